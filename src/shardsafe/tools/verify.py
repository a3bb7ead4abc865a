"""``shardsafe verify``: recompute every block checksum of every chunk and every data
file header, in parallel, and name each problem (file, tensor key, byte range).

Files are read with ``pread`` into one reused buffer per thread (never mapped, so a
file truncated while it is being checked cannot crash the process); XXH3 releases the
GIL, so the threads hash in parallel. Also checked: missing and truncated files, and
that every chunk's byte range matches its box and the chunks cover each tensor.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from math import prod
from pathlib import Path
from typing import Any

from ..api import read_manifest
from ..errors import CorruptCheckpointError
from ..format.checksum import checksum
from ..format.dtypes import itemsize, torch_dtype
from ..format.manifest import Chunk, Manifest
from .common import PathLike, human_bytes
from .progress import Progress
from .reading import block_size

WINDOW_BLOCKS = 16


@dataclass
class Problem:
    """One thing wrong: in ``file`` (None: the manifest), at tensor ``key``, bytes
    ``[start, end)`` of the file, and what."""

    what: str
    file: str | None = None
    key: str | None = None
    start: int | None = None
    end: int | None = None

    def __str__(self) -> str:
        where = self.file or "manifest.json"
        if self.key is not None:
            where += f", tensor '{self.key}'"
        if self.start is not None:
            where += f", bytes {self.start}-{self.end}"
        return f"{where}: {self.what}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass
class VerifyReport:
    """The outcome of ``verify_checkpoint``: ``ok`` when no problem was found."""

    path: str
    files: int = 0
    chunks: int = 0
    bytes_checked: int = 0
    seconds: float = 0.0
    problems: list[Problem] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"path": self.path, "ok": self.ok, "files": self.files, "chunks": self.chunks,
                "bytes_checked": self.bytes_checked, "seconds": self.seconds,
                "problems": [p.to_json() for p in self.problems]}

    def to_text(self) -> str:
        """One line per problem, then a summary."""
        rate = f" ({human_bytes(self.bytes_checked / self.seconds)}/s)" if self.seconds > 0 else ""
        summary = (f"{self.path}: {self.files} files, {self.chunks} chunks, {human_bytes(self.bytes_checked)} "
                   f"checked in {self.seconds:.2f} s{rate}")
        if self.ok:
            return summary + ": OK"
        lines = [f"BAD  {p}" for p in self.problems]
        return "\n".join([*lines, f"{summary}: {len(self.problems)} problem(s)"])


@dataclass
class _Job:
    file: int
    key: str
    chunk: Chunk
    first: int  # first block index
    last: int  # last block index (inclusive)


def _geometry(manifest: Manifest, block: int) -> list[Problem]:
    """Cheap consistency checks of the manifest's chunks against their tensors."""
    problems: list[Problem] = []
    for key, entry in manifest.tensors.items():
        dtype = torch_dtype(entry.dtype)
        if dtype is None:
            problems.append(Problem(f"unknown dtype {entry.dtype!r}", key=key))
            continue
        size = itemsize(dtype)
        covered = 0
        for c in entry.chunks:
            name = manifest.files[c.file].name if 0 <= c.file < len(manifest.files) else f"file #{c.file}"
            if not 0 <= c.file < len(manifest.files):
                problems.append(Problem("chunk refers to a data file the manifest does not list", name, key,
                                        c.start, c.end))
            n = prod(c.lengths)
            covered += n
            if len(c.offsets) != len(entry.shape) or any(o + ln > s for o, ln, s in
                                                        zip(c.offsets, c.lengths, entry.shape)):
                problems.append(Problem(f"chunk {list(c.offsets)}+{list(c.lengths)} lies outside shape "
                                        f"{list(entry.shape)}", name, key, c.start, c.end))
            if c.end - c.start != n * size:
                problems.append(Problem(f"byte range holds {c.end - c.start} bytes, the box needs {n * size}",
                                        name, key, c.start, c.end))
            if len(c.checksum) != max(1, -(-(c.end - c.start) // block)):
                problems.append(Problem("wrong number of block checksums", name, key, c.start, c.end))
        if covered != prod(entry.shape):
            problems.append(Problem(f"chunks hold {covered} of the tensor's {prod(entry.shape)} elements", key=key))
    return problems


def _hash_job(job: _Job, fd: int, block: int, local: threading.local) -> list[tuple[int, int]]:
    """Hash blocks first..last of a chunk; the byte ranges that do not match."""
    c = job.chunk
    lo = c.start + job.first * block
    hi = min(c.end, c.start + (job.last + 1) * block)
    if hi <= lo:
        return [] if c.checksum and c.checksum[0] == checksum(b"") else [(lo, hi)]
    buf = getattr(local, "buf", None)
    if buf is None or len(buf) < hi - lo:
        buf = local.buf = bytearray(max(hi - lo, WINDOW_BLOCKS * block))
    view = memoryview(buf)[: hi - lo]
    got = 0
    while got < hi - lo:
        n = os.preadv(fd, [view[got:]], lo + got)
        if n == 0:
            break
        got += n
    bad: list[tuple[int, int]] = []
    for b in range(job.first, job.last + 1):
        blo = c.start + b * block
        bhi = min(c.end, blo + block)
        if bhi - lo > got or checksum(view[blo - lo: bhi - lo]) != c.checksum[b]:
            bad.append((blo, bhi))
    view.release()
    return bad


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def verify_checkpoint(path: PathLike, *, threads: int | None = None, progress: bool | None = None) -> VerifyReport:
    """Check every byte of the checkpoint at ``path`` against its manifest.

    Returns a report listing every problem; a checkpoint that does not exist raises
    CheckpointNotFoundError, and a corrupt manifest is reported as a problem."""
    t0 = time.perf_counter()
    root = Path(path)
    report = VerifyReport(str(root))
    try:
        manifest = read_manifest(root)
        block = block_size(manifest)
    except CorruptCheckpointError as exc:
        report.problems.append(Problem(str(exc)))
        return report
    report.files = len(manifest.files)
    report.problems.extend(_geometry(manifest, block))
    fds: dict[int, int] = {}
    sizes: dict[int, int] = {}
    jobs: list[_Job] = []
    headers: list[int] = []
    try:
        for i, entry in enumerate(manifest.files):
            try:
                fds[i] = os.open(root / entry.name, os.O_RDONLY)
            except FileNotFoundError:
                n = sum(1 for t in manifest.tensors.values() for c in t.chunks if c.file == i)
                report.problems.append(Problem(f"file is missing (it holds {n} chunks)", entry.name))
                continue
            sizes[i] = os.fstat(fds[i]).st_size
            if sizes[i] != entry.nbytes:
                report.problems.append(Problem(
                    f"file has {sizes[i]} bytes, the manifest says {entry.nbytes} "
                    f"({'truncated' if sizes[i] < entry.nbytes else 'replaced or appended to'})", entry.name))
            headers.append(i)
        for key, entry in manifest.tensors.items():
            for c in entry.chunks:
                report.chunks += 1
                if c.file not in fds:
                    continue
                name = manifest.files[c.file].name
                if c.end > sizes[c.file]:
                    report.problems.append(Problem("chunk lies past the end of the file (truncated)", name, key,
                                                   c.start, c.end))
                    continue
                nblocks = len(c.checksum)
                if nblocks != max(1, -(-(c.end - c.start) // block)):
                    continue  # reported by _geometry
                for first in range(0, nblocks, WINDOW_BLOCKS):
                    jobs.append(_Job(c.file, key, c, first, min(nblocks, first + WINDOW_BLOCKS) - 1))
        total = sum(manifest.files[i].header_bytes for i in headers) + sum(
            min(j.chunk.end, j.chunk.start + (j.last + 1) * block) - (j.chunk.start + j.first * block) for j in jobs)
        local = threading.local()
        bad: dict[tuple[int, int, str], tuple[Chunk, list[tuple[int, int]]]] = {}
        with Progress("verify", total, enabled=progress) as bar, \
                ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:

            def header(i: int) -> Problem | None:
                entry = manifest.files[i]
                data = os.pread(fds[i], entry.header_bytes, 0)
                bar.advance(entry.header_bytes)
                if len(data) != entry.header_bytes or checksum(data) != entry.header_checksum:
                    return Problem("header checksum mismatch (the safetensors header is corrupt)", entry.name,
                                   start=0, end=entry.header_bytes)
                return None

            def run(job: _Job) -> tuple[_Job, list[tuple[int, int]]]:
                out = _hash_job(job, fds[job.file], block, local)
                c = job.chunk
                bar.advance(min(c.end, c.start + (job.last + 1) * block) - (c.start + job.first * block))
                return job, out

            header_futures = [pool.submit(header, i) for i in headers]
            for fut in [pool.submit(run, j) for j in jobs]:
                job, ranges = fut.result()
                if ranges:
                    bad.setdefault((job.file, job.chunk.start, job.key), (job.chunk, []))[1].extend(ranges)
            report.problems.extend(p for p in (f.result() for f in header_futures) if p is not None)
        for (f, _, key), (c, ranges) in sorted(bad.items(), key=lambda kv: kv[0]):
            box = ", ".join(f"{o}:{o + n}" for o, n in zip(c.offsets, c.lengths)) or "scalar"
            for lo, hi in _merge(ranges):
                report.problems.append(Problem(
                    f"checksum mismatch in the chunk [{box}] (chunk bytes {c.start}-{c.end}): the data is corrupt",
                    manifest.files[f].name, key, lo, hi))
        report.bytes_checked = total
    finally:
        for fd in fds.values():
            os.close(fd)
    report.seconds = time.perf_counter() - t0
    return report
