"""A load, phase by phase: read manifest -> match -> plan -> verify -> land -> apply.

Each phase takes and returns plain data, except that the destination tensors (the
``fills`` of the match) are resolved by the reader when bytes land. Every collective is a
:class:`~shardsafe.comm.Comm` call: ranks agree on errors (and on the manifest they read)
once after verification — before any destination byte is written — and once after
landing. Also here: :class:`CheckpointReader`, one open checkpoint from which tools read
whole tensors one at a time (files opened and headers checked once).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint_folder import MAX_MANIFEST_BYTES, open_committed
from ..engine.memory import HostMemory
from ..engine.reader import OpenFiles, Reader
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.manifest import MANIFEST_NAME, Manifest
from ..gcpause import gc_paused
from ..plan.load_plan import DEFAULT_MAX_BUFFER, BlockCheck, Dest, ReadOp, block_checks, plan_reads
from ..state.match import Fill, Matcher, MatchResult
from ..storage.base import Backend, Folder


@dataclass
class LoadInfo:
    """What a load did on this rank. ``bytes_read``: distinct bytes of data files touched
    (verified checksum blocks included); ``bytes_copied``: bytes landed from storage;
    ``bytes_received``: bytes sent by other ranks (``broadcast_replicated``);
    ``bytes_fetched``: bytes of data files fetched over the network (remote backends: each
    needed range once, into a local spill; 0 on local paths)."""

    path: Path | str
    bytes_read: int
    tensors: int
    seconds: float
    bytes_copied: int = 0
    bytes_received: int = 0  # bytes of replicated tensors received from the rank that read them
    retries: int = 0  # storage requests retried after transient failures
    bytes_fetched: int = 0


def block_size(manifest: Manifest) -> int:
    """The checksum block size the checkpoint was written with."""
    block = manifest.extra.get("checksum_block")
    if not isinstance(block, int) or block <= 0:
        raise CorruptCheckpointError("manifest: missing or bad extra.checksum_block")
    return block


@dataclass
class Opened:
    """Phase 1: a committed checkpoint's pinned folder, its parsed manifest and its digest."""

    location: str
    folder: Folder
    manifest: Manifest
    digest: int
    siblings: Callable[[str], Folder] | None = None  # opens a referenced checkpoint's folder (format 3.1)

    def close(self) -> None:
        self.folder.close()


def sibling_opener(backend: Backend, location: str) -> Callable[[str], Folder]:
    """Opens, by name, a checkpoint in the same parent folder as ``location`` (the
    checkpoints that an incremental checkpoint refers to)."""
    parent_location, _ = backend.split(location)

    def open_sibling(name: str) -> Folder:
        with backend.open(parent_location) as parent:
            return parent.open_folder(name)

    return open_sibling


def read_manifest_phase(backend: Backend, location: str) -> Opened:
    """Open the committed checkpoint at ``location`` and parse its manifest."""
    folder, data = open_committed(backend, location)
    try:
        manifest = Manifest.from_bytes(data, folder.where("manifest.json"))
    except BaseException:
        folder.close()
        raise
    digest = int(checksum(data), 16)
    manifest.index_source = index_reader(folder, digest, backend.remote)
    return Opened(location, folder, manifest, digest, sibling_opener(backend, location))


INDEX_THREADS = 16  # file indexes fetched at once from a remote backend


