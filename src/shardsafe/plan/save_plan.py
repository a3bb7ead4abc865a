"""Save planning: which chunks go into which data file, written by which rank.

Planning is a pure function of the per-rank layouts that every rank gathered, so every
rank computes the same plan without further messages. Rules:

- every distinct box of every tensor is written exactly once;
- a box held by one rank only is written by that rank;
- a box held by several ranks (replicated tensors, DTensor replicas) goes to the holder
  with the least bytes so far (counting the single-holder boxes), largest boxes first
  (ties: lowest rank); those under 64 KiB are packed onto the lowest holders, 16 MiB each;
- a replicated tensor larger than 1/8 of the mean bytes per rank is first split into row
  ranges, so that no rank carries much more than its share;
- a rank with nothing to write writes no file;
- a DTensor whose layout is a rule (format 3: Shard, _StridedShard and Replicate
  placements on a mesh of the saving ranks) is not planned box by box: each rank writes
  the boxes it holds that the rule gives to it (one replica of each, rotated by a
  per-tensor salt), so planning grows with tensors, not chunks;
- rank-local tensors are written by their rank and never planned.
"""

from __future__ import annotations

import hashlib
import heapq
import json
from dataclasses import dataclass, field
from math import ceil, prod
from typing import NamedTuple

from ..errors import CheckpointError
from ..format.rules import Mesh, Rule, parse_placement
from ..gcpause import gc_paused
from ..knobs import MIN_SPLIT_BYTES, SMALL_BYTES, SMALL_PACK, SPLIT_FRACTION
from ..layout import Box, boxes_disjoint, split_rows

MeshKey = tuple  # (shape, ranks, dim names or None): a mesh as plain, hashable data
RuleKey = tuple  # (MeshKey, placements as tuples)

"""Replicated boxes smaller than SMALL_BYTES (step counters, biases, norms) are packed onto
their lowest holders, SMALL_PACK bytes per rank, instead of being spread one by one for
balance: a loading rank then finds them in one or two files' indexes instead of one file
per value (format 3 reads only the indexes it needs)."""


@dataclass
class HeldTensor:
    """What one rank holds of one tensor."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    kind: str  # replicated | sharded | rank_local
    boxes: list[Box]  # this rank's boxes (of a rule tensor: not sent to other ranks)
    rule: RuleKey | None = None  # the layout as a rule, when it is one
    spec: dict | None = None  # a DTensor's mesh and placements, for reading (tensors saved as boxes)

    def to_wire_key(self) -> tuple:
        boxes = () if self.rule is not None else tuple((b.offsets, b.lengths) for b in self.boxes)
        return (self.key, self.dtype, self.shape, self.kind, boxes, self.rule)

    def to_wire(self, meshes: dict[MeshKey, int]) -> list:
        """Plain JSON-able data; a rule's mesh is an index into the rank's mesh list."""
        rule = None if self.rule is None else [meshes.setdefault(self.rule[0], len(meshes)),
                                               [list(p) for p in self.rule[1]]]
        boxes = None if self.rule is not None else [[list(b.offsets), list(b.lengths)] for b in self.boxes]
        return [self.key, self.dtype, list(self.shape), self.itemsize, self.kind, boxes, rule, self.spec]

    @staticmethod
    def from_wire(w: list, meshes: list[MeshKey]) -> HeldTensor:
        key, dtype, shape, itemsize, kind, boxes, rule, spec = w
        rule_key = None if rule is None else (meshes[rule[0]], tuple(tuple(p) for p in rule[1]))
        return HeldTensor(key, dtype, tuple(shape), itemsize, kind,
                            [] if boxes is None else [Box(tuple(o), tuple(n)) for o, n in boxes], rule_key, spec)


def wire_of(held: list[HeldTensor]) -> bytes:
    """What a rank holds, as JSON bytes (what ranks exchange to plan; no pickle)."""
    meshes: dict[MeshKey, int] = {}
    tensors = [tl.to_wire(meshes) for tl in held]
    return json.dumps({"meshes": [[list(m[0]), list(m[1]), None if m[2] is None else list(m[2])] for m in meshes],
                       "tensors": tensors}, separators=(",", ":")).encode()


def held_of_wire(data: bytes) -> list[HeldTensor]:
    """The inverse of :func:`wire_of`."""
    body = json.loads(data)
    meshes = [(tuple(s), tuple(r), None if n is None else tuple(n)) for s, r, n in body["meshes"]]
    return [HeldTensor.from_wire(w, meshes) for w in body["tensors"]]


def rule_of(key: RuleKey, shape: tuple[int, ...], salt: int = 0) -> Rule:
    """The format's Rule for a planned rule key."""
    mesh_key, placements = key
    return Rule(shape, Mesh(*mesh_key), tuple(parse_placement(list(p), len(shape)) for p in placements), salt)


