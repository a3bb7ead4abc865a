"""shardsafe.integrations.torchtitan against the real torchtitan 0.3.0: its llama3 debug
model trained on CPU (gloo) with the one-flag switch
``--override.imports shardsafe.integrations.torchtitan.use_shardsafe``.

torchtitan runs in subprocesses (tests/torchtitan_cases.py, which holds the CPU
workarounds); each subprocess runs several trainer jobs in a row to keep the file fast.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

from bitwise import assert_bitwise

pytest.importorskip("torchtitan")

import shardsafe  # noqa: E402
from shardsafe import CheckpointConfig  # noqa: E402

HERE = Path(__file__).resolve().parent
TIMEOUT = 240  # one launch of torchtitan processes
# the module fixture runs three launches inside the first test's setup: on a busy 2-core
# machine (load 15-25) that took longer than the suite's 300 s per test, so the first test
# of the module gets room for all three
pytestmark = pytest.mark.timeout(3 * TIMEOUT + 60)
TORCHTITAN_FIELDS = ("enable", "folder", "interval", "initial_load_path", "initial_load_model_only",
                     "initial_load_in_hf", "initial_load_in_hf_quantized", "last_save_model_only", "last_save_in_hf",
                     "export_dtype", "keep_latest_k", "load_step", "exclude_from_loading",
                     "enable_first_step_checkpoint", "create_seed_checkpoint", "load_only", "async_mode")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


WORDS = ("alpha beta gamma delta training shard model tensor checkpoint sample quick brown fox jumps over the lazy "
         "dog data resume step optimizer").split()


def write_dataset(root: Path, rows: int = 120, words: int = 160) -> None:
    """A synthetic ``tests/assets/c4_test/data.json`` under ``root``: the path torchtitan's
    c4_test dataset reads, relative to the working directory (~100 KB, never committed)."""
    rng = random.Random(0)
    folder = root / "tests" / "assets" / "c4_test"
    folder.mkdir(parents=True, exist_ok=True)
    lines = (json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(words))}) for _ in range(rows))
    (folder / "data.json").write_text("\n".join(lines) + "\n")


def run_jobs(workdir: Path, launch: str, jobs: list[dict[str, Any]], world: int = 1) -> dict[str, dict[str, Any]]:
    """Run torchtitan ``jobs`` in ``world`` fresh processes (one gloo group) with ``workdir``
    as the working directory; results by job name (``by_rank``: every rank's digest). Every
    process is ended before returning; ``LAUNCH-rank<r>.log`` keeps their output."""
    workdir.mkdir(parents=True, exist_ok=True)
    write_dataset(workdir)
    spec, out = workdir / f"{launch}-spec.json", workdir / f"{launch}-results.json"
    spec.write_text(json.dumps({"world": world, "jobs": jobs}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": str(world),
           "HF_DATASETS_CACHE": str(workdir / "hf-cache"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "OMP_NUM_THREADS": "1" if world > 1 else os.environ.get("OMP_NUM_THREADS", "2")}
    code = "import torchtitan_cases as c; c.main()"
    procs = []
    logs = []
    try:
        for rank in range(world):
            log = open(workdir / f"{launch}-rank{rank}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-c", code, str(spec), str(out)], cwd=workdir,
                                          env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdout=log, stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=TIMEOUT)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    tail = (workdir / f"{launch}-rank0.log").read_text()[-3000:]
    assert all(p.returncode == 0 for p in procs) and out.exists(), f"torchtitan run failed:\n{tail}"
    results = {r["name"]: r for r in json.loads(out.read_text())}
    others = [json.loads(Path(f"{out}.rank{rank}").read_text()) for rank in range(1, world)]
    for name, result in results.items():  # every rank's digest (its own dataloader position)
        result["by_rank"] = [result.get("digest")] + [next(r for r in o if r["name"] == name).get("digest")
                                                      for o in others]
    return results


def ok(result: dict[str, Any]) -> dict[str, Any]:
    """The result of a job that must have succeeded."""
    assert "error" not in result, f"job {result['name']} failed: {result['error']}"
    return result


def assert_same_state(want: dict[str, Any], got: dict[str, Any], what: str) -> None:
    """Bitwise equality of two state digests (a tensor's digest hashes its dtype, shape and
    bytes: torchtitan_cases._tensor_digest), naming the first key that differs."""
    for part in ("model", "optimizer", "lr_scheduler", "train_state", "dataloader", "lr"):
        assert_bitwise(want[part], got[part], f"{what}: {part}")


def step_dirs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("step-")) if folder.exists() else []


def args(dump: Path, *extra: str) -> list[str]:
    return ["--dump_folder", str(dump), "--checkpoint.enable", *extra]


# ----------------------------------------------------------------------------- the runs

COMMON = ["--training.steps", "8", "--checkpoint.interval", "4"]
FSDP = [*COMMON, "--parallelism.spmd_backend", "partial_dtensor"]  # workaround 7


def field_jobs(r: Path) -> list[dict[str, Any]]:
    """One short trainer job per group of checkpoint config fields, in dependency order."""
    ret = ["--checkpoint.folder", "ck", "--checkpoint.interval", "1"]
    model_only = ["--training.steps", "1", "--checkpoint.last_save_model_only", "--checkpoint.interval", "10"]
    hf_dir = r / "hf" / "checkpoint" / "step-00000001-hf"
    return [
        {"name": "disabled", "args": ["--dump_folder", str(r / "disabled"), "--training.steps", "1"]},
        {"name": "retention", "args": args(r / "ret", *ret, "--training.steps", "3", "--checkpoint.keep_latest_k", "2",
                                           "--checkpoint.async_mode", "async_with_pinned_mem")},
        {"name": "first-step", "args": args(r / "first", "--training.steps", "2", "--checkpoint.interval", "10",
                                            "--checkpoint.enable_first_step_checkpoint")},
        {"name": "load-only", "args": args(r / "ret", *ret, "--training.steps", "4", "--checkpoint.load_only")},
        {"name": "load-step", "op": "load", "args": args(r / "ret", *ret, "--checkpoint.load_step", "2")},
        {"name": "load-step-missing", "op": "load", "args": args(r / "ret", *ret, "--checkpoint.load_step", "1")},
        {"name": "exclude", "op": "load", "args": args(r / "ret", *ret, "--checkpoint.exclude_from_loading",
                                                       "dataloader,lr_scheduler")},
        {"name": "fresh", "op": "load", "args": args(r / "fresh")},
        {"name": "bf16-export", "model_dtype": "bfloat16",
         "args": args(r / "bf16", *model_only, "--checkpoint.export_dtype", "bfloat16")},
        {"name": "resume-model-only", "op": "load", "args": args(r / "bf16")},
        {"name": "initial-model-only", "op": "load", "model_dtype": "bfloat16",
         "args": args(r / "init1", "--checkpoint.initial_load_path", str(r / "bf16" / "checkpoint" / "step-00000001"))},
        {"name": "initial-full", "op": "load", "args": args(
            r / "init2", "--checkpoint.initial_load_path", str(r / "ret" / "ck" / "step-00000002"),
            "--checkpoint.no-initial-load-model-only")},
        {"name": "hf-export", "args": args(r / "hf", *model_only, "--checkpoint.last_save_in_hf")},
        {"name": "hf-initial", "op": "load", "args": args(r / "hfload", "--checkpoint.initial_load_in_hf",
                                                          "--checkpoint.initial_load_path", str(hf_dir))},
        {"name": "hf-quantized", "op": "build", "args": args(
            r / "q", "--checkpoint.initial_load_in_hf", "--checkpoint.initial_load_in_hf_quantized",
            "--checkpoint.initial_load_path", str(hf_dir))},
        {"name": "seed", "op": "seed", "args": args(r / "seed", "--checkpoint.create_seed_checkpoint")},
        {"name": "from-seed", "op": "load", "args": args(r / "seed")},
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Three launches: (1) one process trains 8 steps straight and stops two jobs after step
    4 (sync, async); (2) two FSDP ranks train 8 steps straight, stop a job at 4 and resume it
    (a new trainer) to 8; (3) a new process resumes (1)'s jobs to 8, loads (2)'s step 4 on one
    rank, and runs the config-field jobs (their folders under ``fields/``)."""
    r = tmp_path_factory.mktemp("tt")
    first = run_jobs(r, "first", [
        {"name": "straight", "args": args(r / "straight", *COMMON)},
        {"name": "sync-4", "args": args(r / "sync", *COMMON), "stop_at": 4},
        {"name": "async-4", "args": args(r / "async", *COMMON, "--checkpoint.async_mode", "async"), "stop_at": 4},
    ])
    fsdp_async = ["--checkpoint.async_mode", "async"]
    fsdp = run_jobs(r, "fsdp", [
        {"name": "fsdp-straight", "args": args(r / "fsdp-straight", *FSDP)},
        {"name": "fsdp-4", "args": args(r / "fsdp", *FSDP, *fsdp_async), "stop_at": 4},
        {"name": "fsdp-8", "args": args(r / "fsdp", *FSDP, *fsdp_async)},
    ], world=2)
    third = run_jobs(r, "third", [
        {"name": "sync-8", "args": args(r / "sync", *COMMON)},
        {"name": "async-8", "args": args(r / "async", *COMMON, "--checkpoint.async_mode", "async")},
        {"name": "fsdp-4-on-1", "op": "load", "args": args(r / "fsdp", "--checkpoint.load_step", "4",
                                                           "--checkpoint.exclude_from_loading", "dataloader")},
        *field_jobs(r / "fields"),
    ])
    return r, {**first, **fsdp, **third}


# ----------------------------------------------------------------------------- resume


def test_one_flag_switches_torchtitan_to_shardsafe(runs):
    root, results = runs
    assert ok(results["straight"])["checkpointer"] == "ShardsafeCheckpointManager"
    folder = root / "straight" / "checkpoint"
    assert step_dirs(folder) == ["step-00000004", "step-00000008"]
    for name in step_dirs(folder):
        files = sorted(p.name for p in (folder / name).iterdir())
        assert "manifest.json" in files and ".metadata" not in files, files
        tree = shardsafe.read_manifest(folder / name).tree
        assert set(tree) == {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    full = shardsafe.load_full(folder / "step-00000004", keys=["train_state", "lr_scheduler"])
    assert full["train_state"] == {"step": 4, "ntokens_seen": 4 * 2 * 64}
    assert full["lr_scheduler"] == {"last_epoch": 4}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_resume_is_bitwise_equal_to_straight_run(runs, mode):
    root, results = runs
    stopped, resumed = ok(results[f"{mode}-4"]), ok(results[f"{mode}-8"])
    assert stopped["digest"]["train_state"]["step"] == 4
    assert step_dirs(root / mode / "checkpoint") == ["step-00000004", "step-00000008"]
    straight = ok(results["straight"])["digest"]
    assert straight["train_state"]["step"] == 8
    assert_same_state(straight, resumed["digest"], f"{mode} resume 4 -> 8")
    assert stopped["digest"]["model"] != straight["model"], "the stopped job really stopped early"


def test_fsdp_two_ranks_resume_bitwise_and_load_on_one_rank(runs):
    root, results = runs
    straight, stopped, resumed = ok(results["fsdp-straight"]), ok(results["fsdp-4"]), ok(results["fsdp-8"])
    for rank, (want, got) in enumerate(zip(straight["by_rank"], resumed["by_rank"])):
        assert_same_state(want, got, f"FSDP rank {rank} resume 4 -> 8")
    assert straight["by_rank"][0]["dataloader"] != straight["by_rank"][1]["dataloader"], "rank-local positions"
    step = root / "fsdp" / "checkpoint" / "step-00000004"
    assert len(list(step.glob("data-r*.safetensors"))) == 2, "both ranks wrote"
    on_one = ok(results["fsdp-4-on-1"])  # resharded 2 -> 1 (dataloader excluded: torchtitan cannot reshard it)
    assert on_one["step"] == 4
    for part in ("model", "optimizer", "lr_scheduler", "train_state"):
        assert on_one["digest"][part] == stopped["digest"][part], part


# ----------------------------------------------------------------------------- config fields


def test_enable_false_creates_nothing(runs):
    root, results = runs
    root = root / "fields"
    assert ok(results["disabled"])["checkpointer"] == "ShardsafeCheckpointManager"
    assert not (root / "disabled" / "checkpoint").exists()


def test_folder_interval_keep_latest_k_and_pinned_async(runs):
    root, results = runs
    root = root / "fields"
    ok(results["retention"])
    assert step_dirs(root / "ret" / "ck") == ["step-00000002", "step-00000003"], "keep_latest_k=2 of 1, 2, 3"


def test_enable_first_step_checkpoint(runs):
    root, results = runs
    root = root / "fields"
    ok(results["first-step"])
    assert step_dirs(root / "first" / "checkpoint") == ["step-00000001", "step-00000002"]


def test_load_only_loads_and_saves_nothing(runs):
    root, results = runs
    root = root / "fields"
    assert ok(results["load-only"])["digest"]["train_state"]["step"] == 4, "resumed at 3, trained to 4"
    assert step_dirs(root / "ret" / "ck") == ["step-00000002", "step-00000003"], "no save with load_only"


def test_load_step_and_exclude_from_loading(runs):
    _, results = runs
    at2 = ok(results["load-step"])
    assert at2["loaded"] and at2["step"] == 2 and at2["digest"]["lr_scheduler"] == {"last_epoch": 2}
    assert "load_step=1" in results["load-step-missing"]["error"]
    excluded, fresh = ok(results["exclude"]), ok(results["fresh"])
    assert fresh["loaded"] is False and fresh["step"] == 0
    assert excluded["step"] == 3, "train_state loaded from the latest step"
    assert excluded["digest"]["lr_scheduler"] == fresh["digest"]["lr_scheduler"], "lr_scheduler excluded"
    assert excluded["digest"]["dataloader"] == fresh["digest"]["dataloader"], "dataloader excluded"
    assert excluded["digest"]["model"] != fresh["digest"]["model"]


def test_last_save_model_only_export_dtype_and_initial_load(runs):
    root, results = runs
    root = root / "fields"
    exported = ok(results["bf16-export"])
    step = root / "bf16" / "checkpoint" / "step-00000001"
    assert set(shardsafe.read_manifest(step).tree) == {"model"}, "last_save_model_only"
    weights = shardsafe.load_full(step, keys="model")["model"]
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}, "export_dtype"
    assert "holds only the model" in results["resume-model-only"]["error"], "no partial resume from an export"
    loaded = ok(results["initial-model-only"])
    assert loaded["loaded"] and loaded["step"] == 0, "initial_load_model_only: counters not loaded"
    assert loaded["digest"]["model"] == exported["digest"]["model"], "bf16 export loaded into the fp32 model"
    full = ok(results["initial-full"])
    assert full["step"] == 2 and full["digest"]["lr_scheduler"] == {"last_epoch": 2}


def test_last_save_in_hf_and_initial_load_in_hf(runs):
    from safetensors import safe_open

    root, results = runs
    root = root / "fields"
    exported = ok(results["hf-export"])
    hf = root / "hf" / "checkpoint" / "step-00000001-hf"
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert "model.layers.0.self_attn.q_proj.weight" in index["weight_map"]
    with safe_open(str(hf / sorted(set(index["weight_map"].values()))[0]), framework="pt") as f:
        assert "model.embed_tokens.weight" in f.keys()
    loaded = ok(results["hf-initial"])
    assert loaded["loaded"] and loaded["step"] == 0
    assert loaded["digest"]["model"] == exported["digest"]["model"], "HF round trip (q/k permutation undone)"


def test_quantized_hf_load_is_refused_by_name(runs):
    _, results = runs
    assert "initial_load_in_hf_quantized" in results["hf-quantized"]["error"]


def test_create_seed_checkpoint(runs):
    root, results = runs
    root = root / "fields"
    seed = ok(results["seed"])
    assert step_dirs(root / "seed" / "checkpoint") == ["step-00000000"]
    resumed = ok(results["from-seed"])
    assert resumed["loaded"] and resumed["step"] == 0
    assert resumed["digest"]["model"] == seed["digest"]["model"]


# ----------------------------------------------------------------------------- config parsing


def test_shardsafe_config_accepts_every_torchtitan_field():
    from torchtitan.components.checkpointer import CheckpointManager

    from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager

    names = tuple(f.name for f in fields(CheckpointManager.Config))
    assert set(names) == set(TORCHTITAN_FIELDS)
    assert set(names) <= {f.name for f in fields(ShardsafeCheckpointManager.Config)}
    defaults = CheckpointManager.Config()
    cfg = CheckpointConfig.from_dict({n: getattr(defaults, n) for n in names})
    assert cfg.keep_last == 10 and cfg.load_step is None and cfg.export_dtype == "float32"


def test_quantized_refused_when_built():
    from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager

    cfg = ShardsafeCheckpointManager.Config(enable=True, initial_load_in_hf=True, initial_load_in_hf_quantized=True,
                                            initial_load_path="/nonexistent")
    with pytest.raises(ValueError, match="initial_load_in_hf_quantized"):
        ShardsafeCheckpointManager(cfg, dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None,
                                   states={}, sd_adapter=None)


def test_dcp_initial_load_path_is_refused_by_name(tmp_path):
    from shardsafe.integrations.torchtitan import ShardsafeCheckpointManager

    dcp = tmp_path / "dcp-step-10"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"a pickle")
    cfg = ShardsafeCheckpointManager.Config(enable=True, initial_load_path=str(dcp))
    mgr = ShardsafeCheckpointManager(cfg, dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None,
                                     states={}, sd_adapter=None, base_folder=str(tmp_path / "run"))
    with pytest.raises(ValueError, match="initial_load_path.*DCP"):
        mgr.load()
    mgr.close()