def index_reader(folder: Folder, digest: int, remote: bool) -> Callable[[list[tuple[str, int]]], list[bytes]]:
    """Reads (name, expected size) file indexes from ``folder`` (several at once on a
    remote backend). A missing index is a corrupt checkpoint, or, when the folder's
    manifest is no longer the one read (``digest``), a checkpoint replaced meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    from ..errors import CheckpointChangedError, CheckpointNotFoundError

    def one(item: tuple[str, int]) -> bytes:
        name, size = item
        try:
            return folder.read_bytes(name, size + 1)
        except CheckpointNotFoundError:
            try:
                now = folder.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
            except CheckpointError:
                now = b""
            if int(checksum(now), 16) != digest:
                raise CheckpointChangedError(
                    f"{folder.location}: the checkpoint was deleted or replaced while it was read") from None
            raise CorruptCheckpointError(f"file index {folder.where(name)} is missing") from None

    def read(items: list[tuple[str, int]]) -> list[bytes]:
        if remote and len(items) > 1:
            with ThreadPoolExecutor(min(INDEX_THREADS, len(items)), thread_name_prefix="shardsafe-index") as pool:
                return list(pool.map(one, items))
        return [one(i) for i in items]

    return read


def dests_of(fills: list[Fill]) -> list[Dest]:
    """The plain description of the fills that planning needs."""
    return [Dest(f.key, f.box, f.direct) for f in fills]


@dataclass
class ReadPlan:
    """Phase 3: the read ops, the blocks to verify before landing, and the ops whose
    blocks are verified after landing (memory the loader allocated)."""

    ops: list[ReadOp]
    checks: list[BlockCheck]
    post: set[int]  # indices into ops
    verify: bool = True

    @property
    def files(self) -> set[int]:
        """The data files the ops read."""
        return {op.chunk.file for op in self.ops}

    def verify_with(self, reader: Reader) -> int:
        """The verify phase: headers of every file read, then the blocks checked before
        landing. Returns the bytes hashed."""
        if not self.verify:
            return 0
        return reader.verify(self.checks, headers=self.files)


def plan_phase(manifest: Manifest, fills: list[Fill], *, verify: bool, verify_fresh_first: bool,
               max_buffer: int) -> ReadPlan:
    """Ops for every fill; with ``verify`` the blocks to check. Whole chunks landing in
    fresh memory are checked after they land unless ``verify_fresh_first``."""
    with gc_paused():  # one pause for both steps: their objects are collected once, afterwards
        ops = plan_reads(manifest, dests_of(fills), max_buffer)
        post: set[int] = set()
        if verify and not verify_fresh_first:
            post = {i for i, op in enumerate(ops)
                    if fills[op.dest].fresh and op.whole_chunk and op.dest_range is not None}
        checks = block_checks([op for i, op in enumerate(ops) if i not in post] if post else ops,
                              block_size(manifest)) if verify else []
    return ReadPlan(ops, checks, post, verify)


def open_files_phase(files: OpenFiles, plan: ReadPlan, threads: int = 8) -> None:
    """Open (and size-check) every file the plan reads, before anything is verified or
    lands: a checkpoint replaced meanwhile is noticed here, never half way. On a remote
    backend (``files.spill``), fetch every byte range the plan will read, once, with
    ``threads`` requests at once (headers, checked blocks and landed runs)."""
    for f in sorted(plan.files):
        files.handle(f)
    if files.spill:
        ranges: dict[int, list[tuple[int, int]]] = {}
        for f in sorted(plan.files):
            if f < len(files.manifest.files):  # a referenced file's header is never read
                ranges.setdefault(f, []).append((0, files.manifest.files[f].header_bytes))
        for c in plan.checks:
            ranges.setdefault(c.file, []).append((c.lo, c.hi))
        for op in plan.ops:
            ranges.setdefault(op.file, []).extend((s, s + n) for s, n in op.runs)
        files.prefetch(ranges, threads)


def land_phase(reader: Reader, plan: ReadPlan, fills: list[Fill], max_buffer: int, block: int) -> int:
    """Allocate fresh tensors, then land every op (post-landing checks included)."""
    for f in fills:
        f.allocate()
    post = plan.post
    index = {id(op): i for i, op in enumerate(plan.ops)} if post else {}
    return reader.land(plan.ops, [f.tensor for f in fills], [f.box for f in fills], max_buffer=max_buffer,
                       post_verify=(lambda op: index[id(op)] in post) if post else None, block=block)


def apply_phase(result: MatchResult) -> None:
    """Put new values in place and hand Statefuls their filled trees. A Stateful whose
    ``load_state_dict`` raises gets its error wrapped in a CheckpointError naming its key
    (``__cause__`` is the original); its tensors have landed by then (see state/fit.py for
    what is checked before the first byte lands)."""
    for assign in result.assigns:
        assign()
    for obj, get, path in result.statefuls:
        try:
            obj.load_state_dict(get())
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's Stateful may raise anything
            raise CheckpointError(f"key '{path}': {type(obj).__name__}.load_state_dict failed: "
                                  f"{type(exc).__name__}: {exc}") from exc


class CheckpointReader:
    """One committed checkpoint, open for reading whole tensors one at a time (CPU,
    checksums verified as they land). Files are opened and headers checked once.
    Memory: the tensor being read, plus staging of at most ``max_buffer`` bytes."""

    def __init__(self, backend: Backend, location: str, *, verify: bool = True, memory: HostMemory | None = None,
                 threads: int = 2, max_buffer: int = 16 << 20, opened: Opened | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.opened = opened if opened is not None else read_manifest_phase(backend, location)
        self.manifest = self.opened.manifest
        self.location = location
        self.verify = verify
        self.max_buffer = max_buffer
        self.block = block_size(self.manifest)
        self.files = OpenFiles(self.opened.folder, self.manifest, digest=self.opened.digest, spill=backend.remote,
                               siblings=self.opened.siblings)
        self.reader = Reader(self.files, memory or HostMemory(), threads, progress)
        self.fetch_threads = max(threads, 8)

    def read(self, key: str) -> torch.Tensor:
        """The full tensor ``key`` (a manifest tensor key) as a fresh CPU tensor."""
        if key not in self.manifest.tensors:
            from ..hints import missing_tensor

            raise missing_tensor(self.manifest, key)
        matcher = Matcher(self.manifest)
        tensor = matcher.fresh_tensor(key)
        fills = matcher.result.fills
        plan = plan_phase(self.manifest, fills, verify=self.verify, verify_fresh_first=False,
                          max_buffer=self.max_buffer)
        open_files_phase(self.files, plan, self.fetch_threads)
        try:
            plan.verify_with(self.reader)
            land_phase(self.reader, plan, fills, self.max_buffer, self.block)
        finally:
            if self.files.spill:
                self.files.forget()  # the spill holds one tensor at a time
        return tensor

    def close(self) -> None:
        """Close the files and the folder."""
        self.files.close()
        self.opened.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CheckpointReader", "LoadInfo", "Opened", "ReadPlan", "apply_phase", "block_size", "land_phase",
           "open_files_phase", "plan_phase", "read_manifest_phase", "DEFAULT_MAX_BUFFER", "CheckpointError"]