class Assignment(NamedTuple):
    """Rank ``rank`` writes ``box`` of tensor ``key``."""

    key: str
    box: Box
    whole: bool


@dataclass
class GlobalPlan:
    """Per-rank assignments and the tensor table for the manifest."""

    world: int
    tensors: dict[str, tuple[str, tuple[int, ...], str]]  # key -> (dtype, shape, kind), sorted by key
    by_rank: list[list[Assignment]] = field(default_factory=list)  # explicit boxes only
    bytes_by_rank: list[int] = field(default_factory=list)  # of explicit boxes
    rules: dict[str, Rule] = field(default_factory=dict)  # tensors whose chunks follow from a rule
    specs: dict[str, dict] = field(default_factory=dict)  # DTensors without a rule: mesh and placements

    def ordinal(self) -> dict[str, int]:
        """Each tensor's place in the manifest (sorted keys)."""
        return {k: i for i, k in enumerate(self.tensors)}

    def assignments(self, rank: int, held: list[HeldTensor], local: list[HeldTensor]) -> list[Assignment]:
        """What ``rank`` writes, in file order: its explicit boxes, the boxes it holds of rule
        tensors that the rule gives to it, then its rank-local tensors."""
        order = self.ordinal()
        out = list(self.by_rank[rank])
        for tl in held:
            rule = self.rules.get(tl.key)
            if rule is not None:
                whole = Box.whole(tl.shape)
                out.extend(Assignment(tl.key, b, b == whole) for b in tl.boxes if rule.writes(rank, b.offsets))
        out.sort(key=lambda a: (order[a.key], a.box.offsets))
        out.extend(Assignment(tl.key, b, True) for tl in sorted(local, key=lambda t: t.key) for b in tl.boxes)
        return out


@dataclass(frozen=True)
class ChunkWrite:
    """One chunk of a data file: box ``box`` of tensor ``key`` (``whole``: the box is the
    whole tensor) at bytes ``[start, end)`` of the file, of safetensors dtype ``code``."""

    key: str
    box: Box
    whole: bool
    code: str
    start: int
    end: int


@dataclass
class FileWrite:
    """One data file as plain data: its name, writing rank, header bytes and chunks."""

    name: str
    rank: int
    header: bytes
    chunks: list[ChunkWrite]

    @property
    def size(self) -> int:
        """The file's size in bytes."""
        return self.chunks[-1].end if self.chunks else len(self.header)


def plan_file(name: str, rank: int, assignments: list[Assignment], codes: dict[str, str],
                itemsizes: dict[str, int]) -> FileWrite:
    """Where each assigned chunk goes in data file ``name``: the safetensors header (chunk
    names made unique) and every chunk's byte range, in assignment order."""
    from ..format.datafile import ChunkEntry, build_header, chunk_name

    entries = [ChunkEntry(chunk_name(a.key, a.box.offsets, a.whole), codes[a.key], a.box.lengths,
                          a.box.numel * itemsizes[a.key]) for a in assignments]
    header, ranges = build_header(entries)
    chunks = [ChunkWrite(a.key, a.box, a.whole, codes[a.key], s, e) for a, (s, e) in zip(assignments, ranges)]
    return FileWrite(name, rank, header, chunks)


def plan_key(signatures: list[list[str]]) -> str:
    """A digest of all ranks' holdings' signatures: equal digests give equal plans (the
    plan cache's key)."""
    return hashlib.sha256(json.dumps(signatures, default=list).encode()).hexdigest()


