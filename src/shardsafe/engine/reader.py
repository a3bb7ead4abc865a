"""Execute read plans: check files, verify block checksums, and land bytes in the
destination tensors (straight into their memory when the layout allows).

Verification order keeps a failed load from touching the destination: blocks needed
by in-place reads are hashed from the file *before* any destination byte is written;
reads into memory the loader allocated itself are hashed after they land (one pass).
"""

from __future__ import annotations

import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from ..errors import CorruptCheckpointError
from ..format.checksum import checksum
from ..format.manifest import Chunk, Manifest
from ..plan.load_plan import ReadOp
from ..storage.local import read_into
from .buffers import byte_view, writable_bytes

Buffer = memoryview | np.ndarray  # writable bytes that a read lands in

IOV_MAX = 1024
MAP_WINDOW = 16 << 20  # mapped file pages count in RSS: keep two threads' windows small


class OpenFiles:
    """File descriptors of a checkpoint's data files, opened on demand, checked for size."""

    def __init__(self, root: Path, manifest: Manifest) -> None:
        self.root = root
        self.manifest = manifest
        self.fds: dict[int, int] = {}

    def fd(self, index: int) -> int:
        if index not in self.fds:
            entry = self.manifest.files[index]
            path = self.root / entry.name
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:
                raise CorruptCheckpointError(f"data file {path} is missing") from None
            size = os.fstat(fd).st_size
            if size != entry.nbytes:
                os.close(fd)
                raise CorruptCheckpointError(
                    f"data file {path} has {size} bytes, the manifest says {entry.nbytes} (truncated or replaced)"
                )
            self.fds[index] = fd
        return self.fds[index]

    def name(self, index: int) -> str:
        return str(self.root / self.manifest.files[index].name)

    def close(self) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bad_block(files: OpenFiles, key: str, chunk: Chunk, lo: int, hi: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"checksum mismatch in {files.name(chunk.file)}, tensor '{key}', bytes {lo}-{hi}: the data is corrupt"
    )


def verify_headers(files: OpenFiles, indices: set[int]) -> None:
    """Check the safetensors header bytes of the given files against the manifest."""
    for i in sorted(indices):
        entry = files.manifest.files[i]
        buf = bytearray(entry.header_bytes)
        read_into(files.fd(i), memoryview(buf), 0, files.name(i))
        if checksum(buf) != entry.header_checksum:
            raise CorruptCheckpointError(f"checksum mismatch in the header of {files.name(i)}: the file is corrupt")


