"""The I/O pipeline (storage seam, one writer, one reader, the Checkpointer) and the
regressions found on the way (issue 12), single-process cases; distributed ones are in
pipeline_cases.py, run by the tests at the end of this file."""

from __future__ import annotations

import ast
import errno
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import pipeline_cases
import shardsafe
from bitwise import assert_bitwise
from format2 import as_format2
from shardsafe.format.checksum import checksum
from shardsafe.format.manifest import MANIFEST_NAME
from shardsafe.format.manifest_codec import _TRAILER
from shardsafe.layout import Box
from shardsafe.plan.save_plan import Assignment, HeldTensor, plan_file, plan_global
from shardsafe.storage.faults import Fault, FaultyBackend
from shardsafe.tools import diff_checkpoints, export_checkpoint

SRC = Path(__file__).resolve().parent.parent / "src" / "shardsafe"


def reseal(path: Path, edit) -> None:
    """Apply ``edit`` to the manifest's JSON and write it back with a valid trailer."""
    data = (path / MANIFEST_NAME).read_bytes()
    head = data[: data.rfind(_TRAILER)]
    body = json.loads(head + b"}")
    edit(body)
    text = json.dumps(body, separators=(",", ":")).encode()[:-1]
    (path / MANIFEST_NAME).write_bytes(text + _TRAILER + checksum(text).encode() + b'"}\n')


# ----------------------------------------------------------------------------- the seam itself


FORBIDDEN = re.compile(r"\bos\.(open|pwrite|pwritev|pread|preadv|rename|replace|unlink|fsync)\b|\bmmap\b(?!=)|"
                       r"\bfcntl\b|\brmtree\b|(?<![\w.])open\(")


def test_no_file_access_outside_storage():
    """No module outside storage/ touches files directly (the only allowed ``open(`` reads a
    TOML config file the user names, not a checkpoint file)."""
    hits = []
    for path in SRC.rglob("*.py"):
        if "storage" in path.relative_to(SRC).parts:
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if FORBIDDEN.search(code) and '"""' not in code and "``" not in code:
                if (path.name == "manager_config.py" and 'open(path, "rb")' in code) or "os.devnull" in code:
                    continue  # CheckpointConfig.from_toml reads a config file; the CLI silences stdout
                if path.name == "exit_settle.py" and "{TASKS}/" in code:
                    continue  # this process's own thread states in /proc (issue 28), no checkpoint file
                hits.append(f"{path.relative_to(SRC)}:{no}: {line.strip()}")
    assert not hits, "\n".join(hits)


LAYERS = [
    {"errors", "gcpause", "layout", "hints", "budget", "knobs", "workers", "lazy"},
    {"storage"},
    {"format"},
    {"checkpoint_folder", "steps"},
    {"plan"},
    {"engine"},
    {"state", "data"},
    {"comm", "exit_settle"},
    {"ops"},
    {"checkpointer", "api", "hf_folder"},
    {"tier"},  # the node-local recovery tier: saves and loads through the Checkpointer
    {"manager", "manager_config", "manager_export", "manager_tier"},
    {"tools"},
    {"integrations"},
]


def _layer(parts: tuple[str, ...]) -> int | None:
    name = parts[0].removesuffix(".py")
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    return None


def test_imports_point_down_the_layers():
    """storage at the bottom, integrations at the top; a module imports only its own
    layer and the ones below (shardsafe/__init__.py and __main__.py are the entry points)."""
    bad = []
    for path in SRC.rglob("*.py"):
        rel = path.relative_to(SRC).parts
        if rel[0] in ("__init__.py", "__main__.py"):
            continue
        mine = _layer(rel)
        assert mine is not None, f"{'/'.join(rel)} belongs to no layer"
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level > 0:
                base = list(rel[:-1])[: len(rel) - node.level]
                target = tuple(base + (node.module.split(".") if node.module else []))
                if not target:  # "from . import x" at the package root
                    target = tuple(a.name for a in node.names[:1])
                if target and target[0] == "__version__" or (node.module is None and node.level == 1
                                                                 and len(rel) == 1):
                    continue
                theirs = _layer(target) if target else None
                if theirs is not None and theirs > mine:
                    bad.append(f"{'/'.join(rel)} imports {'.'.join(target)}")
    assert not bad, "\n".join(bad)