def plan_global(held: list[list[HeldTensor]], signatures: list[str] | None = None) -> GlobalPlan:
    """The deterministic global write plan for the gathered per-rank holdings (run with
    the cyclic GC paused).

    Ranks with identical holdings (the usual SPMD case for replicated state) are planned
    as one group, so planning grows with the number of distinct holdings times tensors,
    not ranks times tensors. Raises CheckpointError naming the key and ranks when ranks
    disagree on a tensor's dtype or shape, or when the boxes of a sharded tensor do not
    cover it. Passes: gather the tensors and their holders; merge and check the rules;
    check that explicit boxes tile each tensor; split large replicated tensors; assign
    boxes to ranks (small ones packed); rotate the rules' replicas."""
    with gc_paused():
        world = len(held)
        groups = _groups(held, signatures)
        g = _Gathered()
        for leader, ranks in groups.items():
            for tl in held[leader]:
                g.add(tl, leader, ranks)
        merged = _merged_rules(g, groups)
        _check_coverage(g)
        work = _split_large(g, world)
        by_rank, load = _assign(work, world)
        order = {k: i for i, k in enumerate(sorted(g.tensors))}
        for items in by_rank:  # files hold chunks in key order (the key's rank: cheaper than strings)
            items.sort(key=lambda a: (order[a.key], a.box.offsets))
        return GlobalPlan(world, {k: g.tensors[k] for k in sorted(g.tensors)}, by_rank, load,
                          _planned_rules(g, merged), {k: v for k, v in g.specs.items() if k not in g.rules})


def _groups(held: list[list[HeldTensor]], signatures: list[str] | None) -> dict[int, list[int]]:
    """Ranks with equal holdings, by the first of them (their leader)."""
    groups: dict[int, list[int]] = {}
    first_of: dict[tuple | str, int] = {}
    for rank, tls in enumerate(held):
        sig = signatures[rank] if signatures is not None else tuple(tl.to_wire_key() for tl in tls)
        leader = first_of.setdefault(sig, rank)
        groups.setdefault(leader, []).append(rank)
    return groups


@dataclass
class _Gathered:
    """Pass 1: every tensor the ranks hold, its explicit boxes and their holders, its rules."""

    tensors: dict[str, tuple[str, tuple[int, ...], str]] = field(default_factory=dict)  # (dtype, shape, kind)
    itemsizes: dict[str, int] = field(default_factory=dict)
    holders: dict[tuple[str, Box], list[int]] = field(default_factory=dict)
    boxes_of: dict[str, list[Box]] = field(default_factory=dict)  # each tensor's distinct boxes
    first_rank: dict[str, int] = field(default_factory=dict)
    rules: dict[str, list[RuleKey]] = field(default_factory=dict)  # several: one layout on disjoint meshes
    rule_groups: dict[str, list[int]] = field(default_factory=dict)  # rule tensor -> leaders that hold it
    specs: dict[str, dict] = field(default_factory=dict)

    def add(self, tl: HeldTensor, leader: int, ranks: list[int]) -> None:
        """What the group of ``leader`` (ranks ``ranks``) holds of one tensor."""
        meta = (tl.dtype, tl.shape, tl.kind)
        known = self.tensors.get(tl.key)
        if known is None:
            self.tensors[tl.key] = meta
            self.itemsizes[tl.key] = tl.itemsize
            self.first_rank[tl.key] = leader
        elif known != meta:
            raise CheckpointError(
                f"tensor '{tl.key}': rank {self.first_rank[tl.key]} has {_describe(known)}, "
                f"rank {leader} has {_describe(meta)}"
            )
        if tl.spec is not None:
            self.specs.setdefault(tl.key, tl.spec)
        if tl.rule is not None:
            self._add_rule(tl, leader)
            return
        for box in tl.boxes:
            h = self.holders.get((tl.key, box))
            if h is None:
                self.holders[(tl.key, box)] = ranks if len(ranks) > 1 else [leader]
                self.boxes_of.setdefault(tl.key, []).append(box)
            elif h is not ranks:
                self.holders[(tl.key, box)] = sorted(set(h) | set(ranks))

    def _add_rule(self, tl: HeldTensor, leader: int) -> None:
        assert tl.rule is not None
        seen = self.rules.setdefault(tl.key, [])
        if tl.rule not in seen:
            if seen and (seen[0][0][0], seen[0][1]) != (tl.rule[0][0], tl.rule[1]):
                raise CheckpointError(f"tensor '{tl.key}': ranks {self.first_rank[tl.key]} and {leader} hold it "
                                      "on meshes of different shapes or with different placements")
            seen.append(tl.rule)
        self.rule_groups.setdefault(tl.key, []).append(leader)


