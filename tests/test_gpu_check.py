"""benchmarks/gpu_check.py where no GPU is at hand: it says so and exits 0, and its CPU dry
run goes through every check's logic (gloo instead of NCCL, no pinned memory), 2 ranks in
the dist check, each check printing its figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.py"
CHECKS = ["save_load", "rng", "throughput", "train_async", "dist", "non_current_device", "pinned_budget"]


def run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env=env)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the real check")
def test_without_cuda_it_says_so_and_exits_0():
    done = run()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no CUDA device: gpu_check skipped"


def test_cpu_dry_run_passes_every_check_and_prints_its_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    done = run("--cpu-dry-run", "--quick", "--dist-world", "2", "--dir", str(scratch), "--out", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = {ln.split("]")[0][1:]: ln for ln in done.stdout.splitlines() if ln.startswith("[") and " in " in ln}
    assert sorted(lines) == sorted(CHECKS)
    for name in CHECKS:
        want = "SKIP" if name == "non_current_device" else "PASS"
        assert lines[name].startswith(f"[{name}] {want} in "), lines[name]
    assert "bitwise" in lines["save_load"] and "sync save" in lines["save_load"] and "async stall" in lines["save_load"]
    assert "bitwise equal after the load" in lines["rng"]
    assert "GB/s" in lines["throughput"] and "pinned copy_" in lines["throughput"]
    assert "undisturbed" in lines["train_async"] and "during the write" in lines["train_async"]
    assert "gloo world 2" in lines["dist"] and "FSDP2 TrainState" in lines["dist"]
    assert "needs CUDA" in lines["non_current_device"]
    assert "shardsafe peak" in lines["pinned_budget"]
    assert "CPU dry run" in done.stdout and f"wrote {out}" in done.stdout

    checks = json.loads(out.read_text())["checks"]
    save_load = checks["save_load"]["figures"]
    assert set(save_load) == {"sync", "async", "async_budget_8MiB"}  # the side stream variant needs CUDA
    assert all(f["bytes"] > 20 << 20 for f in save_load.values())
    tp = checks["throughput"]["figures"]
    assert tp["reps"] == 2 and len(tp["runs_s"]["ss async stall"]) == 2 and tp["bytes"] > 0
    train = checks["train_async"]["figures"]
    assert train["trials"] == 1 and train["median_step_s"] > 0 and train["median_stall_s"] > 0 and train["bytes"] > 0
    dist = checks["dist"]["figures"]
    assert dist["backend"] == "gloo" and dist["world"] == 2 and dist["dtensors"] == 5
    assert sum(dist["bytes_received_by_rank"]) >= 1 << 20  # the replicated device tensor was broadcast
    budget = checks["pinned_budget"]["figures"]
    assert 0 < budget["peak"] <= budget["budget"] and budget["kept"] <= budget["budget"]
    assert list(scratch.iterdir()) == []  # the scratch folder was removed


def test_a_failing_check_is_reported_and_fails_the_run(tmp_path):
    done = run("--cpu-dry-run", "--quick", "--only", "rng", "--inject-failure", "rng", "--dir", str(tmp_path),
               "--out", str(tmp_path / "x.json"))
    assert done.returncode == 1
    assert "[rng] FAIL in " in done.stdout and "failure injected into rng" in done.stdout
    assert "FAILED: rng" in done.stdout
    assert json.loads((tmp_path / "x.json").read_text())["checks"]["rng"]["result"] == "FAIL"
