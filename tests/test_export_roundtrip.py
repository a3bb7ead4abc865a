"""Every export target round-trips the whole tree (issue 22, section 3): ``export`` then
``import`` gives back, bitwise, what ``load_full`` of the checkpoint gives (empty dicts and
lists included; safetensors and hf hold the tensors only, under flat dotted names). And
export's own parameters refuse mistakes: a ``str`` for ``keys`` is one prefix, a bad type a
TypeError, a rename mapping key that names no tensor an error with the closest names, a
dangling ``$rank_local`` and an int torch's weights-only loader cannot read a
CheckpointError naming the key."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest
import torch

import shardsafe
from bitwise import assert_bitwise
from shardsafe.errors import CorruptCheckpointError, MissingKeysError, UnsupportedValueError
from shardsafe.format.manifest import MANIFEST_NAME, Manifest
from shardsafe.hf_folder import HFFolderError
from shardsafe.tools import export_checkpoint, import_checkpoint

SUFFIX = {"torch": ".pt", "safetensors": ".safetensors", "hf": "", "dcp": ""}


def state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(4, 3, generator=g), "b": torch.arange(5),
                  "h": torch.randn(2, generator=g).to(torch.bfloat16)},
        "train": {"step": 10, "extra": {}, "hist": [], "tup": (1, 2.5, "x"),
                  "nested": {"deep": {}, "t": torch.ones(2)}, "mix": [torch.zeros(1), {}],
                  "flag": True, "name": "run", "none": None, "big": 2**100},
        "blob": b"ab",
    }


def flat_tensors(tree: dict, prefix: str = "") -> dict:
    out = {}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree)
    for k, v in items:
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, (dict, list, tuple)):
            out.update(flat_tensors(v, key + "."))
    return out


def round_trip(tmp_path: Path, to: str, **kw) -> tuple[dict, dict]:
    ckpt = tmp_path / "ck"
    if not ckpt.exists():
        shardsafe.save(state(), ckpt)
    out = tmp_path / f"out-{to}{SUFFIX[to]}"
    export_checkpoint(ckpt, out, to, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import_checkpoint(out, tmp_path / f"back-{to}", trust_pickle=True)
    return shardsafe.load_full(ckpt), shardsafe.load_full(tmp_path / f"back-{to}")


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_nested_targets_round_trip_the_whole_tree(tmp_path, to):
    full, back = round_trip(tmp_path, to)
    assert back["train"]["extra"] == {} and back["train"]["nested"]["deep"] == {}
    assert back["train"]["hist"] == [] and isinstance(back["train"]["mix"][1], dict)
    assert_bitwise(full, back, f"export --to {to} then import", dict_types=True)


@pytest.mark.parametrize("to", ["safetensors", "hf"])
def test_flat_targets_round_trip_every_tensor(tmp_path, to):
    full, back = round_trip(tmp_path, to)
    assert_bitwise(flat_tensors(full), back, f"export --to {to} then import")


def test_dcp_export_lists_its_empty_dicts_for_dcp_readers_too(tmp_path):
    """DCP's own reader ignores the listing (its state is the tensors and values DCP keeps);
    shardsafe's import puts the empty dicts back."""
    from torch.distributed.checkpoint import FileSystemReader

    from shardsafe.tools.common import DCP_EMPTY_DICTS

    round_trip(tmp_path, "dcp")
    md = FileSystemReader(str(tmp_path / "out-dcp")).read_metadata()
    assert sorted(md.planner_data[DCP_EMPTY_DICTS]) == [("train", "extra"), ("train", "mix", 1),
                                                       ("train", "nested", "deep")]


def test_keys_as_a_string_is_one_prefix(tmp_path):
    _, back = round_trip(tmp_path, "torch", keys="model")
    assert sorted(back) == ["model"] and sorted(back["model"]) == ["b", "h", "w"]


def test_export_parameters_of_the_wrong_type_are_refused(tmp_path):
    shardsafe.save(state(), tmp_path / "ck")
    with pytest.raises(TypeError, match="keys takes a key or a list of keys"):
        export_checkpoint(tmp_path / "ck", tmp_path / "o.pt", "torch", keys=b"model")
    with pytest.raises(TypeError, match="strip takes one dotted prefix"):
        export_checkpoint(tmp_path / "ck", tmp_path / "o.pt", "torch", strip=["model"])
    with pytest.raises(MissingKeysError, match="did you mean 'model'"):
        export_checkpoint(tmp_path / "ck", tmp_path / "o.pt", "torch", keys="modle")
    assert not (tmp_path / "o.pt").exists()


def test_rename_typo_is_an_error_with_the_closest_names(tmp_path):
    shardsafe.save(state(), tmp_path / "ck")
    with pytest.raises(HFFolderError, match=r"'model.weigth' is not one of the exported names; did you mean "
                                            r"'model.w"):
        export_checkpoint(tmp_path / "ck", tmp_path / "o.safetensors", "safetensors",
                          rename={"model.weigth": "x"})
    # a str is one rule (REGEX=REPLACEMENT), as --rename on the command line
    export_checkpoint(tmp_path / "ck", tmp_path / "o.safetensors", "safetensors", rename=r"^model\.=m.")
    from safetensors.torch import load_file

    assert sorted(load_file(tmp_path / "o.safetensors")) == ["m.b", "m.h", "m.w", "train.mix.0", "train.nested.t"]


def _rewritten(tmp_path: Path, name: str, edit) -> Path:
    src = tmp_path / "small"
    if not src.exists():
        shardsafe.save({"w": torch.ones(2), "step": 1}, src)
    dst = tmp_path / name
    shutil.copytree(src, dst)
    m = Manifest.from_bytes((dst / MANIFEST_NAME).read_bytes())
    edit(m)
    (dst / MANIFEST_NAME).write_bytes(m.to_bytes())
    return dst


def test_dangling_rank_local_is_corrupt_not_skipped(tmp_path):
    ck = _rewritten(tmp_path, "dangling", lambda m: m.tree.__setitem__("x", {"$rank_local": "nope"}))
    with pytest.raises(CorruptCheckpointError, match="'x' is rank-local value 'nope', which the manifest does not"):
        export_checkpoint(ck, tmp_path / "o.pt", "torch")
    assert not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("to", ["torch", "dcp"])
def test_int_beyond_weights_only_pickle_is_refused_naming_the_key(tmp_path, to):
    """A checkpoint written before ``save`` refused such ints: the export says which key,
    instead of writing a file torch.load(weights_only=True) cannot read."""
    ck = _rewritten(tmp_path, "bigint", lambda m: m.tree.__setitem__("big", {"$int": str(2**3000)}))
    out = tmp_path / f"o{SUFFIX[to]}"
    with pytest.raises(UnsupportedValueError, match=f"cannot export 'big' to {to}: it holds an int of 3001 bits"):
        export_checkpoint(ck, out, to)
    assert not out.exists()
    export_checkpoint(ck, tmp_path / "o.safetensors", "safetensors")  # tensors only: fine