def _merged_rules(g: _Gathered, groups: dict[int, list[int]]) -> dict[str, RuleKey]:
    """Pass 2: one rule per rule tensor (replicas on disjoint meshes merged), each of whose
    mesh ranks holds the tensor (else its chunks would be missing)."""
    mixed = sorted(set(g.rules) & set(g.boxes_of))
    if mixed:
        raise CheckpointError(f"tensor '{mixed[0]}': some ranks hold it as a DTensor of a mesh, others not")
    merged = {key: keys[0] if len(keys) == 1 else _replicas_rule(key, keys) for key, keys in g.rules.items()}
    checked: set[tuple] = set()
    for key, rule_key in merged.items():
        leaders = tuple(g.rule_groups[key])
        if (leaders, rule_key[0]) in checked:
            continue
        held = set().union(*(groups[leader] for leader in leaders))
        missing = [r for r in rule_key[0][1] if r not in held]
        if missing:
            raise CheckpointError(f"tensor '{key}': ranks {missing[:8]} of its device mesh did not save it")
        checked.add((leaders, rule_key[0]))
    return merged


def _check_coverage(g: _Gathered) -> None:
    """Pass 3: the distinct explicit boxes of each tensor tile it: no overlap, no hole."""
    for key, (_, shape, _) in g.tensors.items():
        if key in g.rules:
            continue
        need = prod(shape)
        boxes = g.boxes_of.get(key, [])
        covered = sum(b.numel for b in boxes)
        if (covered != need and not (need == 0 and boxes)) or (len(boxes) > 1 and not _disjoint(boxes)):
            overlap = len(boxes) > 1 and not boxes_disjoint(boxes)
            raise CheckpointError(
                f"tensor '{key}': the ranks' shards {'overlap' if overlap else 'do not cover it'} "
                f"({covered} of {need} elements in {len(boxes)} boxes; ranks {_holders_of(g.holders, key)}); "
                "Partial placements must be reduced before saving"
            )


class _Work(NamedTuple):
    """A box to assign to one of its holders."""

    nbytes: int
    key: str
    box: Box
    whole: bool
    ranks: list[int]


