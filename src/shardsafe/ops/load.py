"""A load, phase by phase: open -> manifest -> match -> fetch indexes -> plan -> verify ->
land -> apply.

Each phase takes and returns plain data, except that the destination tensors (the
``fills`` of the match) are resolved by the reader when bytes land. The metadata phases
(open, manifest, fetch indexes) are in :mod:`~shardsafe.ops.metadata`; planning reads
nothing. Every collective is a :class:`~shardsafe.comm.Comm` call: ranks agree on errors
(and on the manifest they read) once after verification — before any destination byte
is written — and once after landing. :func:`load_in_place` and :func:`load_full_tree`
are the whole protocol; the Checkpointer hands them the resources it owns
(:class:`ReadResources`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from ..comm import Comm
from ..engine.memory import HostMemory
from ..engine.reader import OpenFiles, Reader
from ..errors import CheckpointChangedError, CheckpointError, CorruptCheckpointError
from ..format.manifest import Manifest
from ..gcpause import gc_paused
from ..knobs import LOAD_RETRIES
from ..layout import Box
from ..plan.load_plan import DEFAULT_MAX_BUFFER, BlockCheck, Dest, Geometry, ReadOp, block_checks, plan_reads
from ..plan.share_plan import Shared, plan_sharing
from ..state.context import active_group
from ..state.match import Fill, Matcher, MatchResult
from ..state.saved import check_tree, select
from ..storage.base import Backend
from .metadata import (
    Opened,
    fetch_cut_indexes,
    fetch_plan_indexes,
    fetch_rank_local,
    read_manifest_phase,
)
from .share import share_phase

T = TypeVar("T")


@dataclass
class LoadInfo:
    """What a load did on this rank. ``bytes_read``: distinct bytes of data files touched
    (verified checksum blocks included); ``bytes_copied``: bytes landed from storage;
    ``bytes_received``: bytes sent by other ranks (``broadcast_replicated``);
    ``bytes_fetched``: bytes of data files fetched over the network (remote backends: each
    needed range once, into a local spill; 0 on local paths); ``bytes_fetched_to_memory``:
    of those, the bytes kept in memory leased from the budget (the rest went to a local
    spill file; see docs/object-storage.md)."""

    path: Path | str
    bytes_read: int
    tensors: int
    seconds: float
    bytes_copied: int = 0
    bytes_received: int = 0  # bytes of replicated tensors received from the rank that read them
    retries: int = 0  # storage requests retried after transient failures
    bytes_fetched: int = 0
    bytes_stored_read: int = 0  # format 3.2: stored (compressed) bytes read for compressed chunks
    tier: str = ""  # a CheckpointManager with a local tier: "local", "peers" or "persistent"
    bytes_from_peers: int = 0  # local tier: bytes of files this rank received from other nodes first
    bytes_fetched_to_memory: int = 0


@dataclass(frozen=True)
class ReadResources:
    """What a load borrows from its Checkpointer: the host-memory budget, the reader's
    threads and the requests at once on remote backends."""

    memory: HostMemory
    read_threads: int
    fetch_threads: int


def block_size(manifest: Manifest) -> int:
    """The checksum block size the checkpoint was written with."""
    block = manifest.extra.get("checksum_block")
    if not isinstance(block, int) or block <= 0:
        raise CorruptCheckpointError("manifest: missing or bad extra.checksum_block")
    return block


def dests_of(fills: list[Fill]) -> list[Dest]:
    """The plain description of the fills that planning needs."""
    return [Dest(f.key, f.box, f.direct) for f in fills]


@dataclass
class ReadPlan:
    """The plan phase: the read ops, the blocks to verify before landing, and the ops
    whose blocks are verified after landing (memory the loader allocated)."""

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
               max_buffer: int, geoms: Geometry = None, dests: list[Dest] | None = None) -> ReadPlan:
    """Ops for every fill (``dests``: :func:`dests_of` the fills, when the caller has them;
    their indexes fetched, ``geoms`` from the fetch phase); with ``verify`` the blocks to
    check. Whole chunks landing in fresh memory are checked after they land unless
    ``verify_fresh_first``. Reads nothing."""
    with gc_paused():  # one pause for both steps: their objects are collected once, afterwards
        ops = plan_reads(manifest, dests_of(fills) if dests is None else dests, max_buffer, geoms)
        post: set[int] = set()
        if verify and not verify_fresh_first:
            post = {i for i, op in enumerate(ops)
                    if fills[op.dest].fresh and op.whole_chunk and op.dest_range is not None}
        checks = block_checks([op for i, op in enumerate(ops) if i not in post] if post else ops,
                              block_size(manifest)) if verify else []
    return ReadPlan(ops, checks, post, verify)


def open_files_phase(files: OpenFiles, plan: ReadPlan, threads: int = 8, memory: HostMemory | None = None) -> None:
    """Open (and size-check) every file the plan reads, before anything is verified or
    lands: a checkpoint replaced meanwhile is noticed here, never half way. On a remote
    backend (``files.spill``), fetch every byte range the plan will read, once, with
    ``threads`` requests at once (headers, checked blocks and landed runs): into memory
    leased from ``memory`` while its free room lasts (blocks are checked as they arrive),
    the rest into a local spill file (engine/fetch.py)."""
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
        files.prefetch(ranges, threads, memory, plan.checks)


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


def retrying(attempt: Callable[[], T]) -> T:
    """Run a load attempt again (up to LOAD_RETRIES in all) while its checkpoint is
    replaced under it."""
    for n in range(LOAD_RETRIES):
        try:
            return attempt()
        except CheckpointChangedError:
            if n == LOAD_RETRIES - 1:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


# ----------------------------------------------------------------------------- load in place


@dataclass
class LoadOptions:
    """The caller's choices of an in-place load (see :func:`shardsafe.load`)."""

    strict: bool = True
    verify: bool = True
    max_buffer: int = DEFAULT_MAX_BUFFER
    exclude: Any = ()
    cast_dtype: bool = False
    broadcast: bool = False


