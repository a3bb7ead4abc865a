"""A save, phase by phase: describe -> plan -> stage -> write -> commit.

Every phase takes and returns plain data (the live tensors stay in the
:class:`Described` of the rank that holds them, resolved by the writer); every collective
is a :class:`~shardsafe.comm.Comm` call. Protocol (every rank of the group calls it):

1. **describe** each rank flattens its state and describes what it holds (keys, dtypes,
   shapes; boxes, or for a regularly sharded DTensor its mesh and placements, a rule);
   rank 0 begins the save (checks the target, cleans leftovers, creates and locks the
   temp folder). One ``all_gather`` of small fixed data shares the layouts' digests, the
   temp folder's name and any error; then only the first rank of each distinct layout
   sends it (SPMD ranks share one). When ranks hold different value trees (pipeline
   stages), an ``all_gather`` of those trees lets every rank merge them and refuse a key
   whose kind differs between ranks, before anything is written.
2. **plan** every rank computes the same global plan (cached by the ranks' layouts).
3. **stage** this rank's data file is laid out and its bytes borrowed or copied into
   slots of the memory budget.
4. **write** the bytes are hashed and written; the file is made durable.
5. **commit** each rank writes its file's index (byte ranges, block checksums, its
   rank-local values); ranks agree on errors, then one fixed-size tensor ``gather`` brings
   each rank's file size and index size and digest to rank 0, which builds the manifest
   from the plan (O(tensors + files)), writes it last and publishes the checkpoint; a small
   tensor broadcast tells every rank whether it committed.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..checkpoint_folder import SaveTarget, begin_save
from ..comm import Comm, rebuild
from ..comm import describe as describe_error
from ..engine.buffers import flat_bytes
from ..engine.writer import WrittenFile
from ..errors import BaseCheckpointError, CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ..format.checksum import checksum
from ..format.dtypes import dtype_name, name_itemsize, safetensors_code
from ..format.file_index import FileIndex, IndexedChunk, build_index, index_name
from ..format.manifest import FORMAT_VERSION, FileEntry, Manifest, TensorEntry
from ..format.refs import RefFile
from ..format.rules import Mesh, placements_json
from ..format.rules import rule_problem as _rule_problem  # the reader's predicate (tests patch this name)
from ..hints import warn_user
from ..layout import Box
from ..plan.load_plan import Dest
from ..plan.save_plan import (
    ChunkWrite,
    FileWrite,
    GlobalPlan,
    TensorLayout,
    data_file_name,
    layout_digest,
    layout_file,
    layouts_of_wire,
    plan_global,
    wire_of,
)
from ..state.sharding import dtensor_pieces, is_dtensor, layout_of, local_of
from ..state.tree import FlatState, flatten, join_key
from ..storage.base import Backend, Folder
from .incremental import Base, VersionMemo, chain_depth, match, reference_rows
from .metadata import Opened, fetch_cut_indexes, fetch_indexes, read_manifest_phase

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
    bytes_referred: int = 0  # incremental: bytes of this rank's chunks left where the base holds them
    chunks_referred: int = 0


# ----------------------------------------------------------------------------- describe


@dataclass
class Described:
    """Phase 1 on one rank: its flattened state and what it holds, as plain data, plus the
    local tensor of every box it holds (``sources``, resolved by the writer)."""

    flat: FlatState
    layouts: list[TensorLayout]  # planned with the other ranks
    local: list[TensorLayout]  # rank-local tensors: written by this rank, never planned
    sources: dict[tuple[str, Box], torch.Tensor]
    wire: bytes
    signature: str
    tree_digest: str

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


def describe(state: dict[str, Any], rank: int, group_rank: Any = None, world: int = 1) -> Described:
    """Flatten ``state`` and describe this rank's tensors (UnsupportedValueError naming the
    key for anything that cannot be saved). ``group_rank`` maps a global rank to its rank
    in the saving group (None: the identity) of ``world`` ranks; a DTensor whose mesh it
    cannot map, or whose layout a reader would not accept as a rule, is described box by
    box instead of by rule."""
    flat = flatten(state, rank)
    layouts: list[TensorLayout] = []
    local: list[TensorLayout] = []
    sources: dict[tuple[str, Box], torch.Tensor] = {}
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
            rule = _rule_key(t, group_rank, world) if kind == "sharded" else None
            layouts.append(TensorLayout(key, name, tuple(t.shape), t.element_size(), kind, boxes, rule,
                                        None if rule is not None else layout_of(t)))
            continue
        boxes = [Box.whole(t.shape)]
        sources[(key, boxes[0])] = t
        if key in flat.rank_local_tensors:
            local.append(TensorLayout(key, name, tuple(t.shape), t.element_size(), "rank_local", boxes))
        else:
            layouts.append(TensorLayout(key, name, tuple(t.shape), t.element_size(), "replicated", boxes))
    wire = wire_of(layouts)
    return Described(flat, layouts, local, sources, wire, checksum(wire), checksum(repr(flat.tree).encode()))


def _rule_key(t: Any, group_rank: Any, world: int) -> tuple | None:
    """A DTensor's layout as a rule (mesh shape, the saving group's rank at each mesh
    coordinate, dim names; placements), or None when it has none (docs/format.md, rules)
    or a reader of a ``world``-rank checkpoint could refuse it (``format.rules.rule_problem``:
    a ``_StridedShard`` split factor above the world size, a bound the rule budget would not
    back): such a tensor is saved as explicit boxes."""
    if not t.shape or 0 in t.shape:
        return None
    placements = placements_json(t.placements, len(t.shape))
    if placements is None or _rule_problem(tuple(t.shape), placements, tuple(t.device_mesh.shape), world) is not None:
        return None
    mesh = t.device_mesh
    ranks = mesh.mesh.flatten().tolist()
    if group_rank is not None:
        ranks = [group_rank.get(r) for r in ranks]
        if None in ranks:
            return None
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    return (tuple(mesh.shape), tuple(ranks), names), tuple(tuple(p) for p in placements)


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

    def plan(self, wires: list[bytes | None], signatures: list[str]) -> tuple[GlobalPlan, bool]:
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
                first[sig] = layouts_of_wire(ws)
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
    suffix: str = ""  # the save id in data file names ("" where the folder is renamed into place)
    refs: list[RefFile] = field(default_factory=list)  # incremental: the files references point at (every rank)
    ref_rows: list[IndexedChunk] = field(default_factory=list)  # this rank's chunks left in the base's files
    memo_states: dict[tuple[str, Box], tuple] = field(default_factory=dict)  # version_skip: sources' states
    digests: dict[tuple[str, Box], str] = field(default_factory=dict)  # this rank's chunk digests, once written
    chain: dict[str, Any] | None = None  # incremental: extra.incremental (base name, depth)
    memo_epoch: int = -1  # version_skip: VersionMemo.epoch() when the sources' states were taken


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
            cache: PlanCache, check: bool = False, base: str | None = None,
            memo: VersionMemo | None = None) -> PreparedSave:
    """Phases 1 and 2 (one all_gather, a second only when trees differ): describe, agree
    on errors, merge the value trees, plan; with a ``base`` (a checkpoint in the same
    folder), find the chunks it already holds (one all-reduce more). Raises the same error
    on every rank."""
    t0 = time.perf_counter()
    retries0 = backend.retries
    parent_location, _ = backend.split(location)
    error: BaseException | None = None
    described: Described | None = None
    target: SaveTarget | None = None
    tmp = ""
    opened_base: Opened | None = None
    try:
        described = describe(state, comm.rank, _group_ranks(comm), comm.world)
        if base is not None:
            opened_base = open_base(backend, location, base)
        if comm.rank == 0:
            target = begin_save(backend, location, overwrite)
            tmp = target.tmp + "\n" + target.suffix
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        error = exc
    digests: dict = {}
    if check and described is not None and error is None and comm.distributed:
        try:
            digests = replica_digests(described)
        except Exception as exc:  # noqa: BLE001
            error = exc
    mine = (None if error is None else describe_error(error, comm.rank), None,
            described.tree_digest if described else "", tmp, described.signature if described else "", digests)
    try:
        gathered = comm.all_gather(mine)
    except BaseException:
        if opened_base is not None:
            opened_base.close()
        raise
    staging: Folder | None = None
    staging_error: BaseException | None = None
    refs: list[RefFile] = []
    ref_rows: list[IndexedChunk] = []
    memo_states: dict[tuple[str, Box], tuple] = {}
    memo_epoch = -1
    chain: dict[str, Any] | None = None
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
        signatures = [g[4] for g in gathered]
        plan, cached = cache.plan(_distinct_wires(comm, described, signatures), signatures)
        assigned = plan.assignments(comm.rank, described.layouts, described.local)
        if memo is not None:
            memo_epoch = VersionMemo.epoch()
            for a in assigned:
                state = VersionMemo.state(described.source(a))  # type: ignore[arg-type]
                if state is not None:
                    memo_states[(a.key, a.box)] = state
        written = assigned
        if opened_base is not None:
            refs, ref_rows, written = _refer(comm, described, plan, assigned, opened_base,
                                             backend.split(base)[1], backend.split(location)[1], memo)
            if refs:
                chain = {"base": backend.split(base)[1], "depth": chain_depth(opened_base.manifest) + 1}
        mine_file = None
        if assigned or described.flat.rank_local:
            every = described.layouts + described.local
            codes = {tl.key: safetensors_code(described.flat.tensors[tl.key].dtype) for tl in every}
            sizes = {tl.key: tl.itemsize for tl in every}
            mine_file = layout_file(data_file_name(comm.rank, 0, suffix), comm.rank, written, codes, sizes)
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
    finally:
        if opened_base is not None:
            opened_base.close()
    return PreparedSave(comm, location, parent_location, tmp, plan, cached, mine_file, described, tree, t0,
                        overwrite, target, staging, backend, retries0, staging_error, suffix, refs, ref_rows,
                        memo_states, chain=chain, memo_epoch=memo_epoch)


def open_base(backend: Backend, location: str, base: str) -> Opened:
    """The base checkpoint of a save to ``location``: it must be another checkpoint of the
    same parent folder (references name it by its folder name)."""
    parent, name = backend.split(location)
    base_parent, base_name = backend.split(base)
    if base_parent != parent:
        raise CheckpointError(f"base checkpoint {base} must be in the same folder as the new checkpoint {location} "
                              "(references name their checkpoint by its name in that folder)")
    if base_name == name:
        raise CheckpointError(f"a checkpoint cannot be its own base: {location}")
    try:
        return read_manifest_phase(backend, base)
    except CheckpointError as exc:
        raise BaseCheckpointError(f"base checkpoint {base} cannot be used: {exc}") from exc


def _refer(comm: Comm, described: Described, plan: GlobalPlan, assigned: list, opened: Opened, base_name: str,
           target_name: str, memo: VersionMemo | None) -> tuple[list[RefFile], list[IndexedChunk], list]:
    """Find this rank's chunks that the base holds unchanged; agree with every rank on the
    referenced files (one all-reduce). Returns the manifest's ``refs``, this rank's
    reference rows and the assignments still to write."""
    error: BaseException | None = None
    found: dict = {}
    base: Base | None = None
    mine: set[int] = set()
    try:
        base = Base.of(base_name, opened.manifest)
        for c in base.candidates:
            if c.checkpoint == target_name:
                raise CheckpointError(f"base checkpoint '{base_name}' refers to data in '{target_name}', which this "
                                      "save would replace")
        meta = {tl.key: (tl.dtype, tuple(tl.shape)) for tl in described.layouts}
        try:
            fetch_cut_indexes(opened, [Dest(a.key, a.box, False) for a in assigned])
            found = match(base, assigned, described.source, meta, CHECKSUM_BLOCK, memo,
                          lambda files: fetch_indexes(opened, files))
            mine = {m.chunk.file for m in found.values()}
            _check_referenced(opened, base, mine)
        except CheckpointError as exc:
            raise BaseCheckpointError(f"base checkpoint '{base_name}' cannot be used: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    comm.agree(error, opened.digest, " as the base")  # every rank matched against the same manifest
    assert base is not None
    used = comm.all_max([1 if j in mine else 0 for j in range(len(base.candidates))])
    numbering: dict[int, int] = {}
    refs: list[RefFile] = []
    for j, u in enumerate(used):
        if u:
            numbering[j] = len(refs)
            refs.append(base.candidates[j])
    rows = reference_rows(found, assigned, plan.ordinal(), numbering)
    return refs, rows, [a for i, a in enumerate(assigned) if i not in found]


def _check_referenced(opened: Opened, base: Base, files: set[int]) -> None:
    """The files this rank would refer to exist with the size the base recorded (a base
    damaged since its save is noticed now, not by the new checkpoint's loads)."""
    for j in sorted(files):
        ref = base.candidates[j]
        if ref.checkpoint == base.name:
            folder, close = opened.folder, False
        else:
            assert opened.siblings is not None
            try:
                folder, close = opened.siblings(ref.checkpoint), True
            except CheckpointError as exc:
                raise CorruptCheckpointError(f"it refers to checkpoint '{ref.checkpoint}', which is missing "
                                             f"({exc})") from None
        try:
            size = folder.size(ref.name) if folder.kind(ref.name) == "file" else None
        finally:
            if close:
                folder.close()
        if size != ref.nbytes:
            raise CorruptCheckpointError(
                f"data file {folder.where(ref.name)} is {'missing' if size is None else f'{size} bytes'}, "
                f"{ref.nbytes} recorded")


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
    from ..state.saved import children
    from ..state.tree import saved_ref

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
    from ..state.saved import children
    from ..state.tree import saved_ref

    ref = saved_ref(node)
    if ref is not None:
        return "a tensor" if ref[0] == "$tensor" else "a rank-local value"
    kids = children(node)
    if kids is not None:
        return {dict: "a dict", list: "a list", tuple: "a tuple"}[kids[0]]
    return "a plain value"


# ----------------------------------------------------------------------------- commit


FileResult = tuple[FileEntry, bytes]  # a written data file and its index's bytes


def file_result(prep: PreparedSave, written: WrittenFile) -> FileResult:
    """A written file and its index (byte ranges, block checksums, this rank's rank-local
    values), as plain data for the commit."""
    assert prep.mine is not None
    order = prep.plan.ordinal()
    local = {tl.key: i for i, tl in enumerate(sorted(prep.described.local, key=lambda t: t.key))}
    base = len(order)
    chunks = [IndexedChunk(order[c.key] if c.key in order else base + local[c.key], c.box.offsets, c.box.lengths,
                           c.start, c.end, sums, digest)
              for c, sums, digest in zip(prep.mine.chunks, written.checksums, written.digests)]
    if prep.memo_states:  # version_skip: the digests the memo records once committed
        prep.digests = {(c.key, c.box): d for c, d in zip(prep.mine.chunks, written.digests)}
        keys = list(prep.plan.tensors)
        prep.digests.update({(keys[r.ordinal], Box(r.offsets, r.lengths)): r.digest for r in prep.ref_rows})
    chunks.extend(prep.ref_rows)
    local_tensors = {tl.key: (tl.dtype, tl.shape) for tl in sorted(prep.described.local, key=lambda t: t.key)}
    data = build_index(prep.comm.rank, written.entry.header_bytes, written.entry.header_checksum, chunks,
                       local_tensors, prep.described.flat.rank_local)
    return written.entry, data


def remember(prep: PreparedSave, memo: VersionMemo) -> None:
    """After a committed save: record each chunk's digest with its source's state, so the
    next save with ``version_skip`` need not hash what did not change."""
    entries = {}
    for kb, (state, storage) in prep.memo_states.items():
        digest = prep.digests.get(kb)
        if digest:
            entries[kb] = (state, storage, digest)
    memo.replace(entries, prep.memo_epoch)


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
    # has a file, its bytes, its index's bytes, the index's XXH3-64 (as int64), bytes it refers to
    summary = [0, 0, 0, 0, 0]
    if error is None and results:
        try:
            entry, index = results[0]
            if prep.staging is None:
                raise CheckpointError("the save's folder could not be opened on this rank")
            check_index(prep, entry, index)
            prep.staging.write_bytes(index_name(entry.name), index)
            digest = int(checksum(index), 16)
            summary = [1, entry.nbytes, len(index), digest - (1 << 64) if digest >= 1 << 63 else digest,
                       sum(r.end - r.start for r in prep.ref_rows)]
        except BaseException as exc:  # noqa: BLE001 - agreed on below
            error = exc
    try:
        comm.agree(error)
    except BaseException:
        if prep.target is not None:
            prep.target.abort()
        raise
    summaries = comm.gather_ints(summary)
    status: tuple[str, str] | None = None
    if comm.rank == 0:
        assert summaries is not None and prep.target is not None
        try:
            manifest = build_manifest(prep.plan, summaries, prep.tree, comm.world, prep.suffix, prep.refs)
            if prep.chain is not None:
                manifest.extra["incremental"] = {**prep.chain, "referred_bytes": sum(s[4] for s in summaries)}
            prep.target.commit(checked_manifest(manifest), prep.overwrite)
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
    return SaveInfo(prep.location, mine, len(results), len(prep.described.flat.tensors),
                    time.perf_counter() - prep.t0, prep.plan_cached,
                    prep.backend.retries - prep.retries0 if prep.backend is not None else 0,
                    sum(r.end - r.start for r in prep.ref_rows), len(prep.ref_rows))


def check_index(prep: PreparedSave, entry: FileEntry, index: bytes) -> None:
    """Parse this rank's index with the reader's own rules before it is written: a save
    never commits an index its reader refuses (CheckpointError naming the rank)."""
    meta = [(shape, name_itemsize(dtype) or 0) for dtype, shape, _ in prep.plan.tensors.values()]
    try:
        FileIndex.parse(index, index_name(entry.name), file=0, rank=prep.comm.rank, nbytes=entry.nbytes,
                        block=CHECKSUM_BLOCK, tensors=meta, ref_files=[(r.name, r.nbytes) for r in prep.refs],
                        first_ref=1)
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"save refused: rank {prep.comm.rank}'s file index would not load: {exc}") from None


