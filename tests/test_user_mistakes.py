"""A user's mistake is an error, never a silent no-op (issue 22, section 3): misspelt
exclude patterns and keys, a ``str`` where a list of keys is expected, step folders
named by hand (``ckpt/step-100``), two spellings of one step, misspelt storage options,
a missing bucket, a checkpoint whose data file was deleted."""

from __future__ import annotations

import json

import pytest
import torch

import shardsafe
from bitwise import tensors_equal as same
from shardsafe import CheckpointError, CheckpointManager, CheckpointNotFoundError
from shardsafe.errors import MissingKeysError
from shardsafe.storage.s3 import parse_options
from shardsafe.tools import diff_checkpoints, inspect_checkpoint, list_checkpoints
from shardsafe.tools.cli import main as cli


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"0.weight": torch.randn(4, 3, generator=g), "0.bias": torch.randn(4, generator=g)},
            "optim": {"state": {"0.weight": {"exp_avg": torch.randn(4, 3, generator=g)}}, "lr": 0.1 + seed}}


def zeros() -> dict:
    return {"model": {"0.weight": torch.zeros(4, 3), "0.bias": torch.zeros(4)},
            "optim": {"state": {"0.weight": {"exp_avg": torch.zeros(4, 3)}}, "lr": 0.0}}


def untouched(dest: dict) -> bool:
    want = zeros()
    return (same(dest["model"]["0.weight"], want["model"]["0.weight"])
            and same(dest["optim"]["state"]["0.weight"]["exp_avg"], want["optim"]["state"]["0.weight"]["exp_avg"])
            and dest["optim"]["lr"] == 0.0)


def cli_json(capsys, *argv: str) -> tuple[int, dict]:
    code = cli([*argv, "--json", "--no-progress"])
    return code, json.loads(capsys.readouterr().out)


# ------------------------------------------------------------------ exclude and keys


def test_exclude_typo_at_the_top_level_is_an_error_with_the_closest_key(tmp_path):
    shardsafe.save(state(), tmp_path / "ck")
    dest = zeros()
    with pytest.raises(MissingKeysError, match=r"exclude pattern 'optm' matches no key.*did you mean 'optim'"):
        shardsafe.load(dest, tmp_path / "ck", exclude=["optm"])
    assert untouched(dest)  # refused before any byte was written


def test_exclude_typo_of_a_dotted_key_is_an_error_with_the_closest_key(tmp_path):
    shardsafe.save(state(), tmp_path / "ck")
    dest = zeros()
    with pytest.raises(MissingKeysError, match=r"'model\.0\.weigth' matches no key.*did you mean 'model\.0\.weight'"):
        shardsafe.load(dest, tmp_path / "ck", exclude=["model.0.weigth"])
    assert untouched(dest)


def test_exclude_as_a_str_is_one_pattern(tmp_path):
    saved = state()
    shardsafe.save(saved, tmp_path / "ck")
    dest = zeros()
    shardsafe.load(dest, tmp_path / "ck", exclude="optim")
    assert same(dest["model"]["0.weight"], saved["model"]["0.weight"])
    assert same(dest["model"]["0.bias"], saved["model"]["0.bias"])
    assert same(dest["optim"]["state"]["0.weight"]["exp_avg"], torch.zeros(4, 3)) and dest["optim"]["lr"] == 0.0


def test_exclude_of_a_key_only_the_destination_has_is_no_error(tmp_path):
    shardsafe.save({"model": state()["model"]}, tmp_path / "ck")
    dest = zeros()
    shardsafe.load(dest, tmp_path / "ck", exclude=["optim"])  # the optimizer is not in the checkpoint
    assert same(dest["model"]["0.weight"], state()["model"]["0.weight"]) and dest["optim"]["lr"] == 0.0


