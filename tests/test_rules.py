"""Layout rules (format 3.0): the boxes computed from a tensor's mesh and placements are
exactly the boxes torch's own placement code gives each mesh coordinate."""

from __future__ import annotations

import itertools
import random

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.rules import Mesh, Rule, parse_placement, placements_json
from shardsafe.state.sharding import pieces_for


def _torch_boxes(shape, mesh_shape, placements):
    """{coordinate: sorted boxes} from torch's placement code (shardsafe's save path)."""
    out = {}
    for coord in itertools.product(*(range(k) for k in mesh_shape)):
        out[coord] = sorted((p.box.offsets, p.box.lengths) for p in pieces_for(shape, mesh_shape, list(coord),
                                                                               tuple(placements)))
    return out


def _rule(shape, mesh_shape, placements, salt=0):
    mesh = Mesh(tuple(mesh_shape), tuple(range(1, 1 + len(list(itertools.product(*map(range, mesh_shape)))))))
    js = placements_json(placements, len(shape))
    return Rule(tuple(shape), mesh, tuple(parse_placement(p, len(shape)) for p in js), salt)


def _check(shape, mesh_shape, placements, salt=0):
    rule = _rule(shape, mesh_shape, placements, salt)
    held = _torch_boxes(shape, mesh_shape, placements)
    boxes = rule.all_boxes()
    # The rule's boxes are the distinct boxes the coordinates hold: each once.
    distinct = sorted({b for bs in held.values() for b in bs})
    assert sorted((o, n) for o, n, _ in boxes) == distinct
    coords = list(itertools.product(*(range(k) for k in mesh_shape)))
    for o, n, writer in boxes:
        coord = coords[writer - 1]
        assert (o, n) in held[coord], (o, n, coord)  # the writer holds the box it writes
        holders = [c for c in coords if (o, n) in held[c]]
        assert len(holders) == rule.replicas
        # exactly one holder is told to write it
        assert [c for c in holders if rule.writes(coords.index(c) + 1, o)] == [coord]
    return rule


@pytest.mark.parametrize("shape,mesh_shape,placements", [
    ((16, 8), (4,), [Shard(0)]),
    ((10, 3), (4,), [Shard(0)]),               # uneven: 3, 3, 3, 1
    ((5, 3), (4,), [Shard(0)]),                # uneven with an empty shard: 2, 2, 1, 0
    ((3,), (8,), [Shard(0)]),                  # more ranks than rows
    ((8, 8), (2, 2), [Shard(0), Shard(1)]),
    ((8, 8), (2, 2), [Shard(0), Shard(0)]),    # nested
    ((13, 6), (2, 3), [Shard(0), Shard(0)]),   # nested, uneven
    ((8, 8), (2, 2), [_StridedShard(0, split_factor=2), Shard(0)]),   # FSDP2 over TP, colwise
    ((14, 5), (2, 3), [_StridedShard(0, split_factor=3), Shard(0)]),  # strided, uneven
    ((8, 6), (2, 2), [Shard(0), Shard(1)]),    # FSDP2 over TP, rowwise
    ((8, 6), (2, 2), [Shard(0), Replicate()]), # HSDP-like / TP-replicated norm
    ((8, 6), (2, 3), [Replicate(), Shard(1)]), # HSDP
    ((9, 6, 4), (2, 2, 2), [Replicate(), Shard(0), Shard(2)]),
    ((8,), (2, 2), [Replicate(), Replicate()]),
])
def test_rule_boxes_equal_torch_placements(shape, mesh_shape, placements):
    for salt in (0, 1, 5):
        _check(shape, mesh_shape, placements, salt)


def test_rule_boxes_random_layouts():
    rng = random.Random(7)
    for _ in range(150):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 13) for _ in range(ndim))
        mesh_shape = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
        placements = []
        for _ in mesh_shape:
            r = rng.random()
            d = rng.randrange(ndim)
            placements.append(Replicate() if r < 0.3 else Shard(d) if r < 0.75 else
                              _StridedShard(d, split_factor=rng.randint(1, 3)))
        _check(shape, mesh_shape, placements, rng.randint(0, 9))


def test_boxes_meeting_is_the_overlapping_subset():
    rule = _check((37, 11), (2, 4), [_StridedShard(0, split_factor=4), Shard(0)])
    every = rule.all_boxes()
    for o, n in [((0, 0), (37, 11)), ((5, 2), (9, 3)), ((36, 10), (1, 1)), ((12, 0), (1, 11))]:
        want = [b for b in every if all(bo < qo + qn and bo + bn > qo for bo, bn, qo, qn in zip(b[0], b[1], o, n))]
        assert sorted(rule.boxes_meeting(o, n)) == sorted(want)


def test_bad_rules_are_refused():
    with pytest.raises(CorruptCheckpointError, match="placement"):
        parse_placement(["S", 3], 2)
    with pytest.raises(CorruptCheckpointError, match="mesh ranks"):
        Mesh.from_json({"shape": [2], "ranks": [0, 0], "dim_names": None}, 4)
    with pytest.raises(CorruptCheckpointError, match="placements for a"):
        Rule((4,), Mesh((2,), (0, 1)), (("S", 0), ("R",)))
