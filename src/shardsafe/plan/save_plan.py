"""Save planning: which chunks go into which data file, written by which rank."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..layout import Box


@dataclass
class WriteItem:
    """One chunk to write: the box of tensor ``key`` that the local ``source`` holds."""

    key: str
    box: Box
    whole: bool  # the box is the whole tensor
    source: torch.Tensor  # local tensor whose elements are exactly the box, any strides


@dataclass
class FilePlan:
    """One data file, written by one rank."""

    name: str
    rank: int
    items: list[WriteItem] = field(default_factory=list)


def data_file_name(rank: int, index: int = 0) -> str:
    """Data file names: ``data-r<rank>-<index>.safetensors``, zero padded."""
    return f"data-r{rank:05d}-{index:02d}.safetensors"


def plan_local(tensors: dict[str, torch.Tensor], rank: int = 0) -> list[FilePlan]:
    """Plan for one process writing whole tensors into one data file (no empty files)."""
    items = [WriteItem(k, Box.whole(t.shape), True, t) for k, t in tensors.items()]
    return [FilePlan(data_file_name(rank), rank, items)] if items else []