@pytest.mark.parametrize("bad", [b"optim", 5, {"optim": 1}, ["optim", 3]])
def test_keys_and_exclude_of_the_wrong_type_are_type_errors(tmp_path, bad):
    shardsafe.save(state(), tmp_path / "ck")
    with pytest.raises(TypeError, match="keys takes a key or a list of keys"):
        shardsafe.load_full(tmp_path / "ck", keys=bad)
    dest = zeros()
    with pytest.raises(TypeError, match="exclude takes a key or a list of keys"):
        shardsafe.load(dest, tmp_path / "ck", exclude=bad)
    assert untouched(dest)
    with pytest.raises(TypeError, match="keys takes a key or a list of keys"):
        diff_checkpoints(tmp_path / "ck", tmp_path / "ck", keys=bad)


def test_load_full_keys_typo_names_the_closest_key(tmp_path):
    shardsafe.save(state(), tmp_path / "ck")
    with pytest.raises(MissingKeysError, match=r"did you mean 'model\.0\.weight'"):
        shardsafe.load_full(tmp_path / "ck", keys=["model.0.weigth"])
    got = shardsafe.load_full(tmp_path / "ck", keys="model")
    assert list(got) == ["model"] and same(got["model"]["0.bias"], state()["model"]["0.bias"])


def test_manager_exclude_from_loading_typo_is_an_error(tmp_path):
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(10, state())
    dest = zeros()
    with CheckpointManager(tmp_path / "run", exclude_from_loading=["optm"]) as mgr:
        with pytest.raises(MissingKeysError, match=r"'optm' matches no key.*did you mean 'optim'"):
            mgr.load(dest)
    assert untouched(dest)
    with CheckpointManager(tmp_path / "run", exclude_from_loading="optim") as mgr:
        assert mgr.load(dest) == 10
    assert same(dest["model"]["0.weight"], state()["model"]["0.weight"]) and dest["optim"]["lr"] == 0.0


# ------------------------------------------------------------------ diff and the CLI's --keys


def test_diff_keys_as_a_str_and_a_typo(tmp_path):
    shardsafe.save(state(0), tmp_path / "a")
    shardsafe.save(state(1), tmp_path / "b")
    d = diff_checkpoints(tmp_path / "a", tmp_path / "b", keys="optim.lr")
    assert [(c.key, c.what) for c in d.changes] == [("optim.lr", "value")] and d.compared == 1
    with pytest.raises(MissingKeysError, match=r"'optm' selects nothing.*did you mean 'optim'"):
        diff_checkpoints(tmp_path / "a", tmp_path / "b", keys="optm")


