"""The node-local tier on simulated nodes: real processes, real gloo, real SIGKILLs.

One launcher (this file) starts the ranks of a job as separate processes; each simulated
node is a group of ranks with its own local folder (``local=.../node{node}``, ``node=`` per
rank), so no shared filesystem is involved. A node is lost when its folder is deleted
(its processes are gone with the job); a crashed process is SIGKILLed mid-way. Every
restore is compared bitwise with a run that never failed: the step records (losses, the
samples each step took: data position), and a digest of the full model, optimizer, LR
schedule, sampler and this rank's RNG stream (tests/tier_cases.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
CFG = {"total": 8, "save_at": 4, "dataset_len": 64, "global_batch": 8}
NODES4 = [0, 0, 1, 1]  # 4 ranks as 2 nodes of 2


def launch(tmp: Path, tag: str, spec: dict[str, Any], world: int, timeout: float = 240) -> list[dict[str, Any]]:
    """Run ``world`` ranks of tier_cases.py with ``spec``; each rank's JSON result (None
    for a rank that was killed)."""
    spec = {"cfg": CFG, "local": str(tmp / "local" / "node{node}"), "persistent": str(tmp / "persistent"),
            "nodes": NODES4[:world], **spec, "out": str(tmp / tag)}
    spec_file = tmp / f"{tag}.spec.json"
    spec_file.write_text(json.dumps(spec))
    init = tmp / f"{tag}.init"
    procs = []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "INIT_FILE": str(init),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
        procs.append(subprocess.Popen([sys.executable, str(HERE / "tier_cases.py"), str(spec_file)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=max(1, deadline - time.monotonic()))[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    out = []
    for r in range(world):
        f = Path(f"{tmp / tag}.rank{r}.json")
        out.append(json.loads(f.read_text()) if f.exists() else None)
    if spec.get("kill") is None:
        assert all(o is not None for o in out), "\n".join(logs)
    for r, o in enumerate(out):
        if o is not None:
            o["log"] = logs[r]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The run that never fails: 4 ranks, local saves every 2 steps, to step 8."""
    tmp = tmp_path_factory.mktemp("tier-ref")
    return launch(tmp, "ref", {"stop": CFG["total"], "replicas": 2}, 4)


def _resume_matches(ref: list[dict], resumed: list[dict], step: int) -> None:
    for r, (a, b) in enumerate(zip(ref, resumed, strict=True)):
        assert b["loaded"] == step, (r, b["loaded"], b["log"][-3000:])
        assert b["restored"] == a["saves"][str(step)], f"rank {r}: restored state differs from the saved one"
        assert b["records"] == a["records"][step:], f"rank {r}: the resumed steps differ"
        assert b["final"] == a["final"], f"rank {r}: the final state differs"


def test_node_loss_restores_from_peers_bitwise(tmp_path: Path, reference: list[dict]) -> None:
    first = launch(tmp_path, "a", {"stop": 6, "replicas": 2}, 4)
    assert all("error" not in o for o in first), first[0]
    shutil.rmtree(tmp_path / "local" / "node1")  # node 1 lost with its processes
    resumed = launch(tmp_path, "b", {"stop": CFG["total"], "replicas": 2, "load": True}, 4)
    _resume_matches(reference, resumed, 6)
    assert {o["tier"] for o in resumed} == {"peers"}
    assert [o["received"] > 0 for o in resumed] == [False, False, True, True]
