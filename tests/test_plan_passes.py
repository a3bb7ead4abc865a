"""The save planner, pass by pass: the plans of representative inputs are those the
planner produced before it was split into passes (issue 23; computed by commit 6a0fd43,
stored as JSON below), and every plan keeps the planner's invariants."""

from __future__ import annotations

import json

import pytest

from shardsafe.layout import Box
from shardsafe.plan.save_plan import SMALL_BYTES, HeldTensor, plan_global

Held = HeldTensor


def _rep(key, shape, itemsize=4, dtype="float32"):
    return Held(key, dtype, tuple(shape), itemsize, "replicated", [Box.whole(tuple(shape))])


def ddp():
    """4 SPMD ranks, replicated: small values (packed), medium boxes (balanced), large (split)."""
    tls = [_rep(f"small.{i:02d}", (256,)) for i in range(12)]
    tls += [_rep(f"mid.{i}", (256, 256)) for i in range(5)]
    tls += [_rep("big.w", (2048, 1024)), _rep("big.v", (1024, 1024), 2, "bfloat16"), _rep("scalar", ())]
    return [list(tls) for _ in range(4)], ["same"] * 4


def fsdp_and_stages():
    """Row shards over 4 ranks as explicit boxes; pipeline stages (ranks 0-1, 2-3) holding
    different replicated values; an uneven shard; a zero-size tensor."""
    held = []
    for r in range(4):
        rows = [(0, 3), (3, 3), (6, 3), (9, 1)][r]
        tls = [Held("w", "float32", (10, 6), 4, "sharded", [Box((rows[0], 0), (rows[1], 6))])]
        stage = r // 2
        tls.append(_rep(f"stage{stage}.bias", (64 * (stage + 1),)))
        tls.append(_rep(f"stage{stage}.weight", (512, 300)))
        tls.append(_rep("empty", (0, 4)))
        tls.append(_rep("step", ()))
        held.append(tls)
    return held, None


def rules():
    """DTensors saved by rule: Shard(0) on a 2x2 mesh (HSDP: replicate x shard), one on two
    disjoint 1-D meshes (replicas merged into one rule), next to a replicated tensor."""
    held = []
    for r in range(4):
        hsdp = (((2, 2), (0, 1, 2, 3), ("dp", "fsdp")), (("R",), ("S", 0)))
        mesh = (0, 1) if r < 2 else (2, 3)
        rep = (((2,), mesh, None), (("S", 1),))
        row = (r % 2) * 4
        held.append([
            Held("a", "float32", (8, 8), 4, "sharded", [Box((row, 0), (4, 8))], hsdp),
            Held("b", "float32", (4, 6), 4, "sharded", [Box((0, (r % 2) * 3), (4, 3))], rep),
            Held("c", "float16", (8, 8), 2, "sharded", [Box((row, 0), (4, 8))], hsdp),
            _rep("norm", (4096,)),
        ])
    return held, [f"r{r}" for r in range(4)]


CASES = {"ddp": ddp, "fsdp_and_stages": fsdp_and_stages, "rules": rules}


CASES = {"ddp": ddp, "fsdp_and_stages": fsdp_and_stages, "rules": rules}

def canonical(plan) -> dict:
    """The plan as plain JSON-able data."""
    return {
        "world": plan.world,
        "tensors": {k: [d, list(s), kind] for k, (d, s, kind) in plan.tensors.items()},
        "by_rank": [[[a.key, list(a.box.offsets), list(a.box.lengths), a.whole] for a in items]
                    for items in plan.by_rank],
        "bytes_by_rank": list(plan.bytes_by_rank),
        "rules": {k: [list(r.shape), [list(r.mesh.shape), list(r.mesh.ranks)], [list(p) for p in r.placements],
                      r.salt] for k, r in plan.rules.items()},
    }



