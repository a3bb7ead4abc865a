"""The node-local tier on simulated nodes: real processes, real gloo, real SIGKILLs.

One launcher (this file) starts the ranks of a job as separate processes; each simulated
node is a group of ranks with its own local folder (``local=.../node{node}``, ``node=`` per
rank), so no shared filesystem is involved. A node is lost when its folder is deleted
(its processes are gone with the job); a crashed process is SIGKILLed mid-way. Every
restore is compared bitwise with a run that never failed: the step records (losses, the
samples each step took: data position), and a digest of the full model, optimizer, LR
schedule, sampler and this rank's RNG stream (tests/tier_cases.py).

Runs: 4 ranks as 2 nodes of 2, ``replicas=2`` (each rank's files also on the other node),
local saves every 2 steps, persistent saves every 4.
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
BASE = {"replicas": 2, "interval": 4, "local_interval": 2}


def launch(tmp: Path, tag: str, spec: dict[str, Any], world: int = 4, nodes: list[int] | None = None,
           timeout: float = 240) -> list[dict[str, Any] | None]:
    """Run ``world`` ranks of tier_cases.py with ``spec`` (folders under ``tmp``); each
    rank's JSON result (None for a rank that was killed), with its log under "log"."""
    spec = {"cfg": CFG, "local": str(tmp / "local" / "node{node}"), "persistent": str(tmp / "persistent"),
            "nodes": nodes or NODES4[:world], **BASE, **spec, "out": str(tmp / tag)}
    spec_file = tmp / f"{tag}.spec.json"
    spec_file.write_text(json.dumps(spec))
    init = tmp / f"{tag}.init"
    procs, logs = [], []
    for r in range(world):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "INIT_FILE": str(init),
               "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent / "src"), str(HERE)])}
        log = open(tmp / f"{tag}.rank{r}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, str(HERE / "tier_cases.py"), str(spec_file)], env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    # like torchrun: once a rank has failed, the others are stopped after a grace period
    deadline = time.monotonic() + timeout
    try:
        while [p.poll() for p in procs].count(None) and time.monotonic() < deadline:
            if any(p.returncode not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
        text = []
        for log in logs:
            log.seek(0)
            text.append(log.read())
            log.close()
    logs = text
    out: list[dict[str, Any] | None] = []
    for r in range(world):
        f = Path(f"{tmp / tag}.rank{r}.json")
        o = json.loads(f.read_text()) if f.exists() else None
        if o is not None:
            o["log"] = logs[r]
        out.append(o)
    if spec.get("kill") is None:
        assert all(o is not None for o in out), "\n".join(logs)
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src / "local", dst / "local")
    if (src / "persistent").exists():
        shutil.copytree(src / "persistent", dst / "persistent")
    return dst


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The run that never fails, to step 8."""
    return launch(tmp_path_factory.mktemp("tier-ref"), "ref", {"stop": CFG["total"]})


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run stopped after step 6: local steps 4 and 6 (local_keep=2), persistent step 4."""
    tmp = tmp_path_factory.mktemp("tier-stopped")
    out = launch(tmp, "a", {"stop": 6})
    assert all(o is not None and "error" not in o for o in out), out[0]
    return tmp


def _resumed(ref: list[dict], resumed: list[dict | None], step: int, tier: str) -> None:
    for r, (a, b) in enumerate(zip(ref, resumed, strict=True)):
        assert b is not None
        assert "error" not in b, b["error"]
        assert b["loaded"] == step, (r, b["loaded"], b["log"][-3000:])
        assert b["tier"] == tier, (r, b["tier"], b["log"][-3000:])
        assert b["restored"] == a["saves"][str(step)], f"rank {r}: restored state differs from the saved one"
        assert b["records"] == a["records"][step:], f"rank {r}: the resumed steps differ"
        assert b["final"] == a["final"], f"rank {r}: the final state differs"


def test_local_folders_hold_own_files_and_replicas(stopped: Path) -> None:
    for node in (0, 1):
        steps = sorted(p.name for p in (stopped / "local" / f"node{node}").iterdir() if p.name.startswith("step-"))
        assert steps == ["step-00000004", "step-00000006"]  # local_keep=2 dropped step 2
        names = sorted(p.name for p in (stopped / "local" / f"node{node}" / "step-00000006").iterdir())
        data = [n for n in names if n.endswith(".safetensors")]
        assert data == [f"data-r{r:05d}-00.safetensors" for r in range(4)], names  # own + the other node's
        assert "manifest.json" in names


def test_node_loss_restores_from_peers_bitwise(tmp_path: Path, stopped: Path, reference: list[dict]) -> None:
    _copy(stopped, tmp_path)
    shutil.rmtree(tmp_path / "local" / "node1")  # node 1 lost with its processes
    resumed = launch(tmp_path, "b", {"stop": CFG["total"], "load": True})
    _resumed(reference, resumed, 6, "peers")
    assert [o["received"] > 0 for o in resumed] == [False, False, True, True]
    # node 1 fetched only the files its ranks read (their own; the replicated values packed
    # into rank 0's file were read on node 0 and sent), not every file of the step
    step6 = tmp_path / "local" / "node1" / "step-00000006"
    names = sorted(p.name for p in step6.iterdir())
    assert [n for n in names if n.endswith(".safetensors")] == [f"data-r{r:05d}-00.safetensors" for r in (2, 3)]
    fetched = sum(p.stat().st_size for p in step6.iterdir() if p.name != "manifest.json")
    assert resumed[2]["received"] + resumed[3]["received"] == fetched


def test_every_process_killed_restores_from_its_own_node(tmp_path: Path, stopped: Path,
                                                         reference: list[dict]) -> None:
    _copy(stopped, tmp_path)
    resumed = launch(tmp_path, "b", {"stop": CFG["total"], "load": True})
    _resumed(reference, resumed, 6, "local")
    assert [o["received"] for o in resumed] == [0, 0, 0, 0]


def test_loss_of_every_copy_falls_back_to_the_persistent_tier(tmp_path: Path, stopped: Path,
                                                              reference: list[dict]) -> None:
    _copy(stopped, tmp_path)
    for node in (0, 1):
        shutil.rmtree(tmp_path / "local" / f"node{node}")
    resumed = launch(tmp_path, "b", {"stop": CFG["total"], "load": True})
    _resumed(reference, resumed, 4, "persistent")
    assert "no local step is complete across the live nodes" in resumed[0]["log"]


def test_flipped_byte_in_a_replica_is_detected(tmp_path: Path, stopped: Path, reference: list[dict]) -> None:
    _copy(stopped, tmp_path)
    shutil.rmtree(tmp_path / "local" / "node1")
    victim = tmp_path / "local" / "node0" / "step-00000006" / "data-r00002-00.safetensors"  # rank 2's copy
    data = bytearray(victim.read_bytes())
    data[-100] ^= 0x01
    victim.write_bytes(bytes(data))
    resumed = launch(tmp_path, "b", {"stop": CFG["total"], "load": True})
    _resumed(reference, resumed, 4, "persistent")
    assert "could not be restored" in resumed[0]["log"] and "checksum" in resumed[0]["log"]


def test_restart_on_fewer_ranks_restores_from_the_local_tier(tmp_path: Path, stopped: Path,
                                                             reference: list[dict]) -> None:
    _copy(stopped, tmp_path)
    shutil.rmtree(tmp_path / "local" / "node1")
    resumed = launch(tmp_path, "b", {"stop": 6, "load": True}, world=2, nodes=[0, 0])
    for o in resumed:
        assert o is not None and o["loaded"] == 6 and o["tier"] == "local", o and o["log"][-3000:]
    # the full (unsharded) model and optimizer state, resharded 4 -> 2, is the one saved at step 6
    assert resumed[0]["restored_full"] == reference[0]["saves_full"]["6"]


@pytest.mark.parametrize("at", ["save", "replicate"])
def test_rank_killed_during_a_local_save(tmp_path: Path, reference: list[dict], at: str) -> None:
    """Rank 1 dies while writing (or copying) local step 6: the others fail too (a peer
    is gone: the job dies, as under torchrun), no node commits step 6, and the restart
    restores step 4."""
    t0 = time.monotonic()
    out = launch(tmp_path, "a", {"stop": 8, "kill": {"rank": 1, "at": at, "step": 6}})
    assert out == [None] * 4 and time.monotonic() - t0 < 120  # every rank failed, none hung
    for node in (0, 1):
        assert not (tmp_path / "local" / f"node{node}" / "step-00000006").exists()
    resumed = launch(tmp_path, "b", {"stop": CFG["total"], "load": True})
    _resumed(reference, resumed, 4, "local")


def test_rank_killed_during_a_restore(tmp_path: Path, stopped: Path, reference: list[dict]) -> None:
    """Rank 2 dies while receiving node 1's files: the restore fails on every rank, the
    model is untouched, and the next restart restores step 6 from peers."""
    _copy(stopped, tmp_path)
    shutil.rmtree(tmp_path / "local" / "node1")
    out = launch(tmp_path, "b", {"stop": CFG["total"], "load": True, "kill": {"rank": 2, "at": "restore"}})
    assert out[2] is None
    resumed = launch(tmp_path, "c", {"stop": CFG["total"], "load": True})
    _resumed(reference, resumed, 6, "peers")


def test_full_local_folder_is_a_clear_error_and_persistent_saves_go_on(tmp_path: Path) -> None:
    out = launch(tmp_path, "a", {"stop": 4, "local_max_bytes": 4096, "then_persistent": True})
    for o in out:
        assert o is not None and "error" in o, o
        assert "local tier on node" in o["error"] and "GB available" in o["error"], o["error"]
        assert o["persistent_after_error"] == 2
    assert (tmp_path / "persistent" / "step-00000002" / "manifest.json").exists()
    for node in (0, 1):
        assert [p.name for p in (tmp_path / "local" / f"node{node}").iterdir()] == [".shardsafe-tier.json"]


def test_ls_and_verify_on_a_local_folder(tmp_path: Path, stopped: Path) -> None:
    """``shardsafe ls`` shows the local steps and which ranks' files a node holds;
    ``verify`` checks what the node holds and names what is on peers."""
    from shardsafe.tier.local import MARKER
    from shardsafe.tools.listing import TIER_MARKER, format_listing, list_checkpoints
    from shardsafe.tools.verify import verify_checkpoint

    assert MARKER == TIER_MARKER
    _copy(stopped, tmp_path)
    node0 = tmp_path / "local" / "node0"
    for p in (node0 / "step-00000006").glob("data-r00003-00.*"):
        p.unlink()  # as if node 0 kept only ranks 0-2 of step 6
    entries = {e.step: e for e in list_checkpoints(node0)}
    assert entries[4].status == "local" and entries[4].coverage == "files of ranks 0-3 (4 of 4)"
    assert entries[6].status == "partial" and entries[6].coverage == "files of ranks 0-2 (3 of 4)"
    assert "the others are on peer nodes" in format_listing(list(entries.values()), node0)
    report = verify_checkpoint(node0 / "step-00000006")
    assert report.ok, report.to_text()
    assert report.on_peers == ["data-r00003-00.safetensors"]
    victim = node0 / "step-00000006" / "data-r00002-00.safetensors"
    data = bytearray(victim.read_bytes())
    data[-100] ^= 1
    victim.write_bytes(bytes(data))
    bad = verify_checkpoint(node0 / "step-00000006")
    assert not bad.ok and "data-r00002-00.safetensors" in bad.to_text()
