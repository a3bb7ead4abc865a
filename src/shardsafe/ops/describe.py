"""Phase 1 of a save, describe: what this rank holds, as plain data.

:func:`describe` flattens a rank's state and describes each tensor it holds (key, dtype,
shape; its boxes, or for a regularly sharded DTensor its mesh and placements as a rule),
refusing what cannot be saved. The rest checks that ranks agree on what they describe:
the bytes of boxes several ranks hold (``check_replicas``) and the value trees of ranks
that hold different state (pipeline stages: :func:`agreed_tree`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..comm import Comm
from ..engine.buffers import flat_bytes
from ..errors import CheckpointError, UnsupportedValueError
from ..format.checksum import checksum
from ..format.dtypes import dtype_name
from ..format.rules import placements_json
from ..format.rules import rule_problem as _rule_problem  # the reader's predicate (tests patch this name)
from ..format.values import TENSOR_TAG
from ..hints import warn_user
from ..layout import Box
from ..plan.save_plan import ChunkWrite, HeldTensor, wire_of
from ..state.sharding import dtensor_pieces, is_dtensor, local_of, spec_of
from ..state.tree import FlatState, flatten, join_key


@dataclass
class Described:
    """Phase 1 on one rank: its flattened state and what it holds, as plain data, plus the
    local tensor of every box it holds (``sources``, resolved by the writer)."""

    flat: FlatState
    held: list[HeldTensor]  # planned with the other ranks
    local: list[HeldTensor]  # rank-local tensors: written by this rank, never planned
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
    held: list[HeldTensor] = []
    local: list[HeldTensor] = []
    sources: dict[tuple[str, Box], torch.Tensor] = {}
    meshes: dict[int, tuple] = {}  # id(DeviceMesh) -> its shape, ranks and names (alive during the call)
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
            rule = _rule_key(t, group_rank, world, meshes) if kind == "sharded" else None
            held.append(HeldTensor(key, name, tuple(t.shape), t.element_size(), kind, boxes, rule,
                                   None if rule is not None else spec_of(t)))
            continue
        boxes = [Box.whole(t.shape)]
        sources[(key, boxes[0])] = t
        if key in flat.rank_local_tensors:
            local.append(HeldTensor(key, name, tuple(t.shape), t.element_size(), "rank_local", boxes))
        else:
            held.append(HeldTensor(key, name, tuple(t.shape), t.element_size(), "replicated", boxes))
    wire = wire_of(held)
    return Described(flat, held, local, sources, wire, checksum(wire), checksum(repr(flat.tree).encode()))


def _rule_key(t: Any, group_rank: Any, world: int, meshes: dict[int, tuple]) -> tuple | None:
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
    key = meshes.get(id(mesh))
    if key is None:  # DeviceMesh.mesh builds a tensor on every call: once per mesh
        ranks = mesh.mesh.flatten().tolist()
        if group_rank is not None:
            ranks = [group_rank.get(r) for r in ranks]
        names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
        key = meshes[id(mesh)] = (tuple(mesh.shape), tuple(ranks), names)
    if None in key[1]:
        return None
    return key, tuple(tuple(p) for p in placements)


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


def replica_digests(described: Described) -> dict[tuple[str, Box], str]:
    """XXH3-64 of every box this rank holds that other ranks may hold too (plain tensors,
    DTensor boxes with a Replicate placement), for ``check_replicas``."""
    out: dict[tuple[str, Box], str] = {}
    for tl in described.held:
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


def agreed_tree(comm: Comm, described: Described, digests: list[str]) -> Any:
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
        return "a tensor" if ref[0] == TENSOR_TAG else "a rank-local value"
    kids = children(node)
    if kids is not None:
        return {dict: "a dict", list: "a list", tuple: "a tuple"}[kids[0]]
    return "a plain value"
