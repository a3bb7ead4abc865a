"""``shardsafe verify``: recompute every block checksum of every chunk and every data
file header, in parallel, and name each problem (file, tensor key, byte range).

Bytes are read by the one reader the loads use (``pread`` into small reused buffers,
never mapped, so a file truncated while it is being checked cannot crash the process);
every value ``load`` would decode is decoded too. XXH3 releases the
GIL, so the threads hash in parallel. Also checked: missing and truncated files, and
that every chunk's byte range matches its box and the chunks cover each tensor.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from math import prod
from typing import Any

from ..checkpointer import Checkpointer
from ..engine.reader import Problems
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.dtypes import itemsize, torch_dtype
from ..format.manifest import Chunk, Manifest
from ..layout import Box, boxes_disjoint
from ..ops.load import block_size
from ..ops.metadata import read_manifest_phase
from ..ops.reader import CheckpointReader
from ..plan.load_plan import BlockCheck, chunk_checks
from ..state.match import Matcher
from .common import PathLike, human_bytes
from .progress import Progress


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
    referred_bytes: int = 0  # of the bytes checked: chunks in other checkpoints' files (incremental)
    on_peers: list[str] = field(default_factory=list)  # node-local tier: data files held by other nodes

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"path": self.path, "ok": self.ok, "files": self.files, "chunks": self.chunks,
                "bytes_checked": self.bytes_checked, "referred_bytes": self.referred_bytes, "seconds": self.seconds,
                "on_peers": self.on_peers,
                "problems": [p.to_json() for p in self.problems]}

    def to_text(self) -> str:
        """One line per problem, then a summary."""
        rate = f" ({human_bytes(self.bytes_checked / self.seconds)}/s)" if self.seconds > 0 else ""
        summary = (f"{self.path}: {self.files} files, {self.chunks} chunks, {human_bytes(self.bytes_checked)} "
                   f"checked in {self.seconds:.2f} s{rate}")
        if self.referred_bytes:
            summary += f" ({human_bytes(self.referred_bytes)} of it in the checkpoints this one refers to)"
        if self.on_peers:
            summary += f"; {len(self.on_peers)} data file(s) held by peer nodes, not checked here"
        if self.ok:
            return summary + ": OK"
        lines = [f"BAD  {p}" for p in self.problems]
        return "\n".join([*lines, f"{summary}: {len(self.problems)} problem(s)"])


def _indexes(reader: CheckpointReader) -> tuple[set[int], list[Problem]]:
    """Format 3: fetch and check every file's index; the files whose index is unusable."""
    manifest = reader.manifest
    bad: set[int] = set()
    problems: list[Problem] = []
    if not manifest.indexed:
        return bad, problems
    for i, entry in enumerate(manifest.files):
        try:
            reader.fetch_indexes([i])
        except CorruptCheckpointError as exc:
            bad.add(i)
            if getattr(reader, "local_tier", False) and "missing" in str(exc):
                reader.peer_ranks = {*getattr(reader, "peer_ranks", set()), entry.rank}
                continue  # held by a peer node (reported with its data file)
            problems.append(Problem(f"file index: {exc}", entry.index_name))
    return bad, problems


def _chunks(manifest: Manifest, entry: Any, bad: set[int], problems: list[Problem] | None = None,
            key: str = "") -> list[Chunk]:
    """An entry's chunks, skipping those in files whose index is unusable (format 3: the
    boxes the manifest gives, resolved one by one, a box missing from its index reported)."""
    if not manifest.indexed or entry.kind == "rank_local":
        return entry.chunks
    out = []
    for box in entry.boxes():
        if box[2] in bad:
            continue
        try:
            out.extend(manifest.resolve(entry._ord, [box]))
        except CorruptCheckpointError as exc:
            if problems is not None:
                problems.append(Problem(str(exc), manifest.files[box[2]].index_name, key))
    return out


