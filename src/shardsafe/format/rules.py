"""Layouts as rules: the chunks of a regularly sharded tensor, computed instead of listed.

A DTensor saved on a device mesh with ``Shard``, ``_StridedShard`` and ``Replicate``
placements is stored as one *rule* (docs/format.md, "rules"): its global shape, the mesh
(shape and the saving rank at each coordinate) and the placements. Every reader computes
the same chunk boxes from it, and the rank whose file holds each box, without a row per
chunk. Pure numpy/Python, no torch: the placements follow torch's rules exactly
(``torch.chunk`` sizes, left to right over the mesh dims; a strided shard splits into
``split_factor`` parts first, each part into mesh-size pieces, and coordinate ``c`` gets
piece ``c`` of every part), which tests check against torch's own ``_split_tensor``.

Placements as JSON: ``["S", d]`` (Shard(d)), ``["SS", d, split_factor]``
(_StridedShard), ``["R"]`` (Replicate).
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from math import prod
from typing import Any

from ..errors import CorruptCheckpointError

Placement = tuple  # ("S", d) | ("SS", d, split_factor) | ("R",)


@dataclass(frozen=True)
class Mesh:
    """A saving device mesh: its shape and the saving rank at each coordinate (row-major)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    names: tuple[str, ...] | None = None

    def to_json(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "ranks": list(self.ranks),
                "dim_names": None if self.names is None else list(self.names)}

    @staticmethod
    def from_json(d: Any, world: int) -> Mesh:
        """A validated mesh (CorruptCheckpointError naming what is wrong)."""
        if type(d) is not dict:
            raise CorruptCheckpointError("mesh is not an object")
        shape, ranks, names = d.get("shape"), d.get("ranks"), d.get("dim_names")
        if not (type(shape) is list and shape and all(type(s) is int and 1 <= s <= world for s in shape)):
            raise CorruptCheckpointError(f"mesh shape {str(shape)[:80]} is not a list of sizes from 1 to {world}")
        if not (type(ranks) is list and len(ranks) == prod(shape) and all(type(r) is int for r in ranks)
                and len(set(ranks)) == len(ranks) and min(ranks) >= 0 and max(ranks) < world):
            raise CorruptCheckpointError(f"mesh ranks are not {prod(shape)} distinct ranks below {world}")
        if names is not None and not (type(names) is list and len(names) == len(shape)
                                      and all(type(n) is str for n in names)):
            raise CorruptCheckpointError("mesh dim_names is not null or one string per dim")
        return Mesh(tuple(shape), tuple(ranks), None if names is None else tuple(names))


def parse_placement(p: Any, ndim: int, max_factor: int = 1 << 31) -> Placement:
    """A validated JSON placement as a tuple (a strided shard's factor at most ``max_factor``)."""
    if type(p) is list and p == ["R"]:
        return ("R",)
    if type(p) is list and len(p) == 2 and p[0] == "S" and type(p[1]) is int and 0 <= p[1] < ndim:
        return ("S", p[1])
    if type(p) is list and len(p) == 3 and p[0] == "SS" and type(p[1]) is int and 0 <= p[1] < ndim and \
            type(p[2]) is int and 1 <= p[2] <= max_factor:
        return ("SS", p[1], p[2])
    raise CorruptCheckpointError(f"placement {str(p)[:40]} is not [\"R\"], [\"S\", dim] or [\"SS\", dim, factor] "
                                 f"(factor 1 to {max_factor})")