@dataclass
class _Load:
    """One attempt's state, phase by phase (closed at the end of the attempt)."""

    opened: Opened | None = None
    result: MatchResult | None = None
    mine: list[Fill] = field(default_factory=list)
    plan: ReadPlan | None = None
    files: OpenFiles | None = None
    reader: Reader | None = None
    verified: int = 0
    fetched: int = 0
    in_memory: int = 0

    def close(self) -> None:
        if self.files is not None:
            self.fetched, self.in_memory = self.files.fetched, self.files.fetched_in_memory
            self.files.close()
        if self.opened is not None:
            self.opened.close()


def load_in_place(state_dict: dict[str, Any], backend: Backend, location: str, comm: Comm, res: ReadResources,
                  opts: LoadOptions) -> LoadInfo:
    """Load the checkpoint at ``location`` into ``state_dict`` in place (every rank of
    ``comm``), starting again while it is replaced under the load."""
    def attempt() -> LoadInfo:
        with active_group(comm.group, comm.rank, comm.world):
            return _load_once(state_dict, backend, location, comm, res, opts)

    return retrying(attempt)


def _load_once(state_dict: dict[str, Any], backend: Backend, location: str, comm: Comm, res: ReadResources,
               opts: LoadOptions) -> LoadInfo:
    t0 = time.perf_counter()
    retries0 = backend.retries
    max_buffer = res.memory.fits(opts.max_buffer)
    load = _Load()
    error = _match_phases(load, state_dict, backend, location, comm, opts)
    # Replicated tensors every rank needs whole: one rank reads each, then sends it.
    shared = broadcast_plan(comm, load.result.fills if error is None and load.result else None,
                            load.opened.manifest if load.opened else None) if opts.broadcast else []
    load.mine = [] if load.result is None else reading_fills(load.result.fills, shared, comm.rank)
    if error is None:
        error = _verify_phases(load, backend, res, opts, max_buffer)
    try:
        comm.agree(error, load.opened.digest if load.opened is not None else None, f" at {location}")
        copied = stored = 0
        try:
            assert load.reader is not None and load.plan is not None and load.opened is not None
            copied = land_phase(load.reader, load.plan, load.mine, max_buffer, block_size(load.opened.manifest))
            stored = load.reader.files.stored_read
        except Exception as exc:  # noqa: BLE001
            error = exc
        comm.agree(error)
    finally:
        load.close()
    result = load.result
    assert result is not None
    received = share_phase(comm, shared, lambda s: piece_of(result.fills[s.index], s.piece))
    error = None
    try:
        apply_phase(result)
    except Exception as exc:  # noqa: BLE001 - every rank raises the same error
        error = exc
    comm.agree(error)
    return LoadInfo(location, load.verified if opts.verify else copied, len({f.key for f in result.fills}),
                    time.perf_counter() - t0, copied, bytes_received=received,
                    retries=backend.retries - retries0, bytes_fetched=load.fetched, bytes_stored_read=stored,
                    bytes_fetched_to_memory=load.in_memory)