def test_local_backend_refuses_symlinks_and_fifos(tmp_path):
    """Inside a checkpoint only regular files are read: a symlinked data file or manifest,
    or a FIFO in place of a data file, is a CorruptCheckpointError, never followed or hung on."""
    path = tmp_path / "ck"
    shardsafe.save({"w": torch.arange(10.0)}, path)
    data = next(path.glob("data-*.safetensors"))
    outside = tmp_path / "outside.bin"
    outside.write_bytes(data.read_bytes())
    data.unlink()
    data.symlink_to(outside)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="symlink"):
        shardsafe.load_full(path)
    data.unlink()
    os.mkfifo(data)
    t0 = time.monotonic()
    with pytest.raises(shardsafe.CorruptCheckpointError, match="not a regular file"):
        shardsafe.load_full(path)
    assert time.monotonic() - t0 < 10
    data.unlink()
    manifest = path / MANIFEST_NAME
    (tmp_path / "m.json").write_bytes(manifest.read_bytes())
    manifest.unlink()
    manifest.symlink_to(tmp_path / "m.json")
    with pytest.raises(shardsafe.CorruptCheckpointError, match="manifest.json is a symlink"):
        shardsafe.read_manifest(path)


def test_unsupported_url_scheme_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(shardsafe.CheckpointError, match="unsupported URL scheme 'gs'"):
        shardsafe.save({"w": torch.ones(2)}, "gs://bucket/x")
    assert list(tmp_path.iterdir()) == [], "a local folder was created for a gs:// URL"
    shardsafe.save({"w": torch.ones(2)}, f"file://{tmp_path}/ck")
    assert_bitwise({"w": torch.ones(2)}, shardsafe.load_full(tmp_path / "ck"))


def test_commit_without_exchange_rolls_back_and_recovers(tmp_path):
    """Where directories cannot be swapped: a failing second rename rolls back (the old
    checkpoint stays at its path); a crash between the renames (a parked folder, no
    checkpoint at the path) is repaired by the next save."""
    path = tmp_path / "ck"
    shardsafe.save({"w": torch.ones(4)}, path)
    rename_in = Fault("rename", errno.EIO, name=".shardsafe-tmp-")  # tmp -> ck fails
    with shardsafe.Checkpointer(storage=FaultyBackend(faults=[rename_in], exchange=False)) as cp:
        with pytest.raises(shardsafe.StorageError):
            cp.save({"w": torch.zeros(4)}, path, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert_bitwise({"w": torch.ones(4)}, shardsafe.load_full(path))
    # Simulate the crash between the two renames: ck parked, nothing at ck.
    parked = tmp_path / ".ck.shardsafe-old-0123456789ab"
    path.rename(parked)
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="interrupted overwrite"):
        shardsafe.load_full(path)
    shardsafe.save({"v": torch.ones(1)}, tmp_path / "ck", overwrite=True)  # restores, then replaces it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert_bitwise({"v": torch.ones(1)}, shardsafe.load_full(path))


# ----------------------------------------------------------------------------- bug 1: one read session


def _many_small(tmp_path: Path, n: int = 300) -> Path:
    path = tmp_path / "many"
    shardsafe.save({"t": {f"k{i}": torch.full((3,), float(i)) for i in range(n)}, "l": [torch.ones(2)] * 3}, path)
    return path


@pytest.mark.parametrize("to", ["torch", "safetensors", "hf"])
def test_export_opens_each_file_once(tmp_path, to):
    """Export reads every tensor through one open checkpoint: the manifest and the data file
    are opened once and the header is read and hashed once, whatever the tensor count."""
    path = _many_small(tmp_path)
    backend = FaultyBackend()
    with shardsafe.Checkpointer(storage=backend) as cp:
        report = export_checkpoint(path, tmp_path / f"out-{to}", to, checkpointer=cp, keys=["t"])
    assert report.tensors == 300
    assert backend.calls["open_read"] == 3, backend.calls  # manifest.json, the data file's index, the data file
    header_reads = backend.calls["read"] - 300  # one read per tensor (each lands whole), plus the header
    assert header_reads <= 3, backend.calls  # and the index, read once


def test_diff_opens_each_file_once(tmp_path):
    a = _many_small(tmp_path / "a")
    b = _many_small(tmp_path / "b")
    backend = FaultyBackend()
    with shardsafe.Checkpointer(storage=backend) as cp:
        report = diff_checkpoints(a, b, checkpointer=cp)
    assert report.same and report.compared == 303
    assert backend.calls["open_read"] == 6, backend.calls  # manifest, index, data file of each


# ----------------------------------------------------------------------------- bug 2: partial lists


