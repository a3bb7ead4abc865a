"""Write one data file: header, chunks back to back with vectored writes, fsync, while
a helper thread computes the per-block checksums of the same memory."""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..format.checksum import checksum
from ..format.datafile import ChunkEntry, build_header
from ..format.dtypes import safetensors_code
from ..format.manifest import FileEntry
from ..plan.save_plan import FilePlan, WriteItem
from ..storage.local import write_all
from .buffers import byte_view, cpu_contiguous

IOV_MAX = 1024
BATCH_BYTES = 64 << 20


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
    directory: Path, plan: FilePlan, block: int, pool: ThreadPoolExecutor, fsync: bool = True
) -> tuple[FileEntry, list[WrittenChunk]]:
    """Write ``plan`` as one safetensors-layout file in ``directory`` and fsync it."""
    sources = [cpu_contiguous(it.source) for it in plan.items]
    views = [byte_view(s) for s in sources]
    entries = [
        ChunkEntry(_name(it), safetensors_code(s.dtype), it.box.lengths, v.nbytes)
        for it, s, v in zip(plan.items, sources, views)
    ]
    header, ranges = build_header(entries)
    header_sum: Future = pool.submit(checksum, header)
    sums: Future = pool.submit(lambda: [block_checksums(v, block) for v in views])
    path = directory / plan.name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, memoryview(header), 0)
        _write_views(fd, views, [s for s, _ in ranges])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    total = ranges[-1][1] if ranges else len(header)
    entry = FileEntry(plan.name, total, plan.rank, len(header), header_sum.result())
    written = [WrittenChunk(it, s, e, c) for it, (s, e), c in zip(plan.items, ranges, sums.result())]
    return entry, written


def _name(it: WriteItem) -> str:
    from ..format.datafile import chunk_name

    return chunk_name(it.key, it.box.offsets, it.whole)


def _write_views(fd: int, views: list, starts: list[int]) -> None:
    """pwritev consecutive views in batches (at most IOV_MAX buffers / BATCH_BYTES each)."""
    i = 0
    n = len(views)
    while i < n:
        if views[i].nbytes >= BATCH_BYTES:
            write_all(fd, memoryview(views[i]), starts[i])
            i += 1
            continue
        j = i
        size = 0
        while j < n and j - i < IOV_MAX and views[j].nbytes < BATCH_BYTES and size < BATCH_BYTES:
            size += views[j].nbytes
            j += 1
        bufs = [memoryview(v) for v in views[i:j] if v.nbytes]
        written = os.pwritev(fd, bufs, starts[i]) if bufs else 0
        if written < size:  # short vectored write: finish piece by piece
            offset = starts[i]
            for v in views[i:j]:
                end = offset + v.nbytes
                if end > starts[i] + written:
                    skip = max(0, starts[i] + written - offset)
                    write_all(fd, memoryview(v)[skip:], offset + skip)
                offset = end
        i = j
