"""Which codec a save's data file is written with (``compression=``; docs/format.md).

- ``"off"`` (the default): raw, byte for byte the format 3.1 layout;
- ``"zstd"`` / ``"lz4"``: every checksum block of every chunk (rank-local tensors
  excepted) is byte-shuffled and compressed, stored raw when that does not pay;
- ``"auto"``: compress only where it cannot make the save slower. The rule: a codec's
  throughput on this machine (measured once per process on the save's first blocks, one
  thread, times the writer threads) must exceed the storage's write bandwidth, as
  measured by the last raw save of the same :class:`~shardsafe.Checkpointer` to the same
  backend. Without such a measurement (the first save) the file is written raw, and
  measured. zstd (better ratio) is tried first, then lz4. The outcome is measured too: a
  codec whose ``auto`` save wrote its chunk bytes (before compression) slower than the last
  raw save did is not chosen again by that Checkpointer for that backend, so at most one
  ``auto`` save per codec is slower than raw. Each rank decides for its own file; files of
  one checkpoint may differ.
"""

from __future__ import annotations

import os
import time

import torch

from ..errors import CheckpointError
from ..format.codecs import CODECS, compress
from ..knobs import CHECKSUM_BLOCK, ZIP_PROBE
from ..plan.save_plan import FileWrite

CHOICES = ("off", "auto", *CODECS)
MARGIN = 1.25  # auto: a codec must beat the storage by this factor (measurements are noisy)

_THROUGHPUT: dict[str, float] = {}  # codec -> bytes/s of one thread, measured once per process


def check_choice(compression: str) -> str:
    """``compression`` if it is a known choice, else a CheckpointError listing them."""
    if compression not in CHOICES:
        raise CheckpointError(f"compression={compression!r}: expected one of {', '.join(map(repr, CHOICES))}")
    return compression


def _probe_bytes(plan: FileWrite, source) -> tuple[memoryview, int]:
    """Up to ZIP_PROBE bytes of the file's first large chunk (and its itemsize), else a
    sample with the statistics of trained weights."""
    for c in plan.chunks:
        if c.end - c.start >= min(ZIP_PROBE, 1 << 20):
            t = source(c)
            if t.is_floating_point() or t.dtype in (torch.int64, torch.int32):
                flat = t.detach().reshape(-1)[: ZIP_PROBE // t.element_size()].contiguous().cpu()
                return memoryview(flat.view(torch.uint8).numpy()), t.element_size()
    gen = torch.Generator().manual_seed(0)
    sample = torch.randn(ZIP_PROBE // 4, generator=gen) * 0.02
    return memoryview(sample.view(torch.uint8).numpy()), 4


def throughput(codec: str, plan: FileWrite, source) -> float:
    """Bytes/s that one thread compresses with ``codec`` (measured once per process)."""
    found = _THROUGHPUT.get(codec)
    if found is None:
        data, itemsize = _probe_bytes(plan, source)
        t0 = time.perf_counter()
        for lo in range(0, len(data), CHECKSUM_BLOCK):
            compress(codec, data[lo: lo + CHECKSUM_BLOCK], itemsize)
        found = _THROUGHPUT[codec] = len(data) / max(time.perf_counter() - t0, 1e-9)
    return found


def choose(compression: str, plan: FileWrite, source, threads: int, bandwidth: float | None,
           rates: dict[str, float] | None = None) -> str:
    """The codec of this rank's file ("" for raw) under ``compression``; ``bandwidth``:
    the storage's measured write bandwidth (bytes/s, None: unknown); ``rates``: chunk
    bytes/s that earlier ``auto`` saves reached with each codec."""
    if compression == "off":
        return ""
    if compression in CODECS:
        return compression
    if not bandwidth or not plan.chunks:
        return ""
    parallel = max(1, min(threads, os.cpu_count() or 1))
    for codec in CODECS:
        if (rates or {}).get(codec, bandwidth + 1) <= bandwidth:
            continue  # it was slower than raw here
        if throughput(codec, plan, source) * parallel > MARGIN * bandwidth:
            return codec
    return ""


__all__ = ["CHOICES", "check_choice", "choose", "throughput"]