def test_export_torch_keeps_list_indices(tmp_path):
    path = tmp_path / "ck"
    state = {"l": [torch.zeros(1), torch.ones(2), torch.full((3,), 2.0)], "x": 1}
    shardsafe.save(state, path)
    export_checkpoint(path, tmp_path / "out.pt", "torch", keys=["l.2"])
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert list(out) == ["l"] and list(out["l"]) == [2]
    assert torch.equal(out["l"][2], state["l"][2])
    full = shardsafe.load_full(path, keys=["l.2"])
    assert list(full["l"]) == [2] and torch.equal(full["l"][2], state["l"][2])


# ----------------------------------------------------------------------------- bug 5: geometry at save


def test_save_refuses_overlap_plus_hole_of_the_same_size():
    """Two ranks' shards [0:2] and [1:3] of a 4-element tensor hold 4 elements between
    them, but overlap at 1 and leave 3 uncovered: refused at save, naming the tensor."""
    layouts = [[HeldTensor("w", "float32", (4,), 4, "sharded", [Box((0,), (2,))])],
               [HeldTensor("w", "float32", (4,), 4, "sharded", [Box((1,), (2,))])]]
    with pytest.raises(shardsafe.CheckpointError, match="tensor 'w'.*overlap"):
        plan_global(layouts)
    layouts[1][0].boxes = [Box((2,), (2,))]
    assert plan_global(layouts).tensors["w"] == ("float32", (4,), "sharded")


# ----------------------------------------------------------------------------- bug 6: chunk names


def test_chunk_names_never_collide_in_a_data_file(tmp_path):
    """A whole tensor keyed "a@0" and chunk 0 of tensor "a" (named "a@0") in one file."""
    from safetensors import safe_open

    assignments = [Assignment("a", Box((0,), (2,)), False), Assignment("a@0", Box((0,), (3,)), True)]
    plan = plan_file("f.safetensors", 0, assignments, {"a": "F32", "a@0": "F32"}, {"a": 4, "a@0": 4})
    raw = plan.header + b"\0" * (plan.size - len(plan.header))
    (tmp_path / "f.safetensors").write_bytes(raw)
    with safe_open(str(tmp_path / "f.safetensors"), "pt") as f:
        names = sorted(f.keys())
    assert len(names) == 2 and "a@0" in names


# ----------------------------------------------------------------------------- bug 7: holes are corruption


def test_hole_in_the_chunk_table_is_corrupt_and_the_manager_skips_it(tmp_path):
    folder = tmp_path / "run"
    with shardsafe.CheckpointManager(folder, interval=1) as mgr:
        mgr.save(1, {"w": torch.full((8,), 1.0)})
        mgr.save(2, {"w": torch.full((8,), 2.0)})
    as_format2(folder / "step-00000002")

    def shrink(body):  # the only chunk now covers 4 of the 8 elements (its byte range too)
        start = body["chunks"]["b"][0]
        body["chunks"]["n"] = [4]
        body["chunks"]["b"] = [start, start + 16]

    reseal(folder / "step-00000002", shrink)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="cover 4 of the 8"):
        shardsafe.load_full(folder / "step-00000002")
    dest = {"w": torch.zeros(8)}
    with pytest.warns(UserWarning, match="skipping checkpoint .*step-00000002"), \
            shardsafe.CheckpointManager(folder, interval=1) as mgr:
        assert mgr.load(dest) == 1
    assert torch.equal(dest["w"], torch.full((8,), 1.0))


# ----------------------------------------------------------------------------- bug 8: no flock


def test_saves_work_without_flock_and_clean_only_stale_temp_folders(tmp_path):
    path = tmp_path / "ck"
    backend = FaultyBackend(locks=False)
    with shardsafe.Checkpointer(storage=backend) as cp:
        cp.save({"w": torch.ones(3)}, path)
        fresh = tmp_path / ".ck.shardsafe-tmp-aaaaaaaaaaaa"  # an in-flight save elsewhere
        stale = tmp_path / ".ck.shardsafe-tmp-bbbbbbbbbbbb"  # abandoned 7 hours ago
        fresh.mkdir()
        stale.mkdir()
        old = time.time() - 7 * 3600
        os.utime(stale, (old, old))
        cp.save({"w": torch.zeros(3)}, path, overwrite=True)
    assert fresh.exists() and not stale.exists()
    assert_bitwise({"w": torch.zeros(3)}, shardsafe.load_full(path))


# ----------------------------------------------------------------------------- bug 9: allocation after checks


