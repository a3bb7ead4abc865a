"""The Ray Train integration on a real local Ray cluster (loopback, CPU, gloo workers).

One cluster for the module (``ray.init(num_cpus=4, include_dashboard=False)``), stopped at
the end with every process it started checked gone. Each test runs ``TorchTrainer`` with the
FSDP2 loop of tests/ray_cases.py and checks bitwise outcomes:

- an uninterrupted 2-worker run (incremental saves, ``num_to_keep=2`` by a score) is the
  reference: Ray's kept checkpoints are exactly shardsafe's, every one verifies and loads
  bitwise equal to the state saved, and the dropped ones that kept ones refer to are retired;
- 2 -> 4 workers (local storage) and 2 -> 1 (moto S3): the run is started again with the
  same name and another worker count, restores from ``ray.train.get_checkpoint()``; the
  state restored is bitwise the state saved and a plain ``shardsafe.load``, the global sample
  order continues exactly, the losses as in the uninterrupted run (to float rounding: the
  reduction order differs on another worker count);
- SIGKILL of one worker while a step is saved (async saves, ``max_failures=1``): the
  restarted group resumes from the last committed step and its losses are bitwise those of
  the uninterrupted run.

``SHARDSAFE_RAY_FULL=1`` adds the variants left out of the default run (2 -> 4 on S3,
2 -> 1 on local storage, sync saves for the kill, async for the resumes).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("ray.train")

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import ray_cases  # noqa: E402
import shardsafe  # noqa: E402
from bitwise import assert_bitwise  # noqa: E402
from shardsafe.integrations import ray as ss_ray  # noqa: E402
from shardsafe.tools import verify_checkpoint  # noqa: E402

TESTS = Path(__file__).resolve().parent
FULL = os.environ.get("SHARDSAFE_RAY_FULL", "") not in ("", "0")
STEPS, GLOBAL_BATCH = 8, 8
RAY_ENV = {
    # the controller polls the workers this often (default 2 s): reports register sooner
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
    "RAY_DEDUP_LOGS": "0",
}

pytestmark = [pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster on loopback for the module; afterwards no process of it is left."""
    import psutil

    saved = {k: os.environ.get(k) for k in [*RAY_ENV, "PYTHONPATH"]}
    os.environ.update(RAY_ENV)
    # the workers import ray_cases / bitwise (tests/) and shardsafe (src/, or the installed package)
    path = [str(TESTS), str(TESTS.parent / "src"), *filter(None, (saved["PYTHONPATH"] or "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)
    temp = tempfile.mkdtemp(prefix="ssray")  # short: Ray's socket paths live under it
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp, _node_ip_address="127.0.0.1",
             log_to_driver=bool(os.environ.get("SHARDSAFE_RAY_LOGS")), logging_level="ERROR")
    try:
        yield
    finally:
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        deadline = time.monotonic() + 30
        left = []
        while time.monotonic() < deadline:
            left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
                    and p.status() != psutil.STATUS_ZOMBIE]
            if not left:
                break
            time.sleep(0.2)
        for p in left:  # only processes this fixture's cluster started
            p.send_signal(signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        assert not left, f"processes left after ray.shutdown(): {[(p.pid, p.name()) for p in left]}"


def fit(name: str, storage: str, workers: int, tmp: Path, *, fs: Any = None, checkpoint_config: Any = None,
        failures: int = 0, **config: Any) -> Any:
    """One TorchTrainer run of ray_cases.train_loop; its Result."""
    cfg = {"name": name, "steps": STEPS, "interval": 4, "global_batch": GLOBAL_BATCH, "log": str(tmp / "log.jsonl"),
           "dumps": str(tmp), **config}
    trainer = TorchTrainer(
        ray_cases.train_loop, train_loop_config=cfg, scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=name, storage_path=storage, storage_filesystem=fs,
                             checkpoint_config=checkpoint_config or CheckpointConfig(),
                             failure_config=FailureConfig(max_failures=failures)))
    return trainer.fit()


def dumped(tmp: Path, name: str, kind: str, step: int) -> dict[str, Any]:
    return torch.load(tmp / f"{name}-{kind}-{step}.pt", weights_only=True)


def reported_steps(result: Any) -> list[int]:
    """The steps of the checkpoints Ray keeps, from their pointers."""
    return sorted(ss_ray.checkpoint_location(c)[1] for c, _ in result.best_checkpoints)


def data_steps(folder: str, options: dict[str, Any] | None = None) -> list[int]:
    """Committed shardsafe steps in a run's data folder."""
    with shardsafe.CheckpointManager(folder, checkpointer=shardsafe.Checkpointer(storage_options=options),
                                     load_only=True) as mgr:
        return mgr.steps()


def assert_restored_equals_saved(tmp: Path, saved_run: str, restored_run: str, step: int, location: str,
                                 options: dict[str, Any] | None = None) -> None:
    """The state a run restored (gathered to full tensors) is bitwise what the other run
    saved at ``step``, and what a plain load_full of the checkpoint gives."""
    saved = dumped(tmp, saved_run, "saved", step)
    restored = dumped(tmp, restored_run, "restored", step)
    assert_bitwise(saved, restored, f"{restored_run} restored vs {saved_run} saved")
    plain = shardsafe.load_full(location, storage_options=options)["train"]
    assert_bitwise(plain["model"], restored["model"], "load_full model")
    assert_bitwise(plain["optim"]["state"], restored["optim"]["state"], "load_full optimizer state")


def assert_continues(entries: list[dict[str, Any]], reference: dict[int, tuple[str, list[int]]], start: int,
                     *, exact: bool) -> None:
    """Steps after ``start``: the same global samples as the uninterrupted run, and its
    losses (bitwise when ``exact``, else to float rounding)."""
    got = ray_cases.losses(entries)
    assert set(range(start + 1, STEPS + 1)) <= set(got), sorted(got)
    for step in range(start + 1, STEPS + 1):
        loss, ids = got[step]
        ref_loss, ref_ids = reference[step]
        assert ids == ref_ids, f"step {step}: other samples than the uninterrupted run"
        if exact:
            assert loss == ref_loss, f"step {step}: loss {float.fromhex(loss)!r} vs {float.fromhex(ref_loss)!r}"
        else:
            assert float.fromhex(loss) == pytest.approx(float.fromhex(ref_loss), rel=1e-5, abs=1e-6), step


# ----------------------------------------------------------------------------- the reference run


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """The uninterrupted 2-worker run: saves at steps 2, 4, 6, 8 (incremental), Ray keeps
    2 by the lowest ``score`` (4 and 8: steps 2 and 6 are dropped)."""
    tmp = tmp_path_factory.mktemp("ray-ref")
    scores = {"2": 3.0, "4": 1.0, "6": 4.0, "8": 2.0}
    result = fit("reference", str(tmp / "storage"), 2, tmp, interval=2, incremental=True, scores=scores,
                 checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score",
                                                    checkpoint_score_order="min"))
    entries = ray_cases.read_log(str(tmp / "log.jsonl"), "reference")
    return {"tmp": tmp, "result": result, "entries": entries, "losses": ray_cases.losses(entries),
            "folder": str(tmp / "storage" / "reference" / ss_ray.DATA_FOLDER)}


