"""Phases 1 and 2 of a save, up to the agreed plan: describe -> announce -> plan -> assign.

Every rank describes what it holds (:mod:`.describe`) while rank 0 begins the save (checks
the target, cleans leftovers, creates and locks the temp folder). One ``all_gather`` of
small fixed data (an :class:`Announcement` per rank) shares the layouts' signatures, the
temp folder's name and any error; then only the first rank of each distinct layout sends
it (SPMD ranks share one). When ranks hold different value trees (pipeline stages), an
``all_gather`` of those trees lets every rank merge them. Every rank then computes the same
global plan (cached by the ranks' signatures), takes its own assignments, finds those an
incremental save's base already holds, and lays out its data file.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from ..checkpoint_folder import SaveTarget, begin_save, reopen_staging
from ..comm import Comm, rebuild
from ..comm import describe as describe_error
from ..format.dtypes import safetensors_code
from ..format.file_index import IndexedChunk, data_name
from ..format.refs import RefFile
from ..knobs import CHECKSUM_BLOCK
from ..layout import Box
from ..plan.save_plan import (
    Assignment,
    FileWrite,
    GlobalPlan,
    HeldTensor,
    held_of_wire,
    plan_file,
    plan_global,
    plan_key,
)
from ..storage.base import Backend, Folder
from .describe import Described, agreed_tree, check_replicas, describe, replica_digests
from .incremental import VersionMemo, chain_depth, open_base, refer
from .metadata import Opened


@dataclass
class SaveInfo:
    """What a save did (bytes and files are this rank's own)."""

    path: Path | str
    bytes_written: int
    files: int
    tensors: int
    seconds: float
    plan_cached: bool = False
    retries: int = 0  # storage requests retried after transient failures (this rank)
    bytes_referred: int = 0  # incremental: bytes of this rank's chunks left where the base holds them
    chunks_referred: int = 0
    compression: str = "off"  # the codec this rank's file was written with ("off": raw; docs/format.md)
    bytes_stored: int = 0  # bytes of this rank's chunks as stored in its data file (compressed or raw)
    compression_ratio: float = 1.0  # this rank's chunk bytes / bytes_stored
    write_bandwidth: float = 0.0  # bytes/s this rank's file was written at (compression="auto" learns from it)


class PlanCache:
    """The last few global plans, by the ranks' layout signatures (LRU)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.plans: OrderedDict[str, GlobalPlan] = OrderedDict()

    def plan(self, wires: list[bytes | None], signatures: list[str]) -> tuple[GlobalPlan, bool]:
        """The global plan for the gathered layouts (ranks whose layout equals an earlier
        rank's may send None) and whether it came from the cache."""
        digest = plan_key([signatures])
        cached = self.plans.get(digest)
        if cached is not None:
            self.plans.move_to_end(digest)
            return cached, True
        first: dict[str, list[HeldTensor]] = {}
        held: list[list[HeldTensor]] = []
        for sig, ws in zip(signatures, wires):
            if ws is not None and sig not in first:
                first[sig] = held_of_wire(ws)
            held.append(first[sig])
        plan = plan_global(held, signatures)
        self.plans[digest] = plan
        while len(self.plans) > self.size:
            self.plans.popitem(last=False)
        return plan, False

    def clear(self) -> None:
        self.plans.clear()


@dataclass
class PreparedSave:
    """A save after phases 1 and 2: every rank agreed on the plan and the temp folder."""

    comm: Comm
    location: str
    plan: GlobalPlan
    plan_cached: bool
    mine: FileWrite | None
    described: Described
    tree: Any
    t0: float
    overwrite: bool
    target: SaveTarget | None = None  # rank 0 holds the target (its lock) until the save ends
    staging: Folder | None = None
    backend: Backend | None = None
    retries0: int = 0
    error: BaseException | None = None  # this rank could not open the temp folder: finish() reports it
    suffix: str = ""  # the save id in data file names ("" where the folder is renamed into place)
    refs: list[RefFile] = field(default_factory=list)  # incremental: the files references point at (every rank)
    ref_rows: list[IndexedChunk] = field(default_factory=list)  # this rank's chunks left in the base's files
    memo_states: dict[tuple[str, Box], tuple] = field(default_factory=dict)  # version_skip: sources' states
    digests: dict[tuple[str, Box], str] = field(default_factory=dict)  # this rank's chunk digests, once written
    chain: dict[str, Any] | None = None  # incremental: extra.incremental (base name, depth)
    memo_epoch: int = -1  # version_skip: VersionMemo.epoch() when the sources' states were taken
    zip_stats: tuple[str, int, int] = ("off", 0, 0)  # codec, chunk bytes, stored bytes (this rank's file)


class Announcement(NamedTuple):
    """What each rank tells every other in the save's first all-gather."""

    error: tuple[str, str] | None  # this rank's failure so far (comm.describe), or None
    tree_digest: str  # of the rank's value tree: equal digests need no tree exchange
    tmp: str  # rank 0: the temp folder's name in the parent folder ("" elsewhere)
    suffix: str  # rank 0: the save id in data file names
    signature: str  # of the rank's layouts (the plan cache key)
    replicas: dict[tuple[str, Box], str]  # check_replicas: digests of boxes other ranks may hold


@dataclass
class _Begun:
    """Phase 1 on one rank, before the ranks agree."""

    described: Described | None = None
    target: SaveTarget | None = None  # rank 0
    base: Opened | None = None  # an incremental save's base, open
    error: BaseException | None = None

    def abort(self) -> None:
        """Rank 0: give up the temp folder and its lock."""
        if self.target is not None:
            self.target.abort()
            self.target.release()
            self.target.parent.close()


def prepare(state: dict[str, Any], backend: Backend, location: str, overwrite: bool, comm: Comm,
            cache: PlanCache, check: bool = False, base: str | None = None,
            memo: VersionMemo | None = None) -> PreparedSave:
    """Phases 1 and 2 (one all_gather, a second only when trees differ): describe, agree
    on errors, merge the value trees, plan; with a ``base`` (a checkpoint in the same
    folder), find the chunks it already holds (one all-reduce more). Raises the same error
    on every rank."""
    t0 = time.perf_counter()
    retries0 = backend.retries
    begun = _begin(state, backend, location, overwrite, comm, base)
    try:
        heard = comm.all_gather(_announcement(comm, begun, check))
        prep = _agree(comm, begun, heard, cache, check, location, overwrite, t0)
        prep.backend, prep.retries0 = backend, retries0
        _assign(prep, backend, location, heard[0].tmp, base, begun.base, memo)
        return prep
    except BaseException:
        begun.abort()
        raise
    finally:
        if begun.base is not None:
            begun.base.close()


def _begin(state: dict[str, Any], backend: Backend, location: str, overwrite: bool, comm: Comm,
           base: str | None) -> _Begun:
    """Describe this rank's state, open the base; rank 0 begins the save. A failure is kept
    (every rank must hear of it), not raised."""
    begun = _Begun()
    try:
        begun.described = describe(state, comm.rank, _group_ranks(comm), comm.world)
        if base is not None:
            begun.base = open_base(backend, location, base)
        if comm.rank == 0:
            begun.target = begin_save(backend, location, overwrite)
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        begun.error = exc
    return begun


def _announcement(comm: Comm, begun: _Begun, check: bool) -> Announcement:
    """This rank's part of the first all-gather."""
    described, target = begun.described, begun.target
    replicas: dict[tuple[str, Box], str] = {}
    if check and described is not None and begun.error is None and comm.distributed:
        try:
            replicas = replica_digests(described)
        except Exception as exc:  # noqa: BLE001
            begun.error = exc
    return Announcement(None if begun.error is None else describe_error(begun.error, comm.rank),
                        described.tree_digest if described else "", target.tmp if target else "",
                        target.suffix if target else "", described.signature if described else "", replicas)


def _agree(comm: Comm, begun: _Begun, heard: list[Announcement], cache: PlanCache, check: bool, location: str,
           overwrite: bool, t0: float) -> PreparedSave:
    """Raise the first rank's error on every rank; else merge the trees and plan."""
    failures = [a.error for a in heard if a.error is not None]
    if failures:
        if comm.world == 1 and begun.error is not None:
            raise begun.error
        raise rebuild(failures[0]) from begun.error
    described = begun.described
    assert described is not None
    if check:
        check_replicas([a.replicas for a in heard])
    tree = agreed_tree(comm, described, [a.tree_digest for a in heard])
    signatures = [a.signature for a in heard]
    plan, cached = cache.plan(_distinct_wires(comm, described, signatures), signatures)
    return PreparedSave(comm, location, plan, cached, None, described, tree, t0, overwrite, begun.target,
                        suffix=heard[0].suffix)


def _assign(prep: PreparedSave, backend: Backend, location: str, tmp: str, base: str | None,
            opened: Opened | None, memo: VersionMemo | None) -> None:
    """This rank's assignments, less what the base holds; its data file laid out and the
    temp folder opened (a failure to open it is this rank's: ``prep.error``)."""
    comm, described = prep.comm, prep.described
    assigned = prep.plan.assignments(comm.rank, described.held, described.local)
    if memo is not None:
        prep.memo_epoch = VersionMemo.epoch()
        prep.memo_states = _memo_states(described, assigned)
    written = assigned
    if opened is not None:
        assert base is not None
        base_name = backend.split(base)[1]
        prep.refs, prep.ref_rows, written = refer(comm, described, prep.plan, assigned, opened, base_name,
                                                  backend.split(location)[1], memo, CHECKSUM_BLOCK)
        if prep.refs:
            prep.chain = {"base": base_name, "depth": chain_depth(opened.manifest) + 1}
    if not assigned and not described.flat.rank_local:
        return
    every = described.held + described.local
    codes = {tl.key: safetensors_code(described.flat.tensors[tl.key].dtype) for tl in every}
    sizes = {tl.key: tl.itemsize for tl in every}
    prep.mine = plan_file(data_name(comm.rank, prep.suffix), comm.rank, written, codes, sizes)
    try:
        prep.staging = prep.target.staging if prep.target is not None else \
            _open_staging(backend, backend.split(location)[0], tmp)
    except Exception as exc:  # noqa: BLE001 - this rank only: reported to every rank by finish()
        prep.error = exc


def _memo_states(described: Described, assigned: list[Assignment]) -> dict[tuple[str, Box], tuple]:
    """version_skip: the state (storage, version) of each assigned box's source."""
    out: dict[tuple[str, Box], tuple] = {}
    for a in assigned:
        state = VersionMemo.state(described.source(a))  # type: ignore[arg-type]
        if state is not None:
            out[(a.key, a.box)] = state
    return out


def _group_ranks(comm: Comm) -> dict[int, int] | None:
    """Global rank -> rank in the saving group (None without a process group; a group of
    one rank still maps: its rank 0 may be any global rank)."""
    if comm.group is None:
        return None
    import torch.distributed as dist

    return {g: i for i, g in enumerate(dist.get_process_group_ranks(comm.group))}


def _distinct_wires(comm: Comm, described: Described, signatures: list[str]) -> list[bytes | None]:
    """Every distinct layout, sent once: by the first rank that has it (SPMD ranks share
    their layout, so this is one or a few broadcasts, not one message per rank)."""
    if not comm.distributed:
        return [described.wire]
    leaders: dict[str, int] = {}
    for rank, sig in enumerate(signatures):
        leaders.setdefault(sig, rank)
    if len(leaders) == comm.world:  # every rank differs: one all-gather
        return list(comm.all_gather_bytes(described.wire))
    out: list[bytes | None] = [None] * comm.world
    for leader in leaders.values():
        out[leader] = comm.broadcast_bytes(described.wire if comm.rank == leader else None, leader)
    return out


def _open_staging(backend: Backend, parent_location: str, tmp: str) -> Folder:
    """The folder rank 0 made for this save (on an object store, a prefix that may hold
    no object yet: it is "created", which creates nothing)."""
    with backend.open(parent_location, create=True) as parent:
        return reopen_staging(parent, tmp)