def _split_large(g: _Gathered, world: int) -> list[_Work]:
    """Pass 4: every explicit box as work; a whole replicated tensor above the split
    target (mean bytes per rank / SPLIT_FRACTION) split into row ranges first."""
    total = sum(box.numel * g.itemsizes[key] for key, box in g.holders) + \
        sum(prod(g.tensors[key][1]) * g.itemsizes[key] for key in g.rules)
    target = max(MIN_SPLIT_BYTES, total // max(world, 1) // SPLIT_FRACTION)
    work: list[_Work] = []
    for (key, box), ranks in g.holders.items():
        nbytes = box.numel * g.itemsizes[key]
        whole = box.offsets == (0,) * len(box.offsets) and box.lengths == g.tensors[key][1]
        if whole and len(ranks) > 1 and nbytes > target and len(box.lengths) > 0:
            for part in split_rows(box.lengths, ceil(nbytes / target)):
                work.append(_Work(part.numel * g.itemsizes[key], key, part, part == box, ranks))
        else:
            work.append(_Work(nbytes, key, box, whole, ranks))
    return work


def _assign(work: list[_Work], world: int) -> tuple[list[list[Assignment]], list[int]]:
    """Pass 5: each box to a rank, and each rank's bytes. Boxes with one holder have no
    choice; the others go largest first to the least loaded holder (ties: lowest rank),
    except small ones, packed onto their lowest holders (:func:`_pack_small`)."""
    load = [0] * world
    by_rank: list[list[Assignment]] = [[] for _ in range(world)]
    choice = []
    for item in work:  # one holder: assigned first, in any order (no sort)
        if len(item.ranks) == 1:
            r = item.ranks[0]
            load[r] += item.nbytes
            by_rank[r].append(Assignment(item.key, item.box, item.whole))
        else:
            choice.append(item)
    # Largest first; equal sizes keep their order, which is the same on every rank (the
    # gathered holdings are), so comparing sizes alone is enough for a deterministic plan.
    choice.sort(key=lambda w: -w.nbytes)
    heap = [(load[r], r) for r in range(world)]  # (load, rank); stale once a rank's load changes
    small: dict[int, int] = {}  # bytes of small boxes packed onto each rank
    heapq.heapify(heap)
    for item in choice:
        if item.nbytes < SMALL_BYTES:
            r = _pack_small(item, small)
            load[r] += item.nbytes
        elif len(item.ranks) == world:
            r = _least_loaded(heap, load)
            load[r] += item.nbytes
            heapq.heappush(heap, (load[r], r))
        else:
            r = min(item.ranks, key=lambda x: (load[x], x))
            load[r] += item.nbytes
        by_rank[r].append(Assignment(item.key, item.box, item.whole))
    return by_rank, load


def _pack_small(item: _Work, small: dict[int, int]) -> int:
    """A small box's rank: the lowest holder with SMALL_PACK bytes of room left, so that a
    load finds small values in few files' indexes."""
    r = next((h for h in item.ranks if small.get(h, 0) + item.nbytes <= SMALL_PACK), item.ranks[0])
    small[r] = small.get(r, 0) + item.nbytes
    return r


def _least_loaded(heap: list[tuple[int, int]], load: list[int]) -> int:
    """The least loaded rank, popped from ``heap`` (stale entries requeued at their load)."""
    while True:
        lo, r = heapq.heappop(heap)
        if lo == load[r]:
            return r
        heapq.heappush(heap, (load[r], r))


def _planned_rules(g: _Gathered, merged: dict[str, RuleKey]) -> dict[str, Rule]:
    """Pass 6: the rules, in key order; replicated boxes rotate over the replicas from
    tensor to tensor."""
    planned: dict[str, Rule] = {}
    rotation = 0
    for key in sorted(g.rules):
        rule = rule_of(merged[key], g.tensors[key][1])
        if rule.replicas > 1:
            rule = rule_of(merged[key], g.tensors[key][1], rotation % rule.replicas)
            rotation += rule.count()
        planned[key] = rule
    return planned


def _replicas_rule(key: str, keys: list[RuleKey]) -> RuleKey:
    """One rule for a tensor held with the same layout on several disjoint meshes (each a
    replica, e.g. one FSDP mesh per replica group): a mesh with a leading replica dim."""
    keys = sorted(keys, key=lambda k: min(k[0][1]))
    ranks = [r for k in keys for r in k[0][1]]
    if len(set(ranks)) != len(ranks):
        raise CheckpointError(f"tensor '{key}': ranks hold it on overlapping meshes")
    (shape, _, names), placements = keys[0]
    return ((len(keys), *shape), tuple(ranks), None if names is None else ("replica", *names)), \
        (("R",), *placements)


def _disjoint(boxes: list[Box]) -> bool:
    """:func:`boxes_disjoint`, with a cheap first test for row shards (row ranges that do
    not overlap at all), the usual layout."""
    if boxes[0].ndim:
        end = -1
        for b in boxes:  # in rank order, row shards are already sorted: no sort needed
            start = b.offsets[0]
            if start < end:
                break
            end = start + b.lengths[0]
        else:
            return True
    return boxes_disjoint(boxes)


def _holders_of(holders: dict[tuple[str, Box], list[int]], key: str) -> list[int]:
    """The ranks that hold a box of ``key`` (for messages)."""
    return sorted({r for (k, _), ranks in holders.items() if k == key for r in ranks})[:16]


def _describe(meta: tuple[str, tuple[int, ...], str]) -> str:
    return f"{meta[2]} {meta[0]} of shape {list(meta[1])}"