def _geometry(manifest: Manifest, block: int, bad: set[int] | None = None) -> list[Problem]:
    """Cheap consistency checks of the manifest's chunks against their tensors."""
    problems: list[Problem] = []
    bad = set() if bad is None else bad
    for key, entry in manifest.tensors.items():
        dtype = torch_dtype(entry.dtype)
        if dtype is None:
            problems.append(Problem(f"unknown dtype {entry.dtype!r}", key=key))
            continue
        size = itemsize(dtype)
        covered = 0
        chunks = _chunks(manifest, entry, bad, problems, key)
        if len(chunks) < entry.chunk_count:
            continue  # in a file whose index is unusable: reported with the file
        listed = len(manifest.files) + len(manifest.refs)
        for c in chunks:
            ref = manifest.ref_file(c.file) if 0 <= c.file < listed else None
            name = (manifest.files[c.file].name if ref is None else f"{ref.checkpoint or '.'}/{ref.name}") \
                if 0 <= c.file < listed else f"file #{c.file}"
            if not 0 <= c.file < listed:
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
        elif len(chunks) > 1 and not boxes_disjoint([Box(c.offsets, c.lengths) for c in chunks]):
            problems.append(Problem("chunks overlap (and so leave part of the tensor uncovered)", key=key))
    return problems


def _values(manifest: Manifest, skip: set[int] | frozenset[int] = frozenset()) -> list[Problem]:
    """Decode every value that a load decodes (the tree, and each saving rank's
    rank-local values; ``skip``: ranks whose index a node-local folder leaves to peers),
    allocating nothing: what ``load`` would refuse, verify reports."""
    problems: list[Problem] = []
    ranks = max([len(v) for v in manifest.rank_local.values()], default=1)
    for rank in (r for r in range(max(1, ranks)) if r not in skip):
        matcher = Matcher(manifest, rank=rank)
        try:
            matcher.materialize(manifest.tree)
            matcher.result.raise_errors()
        except CheckpointError as exc:
            problems.append(Problem(f"the saved values cannot be decoded{f' for rank {rank}' if rank else ''}: {exc}"))
            break
    return problems


