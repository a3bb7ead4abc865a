"""Loading and errors that help (issue 11, parts 4 and 5): dtype casts as an explicit
choice, exclusions that cover missing keys, errors that suggest what is there, warnings
that point at the user's line."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardsafe


def test_cast_dtype_is_an_explicit_choice(tmp_path):
    model = torch.nn.Linear(8, 3)
    shardsafe.save({"model": model}, tmp_path / "ck")
    bf16 = torch.nn.Linear(8, 3).to(torch.bfloat16)
    before = bf16.weight.detach().clone()
    with pytest.raises(shardsafe.DtypeMismatchError, match="saved dtype float32, destination dtype bfloat16 "
                                                           r"\(pass cast_dtype=True"):
        shardsafe.load({"model": bf16}, tmp_path / "ck")
    assert torch.equal(bf16.weight, before)
    shardsafe.load({"model": bf16}, tmp_path / "ck", cast_dtype=True)
    assert torch.equal(bf16.weight, model.weight.detach().to(torch.bfloat16))
    assert torch.equal(bf16.bias, model.bias.detach().to(torch.bfloat16))


def test_cast_dtype_through_train_state(tmp_path):
    model = torch.nn.Linear(4, 4)
    shardsafe.save({"train": shardsafe.TrainState(model)}, tmp_path / "ck")
    half = torch.nn.Linear(4, 4).half()
    state = shardsafe.TrainState(half)
    shardsafe.load({"train": state}, tmp_path / "ck", cast_dtype=True)
    assert torch.equal(half.weight, model.weight.detach().half())


def test_exclude_covers_keys_the_checkpoint_lacks(tmp_path):
    shardsafe.save({"model": {"w": torch.ones(3)}}, tmp_path / "ck")
    dest = {"model": {"w": torch.zeros(3)}, "data": {"pos": 5}}
    with pytest.raises(shardsafe.MissingKeysError, match="key 'data' is not in the checkpoint"):
        shardsafe.load(dest, tmp_path / "ck")
    shardsafe.load(dest, tmp_path / "ck", exclude=["data"])
    assert torch.equal(dest["model"]["w"], torch.ones(3)) and dest["data"] == {"pos": 5}


def test_missing_key_error_lists_the_closest_saved_keys(tmp_path):
    shardsafe.save({"model": {"layer.weight": torch.ones(2), "layer.bias": torch.ones(2)}, "step": 1},
                   tmp_path / "ck")
    with pytest.raises(shardsafe.MissingKeysError, match=r"key 'modle' .*top level the checkpoint has 'model'"):
        shardsafe.load({"modle": {}}, tmp_path / "ck")
    with pytest.raises(shardsafe.MissingKeysError, match=r"under 'model' the checkpoint has 'layer.weight'"):
        shardsafe.load({"model": {"layer.wieght": torch.zeros(2)}}, tmp_path / "ck")


def test_manager_and_dcp_folders_get_a_hint(tmp_path):
    with shardsafe.CheckpointManager(tmp_path / "run", interval=1) as mgr:
        mgr.save(7, {"w": torch.ones(1)})
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="folder of step checkpoints .*step-00000007"):
        shardsafe.load_full(tmp_path / "run")
    dcp = tmp_path / "dcp"
    dcp.mkdir()
    (dcp / ".metadata").write_bytes(b"not read")
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="shardsafe import .* --trust-pickle"):
        shardsafe.read_manifest(dcp)


def test_rng_warning_points_at_the_users_line(tmp_path):
    """The "RNG re-derived" warning (raised deep inside load) is attributed to this file."""
    model = torch.nn.Linear(2, 2)
    shardsafe.save({"train": shardsafe.TrainState(model)}, tmp_path / "ck")
    sd_path = tmp_path / "ck" / "manifest.json"
    assert sd_path.exists()

    class OtherWorld(shardsafe.TrainState):  # pretends the checkpoint came from 4 ranks
        def load_state_dict(self, sd):
            sd = dict(sd)
            sd["world_size"] = 4
            super().load_state_dict(sd)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardsafe.load({"train": OtherWorld(torch.nn.Linear(2, 2))}, tmp_path / "ck")
    rng = [w for w in caught if "re-derived" in str(w.message)]
    assert rng and rng[0].filename == __file__, [(w.filename, w.lineno) for w in rng]


def test_manager_load_casts_when_configured(tmp_path):
    model = torch.nn.Linear(4, 2)
    with shardsafe.CheckpointManager(tmp_path, interval=1) as mgr:
        mgr.save(1, {"train": shardsafe.TrainState(model)})
    half = torch.nn.Linear(4, 2).half()
    cfg = shardsafe.CheckpointConfig.from_dict({"folder": str(tmp_path), "cast_dtype": True})
    with shardsafe.CheckpointManager.from_config(cfg) as mgr:
        assert mgr.load({"train": shardsafe.TrainState(half)}) == 1
    assert torch.equal(half.weight, model.weight.detach().half())
    with shardsafe.CheckpointManager(tmp_path, interval=1) as mgr, pytest.raises(shardsafe.DtypeMismatchError):
        mgr.load({"train": shardsafe.TrainState(torch.nn.Linear(4, 2).half())}, step=1)