def test_retention_follows_ray_incremental(reference) -> None:
    tmp, result, folder = reference["tmp"], reference["result"], reference["folder"]
    assert result.error is None
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    # Ray kept the two best scores; shardsafe's committed steps are exactly those
    assert reported_steps(result) == [4, 8]
    assert data_steps(folder) == [4, 8]
    assert ss_ray.checkpoint_location(result.checkpoint) == (f"{folder}/step-00000008", 8)
    # Ray deleted its pointer folders of steps 2 and 6 (it never saw the data)
    experiment = tmp / "storage" / "reference"
    assert sorted(p.name for p in experiment.glob("checkpoint_0*")) == ["checkpoint_00000004", "checkpoint_00000008"]
    refs: set[str] = set()
    for step in (4, 8):
        location = f"{folder}/step-{step:08d}"
        report = verify_checkpoint(location)
        assert report.ok, report
        refs |= {r.checkpoint for r in shardsafe.read_manifest(location).refs if r.checkpoint}
        assert_bitwise(dumped(tmp, "reference", "saved", step)["model"],
                       shardsafe.load_full(location)["train"]["model"], f"step {step}")
    # the frozen embedding was written once, at step 2: later saves refer to it, so step 2 is
    # retired (its referenced data files kept), not deleted; nothing refers to step 6 any more
    assert "step-00000002" in refs
    assert (Path(folder) / "step-00000002" / "retired.json").is_file()
    assert not (Path(folder) / "step-00000002" / "manifest.json").exists()
    assert not (Path(folder) / "step-00000006").exists() or "step-00000006" in refs
    assert not [p.name for p in Path(folder).iterdir() if p.name.startswith(".")]


