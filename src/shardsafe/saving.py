"""A save, phase by phase: describe -> plan -> stage -> write -> commit.

Every phase takes and returns plain data (the live tensors stay in the
:class:`Described` of the rank that holds them, resolved by the writer); every collective
is a :class:`~shardsafe.comm.Comm` call. Protocol (every rank of the group calls it):

1. **describe** each rank flattens its state and describes what it holds (keys, dtypes,
   shapes, boxes); rank 0 begins the save (checks the target, cleans leftovers, creates
   and locks the temp folder). One ``all_gather`` shares descriptions, the temp folder's
   name and any error. When ranks hold different value trees (pipeline stages), a second
   ``all_gather`` of those trees lets every rank merge them and refuse a key whose kind
   differs between ranks, before anything is written.
2. **plan** every rank computes the same global plan (cached by the ranks' layouts).
3. **stage** this rank's data file is laid out and its bytes borrowed or copied into
   slots of the memory budget.
4. **write** the bytes are hashed and written; the file is made durable.
5. **commit** one ``gather`` brings every rank's file entry and checksums to rank 0,
   which writes the manifest last and publishes the checkpoint; a small tensor
   broadcast tells every rank whether it committed (the same error on all ranks if not).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .checkpoint_folder import SaveTarget, begin_save
from .comm import Comm, rebuild
from .comm import describe as describe_error
from .engine.buffers import flat_bytes
from .engine.writer import WrittenFile
from .errors import CheckpointError, UnsupportedValueError
from .format.checksum import checksum
from .format.dtypes import dtype_name, safetensors_code
from .format.manifest import Chunk, FileEntry, Manifest, TensorEntry
from .hints import warn_user
from .layout import Box
from .plan.save_plan import (
    ChunkWrite,
    FileWrite,
    GlobalPlan,
    TensorLayout,
    data_file_name,
    layout_digest,
    layout_file,
    plan_global,
)
from .state.sharding import dtensor_pieces, is_dtensor, layout_of, local_of
from .state.tree import FlatState, flatten, join_key
from .storage.base import Backend, Folder

CHECKSUM_BLOCK = 1 << 20


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


# ----------------------------------------------------------------------------- describe


@dataclass
class Described:
    """Phase 1 on one rank: its flattened state and what it holds, as plain data, plus the
    local tensor of every box it holds (``sources``, resolved by the writer)."""

    flat: FlatState
    layouts: list[TensorLayout]
    dlayouts: dict[str, Any]
    sources: dict[tuple[str, Box], torch.Tensor]
    signature: str
    tree_digest: str

    def wire(self) -> list[tuple]:
        return [tl.to_wire() for tl in self.layouts]

    def source(self, chunk: ChunkWrite) -> torch.Tensor:
        """The local tensor holding ``chunk``'s box (a row range of a held box when split)."""
        exact = self.sources.get((chunk.key, chunk.box))
        if exact is not None:
            return exact
        for (k, held), t in self.sources.items():
            if k == chunk.key and held.contains(chunk.box):
                return t[chunk.box.relative_to(held).slices()]
        raise CheckpointError(f"tensor '{chunk.key}': this rank was asked to write {chunk.box} but does not hold it")