GOLDEN = {  # plan_global at 6a0fd43 (before the passes): canonical(plan) of each case, as JSON
    "ddp": (
        '{"by_rank":[[["big.v",[0,0],[512,1024],false],["big.w",[0,0],[256,1024],false],["big.w",[1024,0],[25'
        '6,1024],false],["scalar",[],[],true],["small.00",[0],[256],true],["small.01",[0],[256],true],["small'
        '.02",[0],[256],true],["small.03",[0],[256],true],["small.04",[0],[256],true],["small.05",[0],[256],t'
        'rue],["small.06",[0],[256],true],["small.07",[0],[256],true],["small.08",[0],[256],true],["small.09"'
        ',[0],[256],true],["small.10",[0],[256],true],["small.11",[0],[256],true]],[["big.v",[512,0],[512,102'
        '4],false],["big.w",[256,0],[256,1024],false],["big.w",[1280,0],[256,1024],false]],[["big.w",[512,0],'
        '[256,1024],false],["big.w",[1536,0],[256,1024],false],["mid.0",[0,0],[256,256],true],["mid.2",[0,0],'
        '[256,256],true],["mid.4",[0,0],[256,256],true]],[["big.w",[768,0],[256,1024],false],["big.w",[1792,0'
        '],[256,1024],false],["mid.1",[0,0],[256,256],true],["mid.3",[0,0],[256,256],true]]],"bytes_by_rank":'
        '[3158020,3145728,2883584,2621440],"rules":{},"tensors":{"big.v":["bfloat16",[1024,1024],"replicated"'
        '],"big.w":["float32",[2048,1024],"replicated"],"mid.0":["float32",[256,256],"replicated"],"mid.1":["'
        'float32",[256,256],"replicated"],"mid.2":["float32",[256,256],"replicated"],"mid.3":["float32",[256,'
        '256],"replicated"],"mid.4":["float32",[256,256],"replicated"],"scalar":["float32",[],"replicated"],"'
        'small.00":["float32",[256],"replicated"],"small.01":["float32",[256],"replicated"],"small.02":["floa'
        't32",[256],"replicated"],"small.03":["float32",[256],"replicated"],"small.04":["float32",[256],"repl'
        'icated"],"small.05":["float32",[256],"replicated"],"small.06":["float32",[256],"replicated"],"small.'
        '07":["float32",[256],"replicated"],"small.08":["float32",[256],"replicated"],"small.09":["float32",['
        '256],"replicated"],"small.10":["float32",[256],"replicated"],"small.11":["float32",[256],"replicated'
        '"]},"world":4}'
    ),
    "fsdp_and_stages": (
        '{"by_rank":[[["empty",[0,0],[0,4],true],["stage0.bias",[0],[64],true],["stage0.weight",[0,0],[512,30'
        '0],true],["step",[],[],true],["w",[0,0],[3,6],false]],[["w",[3,0],[3,6],false]],[["stage1.bias",[0],'
        '[128],true],["w",[6,0],[3,6],false]],[["stage1.weight",[0,0],[512,300],true],["w",[9,0],[1,6],false]'
        ']],"bytes_by_rank":[614732,72,584,614424],"rules":{},"tensors":{"empty":["float32",[0,4],"replicated'
        '"],"stage0.bias":["float32",[64],"replicated"],"stage0.weight":["float32",[512,300],"replicated"],"s'
        'tage1.bias":["float32",[128],"replicated"],"stage1.weight":["float32",[512,300],"replicated"],"step"'
        ':["float32",[],"replicated"],"w":["float32",[10,6],"sharded"]},"world":4}'
    ),
    "rules": (
        '{"by_rank":[[["norm",[0],[4096],true]],[],[],[]],"bytes_by_rank":[16384,0,0,0],"rules":{"a":[[8,8],['
        '[2,2],[0,1,2,3]],[["R"],["S",0]],0],"b":[[4,6],[[2,2],[0,1,2,3]],[["R"],["S",1]],0],"c":[[8,8],[[2,2'
        '],[0,1,2,3]],[["R"],["S",0]],0]},"tensors":{"a":["float32",[8,8],"sharded"],"b":["float32",[4,6],"sh'
        'arded"],"c":["float16",[8,8],"sharded"],"norm":["float32",[4096],"replicated"]},"world":4}'
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_equals_the_plan_before_the_passes(name):
    held, signatures = CASES[name]()
    assert canonical(plan_global(held, signatures)) == json.loads(GOLDEN[name])


@pytest.mark.parametrize("name", sorted(CASES))
def test_plan_invariants(name):
    """Every distinct explicit box is written once, by a rank that holds it (or a row
    range of it: a split); each rank's bytes are what it was given; small replicated
    boxes sit on their lowest holder; a rank with nothing writes nothing."""
    held, signatures = CASES[name]()
    plan = plan_global(held, signatures)
    holders: dict[tuple[str, Box], set[int]] = {}
    for rank, tls in enumerate(held):
        for tl in tls:
            if tl.rule is None:
                for box in tl.boxes:
                    holders.setdefault((tl.key, box), set()).add(rank)
    written: dict[tuple[str, Box], int] = {}
    for rank, items in enumerate(plan.by_rank):
        nbytes = 0
        for a in items:
            held_box = next(b for (k, b) in holders if k == a.key and b.contains(a.box))
            assert rank in holders[(a.key, held_box)]
            written[(a.key, a.box)] = written.get((a.key, a.box), 0) + 1
            itemsize = next(tl.itemsize for tl in held[rank] if tl.key == a.key)
            nbytes += a.box.numel * itemsize
            if len(holders[(a.key, held_box)]) > 1 and a.box.numel * itemsize < SMALL_BYTES:
                assert rank == min(holders[(a.key, held_box)])
        assert nbytes == plan.bytes_by_rank[rank]
    assert set(written.values()) <= {1}
    for (key, box) in holders:  # covered: by the box itself or by its row ranges
        parts = [b for (k, b) in written if k == key and box.contains(b)]
        assert sum(b.numel for b in parts) == box.numel or (box.numel == 0 and parts)
    assert set(plan.rules) == {tl.key for tls in held for tl in tls if tl.rule is not None}