def needed_blocks(op: ReadOp, block: int) -> list[int]:
    """Indices of the checksum blocks of ``op.chunk`` that ``op``'s runs touch."""
    start = op.chunk.start
    out: set[int] = set()
    for s, n in op.runs:
        if n == 0:
            continue
        out.update(range((s - start) // block, (s - start + n - 1) // block + 1))
    if not out and op.chunk.end == op.chunk.start:
        out.add(0)
    return sorted(out)


class BlockCheck(NamedTuple):
    """One checksum block to verify: bytes [lo, hi) of file ``file`` must hash to ``expected``."""

    file: int
    lo: int
    hi: int
    expected: str
    key: str
    chunk: Chunk


def block_checks(key: str, chunk: Chunk, blocks: list[int], block: int) -> list[BlockCheck]:
    """The checks for the given block indices of ``chunk``."""
    if chunk.end == chunk.start:
        return [BlockCheck(chunk.file, chunk.start, chunk.end, chunk.checksum[0], key, chunk)]
    if len(chunk.checksum) != -(-(chunk.end - chunk.start) // block):
        raise CorruptCheckpointError(f"manifest: tensor '{key}' has a wrong number of block checksums")
    out = []
    for b in blocks:
        lo = chunk.start + b * block
        out.append(BlockCheck(chunk.file, lo, min(chunk.end, lo + block), chunk.checksum[b], key, chunk))
    return out


def windows(checks: list[BlockCheck]) -> list[list[BlockCheck]]:
    """Group checks (sorted by file and offset) into windows mapped at once: same file, at
    most MAP_WINDOW bytes from first to last byte, gaps under 1 MiB."""
    out: list[list[BlockCheck]] = []
    for c in checks:
        if out:
            first, last = out[-1][0], out[-1][-1]
            if c.file == first.file and c.hi - first.lo <= MAP_WINDOW and c.lo - last.hi < (1 << 20):
                out[-1].append(c)
                continue
        out.append([c])
    return out


def _hash_window(files: OpenFiles, window: list[BlockCheck]) -> int:
    """Hash one window's blocks straight from the page cache through one short-lived map;
    returns the bytes hashed."""
    lo, hi = window[0].lo, max(c.hi for c in window)
    if hi == lo:
        for c in window:
            if checksum(b"") != c.expected:
                raise _bad_block(files, c.key, c.chunk, c.lo, c.hi)
        return 0
    base = lo - lo % mmap.ALLOCATIONGRANULARITY
    hashed = 0
    with mmap.mmap(files.fd(window[0].file), hi - base, prot=mmap.PROT_READ, offset=base) as mm:
        view = memoryview(mm)
        try:
            for c in window:
                if checksum(view[c.lo - base: c.hi - base]) != c.expected:
                    raise _bad_block(files, c.key, c.chunk, c.lo, c.hi)
                hashed += c.hi - c.lo
        finally:
            view.release()
    return hashed


def _hash_landed(files: OpenFiles, op: ReadOp, target: Buffer, block: int) -> None:
    """Verify a whole chunk that has been read into ``target``."""
    chunk = op.chunk
    n = chunk.end - chunk.start
    if len(chunk.checksum) != max(1, -(-n // block)):
        raise CorruptCheckpointError(f"manifest: tensor '{op.fill.key}' has a wrong number of block checksums")
    mv = memoryview(target)
    for b, expected in enumerate(chunk.checksum):
        piece = mv[b * block: (b + 1) * block]
        if checksum(piece) != expected:
            raise _bad_block(files, op.fill.key, chunk, chunk.start + b * block, chunk.start + b * block + len(piece))


def _direct_target(op: ReadOp) -> memoryview:
    """The slice of the destination's bytes that ``op`` fills directly."""
    lo, hi = op.dest_range  # type: ignore[misc]
    return writable_bytes(op.fill.tensor)[lo:hi]


def _read_runs(files: OpenFiles, op: ReadOp, target: Buffer) -> None:
    fd = files.fd(op.chunk.file)
    mv = memoryview(target)
    pos = 0
    for s, n in op.runs:
        read_into(fd, mv[pos: pos + n], s, files.name(op.chunk.file))
        pos += n


def _read_batch(files: OpenFiles, batch: list[tuple[ReadOp, Buffer]]) -> None:
    """One preadv for ops whose single runs sit back to back in one file."""
    if len(batch) == 1:
        _read_runs(files, *batch[0])
        return
    op0 = batch[0][0]
    fd = files.fd(op0.chunk.file)
    start = op0.runs[0][0]
    bufs = [memoryview(t) for _, t in batch if t.nbytes]
    total = sum(b.nbytes for b in bufs)
    got = os.preadv(fd, bufs, start) if bufs else 0
    if got < total:  # short read: finish op by op
        for op, t in batch:
            _read_runs(files, op, t)


BATCH_BYTES = 8 << 20


def _batches(items: list[tuple[ReadOp, Buffer]]) -> list[list[tuple[ReadOp, Buffer]]]:
    """Group single-run ops on adjacent byte ranges of the same file into vectored reads
    of at most IOV_MAX buffers and about BATCH_BYTES (so that threads can share the work)."""
    items = sorted(items, key=lambda it: (it[0].chunk.file, it[0].runs[0][0] if it[0].runs else 0))
    out: list[list[tuple[ReadOp, Buffer]]] = []
    size = 0
    for it in items:
        op = it[0]
        if out and len(op.runs) == 1 and len(out[-1]) < IOV_MAX and size + op.runs[0][1] <= BATCH_BYTES:
            last = out[-1][-1][0]
            if (
                len(last.runs) == 1
                and last.chunk.file == op.chunk.file
                and last.runs[0][0] + last.runs[0][1] == op.runs[0][0]
            ):
                out[-1].append(it)
                size += op.runs[0][1]
                continue
        out.append([it])
        size = op.runs[0][1] if op.runs else 0
    return out


def _split(work: list, weights: list[int], parts: int) -> list[list]:
    """Deal work items to ``parts`` lists with about equal total weight (largest first)."""
    bins: list[list] = [[] for _ in range(parts)]
    load = [0] * parts
    for w, item in sorted(zip(weights, range(len(work))), key=lambda x: -x[0]):
        i = load.index(min(load))
        bins[i].append(work[item])
        load[i] += w
    return [b for b in bins if b]


class ReadSession:
    """Runs a load's read ops in two steps, so that ranks can agree on errors in between:
    :meth:`verify` checks headers and the blocks to be read; :meth:`read` lands all bytes.

    With ``verify_all_first`` (what an in-place load needs) every block is checked before
    anything lands; otherwise blocks that land in memory the loader allocated itself are
    checked as they land (one pass fewer; for ``load_full``, where a failure touches
    nothing of the caller's)."""

    def __init__(self, root: Path, manifest: Manifest, ops: list[ReadOp], *, verify: bool, block: int,
                 threads: int | None = None, verify_all_first: bool = True) -> None:
        if threads is None:
            threads = max(2, min(8, os.cpu_count() or 2))
        self.files = OpenFiles(root, manifest)
        self.ops = ops
        self.verify_enabled = verify
        self.block = block
        self.threads = threads
        self.pool = ThreadPoolExecutor(threads)
        self.verified_bytes = 0  # bytes hashed from files before landing (whole checksum blocks)
        self.copied_bytes = 0  # bytes landed in destinations
        self.post_verify = [] if verify_all_first else [
            op for op in ops if verify and op.fill.fresh and op.whole_chunk and op.dest_range is not None
        ]

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.files.close()

    def __enter__(self) -> ReadSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def verify(self) -> None:
        """Check file sizes, headers and the checksum of every block read in place."""
        for i in sorted({op.chunk.file for op in self.ops}):
            self.files.fd(i)  # size checks first
        if not self.verify_enabled:
            return
        verify_headers(self.files, {op.chunk.file for op in self.ops})
        post_ids = {id(op) for op in self.post_verify}
        pre: dict[tuple[int, int], tuple[str, Chunk, set[int]]] = {}
        for op in self.ops:
            if id(op) in post_ids:
                continue
            entry = pre.setdefault((op.chunk.file, op.chunk.start), (op.fill.key, op.chunk, set()))
            entry[2].update(needed_blocks(op, self.block))
        checks = [c for key, chunk, bl in pre.values() for c in block_checks(key, chunk, sorted(bl), self.block)]
        checks.sort(key=lambda c: (c.file, c.lo))
        groups = windows(checks)
        parts = _split(groups, [w[-1].hi - w[0].lo + 4096 for w in groups], self.threads)
        for f in [self.pool.submit(_run_hash_windows, self.files, g) for g in parts]:
            self.verified_bytes += f.result()

    def read(self) -> int:
        """Land every op's bytes in its destination. Returns the distinct bytes of data
        files this load touched: the blocks verified before landing (which include the
        bytes then copied from them) plus the bytes landed without a prior check."""
        direct = [(op, _direct_target(op)) for op in self.ops if op.dest_range is not None]
        staged = [op for op in self.ops if op.dest_range is None]
        batches = _batches(direct)
        groups = _split(batches, [sum(op.nbytes for op, _ in b) for b in batches], self.threads)
        futures = [self.pool.submit(_run_read_group, self.files, g) for g in groups]
        if staged:
            self._read_staged(staged)
        for f in futures:
            f.result()
        if self.post_verify:
            landed = {id(op): t for op, t in direct}
            jobs = [(op, landed[id(op)]) for op in self.post_verify if id(op) in landed]
            groups = _split(jobs, [op.nbytes for op, _ in jobs], self.threads)
            for f in [self.pool.submit(_run_post_verify, self.files, g, self.block) for g in groups]:
                f.result()
        self.copied_bytes = sum(op.nbytes for op in self.ops)
        if not self.verify_enabled:
            return self.copied_bytes
        post_ids = {id(op) for op in self.post_verify}
        return self.verified_bytes + sum(op.nbytes for op in self.ops if id(op) in post_ids)

    def _read_staged(self, ops: list[ReadOp]) -> None:
        """Ops whose bytes are scattered in the destination: through one reused buffer."""
        size = max(op.nbytes for op in ops)
        buffer = torch.empty(size, dtype=torch.uint8)
        raw = byte_view(buffer)
        for op in ops:
            n = op.nbytes
            _read_runs(self.files, op, raw[:n])
            dtype = op.fill.tensor.dtype
            piece = buffer[:n].view(dtype).view(op.box.lengths) if n else torch.empty(op.box.lengths, dtype=dtype)
            rel = op.box.relative_to(op.fill.box)
            with torch.no_grad():
                op.fill.tensor[rel.slices()].copy_(piece)


def _run_hash_windows(files: OpenFiles, group: list[list[BlockCheck]]) -> int:
    return sum(_hash_window(files, w) for w in group)


def _run_read_group(files: OpenFiles, batches: list) -> None:
    for b in batches:
        _read_batch(files, b)


def _run_post_verify(files: OpenFiles, jobs: list, block: int) -> None:
    for op, target in jobs:
        _hash_landed(files, op, target, block)


__all__ = ["ReadSession", "OpenFiles"]