def _merge(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return out


def verify_checkpoint(path: PathLike, *, threads: int | None = None, progress: bool | None = None,
                      checkpointer: Checkpointer | None = None) -> VerifyReport:
    """Check every byte of the checkpoint at ``path`` against its manifest, and decode
    every saved value.

    Returns a report listing every problem; a checkpoint that does not exist raises
    CheckpointNotFoundError, and a corrupt manifest is reported as a problem."""
    t0 = time.perf_counter()
    cp = checkpointer if checkpointer is not None else Checkpointer()
    report = VerifyReport(str(path))
    try:
        backend, location = cp.locate(path)
        try:
            opened = read_manifest_phase(backend, location)
        except CorruptCheckpointError as exc:
            report.problems.append(Problem(str(exc)))
            return report
        with CheckpointReader(backend, location, memory=cp.memory, opened=opened,
                              threads=threads or min(8, os.cpu_count() or 1)) as reader:
            reader.local_tier = _in_local_tier(backend, location)
            _verify(reader, report, progress)
    finally:
        if checkpointer is None:
            cp.close()
    report.seconds = time.perf_counter() - t0
    return report


def _in_local_tier(backend: Any, location: str) -> bool:
    """True for a step folder of a node-local tier folder (its parent holds the tier's marker)."""
    from .listing import TIER_MARKER

    try:
        parent, _ = backend.split(location)
        with backend.open(parent) as f:
            return f.kind(TIER_MARKER) == "file"
    except CheckpointError:
        return False


def _check_files(reader: CheckpointReader, report: VerifyReport, bad_index: set[int]
                 ) -> tuple[set[int], dict[int, int]]:
    """Open every data file and referenced file, report missing ones, wrong sizes and bad
    headers; the usable files and every opened file's size."""
    manifest = reader.manifest
    files = reader.files
    files.check_sizes = False
    usable: set[int] = set()
    sizes: dict[int, int] = {}
    for i, entry in enumerate(manifest.files):
        try:
            sizes[i] = files.handle(i).size
        except CorruptCheckpointError as exc:
            if getattr(reader, "local_tier", False) and "missing" in str(exc):
                report.on_peers.append(entry.name)  # a node-local copy holds its own ranks' files and replicas
                continue
            n = sum(1 for t in manifest.tensors.values() for b in t.boxes() if b[2] == i)
            what = "file is missing" if "missing" in str(exc) else str(exc)
            report.problems.append(Problem(f"{what} (it holds {n} chunks)", entry.name))
            continue
        if i in bad_index:
            continue  # its chunks' byte ranges are unknown: reported above
        usable.add(i)
        if sizes[i] != entry.nbytes:
            report.problems.append(Problem(
                f"file has {sizes[i]} bytes, the manifest says {entry.nbytes} "
                f"({'truncated' if sizes[i] < entry.nbytes else 'replaced or appended to'})", entry.name))
        try:
            files.check_header(i)
        except CorruptCheckpointError as exc:
            what = str(exc).replace(f" of {files.name(i)}", "").replace(f"{files.name(i)}: ", "")
            report.problems.append(Problem(f"header checksum mismatch (the safetensors header is corrupt): {what}",
                                           entry.name, start=0, end=entry.header_bytes))
            files.headers_ok.add(i)  # still hash its chunks
    nfiles = len(manifest.files)
    for j, ref in enumerate(manifest.refs):  # incremental: the files its references point at
        where = f"{ref.checkpoint or '.'}/{ref.name}"
        try:
            sizes[nfiles + j] = files.handle(nfiles + j).size
        except CorruptCheckpointError as exc:
            report.problems.append(Problem(f"referenced file cannot be read: {exc}", where))
            continue
        usable.add(nfiles + j)
        if sizes[nfiles + j] != ref.nbytes:
            report.problems.append(Problem(f"referenced file has {sizes[nfiles + j]} bytes, the manifest says "
                                           f"{ref.nbytes}", where))
    return usable, sizes


def _verify(reader: CheckpointReader, report: VerifyReport, progress: bool | None = None) -> None:
    manifest = reader.manifest
    block = block_size(manifest)
    report.files = len(manifest.files)
    bad_index, index_problems = _indexes(reader)
    report.problems.extend(index_problems)
    report.problems.extend(_geometry(manifest, block, bad_index))
    report.problems.extend(_values(manifest, getattr(reader, "peer_ranks", set())))
    usable, sizes = _check_files(reader, report, bad_index)
    nfiles = len(manifest.files)

    def name_of(f: int) -> str:
        ref = manifest.ref_file(f)
        return manifest.files[f].name if ref is None else f"{ref.checkpoint or '.'}/{ref.name}"

    checks: list[BlockCheck] = []
    chunk_at: dict[tuple[int, int], tuple[str, Chunk]] = {}
    for key, entry in manifest.tensors.items():
        for c in _chunks(manifest, entry, bad_index):
            report.chunks += 1
            if c.file not in usable or len(c.checksum) != max(1, -(-(c.end - c.start) // block)):
                continue  # reported above / by _geometry
            z = manifest.zrow(c) if manifest.version >= (3, 2) else None  # compressed: its stored range
            if (z.end if z is not None else c.end) > sizes[c.file]:
                report.problems.append(Problem("chunk lies past the end of the file (truncated)",
                                               name_of(c.file), key, c.start, c.end))
                continue
            if c.file >= nfiles and manifest.refs[c.file - nfiles].checkpoint:
                report.referred_bytes += c.end - c.start
            for check in chunk_checks(key, c, None, block):
                checks.append(check)
                chunk_at[(check.file, check.lo)] = (key, c)
    checks.sort(key=lambda c: (c.file, c.lo))
    total = sum(c.hi - c.lo for c in checks)
    problems = Problems()
    with Progress("verify", total, enabled=progress) as bar:
        reader.reader.progress = bar.advance
        reader.reader.verify(checks, problems, headers=set())
    bad: dict[tuple[int, int, str], tuple[Chunk, list[tuple[int, int]]]] = {}
    for check in problems.bad:
        key, c = chunk_at[(check.file, check.lo)]
        bad.setdefault((c.file, c.start, key), (c, []))[1].append((check.lo, check.hi))
    for (f, _, key), (c, ranges) in sorted(bad.items(), key=lambda kv: kv[0]):
        box = ", ".join(f"{o}:{o + n}" for o, n in zip(c.offsets, c.lengths)) or "scalar"
        for lo, hi in _merge(ranges):
            report.problems.append(Problem(
                f"checksum mismatch in the chunk [{box}] (chunk bytes {c.start}-{c.end}): the data is corrupt",
                name_of(f), key, lo, hi))
    for f, exc in problems.errors:
        report.problems.append(Problem(f"cannot read: {exc}", name_of(f)))
    report.bytes_checked = total + sum(manifest.files[i].header_bytes for i in usable if i < nfiles)