def checked_manifest(manifest: Manifest) -> bytes:
    """The manifest's bytes, parsed back with the reader's own rules and bounds first: a
    save never commits a manifest its reader refuses (CheckpointError naming the cause)."""
    data = manifest.to_bytes()
    try:
        Manifest.from_bytes(data, "the manifest to commit")
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"save refused: the checkpoint would not load: {exc}") from None
    return data


def build_manifest(plan: GlobalPlan, summaries: list[list[int]], tree: Any, world: int, file_id: str,
                   refs: list[RefFile] | None = None) -> Manifest:
    """The format-3 manifest of a save, from the plan and each rank's (has a file, bytes,
    index bytes, index digest): O(tensors + files), no chunk of a rule tensor listed."""
    files: list[FileEntry] = []
    file_of_rank: dict[int, int] = {}
    for rank, (has, nbytes, index_bytes, digest, *_) in enumerate(summaries):
        if has:
            file_of_rank[rank] = len(files)
            files.append(FileEntry(data_file_name(rank, 0, file_id), nbytes, rank, 0, "", index_bytes,
                                   format(digest & ((1 << 64) - 1), "016x")))
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {}
    for rank, assigned in enumerate(plan.by_rank):
        for a in assigned:
            boxes.setdefault(a.key, []).append((a.box.offsets, a.box.lengths, file_of_rank[rank]))
    meshes: dict[Mesh, None] = {}
    tensors: dict[str, TensorEntry] = {}
    for key, (dtype, shape, kind) in plan.tensors.items():
        rule = plan.rules.get(key)
        if rule is not None:
            meshes.setdefault(rule.mesh)
            tensors[key] = TensorEntry.by_rule(dtype, shape, kind, rule)
        else:
            tensors[key] = TensorEntry.by_boxes(dtype, shape, kind, boxes[key], plan.layouts.get(key))
    return Manifest(
        tree=tree,
        tensors=tensors,
        files=files,
        world_size=world,
        rank_local=_rank_local_keys(tree),
        writer={"shardsafe": __version__, "torch": torch.__version__},
        extra={"checksum_block": CHECKSUM_BLOCK},
        version=FORMAT_VERSION,
        meshes=list(meshes),
        file_id=file_id,
        refs=list(refs or []),
    )


def _rank_local_keys(tree: Any) -> list[str]:
    """The keys of the rank-local placeholders in a saved value tree."""
    out: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1 and "$rank_local" in node and isinstance(node["$rank_local"], str):
                out.append(node["$rank_local"])
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(set(out))