def test_cli_keys_typo_exits_2_with_the_closest_keys(tmp_path, capsys):
    shardsafe.save(state(0), tmp_path / "a")
    shardsafe.save(state(1), tmp_path / "b")
    code, out = cli_json(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--keys", "modle")
    assert code == 2 and not out["ok"]
    assert "--keys 'modle' selects nothing" in out["error"] and "did you mean 'model'" in out["error"]
    # one prefix per flag: a comma is part of the key, and the error says how to pass two
    code, out = cli_json(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--keys", "model,optim")
    assert code == 2 and "--keys model --keys optim" in out["error"]
    code, out = cli_json(capsys, "diff", str(tmp_path / "a"), str(tmp_path / "b"), "--keys", "model",
                         "--keys", "optim.lr")
    assert code == 1 and [c["key"] for c in out["changes"]] == ["model.0.weight", "model.0.bias", "optim.lr"]
    code, out = cli_json(capsys, "export", str(tmp_path / "a"), str(tmp_path / "x.safetensors"), "--to",
                         "safetensors", "--keys", "model.0.weigth")
    assert code == 2 and "did you mean 'model.0.weight'" in out["error"]
    assert not (tmp_path / "x.safetensors").exists()


# ------------------------------------------------------------------ step folders named by hand


def test_a_step_folder_saved_by_hand_is_a_manager_step(tmp_path, capsys):
    saved = state()
    shardsafe.save(saved, tmp_path / "ckpt" / "step-100")  # the README's own example
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.steps() == [100]
        dest = zeros()
        assert mgr.load(dest) == 100
        assert same(dest["model"]["0.weight"], saved["model"]["0.weight"]) and dest["optim"]["lr"] == 0.1
        mgr.save(100, state(7))  # the same step again: into its folder, whatever its spelling
        mgr.wait()
        assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == ["step-100"]
        assert mgr.steps() == [100]
    got = shardsafe.load_full(tmp_path / "ckpt" / "step-100")
    assert same(got["model"]["0.weight"], state(7)["model"]["0.weight"])
    entries = list_checkpoints(tmp_path / "ckpt")
    assert [(e.name, e.step, e.status) for e in entries] == [("step-100", 100, "valid")]
    code, out = cli_json(capsys, "ls", str(tmp_path / "ckpt"))
    assert code == 0 and [(c["name"], c["step"], c["status"]) for c in out["checkpoints"]] == [
        ("step-100", 100, "valid")]


def test_two_spellings_of_one_step_are_an_error_naming_both(tmp_path, capsys):
    shardsafe.save(state(0), tmp_path / "ckpt" / "step-100")
    shardsafe.save(state(1), tmp_path / "ckpt" / "step-00000100")
    shardsafe.save(state(2), tmp_path / "ckpt" / "step-5")
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        with pytest.raises(CheckpointError, match=r"step 100 has two checkpoints.*'step-00000100' and 'step-100'"):
            mgr.steps()
        dest = zeros()
        with pytest.raises(CheckpointError, match=r"'step-00000100' and 'step-100'"):
            mgr.load(dest)
        assert untouched(dest)
    entries = {e.name: e for e in list_checkpoints(tmp_path / "ckpt")}
    assert entries["step-5"].status == "valid" and entries["step-5"].step == 5
    for name in ("step-100", "step-00000100"):
        assert entries[name].status == "ambiguous" and entries[name].step == 100
        assert "'step-00000100' and 'step-100'" in entries[name].problem
    assert cli(["ls", str(tmp_path / "ckpt")]) == 0
    text = capsys.readouterr().out
    assert text.count("ambiguous") == 2 and "step 100 has two checkpoints in this folder" in text


def test_a_torn_second_spelling_is_no_ambiguity(tmp_path):
    shardsafe.save(state(0), tmp_path / "ckpt" / "step-100")
    (tmp_path / "ckpt" / "step-00000100").mkdir()  # no manifest: not committed
    entries = {e.name: e.status for e in list_checkpoints(tmp_path / "ckpt")}
    assert entries == {"step-100": "valid", "step-00000100": "invalid"}
    with CheckpointManager(tmp_path / "ckpt") as mgr:
        assert mgr.steps() == [100]


# ------------------------------------------------------------------ inspect on a damaged checkpoint


def test_inspect_reports_a_deleted_data_file_and_exits_1(tmp_path, capsys):
    shardsafe.save(state(), tmp_path / "ck")
    data = sorted((tmp_path / "ck").glob("data-*.safetensors"))
    assert len(data) == 1
    assert inspect_checkpoint(tmp_path / "ck").problems == []
    assert cli(["inspect", str(tmp_path / "ck")]) == 0
    capsys.readouterr()
    data[0].unlink()
    report = inspect_checkpoint(tmp_path / "ck")
    assert not report.ok and report.problems == [f"data file {data[0].name} is missing"]
    assert cli(["inspect", str(tmp_path / "ck")]) == 1
    text = capsys.readouterr().out
    assert f"PROBLEM  data file {data[0].name} is missing" in text and "model" in text
    code, out = cli_json(capsys, "inspect", str(tmp_path / "ck"))
    assert code == 1 and out["ok"] is False and out["problems"] == [f"data file {data[0].name} is missing"]
    code, out = cli_json(capsys, "inspect", str(tmp_path / "ck"), "--layout", "model.0.weight")
    assert code == 1 and out["problems"] == [f"data file {data[0].name} is missing"]
    code, out = cli_json(capsys, "verify", str(tmp_path / "ck"))
    assert code == 1  # inspect agrees with verify


def test_inspect_reports_a_truncated_data_file(tmp_path, capsys):
    shardsafe.save(state(), tmp_path / "ck")
    (data,) = (tmp_path / "ck").glob("data-*.safetensors")
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 8)
    code, out = cli_json(capsys, "inspect", str(tmp_path / "ck"))
    assert code == 1 and out["problems"] == [f"data file {data.name} has {size - 8} bytes, the manifest says {size}"]


# ------------------------------------------------------------------ object storage


def test_misspelt_storage_option_names_the_closest_first():
    with pytest.raises(CheckpointError) as info:
        parse_options({"endpont": "http://127.0.0.1:1"})
    message = str(info.value)
    assert message.startswith("unknown S3 storage option(s) 'endpont' ('endpont': did you mean 'endpoint'")
    assert message.index("did you mean") < message.index("accepted:")
    with pytest.raises(CheckpointError, match=r"'colour': no close name; 'regoin': did you mean 'region'"):
        parse_options({"colour": "red", "regoin": "x"})


def test_misspelt_storage_option_through_save(tmp_path):
    pytest.importorskip("obstore")
    with pytest.raises(CheckpointError, match="did you mean 'endpoint'"):
        shardsafe.save({"w": torch.ones(2)}, "s3://bucket/ck", storage_options={"endpont": "http://127.0.0.1:1"})


def test_a_missing_bucket_is_named(s3, capsys, monkeypatch):
    server, _, opts = s3
    with pytest.raises(CheckpointNotFoundError, match=r"bucket 'no-such-bucket-q' does not exist"):
        shardsafe.save({"w": torch.ones(2)}, "s3://no-such-bucket-q/run/ck", storage_options=opts)
    from shardsafe.checkpointer import Checkpointer

    cp = Checkpointer(storage_options=opts)
    try:
        with pytest.raises(CheckpointNotFoundError, match=r"bucket 'no-such-bucket-q' does not exist"):
            list_checkpoints("s3://no-such-bucket-q/run", cp)
    finally:
        cp.close()
    from s3_server import KEY, REGION

    for name, value in {"AWS_ENDPOINT_URL": server.endpoint, "AWS_ACCESS_KEY_ID": KEY,
                        "AWS_SECRET_ACCESS_KEY": KEY, "AWS_REGION": REGION}.items():
        monkeypatch.setenv(name, value)
    code, out = cli_json(capsys, "ls", "s3://no-such-bucket-q/run")
    assert code == 2 and "bucket 'no-such-bucket-q' does not exist" in out["error"]


def test_loading_from_a_missing_bucket_names_it(s3):
    _, _, opts = s3
    with pytest.raises(CheckpointNotFoundError, match=r"bucket 'no-such-bucket-q' does not exist"):
        shardsafe.load_full("s3://no-such-bucket-q/run/ck", storage_options=opts)
    dest = {"w": torch.zeros(2)}
    with pytest.raises(CheckpointNotFoundError, match=r"bucket 'no-such-bucket-q' does not exist"):
        shardsafe.load(dest, "s3://no-such-bucket-q/run/ck", storage_options=opts)
    from shardsafe.checkpointer import Checkpointer

    cp = Checkpointer(storage_options=opts)
    try:  # a manager on a missing bucket says so, instead of "no checkpoint yet" (None)
        with CheckpointManager("s3://no-such-bucket-q/run", checkpointer=cp) as mgr:
            with pytest.raises(CheckpointNotFoundError, match=r"bucket 'no-such-bucket-q' does not exist"):
                mgr.load(dest)
    finally:
        cp.close()
