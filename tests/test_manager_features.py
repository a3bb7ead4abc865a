"""CheckpointManager: keep_best retention by a reported metric (across restarts),
enable=False / load_only, the torchtitan-style first-step save, and config parsing."""

from __future__ import annotations

import pytest
import torch

import shardsafe
from shardsafe import CheckpointConfig, CheckpointManager
from shardsafe.manager import METRIC_KEY, TORCHTITAN_ONLY


def state(step: int) -> dict:
    return {"w": torch.full((4,), float(step)), "step": step}


def saved_steps(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ----------------------------------------------------------------------------- keep_best


def test_keep_best_keeps_best_k_alongside_keep_last(tmp_path):
    losses = {1: 5.0, 2: 1.0, 3: 4.0, 4: 2.0, 5: 6.0, 6: 7.0, 7: 8.0}
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=2, keep_best=2, metric="val_loss", mode="min")
    for step, loss in losses.items():
        assert mgr.maybe_save(step, state(step), metric=loss)
    assert mgr.steps() == [2, 4, 6, 7], "best two (2, 4) and last two (6, 7)"
    assert mgr.best_steps() == [2, 4]
    assert mgr.metric(2) == 1.0
    stored = shardsafe.load_full(mgr.path(2), keys=METRIC_KEY)[METRIC_KEY]
    assert stored == {"name": "val_loss", "value": 1.0}, "a plain value under the documented key"
    dest = {"w": torch.zeros(4), "step": 0}
    assert mgr.load(dest) == 7 and dest["step"] == 7, "loads ignore the metric key"
    mgr.close()


def test_keep_best_survives_a_restart(tmp_path):
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=1, keep_best=2, metric="acc", mode="max")
    for step, acc in {1: 0.5, 2: 0.9, 3: 0.7}.items():
        mgr.save(step, state(step), metric=acc)
    assert mgr.steps() == [2, 3]
    mgr.close()

    # a new process: the ranking comes from the checkpoints themselves
    mgr = CheckpointManager(tmp_path, interval=1, keep_last=1, keep_best=2, metric="acc", mode="max",
                            async_mode="async")
    assert mgr.metric(2) == 0.9 and mgr.metric(3) == 0.7
    mgr.save(4, state(4), metric=0.8)
    mgr.save(5, state(5), metric=0.1)
    mgr.wait()
    assert mgr.steps() == [2, 4, 5], "best two are 2 (0.9) and 4 (0.8); 5 is the newest"
    mgr.save(6, state(6), metric=0.95)
    mgr.wait()
    assert mgr.steps() == [2, 6], "6 is both the newest and the best"
    mgr.close()


def test_keep_best_alone_and_steps_without_metric(tmp_path):
    mgr = CheckpointManager(tmp_path, interval=1, keep_best=1)
    mgr.save(1, state(1), metric=3.0)
    mgr.save(2, state(2))  # no metric: never a best one, kept only while newest
    mgr.save(3, state(3), metric=float("nan"))  # NaN never ranks
    mgr.save(4, state(4), metric=1.0)
    assert mgr.steps() == [4]
    mgr.save(5, state(5), metric=2.0)
    assert mgr.steps() == [4, 5]
    assert mgr.metric(2) is None and mgr.best_steps() == [4]
    mgr.close()


def test_keep_best_ignores_metrics_of_another_name(tmp_path):
    a = CheckpointManager(tmp_path, interval=1, keep_best=5, metric="loss")
    a.save(1, state(1), metric=0.1)
    a.close()
    b = CheckpointManager(tmp_path, interval=1, keep_best=1, metric="bleu", mode="max")
    assert b.metric(1) is None
    b.save(2, state(2), metric=30.0)
    b.save(3, state(3), metric=20.0)
    assert b.steps() == [2, 3], "step 1 (a 'loss' metric) is not ranked by 'bleu'"
    b.close()


def test_metric_key_collision_and_bad_settings(tmp_path):
    mgr = CheckpointManager(tmp_path, interval=1)
    with pytest.raises(ValueError, match=METRIC_KEY):
        mgr.save(1, {METRIC_KEY: 1, "x": torch.zeros(1)}, metric=1.0)
    mgr.close()
    with pytest.raises(ValueError, match="mode"):
        CheckpointManager(tmp_path, mode="lowest")
    with pytest.raises(ValueError, match="keep_best"):
        CheckpointManager(tmp_path, keep_best=0)


def test_keep_best_from_config(tmp_path):
    cfg = CheckpointConfig.from_dict({"folder": str(tmp_path), "interval": 1, "keep_latest_k": 1, "keep_best": 1,
                                      "metric": "loss"})
    mgr = CheckpointManager.from_config(cfg)
    for step, loss in {1: 0.3, 2: 0.5, 3: 0.4}.items():
        mgr.maybe_save(step, state(step), metric=loss)
    assert mgr.steps() == [1, 3]
    mgr.close()


