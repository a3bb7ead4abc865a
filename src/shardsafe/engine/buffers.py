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


def dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements lie back to back in row-major order in its memory (what
    ``is_contiguous`` says; a one-element tensor or a size-1 dim may have any stride)."""
    return t.is_contiguous()


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The memory of a dense tensor (see :func:`dense`) as a flat uint8 tensor (shares
    memory). Works for any strides torch calls contiguous, e.g. ``torch.arange(8.)[::8]``."""
    n = t.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return t.detach().as_strided((n,), (1,)).view(torch.uint8)


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The raw bytes of a dense CPU tensor as a writable uint8 numpy array (shares memory)."""
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return flat_bytes(t).numpy()


def writable_bytes(t: torch.Tensor) -> memoryview:
    """The memory of a dense CPU tensor as a writable byte memoryview (shares memory; the
    caller keeps ``t`` alive while using it). Cheaper than :func:`byte_view` (one ctypes
    call instead of three torch calls), which matters for thousands of tensors."""
    assert t.is_cpu and dense(t)
    n = t.nbytes
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_ubyte * n).from_address(t.data_ptr())).cast("B")


def readable_bytes(t: torch.Tensor) -> memoryview:
    """The memory of a dense CPU tensor as a byte memoryview, like :func:`writable_bytes`
    (the caller keeps ``t`` alive while using it and only reads through it); an empty
    tensor gives an empty view. Several times cheaper than ``flat_bytes(t).numpy()``."""
    return writable_bytes(t)
