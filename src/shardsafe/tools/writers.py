"""Output files written tensor by tensor: a safetensors file (header first: every name,
dtype and shape is known up front) and a ``torch.save`` file (a skeleton written with
``torch.serialization.skip_data``, whose storage bytes are then filled in place).

Both place each tensor at a byte offset known before its data is read, so a tensor can
be written and dropped before the next one is read.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine.buffers import byte_view
from ..format.datafile import ChunkEntry, build_header
from ..format.dtypes import itemsize, safetensors_code
from ..storage.local import write_all


@dataclass(frozen=True)
class Slot:
    """A tensor to export: ``key`` in the checkpoint, ``name`` in the output, its output
    dtype and shape."""

    key: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * itemsize(self.dtype)


def write_tensor(fd: int, offset: int, tensor: torch.Tensor) -> None:
    """Write the raw bytes of ``tensor`` at ``offset`` of the open file ``fd``."""
    if tensor.numel():
        write_all(fd, memoryview(byte_view(tensor.contiguous())), offset)


class _FileWriter:
    """An output file opened for positional writes; ``close`` fsyncs it."""

    fd = -1

    def close(self) -> None:
        """fsync and close."""
        if self.fd >= 0:
            try:
                os.fsync(self.fd)
            finally:
                os.close(self.fd)
                self.fd = -1


class SafetensorsWriter(_FileWriter):
    """A safetensors file whose header is written at once; tensors then go to their places."""

    def __init__(self, path: Path, slots: list[Slot], metadata: dict[str, str] | None = None) -> None:
        entries = [ChunkEntry(s.name, safetensors_code(s.dtype), tuple(s.shape), s.nbytes) for s in slots]
        header, ranges = build_header(entries, dict(metadata or {"format": "pt"}))
        self.offsets: dict[str, int] = {s.name: start for s, (start, _) in zip(slots, ranges)}
        self.size = ranges[-1][1] if ranges else len(header)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        write_all(self.fd, memoryview(header), 0)
        os.ftruncate(self.fd, self.size)

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Put ``tensor`` (of ``slot``'s dtype and shape) in its place."""
        write_tensor(self.fd, self.offsets[slot.name], tensor)


def _pairs(skeleton: Any, loaded: Any) -> Iterator[tuple[Slot, torch.Tensor]]:
    """(slot, loaded fake tensor) for every slot of ``skeleton``, walking both alike."""
    if isinstance(skeleton, Slot):
        yield skeleton, loaded
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            yield from _pairs(v, loaded[k])
    elif isinstance(skeleton, (list, tuple)):
        for v, w in zip(skeleton, loaded):
            yield from _pairs(v, w)


def _fake(skeleton: Any) -> Any:
    if isinstance(skeleton, Slot):
        return torch.empty(skeleton.shape, dtype=skeleton.dtype)
    if isinstance(skeleton, dict):
        return {k: _fake(v) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fake(v) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fake(v) for v in skeleton)
    return skeleton


class TorchSaveWriter(_FileWriter):
    """A ``torch.save`` file of ``skeleton`` (a tree whose tensors are Slots), written
    without data; ``write`` then fills each tensor's storage bytes in the file.

    Uses two public (prototype) torch APIs: ``torch.serialization.skip_data`` to save
    fake tensors without their bytes, and loading under ``FakeTensorMode`` to learn each
    storage's offset in the file (``untyped_storage()._checkpoint_offset``)."""

    def __init__(self, path: Path, skeleton: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.serialization import skip_data

        with FakeTensorMode():
            fake = _fake(skeleton)
        with skip_data(materialize_fake_tensors=True):
            torch.save(fake, path)
        del fake
        with FakeTensorMode():
            loaded = torch.load(path, weights_only=True)
        self.offsets: dict[str, int] = {}
        for slot, t in _pairs(skeleton, loaded):
            offset = t.untyped_storage()._checkpoint_offset
            if offset is None or t.storage_offset() != 0:
                raise RuntimeError("torch.save skeleton: storage offsets unavailable (torch too old?)")
            self.offsets[slot.key] = int(offset)
        self.path = path
        self.fd = os.open(path, os.O_WRONLY)

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Put ``tensor`` (of ``slot``'s dtype and shape) in its storage's place."""
        write_tensor(self.fd, self.offsets[slot.key], tensor)
