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
from collections.abc import Callable
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


FREE_BOXES = 1 << 16
"""The rule budget: the rules' bounds, summed over distinct rules, are at most this plus
:data:`RULE_SLACK` per distinct rule plus the rows of the file indexes (:func:`rules_backed`)."""
BOXES_PER_MANIFEST_BYTE = 16
"""A reader cuts rules whose bounds sum to at most ``FREE_BOXES`` plus this many per byte of
the manifest (what it has read) before reading any index; beyond, it counts the indexes' rows
first (:class:`Backing`)."""
INDEX_BYTES_PER_ROW = 16
"""No index row takes fewer bytes (its block checksum alone is 16 hex digits): an index of
``b`` bytes lists at most ``b // 16`` chunks."""
RULE_SLACK = 512
"""Writers: a rule's bound (:meth:`Rule.count_bound`) exceeds its real box count by at most
this, else the tensor is saved as explicit boxes (so the bound of every committed
manifest is backed by its rows, :func:`rules_backed`)."""


def _nonempty(size: int, k: int) -> list[int]:
    """``torch.chunk`` of ``size`` items into ``k``: the lengths of the non-empty parts,
    which come first (chunk size ceil(size / k); the missing trailing parts are empty)."""
    if size <= 0:
        return []
    c = -(-size // k)
    full, rest = divmod(size, c)
    return [c] * full + ([rest] if rest else [])


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


def _append(runs: Runs, start: int, n: int) -> None:
    """Append the run ``(start, n)``, merged with the last one when they touch."""
    if runs and runs[-1][0] + runs[-1][1] == start:
        runs[-1] = (runs[-1][0], runs[-1][1] + n)
    else:
        runs.append((start, n))


def _cut(runs: Runs, sizes: list[int]) -> list[Runs]:
    """Consecutive pieces of ``sizes`` positions (summing to at most the runs' total) cut
    from the sequence ``runs``, in one forward pass over both."""
    out: list[Runs] = []
    i = used = 0  # the run being cut, and how much of it earlier pieces took
    for size in sizes:
        piece: Runs = []
        while size:
            start, n = runs[i]
            take = min(n - used, size)
            _append(piece, start + used, take)
            used += take
            size -= take
            if used == n:
                i, used = i + 1, 0
        out.append(piece)
    return out


def partition_bound(levels: tuple[tuple[int, Placement], ...]) -> int:
    """The pieces the placements ``levels`` cut a dim into, empty ones included (a Python int)."""
    bound = 1
    for k, p in levels:
        bound *= k * (p[2] if p[0] == "SS" else 1)
    return bound


def dim_bound(n: int, levels: tuple[tuple[int, Placement], ...]) -> int:
    """An upper bound of the intervals of :func:`dim_partition` and of the pieces it holds
    at any level (at most one per position, at most :func:`partition_bound`)."""
    return min(n, partition_bound(levels))


@lru_cache(maxsize=1024)
def dim_partition(n: int, levels: tuple[tuple[int, Placement], ...]) -> DimPartition:
    """The partition of a dim of ``n`` items by ``levels`` (mesh size, placement), applied
    left to right as torch does. One forward pass over runs of positions per level, empty
    pieces never made: time and memory grow with :func:`dim_bound` times the levels, never
    with ``n`` or with the factors alone (callers check the bound before cutting)."""
    groups: list[tuple[int, Runs, int]] = [(0, [(0, n)], n)] if n else []  # (owner label, runs, size)
    for k, p in levels:
        nxt: list[tuple[int, Runs, int]] = []
        for label, runs, size in groups:
            if p[0] == "S":
                sizes = _nonempty(size, k)
                nxt.extend((label * k + c, piece, ln) for c, (piece, ln) in enumerate(zip(_cut(runs, sizes), sizes)))
                continue
            # strided: split_factor parts, each into k; coordinate c takes piece c of each part
            per_part = [_nonempty(ln, k) for ln in _nonempty(size, p[2])]
            flat = iter(_cut(runs, [x for part in per_part for x in part]))
            taken: list[Runs] = [[] for _ in range(min(k, size))]
            sizes_of = [0] * len(taken)
            for part in per_part:
                for c, ln in enumerate(part):
                    for start, m in next(flat):
                        _append(taken[c], start, m)
                    sizes_of[c] += ln
            nxt.extend((label * k + c, piece, ln) for c, (piece, ln) in enumerate(zip(taken, sizes_of)) if ln)
        groups = nxt
    owned = sorted((start, ln, label) for label, runs, _ in groups for start, ln in runs)
    parts_: list[list[int]] = []
    for start, ln, label in owned:  # adjacent runs of one owner are one interval
        if parts_ and parts_[-1][2] == label and parts_[-1][0] + parts_[-1][1] == start:
            parts_[-1][1] += ln
        else:
            parts_.append([start, ln, label])
    return DimPartition([s for s, _, _ in parts_], [ln for _, ln, _ in parts_], [c for _, _, c in parts_],
                        {s: i for i, (s, _, _) in enumerate(parts_)})


class Backing:
    """The boxes a manifest's rules claim beyond their free allowance, checked once, before
    any rule is cut, against the rows its file indexes really list (``rows``
    counts them: the reader has fetched them all, each read bounded by the index's stated
    size, plus one byte). ``armed``: the rules claim more than the work pool, so cutting
    one waits for this check."""

    __slots__ = ("claimed", "free", "rows", "done", "armed")

    def __init__(self, claimed: int, free: int, rows: Callable[[], int]) -> None:
        self.claimed, self.free, self.rows, self.done, self.armed = claimed, free, rows, False, False

    def check(self) -> None:
        """Raise CorruptCheckpointError unless the indexes' rows back the claim."""
        if self.done:
            return
        listed = self.rows()
        if not rules_backed(self.claimed, self.free, listed):
            raise CorruptCheckpointError(f"its rules claim up to {self.claimed} chunks, more than an allowance of "
                                         f"{self.free} and the {listed} rows its file indexes list")
        self.done = True


def free_boxes(manifest_bytes: int) -> int:
    """The rule bounds a reader cuts, for a manifest of ``manifest_bytes`` bytes, before it
    has counted any index's rows (the work pool)."""
    return FREE_BOXES + BOXES_PER_MANIFEST_BYTE * manifest_bytes


def allowance(distinct_rules: int) -> int:
    """The part of the rule budget no index row backs: what writers' bounds may overcount."""
    return FREE_BOXES + RULE_SLACK * distinct_rules


def rules_backed(claimed: int, allowed: int, rows: int) -> bool:
    """The reader's rule budget (docs/format.md, limits): the rules' bounds, summed over
    distinct rules, within :func:`allowance` plus the index rows (those listed, or at most
    ``index bytes // 16`` before the indexes are read)."""
    return claimed <= allowed + rows


def rule_problem(shape: tuple[int, ...], placements: list[list[Any]], mesh_shape: tuple[int, ...],
                 world: int) -> str | None:
    """Why a reader could refuse these rule placements in a ``world``-rank checkpoint, or
    None: a placement it does not parse, or a bound more than :data:`RULE_SLACK` above the
    real box count (the writer then saves explicit boxes). Cuts nothing unless the bound
    is above the slack; the cut grows with the dims' bounds, not their product."""
    try:
        if len(placements) != len(mesh_shape):
            raise CorruptCheckpointError(f"{len(placements)} placements for a {len(mesh_shape)}-dim mesh")
        parsed = tuple(parse_placement(p, len(shape), world) for p in placements)
    except CorruptCheckpointError as exc:
        return str(exc)
    if not shape or 0 in shape:
        return "a rule needs a shape of non-zero dims"
    rule = Rule(shape, Mesh(tuple(mesh_shape), tuple(range(prod(mesh_shape)))), parsed)
    bound = rule.count_bound()
    if bound > RULE_SLACK and bound - rule.count() > RULE_SLACK:
        return f"its bound of {bound} boxes is more than {RULE_SLACK} above its {rule.count()} boxes"
    return None


class Rule:
    """The chunks of one tensor under one mesh and placements, and which rank's file holds
    each: a box held by several coordinates (Replicate mesh dims) is held by the replica
    ``(box ordinal + salt) mod replicas`` (ordinal: the box's row-major index among all
    boxes; replicas numbered row-major over the Replicate dims)."""

    __slots__ = ("shape", "mesh", "placements", "salt", "_dims", "_levels_of", "_rep_dims", "_replicas",
                 "_shard_dims_of", "_meeting", "backing")

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
        self.backing: Backing | None = None  # the manifest's check that index rows back its rules

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
        """An upper bound of :meth:`count` (and of the work of cutting), without cutting."""
        return prod(dim_bound(n, lv) for n, lv in zip(self.shape, self.levels()))

    def dims(self) -> list[DimPartition]:
        """The partition of every tensor dim."""
        if self._dims is None:
            if self.backing is not None:
                self.backing.check()
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


__all__ = ["BOXES_PER_MANIFEST_BYTE", "FREE_BOXES", "INDEX_BYTES_PER_ROW", "RULE_SLACK", "Backing", "DimPartition",
           "Mesh", "Rule", "allowance", "dim_bound", "dim_partition", "free_boxes", "parse_placement",
           "placements_json", "rule_problem", "rules_backed"]
