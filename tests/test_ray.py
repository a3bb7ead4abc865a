"""The Ray Train integration on a real local Ray cluster (loopback, CPU, gloo workers).

One cluster for the module (``ray.init(num_cpus=4, include_dashboard=False)``), stopped at
the end with every process it started checked gone. Each test runs ``TorchTrainer`` with the
FSDP2 loop of tests/ray_cases.py and checks bitwise outcomes:

- an uninterrupted 2-worker run with its storage on the moto S3 server (incremental saves,
  ``num_to_keep=2`` by a score) is the reference: Ray's kept checkpoints are exactly
  shardsafe's, every one verifies and loads bitwise equal to the state saved, and a dropped
  one that kept ones refer to is retired;
- 2 -> 4 and 2 -> 1 workers: new runs restore step 4 of the reference run
  (``restore(checkpoint=...)``, Ray 2.x's replacement of ``resume_from_checkpoint``) and
  save to local storage (sync on 4 workers, async on 1). The state restored is bitwise the
  state saved and a plain ``shardsafe.load``, the global sample order continues exactly, the
  losses as in the uninterrupted run (to float rounding: the reduction order differs on
  another worker count);
- SIGKILL of one worker while a step is saved (async saves, ``max_failures=1``): the
  restarted group resumes from the last committed step and its losses are bitwise those of
  the uninterrupted run.

``SHARDSAFE_RAY_FULL=1`` adds the variants left out of the default run: the same run
started again under its name on 1 and 4 workers (``get_checkpoint()`` on another worker
count), and the kill with sync saves.
"""

from __future__ import annotations

import contextlib
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

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900), pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _descendants(roots: list[Any]) -> list[Any]:
    """The processes under ``roots`` (psutil), the roots included, that are still running."""
    import psutil

    out = []
    for root in roots:
        try:
            out += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    return out