def _chunks(n: int, k: int) -> list[tuple[int, int]]:
    """``torch.chunk`` of ``n`` items into ``k``: (start, length) per part, the missing
    trailing parts empty (chunk size ceil(n / k))."""
    size = -(-n // k) if n else 0
    return [(min(i * size, n), max(0, min((i + 1) * size, n) - min(i * size, n))) for i in range(k)]


@dataclass(frozen=True)
class DimPartition:
    """The intervals one tensor dim is cut into: sorted ``starts``/``lengths`` tiling
    ``[0, n)`` and, for each, the owner's coordinates on the mesh dims that shard this
    dim (flattened row-major over those dims' sizes)."""

    starts: list[int]
    lengths: list[int]
    owners: list[int]
    index_of_start: dict[int, int] = field(compare=False)


Runs = list[tuple[int, int]]  # (start, length) runs of positions, in sequence order


def _take(runs: Runs, a: int, b: int) -> Runs:
    """Positions ``a .. b-1`` of the sequence ``runs`` (as runs)."""
    out: Runs = []
    pos = 0
    for start, n in runs:
        lo, hi = max(a, pos), min(b, pos + n)
        if lo < hi:
            out.append((start + lo - pos, hi - lo))
        pos += n
        if pos >= b:
            break
    return out


def partition_bound(levels: tuple[tuple[int, Placement], ...]) -> int:
    """An upper bound of the intervals :func:`dim_partition` makes (the pieces it cuts)."""
    bound = 1
    for k, p in levels:
        bound *= k * (p[2] if p[0] == "SS" else 1)
    return bound


@lru_cache(maxsize=1024)
def dim_partition(n: int, levels: tuple[tuple[int, Placement], ...]) -> DimPartition:
    """The partition of a dim of ``n`` items by ``levels`` (mesh size, placement), applied
    left to right as torch does. Works on runs of positions, never on the positions
    themselves: the cost grows with the pieces cut (:func:`partition_bound`), not with ``n``."""
    groups: list[tuple[int, Runs]] = [(0, [(0, n)] if n else [])]
    for k, p in levels:
        nxt: list[tuple[int, Runs]] = []
        for label, runs in groups:
            size = sum(ln for _, ln in runs)
            if p[0] == "S":
                pieces = [_take(runs, s, s + ln) for s, ln in _chunks(size, k)]
            else:  # strided: split_factor parts, each into k; coordinate c takes piece c of each part
                parts = [_take(runs, s, s + ln) for s, ln in _chunks(size, p[2])]
                cut = [[_take(part, s, s + ln) for s, ln in _chunks(sum(x for _, x in part), k)] for part in parts]
                pieces = [[r for c in cut for r in c[i]] for i in range(k)]
            nxt.extend((label * k + c, piece) for c, piece in enumerate(pieces))
        groups = nxt
    owned = sorted((start, ln, label) for label, runs in groups for start, ln in runs if ln)
    parts_: list[list[int]] = []
    for start, ln, label in owned:  # adjacent runs of one owner are one interval
        if parts_ and parts_[-1][2] == label and parts_[-1][0] + parts_[-1][1] == start:
            parts_[-1][1] += ln
        else:
            parts_.append([start, ln, label])
    return DimPartition([s for s, _, _ in parts_], [ln for _, ln, _ in parts_], [c for _, _, c in parts_],
                        {s: i for i, (s, _, _) in enumerate(parts_)})


class Rule:
    """The chunks of one tensor under one mesh and placements, and which rank's file holds
    each: a box held by several coordinates (Replicate mesh dims) is held by the replica
    ``(box ordinal + salt) mod replicas`` (ordinal: the box's row-major index among all
    boxes; replicas numbered row-major over the Replicate dims)."""

    __slots__ = ("shape", "mesh", "placements", "salt", "_dims", "_levels_of", "_rep_dims", "_replicas",
                 "_shard_dims_of", "_meeting")

    def __init__(self, shape: tuple[int, ...], mesh: Mesh, placements: tuple[Placement, ...], salt: int = 0) -> None:
        if len(placements) != len(mesh.shape):
            raise CorruptCheckpointError(f"{len(placements)} placements for a {len(mesh.shape)}-dim mesh")
        self.shape = tuple(shape)
        self.mesh = mesh
        self.placements = tuple(placements)
        self.salt = salt
        self._shard_dims_of = [[i for i, p in enumerate(placements) if p[0] != "R" and p[1] == d]
                               for d in range(len(shape))]
        self._rep_dims = [i for i, p in enumerate(placements) if p[0] == "R"]
        self._replicas = prod(mesh.shape[i] for i in self._rep_dims)
        self._dims: list[DimPartition] | None = None
        self._meeting: dict[tuple, list] = {}  # boxes_meeting by query (tensors share rules: see the parser)

    @property
    def replicas(self) -> int:
        """How many coordinates hold each box."""
        return self._replicas

    def to_json(self, mesh_index: int) -> dict[str, Any]:
        return {"mesh": mesh_index, "placements": [list(p) for p in self.placements], "salt": self.salt}

    def levels(self) -> list[tuple[tuple[int, Placement], ...]]:
        """Per tensor dim, the (mesh size, placement) of the mesh dims that shard it."""
        return [tuple((self.mesh.shape[i], self.placements[i]) for i in mesh_dims) for mesh_dims in self._shard_dims_of]

    def count_bound(self) -> int:
        """An upper bound of :meth:`count`, computed without cutting anything."""
        return prod(partition_bound(lv) for lv in self.levels())

    def dims(self) -> list[DimPartition]:
        """The partition of every tensor dim."""
        if self._dims is None:
            self._dims = [dim_partition(n, lv) for n, lv in zip(self.shape, self.levels())]
        return self._dims

    def count(self) -> int:
        """Number of chunks (boxes)."""
        return prod(len(p.starts) for p in self.dims())

    def _writer(self, q: tuple[int, ...]) -> int:
        """The saving rank whose file holds the box with interval indices ``q``."""
        dims = self.dims()
        coord = [0] * len(self.mesh.shape)
        ordinal = 0
        for d, (part, i) in enumerate(zip(dims, q)):
            ordinal = ordinal * len(part.starts) + i
            label = part.owners[i]
            for mesh_dim in reversed(self._shard_dims_of[d]):
                k = self.mesh.shape[mesh_dim]
                coord[mesh_dim] = label % k
                label //= k
        j = (ordinal + self.salt) % self._replicas
        for mesh_dim in reversed(self._rep_dims):
            k = self.mesh.shape[mesh_dim]
            coord[mesh_dim] = j % k
            j //= k
        flat = 0
        for c, k in zip(coord, self.mesh.shape):
            flat = flat * k + c
        return self.mesh.ranks[flat]

    def boxes_meeting(self, offsets: tuple[int, ...], lengths: tuple[int, ...]
                      ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """(offsets, lengths, saving rank) of every box that overlaps the given box."""
        query = (offsets, lengths)
        found = self._meeting.get(query)
        if found is None:
            found = self._meeting[query] = self._boxes_meeting(offsets, lengths)
        return found

    def _boxes_meeting(self, offsets: tuple[int, ...], lengths: tuple[int, ...]
                       ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        ranges = []
        for part, o, n in zip(self.dims(), offsets, lengths):
            if n <= 0:
                return []
            lo = bisect_right(part.starts, o) - 1
            hi = bisect_left(part.starts, o + n)
            ranges.append(range(max(lo, 0), hi))
        return [self._box(q) for q in product(*ranges)]

    def all_boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """Every box of the tensor, row-major by interval."""
        return [self._box(q) for q in product(*(range(len(p.starts)) for p in self.dims()))]

    def _box(self, q: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        dims = self.dims()
        return (tuple(p.starts[i] for p, i in zip(dims, q)), tuple(p.lengths[i] for p, i in zip(dims, q)),
                self._writer(q))

    def writes(self, rank: int, offsets: tuple[int, ...]) -> bool:
        """True when ``rank``'s file holds the box starting at ``offsets`` (one that rank holds)."""
        q = []
        for part, o in zip(self.dims(), offsets):
            i = part.index_of_start.get(o)
            if i is None:
                return False
            q.append(i)
        return self._writer(tuple(q)) == rank


def placements_json(placements: Any, ndim: int) -> list[list[Any]] | None:
    """Torch placements (of a tensor with ``ndim`` dims) as JSON rule placements, or None
    when one has no rule (Partial, unknown kinds)."""
    out: list[list[Any]] = []
    for p in placements:
        name = type(p).__name__
        dim = getattr(p, "dim", None)
        if type(dim) is int and -ndim <= dim < 0:
            dim += ndim
        if name == "Replicate":
            out.append(["R"])
        elif name == "Shard" and type(dim) is int and 0 <= dim < ndim:
            out.append(["S", dim])
        elif name == "_StridedShard" and type(dim) is int and 0 <= dim < ndim:
            factor = p.split_factor
            if type(factor) is not int:
                return None
            out.append(["SS", dim, factor])
        else:
            return None
    return out


__all__ = ["DimPartition", "Mesh", "Rule", "dim_partition", "parse_placement", "placements_json"]