def _match_phases(load: _Load, state_dict: dict[str, Any], backend: Backend, location: str, comm: Comm,
                  opts: LoadOptions) -> BaseException | None:
    """Open, manifest and match (this rank's rank-local values fetched first), and the
    indexes that cutting the matched rules needs; the error, agreed on later."""
    try:
        load.opened = read_manifest_phase(backend, location)
        manifest = load.opened.manifest
        check_tree(manifest)
        fetch_rank_local(load.opened, comm.rank)
        matcher = Matcher(manifest, rank=comm.rank, strict=opts.strict, exclude=opts.exclude, world=comm.world,
                          cast_dtype=opts.cast_dtype)
        matcher.match(state_dict, manifest.tree, [], top=True)
        matcher.check_exclude(manifest.tree)
        load.result = matcher.result
        load.result.raise_errors()
        if opts.broadcast:  # the broadcast plan cuts rules too
            fetch_cut_indexes(load.opened, dests_of(load.result.fills))
    except Exception as exc:  # noqa: BLE001 - agreed on by every rank
        return exc
    return None


def _verify_phases(load: _Load, backend: Backend, res: ReadResources, opts: LoadOptions,
                   max_buffer: int) -> BaseException | None:
    """Fetch indexes, plan, open the files and verify what is read before landing."""
    try:
        opened = load.opened
        assert opened is not None
        dests = dests_of(load.mine)
        geoms = fetch_plan_indexes(opened, dests)
        load.plan = plan_phase(opened.manifest, load.mine, verify=opts.verify, verify_fresh_first=True,
                               max_buffer=max_buffer, geoms=geoms, dests=dests)
        load.files = OpenFiles(opened.folder, opened.manifest, digest=opened.digest, spill=backend.remote,
                               siblings=opened.siblings)
        open_files_phase(load.files, load.plan, res.fetch_threads, res.memory)
        load.reader = Reader(load.files, res.memory, res.read_threads)
        load.verified = load.plan.verify_with(load.reader)
    except Exception as exc:  # noqa: BLE001
        return exc
    return None


