"""Write one data file: header, chunks back to back, fsync; each checksum block is hashed
and written in the same pass (hash, then write while the bytes are still in the core's
cache), by a few threads taking consecutive stretches of the file."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..format.checksum import checksum
from ..format.datafile import ChunkEntry, build_header
from ..format.dtypes import safetensors_code
from ..format.manifest import FileEntry
from ..plan.save_plan import FilePlan, WriteItem
from ..storage.local import write_all
from .buffers import byte_view, cpu_contiguous
from .parallel import run_shares

IOV_MAX = 1024


@dataclass
class WrittenChunk:
    """Where a chunk landed and its block checksums."""

    item: WriteItem
    start: int
    end: int
    checksums: list[str]


def block_checksums(view, block: int) -> list[str]:
    """Checksums of consecutive ``block``-byte pieces of ``view`` (at least one)."""
    n = len(view)
    if n == 0:
        return [checksum(b"")]
    mv = memoryview(view)
    return [checksum(mv[i: i + block]) for i in range(0, n, block)]


def write_data_file(
    directory: Path, plan: FilePlan, block: int, threads: int = 2, fsync: bool = True
) -> tuple[FileEntry, list[WrittenChunk]]:
    """Write ``plan`` as one safetensors-layout file in ``directory`` with ``threads``
    threads (the caller's included) and fsync it; every chunk's block checksums are
    computed from the bytes as they are written."""
    sources = [cpu_contiguous(it.source) for it in plan.items]
    views = [byte_view(s) for s in sources]
    entries = [
        ChunkEntry(_name(it), safetensors_code(s.dtype), it.box.lengths, v.nbytes)
        for it, s, v in zip(plan.items, sources, views)
    ]
    header, ranges = build_header(entries)
    path = directory / plan.name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, memoryview(header), 0)
        sums = write_and_hash(fd, views, [s for s, _ in ranges], block, threads)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    total = ranges[-1][1] if ranges else len(header)
    entry = FileEntry(plan.name, total, plan.rank, len(header), checksum(header))
    written = [WrittenChunk(it, s, e, c) for it, (s, e), c in zip(plan.items, ranges, sums)]
    return entry, written


SEGMENT_UNITS = 8  # a thread takes this many consecutive units (~8 MiB) at a time


def _block_sum(piece: memoryview) -> str:
    return checksum(piece)


def write_and_hash(fd: int, views: list, starts: list[int], block: int, threads: int = 1) -> list[list[str]]:
    """Write each view at its file offset and return its block checksums (at least one per
    view), in one pass over memory: a unit (one checksum block of a large view, or a run of
    small views up to a block) is hashed, then written while still cached. ``threads``
    threads (the caller and helpers it starts and joins) share the units in stretches of
    SEGMENT_UNITS consecutive units."""
    sums: list[list[str | None]] = [[None] * max(1, -(-v.nbytes // block)) for v in views]
    units: list[tuple[list[memoryview], int, list[tuple[int, int]]]] = []
    pieces: list[memoryview] = []
    keys: list[tuple[int, int]] = []
    offset = size = 0
    for vi, (v, start) in enumerate(zip(views, starts)):
        mv = memoryview(v).cast("B") if v.nbytes else memoryview(b"")
        for bi in range(len(sums[vi])):
            piece = mv[bi * block: (bi + 1) * block]
            at = start + bi * block
            if pieces and (offset + size != at or size + len(piece) > block or len(pieces) >= IOV_MAX):
                units.append((pieces, offset, keys))
                pieces, keys, size = [], [], 0
            if not pieces:
                offset = at
            pieces.append(piece)
            keys.append((vi, bi))
            size += len(piece)
    if pieces:
        units.append((pieces, offset, keys))

    def run(stretches: list[list[tuple[list[memoryview], int, list[tuple[int, int]]]]]) -> None:
        for stretch in stretches:
            for unit_pieces, unit_offset, unit_keys in stretch:
                for piece, (vi, bi) in zip(unit_pieces, unit_keys):
                    sums[vi][bi] = _block_sum(piece)
                _write_unit(fd, unit_pieces, unit_offset)

    stretches = [units[i: i + SEGMENT_UNITS] for i in range(0, len(units), SEGMENT_UNITS)]
    workers = max(1, min(threads, len(stretches)))
    shares = [stretches[w::workers] for w in range(workers)]
    if workers == 1:
        run(shares[0])
        return sums  # type: ignore[return-value]
    with ThreadPoolExecutor(workers - 1, thread_name_prefix="shardsafe-write") as pool:
        run_shares(pool, run, shares)
    return sums  # type: ignore[return-value]


def _write_unit(fd: int, pieces: list[memoryview], offset: int) -> None:
    """pwritev ``pieces`` back to back at ``offset``, finishing short writes piece by piece."""
    total = sum(len(p) for p in pieces)
    if total == 0:
        return
    written = os.pwritev(fd, pieces, offset)
    if written < total:
        for p in pieces:
            if written >= len(p):
                written -= len(p)
            else:
                write_all(fd, p[written:], offset + written)
                written = 0
            offset += len(p)


def _name(it: WriteItem) -> str:
    from ..format.datafile import chunk_name

    return chunk_name(it.key, it.box.offsets, it.whole)
