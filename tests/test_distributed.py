"""Distributed save / load on real gloo process groups (CPU).

Checkpoints saved at 4 ranks by one module-scoped fixture feed most tests. Tests are
ordered by world size (4, 3, 8, 2, then one process) so that the session's pools
(at most two alive at a time, see conftest.py) are started once each.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import pytest
import torch

import dist_cases
import shardsafe
from bitwise import assert_bitwise
from shardsafe.format.dtypes import itemsize, torch_dtype
from shardsafe.format.manifest import MANIFEST_NAME, Manifest

LAYOUTS = ("fsdp", "ddp", "fsdp_tp", "hsdp")
MiB = 1 << 20


# ----------------------------------------------------------------------------- helpers


def _overlap(a: tuple, b: tuple) -> bool:
    """Do two boxes (offsets, lengths) share an element?"""
    (oa, na), (ob, nb) = a, b
    return all(max(x, y) < min(x + m, y + n) for x, m, y, n in zip(oa, na, ob, nb))


def assert_chunks_partition(m: Manifest) -> None:
    """Every tensor's chunks cover it exactly once: no overlap, no hole, byte ranges
    that match the chunk sizes and do not overlap inside a file."""
    for key, entry in m.tensors.items():
        size = itemsize(torch_dtype(entry.dtype))
        numel = math.prod(entry.shape)
        boxes = [(c.offsets, c.lengths) for c in entry.chunks]
        assert len(set(boxes)) == len(boxes), f"{key}: a chunk is written twice: {boxes}"
        for i, a in enumerate(boxes):
            assert all(0 <= o and o + n <= s for o, n, s in zip(a[0], a[1], entry.shape)), f"{key}: {a} outside"
            for b in boxes[i + 1:]:
                assert not _overlap(a, b), f"{key}: chunks {a} and {b} overlap"
        assert sum(math.prod(n) for _, n in boxes) == numel, f"{key}: chunks cover {boxes} of {entry.shape}"
        for c in entry.chunks:
            assert c.end - c.start == math.prod(c.lengths) * size, f"{key}: chunk {c} byte range vs box"
            assert m.files[c.file].rank == c.rank, f"{key}: chunk rank {c.rank} in a file of another rank"
    by_file = defaultdict(list)
    for entry in m.tensors.values():
        for c in entry.chunks:
            by_file[c.file].append((c.start, c.end))
    for f, ranges in by_file.items():
        ranges.sort()
        assert ranges[0][0] >= m.files[f].header_bytes
        assert ranges[-1][1] <= m.files[f].nbytes
        for (_, e), (s, _) in zip(ranges, ranges[1:]):
            assert e <= s, f"file {m.files[f].name}: chunks overlap"


def assert_files_consistent(path: Path, m: Manifest) -> None:
    """No empty data file, no unlisted file, sizes as the manifest says."""
    used = {c.file for e in m.tensors.values() for c in e.chunks}
    assert used == set(range(len(m.files))), f"data files without chunks: {set(range(len(m.files))) - used}"
    on_disk = {p.name for p in path.iterdir()}
    assert on_disk == {MANIFEST_NAME} | {f.name for f in m.files} | {f.index_name for f in m.files}, on_disk
    for f in m.files:
        assert (path / f.name).stat().st_size == f.nbytes > f.header_bytes, f.name


def bytes_by_rank(m: Manifest) -> dict[int, int]:
    out: dict[int, int] = defaultdict(int)
    for e in m.tensors.values():
        for c in e.chunks:
            out[c.rank] += c.end - c.start
    return dict(out)


def no_leftovers(path: Path) -> list[str]:
    """Anything at ``path`` or beside it that a save left (temp / old siblings)."""
    return [p.name for p in path.parent.iterdir() if p.name == path.name or p.name.startswith(f".{path.name}")]


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ckpts(pg_pool, tmp_path_factory):
    """One trained checkpoint per layout, saved at 4 ranks, with its full reference."""
    root = tmp_path_factory.mktemp("ckpts")
    out = {}
    pool = pg_pool(4)
    for layout in LAYOUTS:
        path, ref = root / layout, root / f"{layout}.ref.pt"
        infos = pool.run(dist_cases.save_trained, layout, str(path), str(ref))
        out[layout] = (path, ref, infos)
    return out


def _load(pg_pool, world: int, layout: str, ckpt) -> list[dict]:
    path, ref, _ = ckpt
    return pg_pool(world).run(dist_cases.load_measured, layout, str(path), str(ref))


# ----------------------------------------------------------------------------- world 4: saves


def test_fsdp_tp_uses_strided_shard(ckpts):
    placements = ckpts["fsdp_tp"][2][0]["placements"]
    strided = {k: p for k, p in placements.items() if any(s.startswith("_StridedShard") for s in p)}
    # FSDP over TP on the same dim (ColwiseParallel: dim 0) gives _StridedShard on torch 2.13.
    assert "blocks.0.up.weight" in strided, placements
    assert strided["blocks.0.up.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
    m = shardsafe.read_manifest(ckpts["fsdp_tp"][0])
    assert m.tensors["model.blocks.0.up.weight"].kind == "sharded"
    assert m.tensors["model.blocks.0.up.weight"].layout["placements"] == ["_S(0, 2)", "S(0)"]  # str() forms
    # TP splits the 20 rows in halves (tp coordinate), FSDP each half again (dp coordinate):
    # rank = 2 * dp + tp holds rows [10 * tp + 5 * dp, +5), so ranks 1 and 2 swap places.
    chunks = m.tensors["model.blocks.0.up.weight"].chunks
    assert [(c.offsets, c.lengths, c.rank) for c in chunks] == [
        ((0, 0), (5, 12), 0), ((5, 0), (5, 12), 2), ((10, 0), (5, 12), 1), ((15, 0), (5, 12), 3)
    ]
    # TP-replicated values (norm weights: FSDP over dp only) are written once, not per TP peer.
    assert len(m.tensors["model.blocks.0.norm.weight"].chunks) == 2
    assert_chunks_partition(m)


def test_manifest_fsdp_kinds(ckpts):
    path = ckpts["fsdp"][0]
    m = shardsafe.read_manifest(path)
    assert m.world_size == 4
    for name in ("embed.weight", "blocks.0.up.weight", "blocks.1.down.bias", "head.weight"):
        assert m.tensors[f"model.{name}"].kind == "sharded"
        assert m.tensors[f"optim.state.{name}.exp_avg"].kind == "sharded"
        assert m.tensors[f"optim.state.{name}.exp_avg_sq"].kind == "sharded"
        step = m.tensors[f"optim.state.{name}.step"]
        assert step.kind == "replicated" and step.shape == () and len(step.chunks) == 1
        assert step.layout is None  # a plain tensor, not a DTensor
    # Each rank wrote its own shard of a sharded tensor (31 rows over 4 ranks: 8, 8, 8, 7).
    embed = m.tensors["model.embed.weight"].chunks
    assert [(c.offsets, c.lengths, c.rank) for c in embed] == [
        ((0, 0), (8, 12), 0), ((8, 0), (8, 12), 1), ((16, 0), (8, 12), 2), ((24, 0), (7, 12), 3)
    ]
    assert {k: v for k, v in m.tensors.items() if v.kind == "rank_local"} == {}
    assert_chunks_partition(m)
    # Plain values (param_groups) live in the manifest tree, not in data files.
    groups = shardsafe.load_full(path, keys="optim.param_groups")["optim"]["param_groups"]
    assert groups[0]["lr"] == 0.01 and groups[0]["params"][0] == "embed.weight"


def test_manifest_ddp_every_chunk_written_once(ckpts):
    m = shardsafe.read_manifest(ckpts["ddp"][0])
    assert m.world_size == 4
    assert {e.kind for e in m.tensors.values()} == {"replicated"}
    assert_chunks_partition(m)
    # Tiny's tensors are below the row-split threshold: one chunk each, out of 4 identical copies.
    assert all(len(e.chunks) == 1 for e in m.tensors.values())
    # 4 ranks hold every tensor; each is written by one of them. Tiny's are all under 64 KiB:
    # packed onto the lowest holder (16 MiB per rank), so a load finds them in one index.
    writers = {c.rank for e in m.tensors.values() for c in e.chunks}
    assert writers == {0}, writers
    assert all(c.end - c.start < 64 << 10 for e in m.tensors.values() for c in e.chunks)


def test_manifest_hsdp_replicas_deduplicated(ckpts):
    m = shardsafe.read_manifest(ckpts["hsdp"][0])
    assert_chunks_partition(m)
    # Replicate x Shard(0) on a (2, 2) mesh: 2 distinct row shards per tensor, each written once.
    embed = m.tensors["model.embed.weight"]
    assert embed.kind == "sharded"
    assert [(c.offsets, c.lengths) for c in embed.chunks] == [((0, 0), (16, 12)), ((16, 0), (15, 12))]
    assert embed.layout["placements"] == ["R", "S(0)"]  # str() forms
    assert embed.layout["mesh_shape"] == [2, 2]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_manifest_no_empty_or_unlisted_files(ckpts, layout):
    path = ckpts[layout][0]
    m = shardsafe.read_manifest(path)
    assert_files_consistent(path, m)
    assert no_leftovers(path) == [path.name]


def test_second_save_uses_cached_plan(pg_pool, tmp_path):
    paths = [tmp_path / f"c{i}" for i in range(3)]
    flags = pg_pool(4).run(dist_cases.save_twice, "fsdp", *map(str, paths))
    assert flags == [[False, True, False]] * 4
    # The cached plan lays the checkpoint out exactly like the fresh one.
    m1, m2 = (shardsafe.read_manifest(p) for p in paths[:2])
    assert {k: e.to_json() for k, e in m1.tensors.items()} == {k: e.to_json() for k, e in m2.tensors.items()}
    assert [f.to_json() for f in m1.files] == [f.to_json() for f in m2.files]
    assert "extra" in shardsafe.read_manifest(paths[2]).tensors


# ----------------------------------------------------------------------------- world 4: loads across layouts


@pytest.mark.parametrize(
    "src,dst",
    [
        ("fsdp", "ddp"), ("ddp", "fsdp"), ("fsdp_tp", "fsdp"), ("fsdp", "fsdp_tp"), ("hsdp", "fsdp"),
        ("fsdp", "hsdp"), ("ddp", "fsdp_tp"),
    ],
)
def test_reshard_layouts_at_4(pg_pool, ckpts, src, dst):
    results = _load(pg_pool, 4, dst, ckpts[src])
    assert all(r["tensors"] > 0 for r in results)


# ----------------------------------------------------------------------------- world 4: rank-local values


@pytest.fixture(scope="module")
def rank_local_ckpt(pg_pool, tmp_path_factory):
    path = tmp_path_factory.mktemp("rl") / "ckpt"
    pg_pool(4).run(dist_cases.save_rank_local, str(path))
    return path


def test_rank_local_manifest(rank_local_ckpt):
    m = shardsafe.read_manifest(rank_local_ckpt)
    assert m.world_size == 4
    local = {k: e for k, e in m.tensors.items() if e.kind == "rank_local"}
    assert set(local) == {f"rng#rank{r}.t" for r in range(4)}, set(local)
    for r in range(4):
        chunks = local[f"rng#rank{r}.t"].chunks
        assert [c.rank for c in chunks] == [r], "a rank-local tensor is written by its own rank"
    assert m.tensors["w"].kind == "replicated"
    assert len(m.rank_local["rng"]) == 4


@pytest.mark.parametrize("form", ["marked_empty", "marked_tensor", "plain"])
def test_rank_local_load_each_rank_its_own(pg_pool, rank_local_ckpt, form):
    got = pg_pool(4).run(dist_cases.load_rank_local, str(rank_local_ckpt), form)
    assert got == [{"seed": r, "t": [r, r, r]} for r in range(4)]


def test_rank_local_load_full_by_rank(rank_local_ckpt):
    for r in (0, 2, 3):
        full = shardsafe.load_full(rank_local_ckpt, rank=r)
        assert set(full) == {"rng", "w"}
        assert full["rng"]["seed"] == r
        assert_bitwise(torch.full((3,), r), full["rng"]["t"], "rng.t")
        assert_bitwise(torch.arange(6.0), full["w"], "w")


# ----------------------------------------------------------------------------- world 4: errors agree


def test_shape_mismatch_on_one_rank_fails_everywhere(pg_pool, ckpts):
    results = pg_pool(4).run(dist_cases.load_with_fault, "fsdp", str(ckpts["fsdp"][0]), "shape", 1, timeout=120)
    for r in results:
        name, msg = r["error"]
        assert name == "ShapeMismatchError", msg
        assert "model.head.weight" in msg and "[31, 12]" in msg and "[31, 13]" in msg, msg
        assert "rank 1" in msg, msg


def test_extra_key_on_one_rank_fails_everywhere(pg_pool, ckpts):
    results = pg_pool(4).run(dist_cases.load_with_fault, "fsdp", str(ckpts["fsdp"][0]), "extra_key", 2, timeout=120)
    for r in results:
        name, msg = r["error"]
        assert name == "MissingKeysError", msg
        assert "model.extra.weight" in msg and "rank 2" in msg, msg


def test_unsupported_value_on_one_rank_fails_everywhere(pg_pool, tmp_path):
    path = tmp_path / "bad"
    results = pg_pool(4).run(dist_cases.save_with_fault, str(path), 3, timeout=120)
    for r in results:
        name, msg = r["error"]
        assert name == "UnsupportedValueError", msg
        assert "meta.tags" in msg and "set" in msg and "rank 3" in msg, msg
    assert no_leftovers(path) == [], "a failed save left files behind"
    assert not path.exists()
    assert shardsafe.load_full(tmp_path / "bad-after")["w"].equal(torch.ones(4))


@pytest.fixture(scope="module")
def write_failure(pg_pool, tmp_path_factory):
    path = tmp_path_factory.mktemp("wfail") / "ckpt"
    results = pg_pool(4).run(dist_cases.save_with_write_failure, str(path), 2, timeout=120)
    return path, results


def test_write_failure_on_one_rank_fails_everywhere(write_failure):
    path, results = write_failure
    for r in results:
        assert r["error"] is not None, "a rank returned from a failed save without raising"
        assert r["error"][2], f"not a CheckpointError: {r['error']}"
    assert no_leftovers(path) == [], "a failed save left files behind"
    assert shardsafe.load_full(path.parent / "ckpt-after")["w"].equal(torch.ones(4))


def test_write_failure_error_agrees(write_failure):
    _, results = write_failure
    for r in results:
        name, msg, _ = r["error"]
        assert "No space left on device" in msg and "rank 2" in msg, f"rank {results.index(r)}: {name}: {msg}"
    assert len({r["error"][:2] for r in results}) == 1, [r["error"] for r in results]


def test_explicit_process_groups(pg_pool, tmp_path):
    results = pg_pool(4).run(dist_cases.save_load_subgroups, str(tmp_path), timeout=120)
    assert [(r["w"], r["mine"]) for r in results] == [([float(r // 2)] * 5, {"r": r}) for r in range(4)]
    for g in range(2):
        m = shardsafe.read_manifest(tmp_path / f"g{g}")
        assert m.world_size == 2
        assert list(m.rank_local["mine"]) == [{"r": 2 * g}, {"r": 2 * g + 1}]
        assert {c.rank for c in m.tensors["w"].chunks} <= {0, 1}
        assert_bitwise(torch.full((5,), float(g)), shardsafe.load_full(tmp_path / f"g{g}")["w"])


# ----------------------------------------------------------------------------- world 4: replicated planning


def test_large_replicated_tensor_split_across_ranks(pg_pool, tmp_path):
    path = tmp_path / "split"
    shape = (2560, 4096)  # 40 MiB of float32
    pg_pool(4).run(dist_cases.save_replicated, str(path), [shape])
    m = shardsafe.read_manifest(path)
    entry = m.tensors["t0"]
    assert entry.kind == "replicated" and entry.shape == shape
    assert_chunks_partition(m)
    assert len(entry.chunks) > 1 and all(c.lengths[1:] == shape[1:] for c in entry.chunks), "row ranges"
    assert len({c.rank for c in entry.chunks}) >= 2, [c.rank for c in entry.chunks]
    per_rank = bytes_by_rank(m)
    assert max(per_rank.values()) <= 1.15 * sum(per_rank.values()) / 4, per_rank
    got = shardsafe.load_full(path)
    assert_bitwise(dist_cases.big_replicated([shape]), got)


def test_replicated_writes_balanced(pg_pool, tmp_path):
    path = tmp_path / "balance"
    shapes = [(16 * 1024, 1024), (18 * 256, 1024), (34 * 256, 1024), (18 * 256, 1024)]  # 64/18/34/18 MiB
    assert sum(math.prod(s) * 4 for s in shapes) == 134 * MiB
    pg_pool(4).run(dist_cases.save_replicated, str(path), shapes)
    m = shardsafe.read_manifest(path)
    assert_chunks_partition(m)
    assert_files_consistent(path, m)
    per_rank = bytes_by_rank(m)
    assert set(per_rank) == {0, 1, 2, 3}
    mean = sum(per_rank.values()) / len(per_rank)
    assert max(per_rank.values()) / mean <= 1.15, per_rank
    # Spot-check the data of the smallest tensor through load_full.
    got = shardsafe.load_full(path, keys="t1")
    assert_bitwise(dist_cases.big_replicated(shapes)["t1"], got["t1"])


# ----------------------------------------------------------------------------- world 3


def test_fsdp_4_to_3_uneven(pg_pool, ckpts):
    results = _load(pg_pool, 3, "fsdp", ckpts["fsdp"])
    dest = sum(r["dest_bytes"] for r in results)
    # Exactly the needed bytes land in the destination...
    assert sum(r["bytes_copied"] for r in results) == dest
    # ...while verification hashes whole checksum blocks (1 MiB), here whole tiny chunks that the
    # uneven 3-way split cuts: more than 1.0, and never more than every saved chunk read twice.
    ratio = sum(r["bytes_read"] for r in results) / dest
    assert 1.0 < ratio < 2.0, ratio


def test_round_trip_4_3_4(pg_pool, ckpts, tmp_path):
    path, ref, _ = ckpts["fsdp"]
    mid = tmp_path / "at3"
    pg_pool(3).run(dist_cases.load_then_save, "fsdp", str(path), str(mid), str(ref))
    m = shardsafe.read_manifest(mid)
    assert m.world_size == 3
    assert_chunks_partition(m)
    assert_files_consistent(mid, m)
    pg_pool(4).run(dist_cases.load_into, "fsdp", str(mid), str(ref))
    # Same logical content both ways, read without a process group too.
    assert_bitwise(shardsafe.load_full(path), shardsafe.load_full(mid))


# ----------------------------------------------------------------------------- world 8


@pytest.mark.parametrize("layout", ["fsdp", "fsdp_tp"])
def test_8_ranks_to_fsdp_3(pg_pool, tmp_path, layout):
    # fsdp: 12 and 20 rows over 8 ranks leave ranks 6 and 7 with empty shards;
    # fsdp_tp (4 x 2): each TP half of 20 rows splits 3, 3, 3, 1 over dp (uneven _StridedShard).
    path, ref = tmp_path / "at8", tmp_path / "at8.ref.pt"
    infos = pg_pool(8).run(dist_cases.save_trained, layout, str(path), str(ref))
    m = shardsafe.read_manifest(path)
    assert m.world_size == 8
    assert_chunks_partition(m)
    assert_files_consistent(path, m)
    if layout == "fsdp_tp":
        assert infos[0]["placements"]["blocks.0.up.weight"] == ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]
        up = m.tensors["model.blocks.0.up.weight"].chunks
        assert sorted(c.lengths[0] for c in up) == [1, 1, 3, 3, 3, 3, 3, 3]
    else:
        norm = m.tensors["model.blocks.0.norm.weight"].chunks
        assert [c.rank for c in norm] == [0, 1, 2, 3, 4, 5]
        # ... and into uneven _StridedShard destinations (fsdp_tp 4 x 2) at the same world size.
        pg_pool(8).run(dist_cases.load_measured, "fsdp_tp", str(path), str(ref))
    pg_pool(3).run(dist_cases.load_measured, "fsdp", str(path), str(ref))


# ----------------------------------------------------------------------------- world 2


def test_fsdp_4_to_2_read_amplification(pg_pool, ckpts):
    results = _load(pg_pool, 2, "fsdp", ckpts["fsdp"])
    ratio = sum(r["bytes_read"] for r in results) / sum(r["dest_bytes"] for r in results)
    assert 1.0 <= ratio <= 1.05, ratio


def test_hsdp_4_to_fsdp_2(pg_pool, ckpts):
    _load(pg_pool, 2, "fsdp", ckpts["hsdp"])


# ----------------------------------------------------------------------------- one process, no group


def test_fsdp_4_to_single_process(ckpts):
    from torch.distributed.checkpoint.state_dict import set_state_dict

    path, ref, _ = ckpts["fsdp"]
    model, opt = dist_cases.build("single", 1)
    state = dist_cases.train_state(model, opt)
    info = shardsafe.load(state, path)
    assert info.tensors > 0
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = dist_cases.full_reference(dist_cases.train_state(model, opt))
    assert_bitwise(torch.load(ref, weights_only=True), got)


def test_save_through_a_one_rank_group_whose_rank_is_not_global_rank_0(pg_pool, tmp_path):
    """The group's rank 0 is global rank 1 on the second process: the rule's mesh is
    mapped to group ranks, so the save is not refused."""
    got = pg_pool(2).run(dist_cases.save_on_own_one_rank_group, str(tmp_path / "ck"))
    assert [g["equal"] for g in got] == [True, True]