# ----------------------------------------------------------------------------- other worker counts


def _resume(reference: dict[str, Any], tmp: Path, name: str, storage: str, workers: int, *, fs: Any = None,
            options: dict[str, Any] | None = None, **config: Any) -> None:
    """Save step 4 on 2 workers, run the same name again on ``workers`` to step 8."""
    extra = {"storage_options": options} if options else {}
    first = fit(name, storage, 2, tmp, fs=fs, steps=4, **extra, **config)
    assert first.error is None
    second = fit(name, storage, workers, tmp, fs=fs, **extra, **config)
    assert second.error is None
    entries = ray_cases.read_log(str(tmp / "log.jsonl"), name)
    starts = [e for e in entries if e.get("event") == "start"]
    assert [(s["world"], s["restored"]) for s in starts] == [(2, None), (workers, 4)]
    assert starts[1]["plain_load_difference"] == []  # every rank: bitwise what a plain shardsafe.load gives
    assert_restored_equals_saved(tmp, name, name, 4, starts[1]["location"], options)
    assert_continues(entries, reference["losses"], 4, exact=False)
    assert reported_steps(second) == [4, 8]


def test_resume_on_four_workers(reference, tmp_path: Path) -> None:
    _resume(reference, tmp_path, "grow", str(tmp_path / "storage"), 4)
    assert data_steps(str(tmp_path / "storage" / "grow" / ss_ray.DATA_FOLDER)) == [4, 8]


def _s3_fs(s3: Any) -> tuple[Any, str, dict[str, Any]]:
    import pyarrow.fs

    from s3_server import KEY, REGION

    server, bucket, options = s3
    fs = pyarrow.fs.S3FileSystem(access_key=KEY, secret_key=KEY, region=REGION, scheme="http",
                                 endpoint_override=server.endpoint.removeprefix("http://"))
    return fs, f"{bucket}/runs", options


def test_resume_on_one_worker_s3(reference, tmp_path: Path, s3) -> None:
    fs, storage, options = _s3_fs(s3)
    _resume(reference, tmp_path, "shrink", storage, 1, fs=fs, options=options)
    server, bucket, _ = s3
    keys = server.keys(bucket, "runs/shrink/")
    assert {k.split("/")[3] for k in keys if k.startswith("runs/shrink/shardsafe/")} == {"step-00000004",
                                                                                         "step-00000008"}
    assert "runs/shrink/checkpoint_00000004/shardsafe.json" in keys
    with shardsafe.Checkpointer(storage_options=options) as cp:
        for step in (4, 8):
            assert verify_checkpoint(f"s3://{bucket}/runs/shrink/shardsafe/step-{step:08d}", checkpointer=cp).ok


@pytest.mark.skipif(not FULL, reason="SHARDSAFE_RAY_FULL=1: 2 -> 1 on local storage, async saves")
def test_resume_on_one_worker_async(reference, tmp_path: Path) -> None:
    _resume(reference, tmp_path, "shrink-local", str(tmp_path / "storage"), 1, async_save=True)