def test_claimed_huge_tensor_is_refused_before_allocation(tmp_path):
    """A manifest claiming a 2 TiB tensor (and a file that size) fails on the file's real
    size before the loader allocates anything."""
    path = tmp_path / "ck"
    shardsafe.save({"w": torch.ones(4)}, path)
    as_format2(path)
    huge = 1 << 39  # elements of float32: 2 TiB

    def claim(body):
        body["tensors"]["w"]["shape"] = [huge]
        body["chunks"]["n"] = [huge]
        start = body["chunks"]["b"][0]
        body["chunks"]["b"] = [start, start + 4 * huge]
        body["chunks"]["x"] = "0" * 16 * (-(-4 * huge // (1 << 20)))
        body["files"][0]["bytes"] = start + 4 * huge

    reseal(path, claim)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="bytes, the manifest says"):
        shardsafe.load_full(path)


# ----------------------------------------------------------------------------- bug 11: odd strides


@pytest.mark.parametrize("how", ["sync", "async"])
def test_one_element_views_with_any_stride_save(tmp_path, how):
    state = {"a": torch.arange(8.0)[::8], "col": torch.arange(6.0).view(1, 6)[:, 2:3],
             "row": torch.arange(12.0).view(3, 4)[1:2, :].t(), "s": torch.arange(3.0)[2:]}
    ref = {k: v.clone() for k, v in state.items()}
    if how == "sync":
        shardsafe.save(state, tmp_path / "ck")
    else:
        shardsafe.async_save(state, tmp_path / "ck").result(60)
    assert_bitwise(ref, shardsafe.load_full(tmp_path / "ck"))


# ----------------------------------------------------------------------------- bug 12: optimizer before wrapping


def test_train_state_refuses_an_optimizer_of_other_parameters(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight = torch.nn.Parameter(model.weight.detach().clone())  # what wrapping does to parameters
    state = shardsafe.TrainState(model, opt)
    with pytest.raises(shardsafe.CheckpointError, match="created before fully_shard"):
        shardsafe.save({"train": state}, tmp_path / "ck")
    assert not (tmp_path / "ck").exists()


# ----------------------------------------------------------------------------- the budget


BUDGET_SCRIPT = r"""
import sys, threading, time, psutil, torch, shardsafe
budget = 32 << 20
state = {f"t{i}": torch.randn(1024, 8192).t() for i in range(8)}  # 8 x 32 MiB, not dense: staged
cp = shardsafe.Checkpointer(memory_budget=budget)
cp.save({"warm": torch.ones(4, 4).t()}, sys.argv[1] + "-warm")  # imports and first-use costs are not the save's
proc = psutil.Process()
base = proc.memory_info().rss
peak = [base]
done = threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], proc.memory_info().rss)
        time.sleep(0.002)
th = threading.Thread(target=sample); th.start()
with cp:
    cp.save(state, sys.argv[1])
    mem_peak = cp.memory.peak
done.set(); th.join()
print((peak[0] - base) >> 20, mem_peak >> 20)
"""


def test_sync_save_larger_than_the_budget_stays_within_it(tmp_path):
    """A 256 MiB state of non-dense tensors (each staged through memory) saved under a 32 MiB
    budget: RSS grows by at most budget + 64 MiB."""
    out = subprocess.run([sys.executable, "-c", BUDGET_SCRIPT, str(tmp_path / "ck")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rss_growth, leased = (int(v) for v in out.stdout.split())
    assert leased <= 32, f"leased {leased} MiB of a 32 MiB budget"
    assert rss_growth <= 32 + 64, f"RSS grew {rss_growth} MiB"
    assert shardsafe.read_manifest(tmp_path / "ck").tensors["t0"].shape == (8192, 1024)


# ----------------------------------------------------------------------------- distributed cases


def test_ranks_disagreeing_on_a_kind_are_refused_at_save(pg_pool, tmp_path):
    """Bug 3: {"x": 1} on rank 0, a tensor "x" on rank 1: refused on every rank, naming the
    key and both ranks; nothing committed."""
    results = pg_pool(2).run(pipeline_cases.save_kind_conflict, str(tmp_path / "ck"))
    for r in results:
        assert r is not None and "key 'x'" in r and "rank 0" in r and "rank 1" in r, results
    assert not (tmp_path / "ck").exists() and list(tmp_path.iterdir()) == []


def test_manager_ranks_follow_rank_0s_listing(pg_pool, tmp_path):
    """Bug 4: rank 1's listing misses the newest step (a stale NFS cache): both ranks load
    the step rank 0 chose; ranks that read different manifests refuse the load."""
    results = pg_pool(2).run(pipeline_cases.manager_stale_listing, str(tmp_path))
    assert [r["loaded"] for r in results] == [3, 3], results
    assert all(r["value"] == 3.0 for r in results), results
    assert all("ranks read different manifests" in r["mismatch"] for r in results), results


def test_fresh_optimizer_without_state_is_refused_not_materialized(pg_pool, tmp_path):
    """Bug 9: loading a sharded optimizer state into an optimizer without state on 2 ranks
    names the key and says how to build the state, instead of allocating full tensors."""
    results = pg_pool(2).run(pipeline_cases.load_into_stateless_optimizer, str(tmp_path / "ck"))
    for r in results:
        assert "saved sharded" in r and "get_state_dict" in r, r


def test_train_state_uses_the_group_of_the_save(pg_pool, tmp_path):
    """Bug 10: TrainState in a save on a 2-rank subgroup of a 4-rank job records world size
    2 and one RNG entry per subgroup rank."""
    pg_pool(4).run(pipeline_cases.train_state_on_subgroups, str(tmp_path))
    for g in range(2):
        m = shardsafe.read_manifest(tmp_path / f"g{g}")
        assert m.world_size == 2
        assert shardsafe.load_full(tmp_path / f"g{g}", keys="train.world_size")["train"]["world_size"] == 2
        assert len(m.rank_local["train.rng"]) == 2


def test_optimizer_created_before_fully_shard_is_refused(pg_pool, tmp_path):
    """Bug 12 under real FSDP2: the error says to create the optimizer after wrapping."""
    results = pg_pool(2).run(pipeline_cases.optimizer_before_fully_shard, str(tmp_path / "ck"))
    assert all("created before fully_shard" in r for r in results), results


def test_check_replicas_names_the_key_and_ranks(pg_pool, tmp_path):
    """A plain tensor that differs between ranks: refused with check_replicas (on in the
    tests through SHARDSAFE_CHECK_REPLICAS), saved from one rank without it."""
    results = pg_pool(2).run(pipeline_cases.save_differing_replica, str(tmp_path / "ck"))
    for r in results:
        assert "tensor 'w'" in r["refused"] and "ranks [0]" in r["refused"] and "ranks [1]" in r["refused"], r
    assert not (tmp_path / "ck").exists()
    assert torch.equal(shardsafe.load_full(tmp_path / "ck-unchecked")["w"], torch.zeros(4))


def test_load_broadcasts_replicated_tensors(pg_pool, tmp_path):
    """broadcast_replicated: each replicated tensor is read from storage by one rank and
    sent to the others; the bytes read over all ranks are the checkpoint's once."""
    path = str(tmp_path / "ck")
    pg_pool(4).run(pipeline_cases.save_for_broadcast, path)
    plain = pg_pool(4).run(pipeline_cases.load_broadcast, path, False)
    shared = pg_pool(4).run(pipeline_cases.load_broadcast, path, True)
    assert all(r["ok"] for r in plain + shared)
    total = (1 << 16) * 4 + 300 * 7 * 4 + 10 * 8
    assert [r["read"] for r in plain] == [total] * 4 and all(r["received"] == 0 for r in plain)
    assert sum(r["read"] for r in shared) == total
    assert all(r["read"] + r["received"] == total for r in shared)
    # each piece is read by the rank whose file holds it; replicated values under 64 KiB are
    # all written by the lowest holder (a load then finds them in one file's index)
    with shardsafe.Checkpointer() as cp:
        m = cp.read_manifest(path)
    chunks = [c for e in m.tensors.values() for c in e.chunks]
    assert {c.rank for c in chunks if c.end - c.start < 64 << 10} == {0}
    assert [r["read"] for r in shared] == [sum(c.end - c.start for c in chunks if c.rank == k) for k in range(4)]


def test_small_replicated_values_are_packed_onto_the_lowest_holders():
    """Replicated boxes under 64 KiB go to the lowest holders, 16 MiB each (a load then
    reads few indexes); larger ones are still balanced."""
    small = [HeldTensor(f"s{i:04d}", "float32", (8192,), 4, "replicated", [Box((0,), (8192,))])
             for i in range(600)]  # 600 x ~32 KiB = ~19 MiB
    big = [HeldTensor(f"b{i}", "float32", (1 << 18,), 4, "replicated", [Box((0,), (1 << 18,))]) for i in range(4)]
    plan = plan_global([small + big] * 4, ["same"] * 4)
    writer = {a.key: r for r, items in enumerate(plan.by_rank) for a in items}
    packed = [writer[f"s{i:04d}"] for i in range(600)]
    assert set(packed) == {0, 1} and packed == sorted(packed)  # rank 0 until 16 MiB, then rank 1
    assert sum(1 for r in packed if r == 0) * 8192 * 4 <= 16 << 20
    assert {writer[f"b{i}"] for i in range(4)} == {0, 1, 2, 3}  # 1 MiB each: balanced, one per rank
