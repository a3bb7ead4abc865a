"""DTensor geometry: which boxes of the global tensor this rank's local tensor holds.

A local shard is the product, over tensor dims, of the global indices it holds on each
dim. ``Shard(d)`` gives one contiguous range per dim; ``_StridedShard`` (FSDP2 over
tensor parallel on the same dim) gives several, so a local tensor may cover several
boxes. Indices come from the placements' own ``_split_tensor`` so uneven and strided
shards follow torch's rules exactly.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from ..layout import Box

try:  # torch.distributed may be missing in minimal builds
    from torch.distributed.tensor import DTensor, Replicate, Shard
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = Shard = None  # type: ignore[assignment,misc]


def is_dtensor(t: Any) -> bool:
    """True for a torch DTensor."""
    return DTensor is not None and isinstance(t, DTensor)


@dataclass(frozen=True)
class Piece:
    """Part of a local tensor: ``local[local_slices]`` holds global ``box``."""

    local_slices: tuple[slice, ...]
    box: Box


def _runs(indices: list[int]) -> list[tuple[int, int, int]]:
    """Sorted-by-position maximal runs (local_start, global_start, length) of consecutive indices."""
    out: list[tuple[int, int, int]] = []
    for pos, g in enumerate(indices):
        if out and out[-1][1] + out[-1][2] == g and out[-1][0] + out[-1][2] == pos:
            ls, gs, n = out[-1]
            out[-1] = (ls, gs, n + 1)
        else:
            out.append((pos, g, 1))
    return out


def _is_shard_like(p: Any) -> bool:
    return hasattr(p, "dim") and hasattr(p, "_split_tensor") and not isinstance(p, Replicate)


def dim_indices(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int],
                placements: tuple[Any, ...]) -> list[list[int]]:
    """Global indices held on each tensor dim by the mesh coordinate ``coord``."""
    idx: list[list[int] | None] = [None] * len(global_shape)
    for mesh_dim, p in enumerate(placements):
        if not _is_shard_like(p):
            if not isinstance(p, Replicate):
                raise TypeError(f"placement {p} (Partial?) cannot be checkpointed; redistribute first")
            continue
        d = p.dim if p.dim >= 0 else p.dim + len(global_shape)
        current = idx[d] if idx[d] is not None else list(range(global_shape[d]))
        shape = [1] * d + [len(current)]
        positions = torch.arange(len(current)).view(shape)
        shards, _ = p._split_tensor(positions, mesh_shape[mesh_dim], with_padding=False, contiguous=False)
        mine = shards[coord[mesh_dim]].reshape(-1).tolist() if coord[mesh_dim] < len(shards) else []
        idx[d] = [current[i] for i in mine]
    return [list(range(n)) if i is None else i for n, i in zip(global_shape, idx)]


def _plain_shard_box(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int],
                     placements: tuple[Any, ...]) -> Box | None:
    """Closed form for placements that are all exactly ``Shard`` or ``Replicate``: torch.chunk
    rule (chunk = ceil(len / n)) applied left to right over the mesh dims. None otherwise."""
    offsets = [0] * len(global_shape)
    lengths = list(global_shape)
    for mesh_dim, p in enumerate(placements):
        if type(p) is Replicate:
            continue
        if type(p) is not Shard:
            return None
        d = p.dim if p.dim >= 0 else p.dim + len(global_shape)
        n = mesh_shape[mesh_dim]
        chunk = -(-lengths[d] // n) if lengths[d] else 0
        start = min(coord[mesh_dim] * chunk, lengths[d])
        length = min(start + chunk, lengths[d]) - start
        offsets[d] += start
        lengths[d] = length
    return Box(tuple(offsets), tuple(lengths))


@lru_cache(maxsize=4096)
def _pieces_cached(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
                   placements: tuple[Any, ...]) -> tuple[Piece, ...]:
    if any(n == 0 for n in global_shape):
        # Nothing to store: every rank "holds" the empty whole, so the planner sees it covered.
        return (Piece(tuple(slice(0, n) for n in global_shape), Box.whole(global_shape)),)
    box = _plain_shard_box(global_shape, mesh_shape, list(coord), placements)
    if box is not None:
        return () if box.is_empty() else (Piece(tuple(slice(0, n) for n in box.lengths), box),)
    per_dim = [_runs(ix) for ix in dim_indices(global_shape, mesh_shape, list(coord), placements)]
    if any(len(r) == 0 for r in per_dim):
        return ()  # an empty local shard holds nothing
    pieces: list[Piece] = [Piece((), Box((), ()))]
    for runs in per_dim:
        pieces = [
            Piece(p.local_slices + (slice(ls, ls + n),), Box(p.box.offsets + (gs,), p.box.lengths + (n,)))
            for p in pieces
            for ls, gs, n in runs
        ]
    return tuple(pieces)


def pieces_for(global_shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: list[int],
               placements: tuple[Any, ...]) -> list[Piece]:
    """The boxes a mesh coordinate holds, each with where it sits in the local tensor
    (cached: a parameter and its optimizer states share the geometry)."""
    try:
        return list(_pieces_cached(tuple(global_shape), tuple(mesh_shape), tuple(coord), tuple(placements)))
    except TypeError:  # unhashable placement: compute without the cache
        return list(_pieces_cached.__wrapped__(tuple(global_shape), tuple(mesh_shape), tuple(coord),
                                               tuple(placements)))


def local_of(t: Any) -> torch.Tensor:
    """The local tensor of DTensor ``t``, detached (same storage, in-place writes allowed).
    Taken directly: ``to_local()`` is an autograd op costing ~50 us a call, and a state has
    thousands of DTensors."""
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t.to_local()).detach()


_MESH_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _mesh_facts(mesh: Any) -> tuple[tuple[int, ...], list[int] | None]:
    """(shape, this rank's coordinate) of a device mesh, computed once per mesh (both are
    fixed for a mesh's life; asking torch costs ~20 us, times thousands of DTensors)."""
    try:
        return _MESH_FACTS[mesh]
    except (KeyError, TypeError):
        pass
    coord = mesh.get_coordinate()
    facts = (tuple(mesh.shape), None if coord is None else list(coord))
    with contextlib.suppress(TypeError):
        _MESH_FACTS[mesh] = facts
    return facts


def dtensor_pieces(t: Any) -> list[Piece]:
    """The pieces of this rank's local tensor of DTensor ``t``."""
    mesh_shape, coord = _mesh_facts(t.device_mesh)
    if coord is None:
        return []
    return pieces_for(tuple(t.shape), mesh_shape, coord, tuple(t.placements))


def spec_of(t: Any) -> dict[str, Any]:
    """A JSON description of a DTensor's saving layout, for the manifest."""
    mesh = t.device_mesh
    return {
        "mesh_shape": list(mesh.shape),
        "mesh_dim_names": list(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        "placements": [str(p) for p in t.placements],
    }
