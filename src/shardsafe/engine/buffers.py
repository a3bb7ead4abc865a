"""Byte views of tensors, without copies where the memory already has the right layout."""

from __future__ import annotations

import ctypes

import numpy as np
import torch


def resolved(t: torch.Tensor) -> torch.Tensor:
    """``t`` detached, with lazy conjugate / negative views materialized (so its memory
    holds exactly its values); ``t``'s own storage when there is nothing to resolve."""
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A CPU, contiguous, conjugation-resolved tensor with ``t``'s values (``t`` itself when possible)."""
    t = resolved(t)
    if t.device.type != "cpu":
        t = t.to("cpu")
    return t.contiguous()


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a contiguous CPU tensor as a writable uint8 numpy array (shares memory)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def writable_bytes(t: torch.Tensor) -> memoryview:
    """The memory of a contiguous CPU tensor as a writable byte memoryview (shares memory;
    the caller keeps ``t`` alive while using it). Cheaper than :func:`byte_view` (one
    ctypes call instead of three torch calls), which matters for thousands of tensors."""
    assert t.device.type == "cpu" and t.is_contiguous()
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")
