"""Exact resume: a run interrupted, checkpointed with a TrainState and resumed continues
exactly as the uninterrupted run (bitwise on the same world size; the same global sample
sequence and losses to 1e-5 on another world size).

The recipe and the multi-rank cases are in resume_cases.py. Single-process runs train and
save in this process (one intra-op thread) and resume in a fresh Python process (a script
written into tmp_path); multi-rank resumes run in the session's gloo worker pools with
freshly built objects (other initial weights) and reseeded RNG streams.
Tests run 4-rank cases first, then 2-rank cases, then one process, so each pool starts once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import resume_cases
import shardsafe
from bitwise import assert_bitwise
from shardsafe.data import ElasticSampler
from shardsafe.state import rng as rng_mod

TESTS_DIR = Path(__file__).resolve().parent

SCRIPT = """\
import sys
sys.path.insert(0, {tests!r})
import resume_cases

if __name__ == "__main__":
    resume_cases.single_main(sys.argv[1:])
"""


def run_fresh_process(tmp_path: Path, mode: str, cfg: dict, ckpt: Path) -> dict:
    """Run ``resume_cases.single_main(mode, ...)`` in a new Python process; its results."""
    script = tmp_path / "resume_script.py"
    if not script.exists():
        script.write_text(SCRIPT.format(tests=str(TESTS_DIR)))
    out = tmp_path / f"{mode}.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), mode, json.dumps(cfg), str(ckpt), str(out)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, f"{mode} process failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(out, weights_only=True)


@pytest.fixture
def keep_rng():
    """Give the test process its RNG streams back (a TrainState load reseeds them)."""
    saved = rng_mod.capture()
    yield
    rng_mod.restore(saved)


def _ids_by_step(records: list[dict]) -> dict[int, list[int]]:
    return {r["step"]: r["ids"] for r in records}


# ----------------------------------------------------------------------------- 4 ranks


def test_fsdp2_exact_resume_4_ranks(pg_pool, tmp_path):
    """FSDP2 on 4 ranks, dropout on: bitwise identical losses, LRs, sample ids, parameters,
    optimizer state and RNG streams after resuming with fresh objects."""
    cfg = resume_cases.config(dataset_len=48, global_batch=16, total=8, save_at=4)  # epochs of 3 steps
    out = pg_pool(4).run(resume_cases.exact_resume, "fsdp", cfg, str(tmp_path / "ckpt"), timeout=240)
    r0 = out[0]
    assert r0["straight"] == r0["resumed"]
    for k in ("param_group_lr", "last_epoch"):
        assert r0["saved_lr"][k] == r0["after_lr"][k], k
    assert r0["after_lr"]["last_epoch"] == 4
    # every rank had its own torch RNG stream at the save, and got that one back (checked in the case)
    assert len({o["rng_digest"] for o in out}) == 4
    # a global batch is 16 distinct ids, ranks' parts in rank order
    assert all(len(set(r["ids"])) == 16 for r in r0["straight"])


@pytest.fixture(scope="module")
def elastic_ckpt(pg_pool, tmp_path_factory):
    """FSDP2 on 4 ranks, no dropout, 14 steps with a checkpoint after step 6."""
    cfg = resume_cases.config(dataset_len=160, global_batch=16, micro_batch=4, dropout=0.0, total=14, save_at=6)
    path = tmp_path_factory.mktemp("elastic") / "ckpt"
    out = pg_pool(4).run(resume_cases.elastic_save, "fsdp", cfg, str(path), timeout=240)
    return cfg, path, out[0]


def test_fsdp2_saved_on_4_ranks(elastic_ckpt):
    cfg, path, r0 = elastic_ckpt
    m = shardsafe.read_manifest(path)
    assert m.world_size == 4
    assert len(r0["records"]) == cfg["total"]


# ----------------------------------------------------------------------------- 2 ranks


def test_fsdp2_resume_4_to_2_ranks(pg_pool, elastic_ckpt):
    """Resume the 4-rank FSDP2 checkpoint on 2 ranks: same global sample ids every later
    step, losses within 1e-5 relative, the LR schedule continues at the saved step, the
    global batch is kept by accumulating 2 micro-batches, RNG re-derived with one warning."""
    cfg, path, ref = elastic_ckpt
    out = pg_pool(2).run(resume_cases.elastic_resume, "fsdp", cfg, str(path), timeout=240)
    save_at, total = cfg["save_at"], cfg["total"]
    for rank, o in enumerate(out):
        assert o["rng_restored"] == "derived"
        assert len(o["warnings_first_load"]) == 1, o["warnings_first_load"]
        assert "saved on 4 ranks, resuming on 2" in o["warnings_first_load"][0]
        assert len(o["warnings_both_loads"]) == 1, "the re-derivation warning must be issued once"
        assert o["initial_seed_is_derived"], f"rank {rank}: torch seed is not derive_seed(base, step, rank)"
        assert o["counters"] == [save_at, 0, save_at * cfg["global_batch"]]
        assert o["sampler"]["consumed"] == save_at * cfg["global_batch"]
        # global batch kept: micro-batch 4 (as on 4 ranks) x 2 ranks x 2 accumulation steps
        assert (o["micro_batch"], o["accum"]) == (4, 2)
        assert o["view"]["last_epoch"] == save_at
        assert o["view"]["param_group_lr"] == ref["saved_view"]["param_group_lr"]

    got = out[0]["records"]
    want = ref["records"][save_at:]
    assert [r["step"] for r in got] == list(range(save_at + 1, total + 1))
    # the run crosses into epoch 1 (10 global batches per epoch) after the resume
    assert _ids_by_step(got) == _ids_by_step(want)
    assert [r["lr"] for r in got] == [r["lr"] for r in want]
    for g, w in zip(got, want):
        assert g["loss"] == pytest.approx(w["loss"], rel=1e-5), f"step {g['step']}: {g['loss']} vs {w['loss']}"
    # and every rank saw the same global sequence (ids are gathered on every rank)
    assert _ids_by_step(out[1]["records"]) == _ids_by_step(got)


def test_ddp_exact_resume_2_ranks(pg_pool, tmp_path):
    """DDP on 2 ranks, dropout on: bitwise identical resume with fresh objects."""
    cfg = resume_cases.config()
    out = pg_pool(2).run(resume_cases.exact_resume, "ddp", cfg, str(tmp_path / "ckpt"), timeout=240)
    r0 = out[0]
    assert r0["straight"] == r0["resumed"] and len(r0["straight"]) == cfg["total"]
    for k in ("param_group_lr", "last_epoch"):
        assert r0["saved_lr"][k] == r0["after_lr"][k], k
    assert out[0]["rng_digest"] != out[1]["rng_digest"]


@pytest.fixture(scope="module")
def cross_cfg():
    return resume_cases.config(dropout=0.1)


def test_ddp_state_loads_into_plain_model(pg_pool, tmp_path, cross_cfg, keep_rng):
    """Saved from DDP (live keys 'module.*') on 2 ranks, loaded into a plain one-process model."""
    path, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    keys = pg_pool(2).run(resume_cases.save_trained_state, "ddp", cross_cfg, 3, str(path), str(ref))[0]
    assert all(k.startswith("module.") for k in keys)
    saved_keys = shardsafe.read_manifest(path).tensors
    assert not any(".module." in k for k in saved_keys), sorted(saved_keys)
    got = resume_cases.load_trained_state(0, 1, "single", cross_cfg, str(path), str(ref))
    assert not any(k.startswith("module.") for k in got["keys"])
    assert got["rng_restored"] == "derived"


def test_plain_state_loads_into_ddp_model(pg_pool, tmp_path, cross_cfg, keep_rng):
    path, ref = tmp_path / "ckpt", tmp_path / "ref.pt"
    resume_cases.save_trained_state(0, 1, "single", cross_cfg, 3, str(path), str(ref))
    out = pg_pool(2).run(resume_cases.load_trained_state, "ddp", cross_cfg, str(path), str(ref))
    assert all(k.startswith("module.") for k in out[0]["keys"])
    assert out[0]["next_loss"] == out[1]["next_loss"]  # the global loss, same on both ranks


# ----------------------------------------------------------------------------- one process


def test_sequential_lr_last_lr_after_load(tmp_path, keep_rng):
    """After load, the scheduler reports the saved LR (get_last_lr) and its whole state."""
    cfg = resume_cases.config()
    run = resume_cases.build_run(cfg, "single", 0, 1, init_seed=0, rng_seed=100)
    resume_cases.train(run, cfg["warmup"] + 2)  # past the milestone: the cosine scheduler is current
    shardsafe.save({"train": run.state}, tmp_path / "ckpt")

    control = resume_cases.build_run(cfg, "single", 0, 1, init_seed=7, rng_seed=999)
    control.sched.load_state_dict(run.sched.state_dict())  # plain torch round trip: correct
    assert control.sched.get_last_lr() == run.sched.get_last_lr()

    fresh = resume_cases.build_run(cfg, "single", 0, 1, init_seed=7, rng_seed=999)
    shardsafe.load({"train": fresh.state}, tmp_path / "ckpt")
    assert fresh.opt.param_groups[0]["lr"] == run.opt.param_groups[0]["lr"]
    assert fresh.sched.get_last_lr() == run.sched.get_last_lr()
    assert fresh.sched.state_dict() == run.sched.state_dict()


@pytest.mark.parametrize(
    "variant",
    [
        pytest.param({}, id="dropout-workers0"),
        pytest.param({"workers": 2, "scaler": True}, id="workers2-gradscaler"),
    ],
)
def test_single_process_exact_resume_in_fresh_process(tmp_path, variant, keep_rng):
    """20 steps straight and 10 steps + save (CheckpointManager) in this process, then a
    fresh process that resumes from the latest checkpoint and runs 10 more: every per-step loss, LR and
    sample id, and the final parameters, optimizer, scheduler, scaler, sampler state and
    RNG stream are bitwise equal. The second variant loads through a DataLoader with 2
    workers (prefetching past the saved position) and a GradScaler("cpu")."""
    cfg = resume_cases.config(**variant)
    ckpt = tmp_path / "ckpts"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the fresh process
    try:
        first = resume_cases.single_first(cfg, str(ckpt))
    finally:
        torch.set_num_threads(threads)
    resumed = run_fresh_process(tmp_path, "resume", cfg, ckpt)

    save_at, total, g = cfg["save_at"], cfg["total"], cfg["global_batch"]
    saved = first["saved"]
    assert saved["steps_on_disk"] == [save_at]  # interval 5, keep_last=1
    assert resumed["loaded_step"] == save_at
    after = resumed["after_load"]
    assert after["rng_restored"] == "exact"
    assert after["counters"] == [save_at, 0, save_at * g]
    assert after["extra"] == {"recipe": "resume_cases"}

    # the LR: a fresh scheduler starts at warmup; after load it shows the saved LR
    assert resumed["before"]["last_epoch"] == 0 and resumed["before"] != saved
    for k in ("param_group_lr", "last_epoch"):  # get_last_lr(): test_sequential_lr_last_lr_after_load
        assert after[k] == saved[k], k
    # the data position is what the loop took (10 global batches), not what workers prefetched
    assert saved["sampler"]["consumed"] == save_at * g and after["sampler"] == saved["sampler"]
    if cfg["scaler"]:
        assert after["scaler"] == saved["scaler"]
        assert saved["scaler"]["scale"] > 65536.0 and saved["scaler"]["_growth_tracker"] == save_at % 3

    straight = first["straight"]
    assert len(straight) == total and [r["step"] for r in straight] == list(range(1, total + 1))
    resume_cases.assert_records_equal(straight, first["first"] + resumed["resumed"], "single")
    # the schedule continues: LRs after the resume are the uninterrupted ones, and they move
    lrs = [r["lr"] for r in straight]
    assert len(set(lrs[save_at:])) == total - save_at
    # the run crosses an epoch boundary after the resume (12 global batches per epoch)
    assert resumed["final"]["counters"]["epoch"] == 1
    assert_bitwise(first["final"], resumed["final"], "final")


def test_resume_from_a_checkpoint_at_the_end_of_an_epoch(tmp_path, keep_rng):
    """Saved after the last global batch of epoch 0 (consumed == epoch end): the resumed
    loop starts epoch 1 in its own order and stays bitwise equal (fresh objects, this process)."""
    cfg = resume_cases.config(total=16, save_at=12)  # 96 samples / 8 = 12 global batches per epoch
    out = resume_cases.exact_resume(0, 1, "single", cfg, str(tmp_path / "ckpt"))
    epoch0 = {i for r in out["straight"][:12] for i in r["ids"]}
    assert epoch0 == set(range(96))  # the whole epoch, each sample once
    order1 = ElasticSampler(96, 8, seed=cfg["data_seed"]).global_order(1).tolist()
    assert [i for r in out["straight"][12:] for i in r["ids"]] == order1[:32]  # epoch 1's own order
    assert out["straight"] == out["resumed"]


def test_compiled_and_plain_models_load_into_each_other(tmp_path, keep_rng):
    """A torch.compile'd model (live keys '_orig_mod.*') and a plain one share checkpoints.

    Compiled with backend="eager": the '_orig_mod.' prefix comes from the OptimizedModule
    wrapper whatever the backend, and inductor needs ~95 s to compile this tiny model on
    the 2-core test machine. SHARDSAFE_TEST_INDUCTOR=1 uses inductor instead."""
    if not hasattr(torch, "compile"):
        pytest.skip("torch.compile is not available")
    backend = "inductor" if os.environ.get("SHARDSAFE_TEST_INDUCTOR") == "1" else "eager"
    cfg = resume_cases.config(backend=backend)
    compiled_path, compiled_ref = tmp_path / "compiled", tmp_path / "compiled.pt"
    keys = resume_cases.save_trained_state(0, 1, "compiled", cfg, 2, str(compiled_path), str(compiled_ref))
    assert all(k.startswith("_orig_mod.") for k in keys)
    assert not any("_orig_mod" in k for k in shardsafe.read_manifest(compiled_path).tensors)
    got = resume_cases.load_trained_state(0, 1, "single", cfg, str(compiled_path), str(compiled_ref))
    assert not any(k.startswith("_orig_mod.") for k in got["keys"])
    assert got["rng_restored"] == "exact"

    plain_path, plain_ref = tmp_path / "plain", tmp_path / "plain.pt"
    resume_cases.save_trained_state(0, 1, "single", cfg, 2, str(plain_path), str(plain_ref))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = resume_cases.load_trained_state(0, 1, "compiled", cfg, str(plain_path), str(plain_ref))
    assert all(k.startswith("_orig_mod.") for k in got["keys"])