def _running(p: Any) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster on loopback for the module; afterwards none of its processes is left."""
    import psutil

    saved = {k: os.environ.get(k) for k in [*RAY_ENV, "PYTHONPATH"]}
    os.environ.update(RAY_ENV)
    # the workers import ray_cases / bitwise (tests/) and shardsafe (src/, or the installed package)
    path = [str(TESTS), str(TESTS.parent / "src"), *filter(None, (saved["PYTHONPATH"] or "").split(os.pathsep))]
    os.environ["PYTHONPATH"] = os.pathsep.join(path)
    temp = tempfile.mkdtemp(prefix="ssray")  # short: Ray's socket paths live under it
    before = {p.pid for p in psutil.Process().children()}
    # a Ray process whose GCS is gone retries for gcs_rpc_server_reconnect_timeout_s (60 s by default)
    # before it exits on its own: 5 s here, so that shutdown leaves nothing behind within the wait below
    ray.init(num_cpus=4, include_dashboard=False, _temp_dir=temp, _node_ip_address="127.0.0.1",
             log_to_driver=bool(os.environ.get("SHARDSAFE_RAY_LOGS")), logging_level="ERROR",
             _system_config={"gcs_rpc_server_reconnect_timeout_s": 5})
    # what ray.init started (GCS, raylet, agents ...); the workers are their children
    roots = [p for p in psutil.Process().children() if p.pid not in before]
    try:
        yield
    finally:
        started = _descendants(roots)  # before shutdown: orphaned workers would no longer be found under us
        ray.shutdown()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        deadline = time.monotonic() + 30
        left = started
        while time.monotonic() < deadline:
            left = [p for p in started if _running(p)]
            if not left:
                break
            time.sleep(0.2)
        names = [(p.pid, p.name()) for p in left if _running(p)]
        for p in left:  # only processes of this fixture's cluster
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)
        assert not names, f"processes of the Ray cluster left after ray.shutdown(): {names}"


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
    with shardsafe.Checkpointer(storage_options=options) as cp, \
            shardsafe.CheckpointManager(folder, checkpointer=cp, load_only=True) as mgr:
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


def _s3_fs(server: Any, bucket: str) -> tuple[Any, str, dict[str, Any]]:
    """Ray's pyarrow filesystem for the moto server, the storage path, shardsafe's options."""
    import pyarrow.fs

    from s3_server import KEY, REGION

    fs = pyarrow.fs.S3FileSystem(access_key=KEY, secret_key=KEY, region=REGION, scheme="http",
                                 endpoint_override=server.endpoint.removeprefix("http://"))
    options = {"endpoint": server.endpoint, "key": KEY, "secret": KEY, "region": REGION, "retry_backoff": 0.01,
               "max_backoff": 0.2}
    return fs, f"{bucket}/runs", options


@pytest.fixture(scope="module")
def reference(cluster, s3_server, tmp_path_factory):
    """The uninterrupted 2-worker run, its storage on the moto S3 server: saves at steps 2,
    4, 6, 8 (incremental, zstd-compressed), Ray keeps 2 by the lowest ``score`` (4 and 8; 2 and 6 dropped)."""
    tmp = tmp_path_factory.mktemp("ray-ref")
    bucket = s3_server.new_bucket()
    fs, storage, options = _s3_fs(s3_server, bucket)
    scores = {"2": 3.0, "4": 1.0, "6": 4.0, "8": 2.0}
    result = fit("reference", storage, 2, tmp, fs=fs, interval=2, incremental=True, scores=scores,
                 storage_options=options, compression="zstd",
                 checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score",
                                                    checkpoint_score_order="min"))
    entries = ray_cases.read_log(str(tmp / "log.jsonl"), "reference")
    yield {"tmp": tmp, "result": result, "entries": entries, "losses": ray_cases.losses(entries),
           "server": s3_server, "bucket": bucket, "options": options,
           "folder": f"s3://{bucket}/runs/reference/{ss_ray.DATA_FOLDER}"}
    s3_server.drop_bucket(bucket)


def test_retention_follows_ray_incremental_s3(reference) -> None:
    tmp, result, folder, options = reference["tmp"], reference["result"], reference["folder"], reference["options"]
    server, bucket = reference["server"], reference["bucket"]
    assert result.error is None
    assert sorted(reference["losses"]) == list(range(1, STEPS + 1))
    # Ray kept the two best scores; shardsafe's committed steps are exactly those
    assert reported_steps(result) == [4, 8]
    assert data_steps(folder, options) == [4, 8]
    assert ss_ray.checkpoint_location(result.checkpoint) == (f"{folder}/step-00000008", 8)
    keys = server.keys(bucket, "runs/reference/")
    # Ray deleted its pointer folders of steps 2 and 6 (it never saw the data)
    assert sorted({k.split("/")[2] for k in keys if k.startswith("runs/reference/checkpoint_0")}) == [
        "checkpoint_00000004", "checkpoint_00000008"]
    refs: set[str] = set()
    with shardsafe.Checkpointer(storage_options=options) as cp:
        for step in (4, 8):
            location = f"{folder}/step-{step:08d}"
            report = verify_checkpoint(location, checkpointer=cp)
            assert report.ok, report
            manifest = cp.read_manifest(location)
            assert manifest.requires == ["compression"], manifest.requires  # compression="zstd" reached the saves
            refs |= {r.checkpoint for r in manifest.refs if r.checkpoint}
            saved, loaded = dumped(tmp, "reference", "saved", step), cp.load_full(location)["train"]
            assert_bitwise(saved["model"], loaded["model"], f"step {step} model")
            assert_bitwise(saved["optim"]["state"], loaded["optim"]["state"], f"step {step} optimizer")
    # the frozen embedding was written once, at step 2, and later saves refer to it: step 2 is
    # retired (its referenced data files kept, its manifest gone), not deleted
    assert "step-00000002" in refs
    step2 = {k.rsplit("/", 1)[1] for k in keys if k.startswith("runs/reference/shardsafe/step-00000002/")}
    assert "retired.json" in step2 and "manifest.json" not in step2
    step6 = {k for k in keys if k.startswith("runs/reference/shardsafe/step-00000006/")}
    assert not step6 or "step-00000006" in refs
    assert not server.uploads(bucket)


# ----------------------------------------------------------------------------- other worker counts


def _check_resumed(reference: dict[str, Any], tmp: Path, saved_run: str, name: str, workers: int, first_world: int,
                   options: dict[str, Any] | None) -> None:
    """Run ``name`` restored step 4 of ``saved_run`` on ``workers``: bitwise what was saved
    and what a plain shardsafe.load gives, then the same samples and losses as the
    uninterrupted run."""
    entries = ray_cases.read_log(str(tmp / "log.jsonl"), name)
    starts = [e for e in entries if e.get("event") == "start"]
    assert [(s["world"], s["restored"]) for s in starts][-1] == (workers, 4)
    assert starts[-1]["plain_load_difference"] == []  # every rank: bitwise what a plain shardsafe.load gives
    assert shardsafe.read_manifest(starts[-1]["location"], storage_options=options).world_size == first_world
    assert_restored_equals_saved(tmp, saved_run, name, 4, starts[-1]["location"], options)
    assert_continues(entries, reference["losses"], 4, exact=False)


@pytest.mark.parametrize("workers,async_save", [(4, False), (1, True)], ids=["2to4-sync", "2to1-async"])
def test_new_run_resumes_on_other_worker_count(reference, tmp_path: Path, workers: int, async_save: bool) -> None:
    """A new run on ``workers`` from step 4 of the reference run on S3 (restore(checkpoint=...):
    Ray 2.x's replacement of resume_from_checkpoint), saving to local storage."""
    step4 = next(c for c, m in reference["result"].best_checkpoints if m["step"] == 4)
    tmp = reference["tmp"]
    name = f"resume-{workers}"
    result = fit(name, str(tmp_path / "storage"), workers, tmp, resume_from=step4, async_save=async_save,
                 storage_options=reference["options"])
    assert result.error is None
    _check_resumed(reference, tmp, "reference", name, workers, 2, reference["options"])
    assert reported_steps(result) == [8]  # this run's own checkpoints: step 4 is the reference run's
    assert data_steps(str(tmp_path / "storage" / name / ss_ray.DATA_FOLDER)) == [8]


@pytest.mark.skipif(not FULL, reason="SHARDSAFE_RAY_FULL=1: the same run started again on 1 and 4 workers")
@pytest.mark.parametrize("workers", [1, 4])
def test_same_run_resumes_on_other_worker_count(reference, tmp_path: Path, workers: int) -> None:
    """The run started again under its name on ``workers``: get_checkpoint() -> step 4."""
    storage = str(tmp_path / "storage")
    assert fit("local", storage, 2, tmp_path, steps=4).error is None
    assert fit("local", storage, workers, tmp_path).error is None
    starts = [(s["world"], s["restored"]) for s in ray_cases.read_log(str(tmp_path / "log.jsonl"), "local")
              if s.get("event") == "start"]
    assert starts == [(2, None), (workers, 4)]
    _check_resumed(reference, tmp_path, "local", "local", workers, 2, None)
    assert data_steps(str(tmp_path / "storage" / "local" / ss_ray.DATA_FOLDER)) == [4, 8]


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


def test_workers_that_read_no_pointer_are_named(tmp_path: Path, pg_pool) -> None:
    folder = tmp_path / "run" / "checkpoint_00000002"
    folder.mkdir(parents=True)
    (folder / "shardsafe.json").write_text(
        '{"format": "shardsafe-ray", "version": 1, "step": 2, "checkpoint": "shardsafe/step-00000002"}')
    messages = pg_pool(2).run(ray_cases.pointer_disagreement, str(tmp_path))
    for message in messages:  # every rank raised, naming rank 1 and the missing file
        assert "rank 1: CheckpointError" in message and "has no shardsafe.json" in message, message
        assert "rank 0" not in message


def test_options_are_fixed_and_steps_increase() -> None:
    session = ss_ray.RayCheckpointing(storage_options={"region": "us-east-1"})
    try:
        session.configure(storage_options={"region": "us-east-1"}, async_save=True, incremental=True)
        assert session.options["async_save"] and session.options["incremental"]
        with pytest.raises(ValueError, match="storage_options="):
            session.configure(storage_options={"region": "eu-west-1"})
        with pytest.raises(TypeError, match="'asynch'"):
            session.configure(asynch=True)
        for bad in (-1, "3", 2.0):
            with pytest.raises(ValueError, match="non-negative int"):
                session.report({}, {}, step=bad)
        session.last_step = 4  # as after restoring step 4
        with pytest.raises(ValueError, match="step 4 is not after step 4"):
            session.report({}, {}, step=4)
    finally:
        session.close()
    with pytest.raises(shardsafe.CheckpointError, match="closed"):
        session.manager  # noqa: B018