# ----------------------------------------------------------------------------- enable / load_only


def test_enable_false_creates_and_saves_nothing(tmp_path):
    folder = tmp_path / "ckpt"
    mgr = CheckpointManager(folder, interval=1, enable=False, keep_last=1)
    assert not folder.exists()
    assert mgr.should_save(1, force=True) is False
    assert mgr.maybe_save(1, state(1), force=True) is False
    assert mgr.save(2, state(2)) is None
    assert mgr.load({"w": torch.zeros(4), "step": 0}) is None
    mgr.close()
    assert not folder.exists()

    mgr = CheckpointManager.from_config({"folder": str(folder), "enable": False, "interval": 1})
    mgr.maybe_save(1, state(1))
    mgr.close()
    assert not folder.exists(), "CheckpointConfig(enable=False) too"


def test_enable_false_leaves_an_existing_folder_alone(tmp_path):
    with CheckpointManager(tmp_path, interval=1) as mgr:
        mgr.save(1, state(1))
    leftover = tmp_path / ".step-00000002.shardsafe-tmp-abc"
    leftover.mkdir()
    with CheckpointManager(tmp_path, interval=1, enable=False) as mgr:
        mgr.save(2, state(2))
    assert saved_steps(tmp_path) == [".step-00000002.shardsafe-tmp-abc", "step-00000001"]


def test_load_only_loads_but_saves_nothing(tmp_path):
    with CheckpointManager(tmp_path, interval=1) as mgr:
        mgr.save(3, state(3))
    mgr = CheckpointManager.from_config({"folder": str(tmp_path), "interval": 1, "load_only": True})
    dest = {"w": torch.zeros(4), "step": 0}
    assert mgr.load(dest) == 3 and dest["step"] == 3
    assert mgr.maybe_save(4, state(4)) is False and mgr.save(5, state(5)) is None
    assert mgr.steps() == [3]
    mgr.close()
    missing = tmp_path / "none"
    CheckpointManager(missing, load_only=True).close()
    assert not missing.exists()


def test_enable_first_step_checkpoint(tmp_path):
    mgr = CheckpointManager.from_config({"folder": str(tmp_path), "interval": 5, "enable_first_step_checkpoint": True})
    saved = [s for s in range(1, 11) if mgr.maybe_save(s, state(s))]
    assert saved == [1, 5, 10]
    mgr.close()


# ----------------------------------------------------------------------------- config


TORCHTITAN_030 = {
    "enable": True, "folder": "checkpoint", "interval": 500, "initial_load_path": None,
    "initial_load_model_only": True, "initial_load_in_hf": False, "initial_load_in_hf_quantized": False,
    "last_save_model_only": True, "last_save_in_hf": False, "export_dtype": "float32", "keep_latest_k": 10,
    "load_step": -1, "exclude_from_loading": [], "enable_first_step_checkpoint": False,
    "create_seed_checkpoint": False, "load_only": False, "async_mode": "disabled",
}


def test_from_dict_accepts_every_torchtitan_key():
    cfg = CheckpointConfig.from_dict(TORCHTITAN_030)
    assert (cfg.keep_last, cfg.load_step, cfg.export_dtype, cfg.initial_load_model_only) == (10, None, "float32", True)
    cfg = CheckpointConfig.from_dict({**TORCHTITAN_030, "load_only": True, "enable_first_step_checkpoint": True,
                                      "initial_load_path": "/ckpt/step-10", "last_save_in_hf": True})
    assert cfg.load_only and cfg.enable_first_step_checkpoint and cfg.initial_load_path == "/ckpt/step-10"


def test_from_dict_error_lists_names_and_aliases():
    with pytest.raises(ValueError) as err:
        CheckpointConfig.from_dict({"keep_lastest_k": 3})
    text = str(err.value)
    assert "'keep_lastest_k'" in text
    for name in ("keep_last", "keep_best", "load_only", "initial_load_in_hf", "async_mode"):
        assert name in text
    assert "keep_latest_k (= keep_last)" in text and "enable_checkpoint (= enable)" in text


@pytest.mark.parametrize("name", TORCHTITAN_ONLY)
def test_plain_manager_refuses_torchtitan_only_settings_by_name(tmp_path, name):
    value = "/some/checkpoint" if name == "initial_load_path" else True
    with pytest.raises(ValueError, match=name):
        CheckpointManager.from_config({"folder": str(tmp_path / "m"), name: value})
    assert not (tmp_path / "m").exists()