def _is_replicate(p: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(p, Replicate)


def describe(state: dict[str, Any], rank: int) -> Described:
    """Flatten ``state`` and describe this rank's tensors (UnsupportedValueError naming the
    key for anything that cannot be saved)."""
    flat = flatten(state, rank)
    layouts: list[TensorLayout] = []
    sources: dict[tuple[str, Box], torch.Tensor] = {}
    dlayouts: dict[str, Any] = {}
    for key, t in flat.tensors.items():
        name = dtype_name(t.dtype, key)
        _check_saveable(key, t)
        if is_dtensor(t):
            local_t = local_of(t)
            try:
                pieces = dtensor_pieces(t)
            except TypeError as exc:
                raise UnsupportedValueError(f"cannot save tensor '{key}': {exc}") from None
            boxes = [p.box for p in pieces]
            for p in pieces:
                sources[(key, p.box)] = local_t[p.local_slices]
            kind = "sharded" if any(not _is_replicate(p) for p in t.placements) else "replicated"
            dlayouts[key] = layout_of(t)
        else:
            boxes = [Box.whole(t.shape)]
            sources[(key, boxes[0])] = t
            kind = "rank_local" if key in flat.rank_local_tensors else "replicated"
        layouts.append(TensorLayout(key, name, tuple(t.shape), t.element_size(), kind, boxes))
    wire = [tl.to_wire() for tl in layouts]
    return Described(flat, layouts, dlayouts, sources, checksum(repr(wire).encode()),
                     checksum(repr(flat.tree).encode()))


def _check_saveable(key: str, t: torch.Tensor) -> None:
    """Refuse tensors whose bytes cannot be saved as a dense array, naming the key."""
    local = local_of(t) if is_dtensor(t) else t
    if local.layout != torch.strided:
        raise UnsupportedValueError(f"cannot save tensor '{key}': layout {local.layout} is not a dense (strided) "
                                    "tensor; convert it with .to_dense() first")
    if local.is_meta:
        raise UnsupportedValueError(f"cannot save tensor '{key}': it is on the meta device and holds no data")
    if getattr(local, "is_nested", False):
        raise UnsupportedValueError(f"cannot save tensor '{key}': nested tensors are not supported")


# ----------------------------------------------------------------------------- plan


class PlanCache:
    """The last few global plans, by the ranks' layout signatures (LRU)."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self.plans: OrderedDict[str, GlobalPlan] = OrderedDict()

    def plan(self, wires: list[list[tuple] | None], signatures: list[str]) -> tuple[GlobalPlan, bool]:
        """The global plan for the gathered layouts (ranks whose layout equals an earlier
        rank's may send None) and whether it came from the cache."""
        digest = layout_digest([signatures])
        cached = self.plans.get(digest)
        if cached is not None:
            self.plans.move_to_end(digest)
            return cached, True
        first: dict[str, list[TensorLayout]] = {}
        layouts: list[list[TensorLayout]] = []
        for sig, ws in zip(signatures, wires):
            if ws is not None and sig not in first:
                first[sig] = [TensorLayout.from_wire(w) for w in ws]
            layouts.append(first[sig])
        plan = plan_global(layouts, signatures)
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
    parent_location: str
    tmp: str
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


def replica_digests(described: Described) -> dict[tuple[str, Box], str]:
    """XXH3-64 of every box this rank holds that other ranks may hold too (plain tensors,
    DTensor boxes with a Replicate placement), for ``check_replicas``."""
    out: dict[tuple[str, Box], str] = {}
    for tl in described.layouts:
        if tl.kind == "rank_local":
            continue
        t = described.flat.tensors[tl.key]
        if is_dtensor(t) and not any(_is_replicate(p) for p in t.placements):
            continue
        for box in tl.boxes:
            src = described.sources[(tl.key, box)].detach()
            src = src.cpu() if src.device.type != "cpu" else src
            out[(tl.key, box)] = checksum(memoryview(flat_bytes(src.contiguous()).numpy())) if src.numel() else ""
    return out


def check_replicas(gathered: list[dict[tuple[str, Box], str]]) -> None:
    """Raise CheckpointError naming the key and ranks when ranks hold different bytes for
    the same box (the same on every rank: they all see the same gathered digests)."""
    seen: dict[tuple[str, Box], dict[str, list[int]]] = {}
    for rank, digests in enumerate(gathered):
        for k, d in digests.items():
            seen.setdefault(k, {}).setdefault(d, []).append(rank)
    for (key, box), by_digest in seen.items():
        if len(by_digest) > 1:
            groups = sorted(by_digest.values(), key=lambda r: r[0])
            desc = "; ".join(f"ranks {r[:8]}" for r in groups)
            raise CheckpointError(
                f"tensor '{key}' (box {list(box.offsets)}+{list(box.lengths)}) differs between ranks ({desc} hold "
                "different values); a replicated tensor must be the same on every rank (mark per-rank tensors with "
                "shardsafe.rank_local)")


def prepare(state: dict[str, Any], backend: Backend, location: str, overwrite: bool, comm: Comm,
            cache: PlanCache, check: bool = False) -> PreparedSave:
    """Phases 1 and 2 (one all_gather, a second only when trees differ): describe, agree
    on errors, merge the value trees, plan. Raises the same error on every rank."""
    t0 = time.perf_counter()
    retries0 = backend.retries
    parent_location, _ = backend.split(location)
    error: BaseException | None = None
    described: Described | None = None
    target: SaveTarget | None = None
    tmp = ""
    try:
        described = describe(state, comm.rank)
        if comm.rank == 0:
            target = begin_save(backend, location, overwrite)
            tmp = target.tmp + "\n" + target.suffix
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        error = exc
    wire = described.wire() if described is not None else []
    digests: dict = {}
    if check and described is not None and error is None and comm.distributed:
        try:
            digests = replica_digests(described)
        except Exception as exc:  # noqa: BLE001
            error = exc
    mine = (None if error is None else describe_error(error, comm.rank), wire,
            described.tree_digest if described else "", tmp, described.signature if described else "", digests)
    gathered = comm.all_gather(mine)
    staging: Folder | None = None
    staging_error: BaseException | None = None
    try:
        failures = [g[0] for g in gathered if g[0] is not None]
        if failures:
            if comm.world == 1 and error is not None:
                raise error
            raise rebuild(failures[0]) from error
        assert described is not None
        tmp, suffix = gathered[0][3].split("\n")
        if check:
            check_replicas([g[5] for g in gathered])
        tree = _agreed_tree(comm, described, [g[2] for g in gathered])
        plan, cached = cache.plan([g[1] for g in gathered], [g[4] for g in gathered])
        assigned = plan.by_rank[comm.rank]
        mine_file = None
        if assigned:
            codes = {tl.key: safetensors_code(described.flat.tensors[tl.key].dtype) for tl in described.layouts}
            sizes = {tl.key: tl.itemsize for tl in described.layouts}
            mine_file = layout_file(data_file_name(comm.rank, 0, suffix), comm.rank, assigned, codes, sizes)
            try:
                staging = target.staging if target is not None else _open_staging(backend, parent_location, tmp)
            except Exception as exc:  # noqa: BLE001 - this rank only: reported to every rank by finish()
                staging_error = exc
    except BaseException:
        if target is not None:
            target.abort()
            target.release()
            target.parent.close()
        raise
    return PreparedSave(comm, location, parent_location, tmp, plan, cached, mine_file, described, tree, t0,
                        overwrite, target, staging, backend, retries0, staging_error)


def _open_staging(backend: Backend, parent_location: str, tmp: str) -> Folder:
    """The folder rank 0 made for this save (on an object store, a prefix that may hold
    no object yet: it is "created", which creates nothing)."""
    with backend.open(parent_location, create=True) as parent:
        return parent.open_folder(tmp, create=not parent.can_rename)


def _agreed_tree(comm: Comm, described: Described, digests: list[str]) -> Any:
    """The value tree to save: rank 0's, with the dict entries only other ranks hold.
    When trees differ, every rank merges the same gathered trees and raises the same
    error for a key whose kind differs between ranks."""
    if all(d == digests[0] for d in digests):
        return described.flat.tree
    mine = described.flat.tree if comm.rank == 0 or digests[comm.rank] != digests[0] else None
    trees = comm.all_gather(mine)
    merged = trees[0]
    for rank in range(1, len(trees)):
        if trees[rank] is not None:
            merged = merge_trees(merged, trees[rank], [], rank, comm.rank == 0)
    return merged


def merge_trees(base: Any, other: Any, parts: list[str], rank: int, warn: bool = True) -> Any:
    """Add to rank 0's tree ``base`` the dict entries only rank ``rank`` has. A key whose
    kind differs (a tensor on one rank, a value or container on the other; a dict
    against a list) raises CheckpointError naming the key and both ranks; differing
    plain values keep rank 0's, with a warning."""
    from .state.saved import children
    from .state.tree import saved_ref

    key = join_key(parts) or "<root>"
    kb, ko = children(base), children(other)
    rb, ro = saved_ref(base), saved_ref(other)
    if (kb is None) != (ko is None) or (kb is not None and ko is not None and kb[0] is not ko[0]) or \
            (rb is None) != (ro is None) or (rb is not None and ro is not None and rb[0] != ro[0]):
        raise CheckpointError(
            f"key '{key}': rank 0 holds {_kind_of(base)}, rank {rank} holds {_kind_of(other)}; every rank must "
            "hold the same kind of value at a key (mark per-rank values with shardsafe.rank_local)")
    if isinstance(base, dict) and isinstance(other, dict) and kb is not None and kb[0] is dict and \
            not any(k.startswith("$") for k in base):
        out = dict(base)
        for k, v in other.items():
            out[k] = merge_trees(base[k], v, parts + [k], rank, warn) if k in base else v
        return out
    if base != other and warn:
        warn_user(f"value at '{key}' differs between rank 0 and rank {rank}; rank 0's is saved (mark per-rank "
                  "values with shardsafe.rank_local)")
    return base


def _kind_of(node: Any) -> str:
    from .state.saved import children
    from .state.tree import saved_ref

    ref = saved_ref(node)
    if ref is not None:
        return "a tensor" if ref[0] == "$tensor" else "a rank-local value"
    kids = children(node)
    if kids is not None:
        return {dict: "a dict", list: "a list", tuple: "a tuple"}[kids[0]]
    return "a plain value"


# ----------------------------------------------------------------------------- commit


FileResult = tuple[FileEntry, list[tuple[str, Box, int, int, list[str]]]]


def file_result(prep: PreparedSave, written: WrittenFile) -> FileResult:
    """A written file as plain data for the commit gather."""
    assert prep.mine is not None
    return written.entry, [(c.key, c.box, c.start, c.end, sums)
                           for c, sums in zip(prep.mine.chunks, written.checksums)]


def finish(prep: PreparedSave, results: list[FileResult], error: BaseException | None) -> SaveInfo:
    """Phase 5 (one gather + one small tensor broadcast): rank 0 writes the manifest and
    commits; every rank learns whether the commit happened and raises the same error
    when it did not. Releases the temp folder on every path."""
    try:
        return _finish(prep, results, error)
    finally:
        if prep.staging is not None and prep.target is None:
            prep.staging.close()
        if prep.target is not None:
            prep.target.release()
            prep.target.parent.close()


def _finish(prep: PreparedSave, results: list[FileResult], error: BaseException | None) -> SaveInfo:
    comm = prep.comm
    described = prep.described
    collected = comm.gather((None if error is None else describe_error(error, comm.rank), results,
                             described.flat.rank_local, described.dlayouts))
    if error is not None and not comm.distributed:
        if prep.target is not None:
            prep.target.abort()
        raise error
    status: tuple[str, str] | None = None
    if comm.rank == 0:
        assert collected is not None and prep.target is not None
        try:
            bad = [c[0] for c in collected if c[0] is not None]
            if bad:
                status = bad[0]
            else:
                manifest = build_manifest(prep.plan, collected, prep.tree, comm.world)
                prep.target.commit(manifest.to_bytes(), prep.overwrite)
        except BaseException as exc:
            if not comm.distributed:
                prep.target.abort()
                raise
            status = describe_error(exc, comm.rank)
        if status is not None:
            prep.target.abort()
    status = comm.broadcast_status(status)
    if status is not None:
        raise rebuild(status) from error
    mine = sum(e.nbytes for e, _ in results)
    return SaveInfo(prep.location, mine, len(results), len(described.flat.tensors), time.perf_counter() - prep.t0,
                    prep.plan_cached, prep.backend.retries - prep.retries0 if prep.backend is not None else 0)


def build_manifest(plan: GlobalPlan, collected: list, tree: Any, world: int) -> Manifest:
    """The manifest of a save from the plan and every rank's written files."""
    dlayouts: dict[str, Any] = {}
    for c in collected:
        for k, v in c[3].items():
            dlayouts.setdefault(k, v)
    tensors = {key: TensorEntry(dt, shape, kind, [], dlayouts.get(key)) for key, (dt, shape, kind) in
               plan.tensors.items()}
    files: list[FileEntry] = []
    rank_local: dict[str, list[Any]] = {}
    for rank, (_, results, rl, _) in enumerate(collected):
        for entry, chunks in results:
            index = len(files)
            files.append(entry)
            for key, box, start, end, sums in chunks:
                tensors[key].chunks.append(Chunk(box.offsets, box.lengths, index, start, end, sums, rank))
        for key, value in rl.items():
            rank_local.setdefault(key, [None] * world)[rank] = value
    for entry in tensors.values():
        entry.chunks.sort(key=lambda c: c.offsets)
    return Manifest(
        tree=tree,
        tensors=tensors,
        files=files,
        world_size=world,
        rank_local=rank_local,
        writer={"shardsafe": __version__, "torch": torch.__version__},
        extra={"checksum_block": CHECKSUM_BLOCK},
    )