def broadcast_plan(comm: Comm, fills: list | None, manifest: Any) -> list[Shared]:
    """The pieces of boxes this rank shares with others (an identical key and box needed
    whole by several ranks), planned by :func:`plan_sharing` from one all-gather of every
    rank's (key, box, bytes) list, as JSON (no pickle); ``Shared.index`` is a fill index.
    Empty when a rank has no fills (its error is agreed on later)."""
    mine: dict[tuple, int] = {}
    requests: list[list] = []
    device = comm._device() if comm.distributed else None  # where this group's collectives take tensors
    if fills is not None and manifest is not None:
        for i, f in enumerate(fills):
            entry = manifest.tensors.get(f.key)
            if entry is None or entry.kind == "rank_local" or f.fresh or f.cast:
                continue
            if device is not None and str(f.tensor.device) != device:
                continue  # gloo sends CPU tensors only, NCCL tensors on the current GPU only
            if tuple(f.tensor.shape) != tuple(f.box.lengths):
                continue  # not a plain view of its box: read by every rank
            box = (f.key, tuple(f.box.offsets), tuple(f.box.lengths))
            if box not in mine:
                mine[box] = i
                requests.append([f.key, list(f.box.offsets), list(f.box.lengths),
                                 f.tensor.numel() * f.tensor.element_size()])
    wire = b"-" if fills is None else json.dumps(requests).encode()
    everyone = comm.all_gather_bytes(wire)
    if any(w == b"-" for w in everyone):
        return []
    gathered = [[(k, tuple(o), tuple(n), b) for k, o, n, b in json.loads(w)] for w in everyone]
    fill_of = list(mine.values())
    return [s._replace(index=fill_of[s.index]) for s in plan_sharing(manifest, gathered, comm.rank)]


def piece_of(fill: Fill, piece: Box) -> Any:
    """The view of ``fill.tensor`` that holds ``piece`` (global coordinates)."""
    t = fill.tensor
    for d, (o, n, fo) in enumerate(zip(piece.offsets, piece.lengths, fill.box.offsets)):
        if o != fo or n != t.shape[d]:
            t = t.narrow(d, o - fo, n)
    return t


def reading_fills(fills: list[Fill], shared: list[Shared], rank: int) -> list[Fill]:
    """The fills this rank reads: those it shares with nobody, and the pieces it owns of
    those it shares (a view of the fill's tensor each)."""
    split = {s.index for s in shared}
    out = [f for i, f in enumerate(fills) if i not in split]
    for s in shared:
        if s.owner == rank:
            f = fills[s.index]
            out.append(f if s.piece == f.box else Fill(f.key, piece_of(f, s.piece), s.piece, fresh=False))
    return out


# ----------------------------------------------------------------------------- load full


def load_full_tree(backend: Backend, location: str, keys: list[str] | None, res: ReadResources, *,
                   verify: bool = True, rank: int = 0) -> Any:
    """A fresh tree of full CPU tensors from the checkpoint at ``location`` (``keys``: only
    those subtrees; ``rank``: whose rank-local values), starting again while it is
    replaced under the load."""
    return retrying(lambda: _load_full_once(backend, location, keys, res, verify, rank))


def _load_full_once(backend: Backend, location: str, keys: list[str] | None, res: ReadResources, verify: bool,
                    rank: int) -> Any:
    opened = read_manifest_phase(backend, location)
    try:
        manifest = opened.manifest
        check_tree(manifest)
        tree = manifest.tree
        if keys is not None:
            tree = select(tree, list(keys))
        fetch_rank_local(opened, rank)
        matcher = Matcher(manifest, rank=rank)
        value = matcher.materialize(tree)
        matcher.result.raise_errors()
        fills = matcher.result.fills
        max_buffer = res.memory.fits(DEFAULT_MAX_BUFFER)
        dests = dests_of(fills)
        geoms = fetch_plan_indexes(opened, dests)
        plan = plan_phase(manifest, fills, verify=verify, verify_fresh_first=False, max_buffer=max_buffer,
                          geoms=geoms, dests=dests)
        with OpenFiles(opened.folder, manifest, digest=opened.digest, spill=backend.remote,
                       siblings=opened.siblings) as files:
            open_files_phase(files, plan, res.fetch_threads, res.memory)
            reader = Reader(files, res.memory, res.read_threads)
            plan.verify_with(reader)
            land_phase(reader, plan, fills, max_buffer, block_size(manifest))
        return value
    finally:
        opened.close()


__all__ = ["DEFAULT_MAX_BUFFER", "LoadInfo", "LoadOptions", "ReadPlan", "ReadResources", "apply_phase",
           "block_size", "broadcast_plan", "dests_of", "land_phase", "load_full_tree", "load_in_place",
           "open_files_phase", "piece_of", "plan_phase", "reading_fills", "retrying"]