@pytest.mark.skipif(not FULL, reason="SHARDSAFE_RAY_FULL=1: 2 -> 4 on S3")
def test_resume_on_four_workers_s3(reference, tmp_path: Path, s3) -> None:
    fs, storage, options = _s3_fs(s3)
    _resume(reference, tmp_path, "grow-s3", storage, 4, fs=fs, options=options, incremental=True)


# ----------------------------------------------------------------------------- a killed worker


@pytest.mark.parametrize("async_save", [True, pytest.param(False, marks=pytest.mark.skipif(
    not FULL, reason="SHARDSAFE_RAY_FULL=1: sync saves"))], ids=["async", "sync"])
def test_sigkill_worker_resumes_from_last_committed(reference, tmp_path: Path, async_save: bool) -> None:
    marker = tmp_path / "killed"
    result = fit("killed", str(tmp_path / "storage"), 2, tmp_path, failures=1, interval=2, kill_at=6,
                 kill_marker=str(marker), async_save=async_save)
    assert result.error is None
    assert marker.exists()  # rank 1 really died while step 6 was being saved
    entries = ray_cases.read_log(str(tmp_path / "log.jsonl"), "killed")
    starts = [e for e in entries if e.get("event") == "start"]
    # the restarted group got the last checkpoint Ray registered: step 4 (step 6 never committed)
    assert [s["restored"] for s in starts] == [None, 4]
    assert starts[1]["plain_load_difference"] == []
    assert_restored_equals_saved(tmp_path, "killed", "killed", 4, starts[1]["location"])
    assert_continues(entries, reference["losses"], 0, exact=True)  # same worker count: bitwise, every step
    folder = tmp_path / "storage" / "killed" / ss_ray.DATA_FOLDER
    assert reported_steps(result) == [2, 4, 6, 8] == data_steps(str(folder))
    for step in (2, 4, 6, 8):
        assert verify_checkpoint(folder / f"step-{step:08d}").ok
    assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no leftover of the torn save


# ----------------------------------------------------------------------------- without a cluster


def test_pointer_errors_name_the_file(tmp_path: Path) -> None:
    import pyarrow.fs

    fs = pyarrow.fs.LocalFileSystem()
    (tmp_path / "run" / "checkpoint_00000001").mkdir(parents=True)
    ckpt = ray.train.Checkpoint(path=str(tmp_path / "run" / "checkpoint_00000001"), filesystem=fs)
    with pytest.raises(shardsafe.CheckpointError, match="has no shardsafe.json"):
        ss_ray.checkpoint_location(ckpt)
    (tmp_path / "run" / "checkpoint_00000001" / "shardsafe.json").write_text('{"format": "x"}')
    with pytest.raises(shardsafe.CorruptCheckpointError, match="checkpoint_00000001/shardsafe.json"):
        ss_ray.checkpoint_location(ckpt)
    (tmp_path / "run" / "checkpoint_00000001" / "shardsafe.json").write_text(
        '{"format": "shardsafe-ray", "version": 1, "step": 1, "checkpoint": "../../etc"}')
    with pytest.raises(shardsafe.CorruptCheckpointError, match="outside its experiment folder"):
        ss_ray.checkpoint_location(ckpt)
    (tmp_path / "run" / "checkpoint_00000001" / "shardsafe.json").write_text(
        '{"format": "shardsafe-ray", "version": 1, "step": 1, "checkpoint": "shardsafe/step-00000001"}')
    assert ss_ray.checkpoint_location(ckpt) == (str(tmp_path / "run" / "shardsafe" / "step-00000001"), 1)
    with pytest.raises(shardsafe.CheckpointError, match="'gcs'"):
        ss_ray.storage_url(type("GcsFileSystem", (), {"type_name": "gcs"})(), "bucket/x")
    assert ss_ray.storage_url(type("S3", (), {"type_name": "s3"})(), "bucket/x") == "s3://bucket/x"
    assert "ray.train" in sys.modules
