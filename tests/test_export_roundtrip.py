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


# -- many small tensors (issue 22 section 4): batched reads, torch's layout, DCP files by group -----


def many_state() -> dict:
    """Tensors of every kind the skeleton must pickle as torch does, small ones around a large one."""
    g = torch.Generator().manual_seed(1)
    model = {f"layers.{i}.w": torch.randn(3 + i % 5, generator=g) for i in range(40)}
    model["big"] = torch.randn(64, 64, generator=g)  # 16 KiB: larger than the test's batch bound
    model.update({"bf16": torch.randn(2, 3, generator=g).bfloat16(), "scalar": torch.tensor(7),
                  "empty": torch.zeros(0, 3), "flags": torch.tensor([True, False, True]),
                  "u16": torch.arange(6).to(torch.uint16).view(2, 3),
                  "c64": torch.randn(2, generator=g).to(torch.complex64),
                  "f8": torch.randn(4, generator=g).to(torch.float8_e4m3fn), "i64": torch.arange(5)})
    return {"model": model, "train": {"step": 3, "hist": [torch.ones(2), {"x": torch.zeros(1)}], "t": (1, "a")}}


def _records(data: bytes) -> tuple[dict, bytes]:
    """(record name -> (header offset, size), the data.pkl record) of a torch.save zip."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {i.filename: (i.header_offset, i.file_size) for i in zf.infolist()}, zf.read("archive/data.pkl")


def test_torch_export_is_laid_out_and_pickled_as_torch_save(tmp_path):
    """The skeleton's data.pkl is byte for byte what torch.save pickles for the same state, and
    every record sits where torch.save puts it; the file loads weights-only, bitwise."""
    import io

    shardsafe.save(many_state(), tmp_path / "ck")
    full = shardsafe.load_full(tmp_path / "ck")
    export_checkpoint(tmp_path / "ck", tmp_path / "o.pt", "torch")
    ref = io.BytesIO()
    torch.save(full, ref)
    ours = (tmp_path / "o.pt").read_bytes()
    (ours_records, ours_pkl), (ref_records, ref_pkl) = _records(ours), _records(ref.getvalue())
    assert ours_pkl == ref_pkl
    assert ours_records == ref_records and len(ours) == len(ref.getvalue())
    assert_bitwise(full, torch.load(tmp_path / "o.pt", weights_only=True), "export --to torch", dict_types=True)
    assert_bitwise(full, torch.load(tmp_path / "o.pt", weights_only=True, mmap=True), "mmap load", dict_types=True)


def test_torch_save_frame_is_torch_save_of_one_tensor():
    """What --to dcp writes for each tensor: torch.save's file for it, loadable, same size."""
    import io

    from shardsafe.engine.outputs import tensor_bytes, torch_save_frame

    for t in many_state()["model"].values():
        before, after = torch_save_frame(t.dtype, tuple(t.shape))
        data = before + bytes(tensor_bytes(t)) + after
        ref = io.BytesIO()
        torch.save(t, ref)
        assert len(data) == len(ref.getvalue())
        assert_bitwise(t, torch.load(io.BytesIO(data), weights_only=True), f"frame of {t.dtype} {tuple(t.shape)}")


@pytest.mark.parametrize("to", ["torch", "safetensors", "hf", "dcp"])
def test_small_tensors_are_read_in_bounded_batches(tmp_path, monkeypatch, to):
    """Every tensor is read exactly once, in batches of at most BATCH_BYTES (a larger tensor
    alone), far fewer batches than tensors; the export is bitwise what load_full gives. For
    dcp, each .distcp file holds one batch."""
    from shardsafe.tools import export as ex

    bound = 4096
    monkeypatch.setattr(ex, "BATCH_BYTES", bound)
    batches: list[list[str]] = []
    real = ex.read_tensors

    def spy(reader, keys):
        batches.append(list(keys))
        return real(reader, keys)

    monkeypatch.setattr(ex, "read_tensors", spy)
    shardsafe.save(many_state(), tmp_path / "ck")
    sizes = {k: t.nbytes for k, t in flat_tensors(shardsafe.load_full(tmp_path / "ck")).items()}
    full, back = round_trip(tmp_path, to)
    read = [k for b in batches for k in b]
    assert sorted(read) == sorted(sizes)  # each tensor once
    for b in batches:
        assert len(b) == 1 or sum(sizes[k] for k in b) <= bound, b
    assert len(batches) <= sum(sizes.values()) // bound + 4 < len(sizes)
    if to in ("torch", "dcp"):
        assert_bitwise(full, back, f"export --to {to} then import", dict_types=True)
    else:
        assert_bitwise(flat_tensors(full), back, f"export --to {to} then import")
    if to == "dcp":
        assert len(list((tmp_path / "out-dcp").glob("*.distcp"))) == len(batches)


def test_corrupt_small_tensor_fails_the_export_and_leaves_nothing(tmp_path):
    """Checksums are verified before a batch's bytes are written: a flipped byte in the last
    tensor of a batch stops the export (naming the tensor), and no output appears."""
    shardsafe.save({"model": {f"t{i}": torch.full((64,), float(i)) for i in range(50)}}, tmp_path / "ck")
    (data,) = (tmp_path / "ck").glob("*.safetensors")
    raw = bytearray(data.read_bytes())
    at = raw.find(torch.full((64,), 49.0).numpy().tobytes())
    assert at > 0
    raw[at + 5] ^= 1
    data.write_bytes(bytes(raw))
    for to in ("torch", "safetensors", "hf", "dcp"):
        out = tmp_path / f"out-{to}{SUFFIX[to]}"
        with pytest.raises(CorruptCheckpointError, match="model.t49"):
            export_checkpoint(tmp_path / "ck", out, to)
        assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out-")]


def test_sparse_file_keeps_what_was_written():
    """The in-memory skeleton file: appends, seeks past holes, overwrites across pieces."""
    import io
    import random

    from shardsafe.engine.outputs import SparseFile

    rng = random.Random(0)
    for _ in range(50):
        ours, ref = SparseFile(), io.BytesIO()
        for _ in range(20):
            pos = rng.randrange(0, 200) if rng.random() < 0.5 else ours.size
            data = bytes(rng.randrange(256) for _ in range(rng.randrange(0, 30)))
            for f in (ours, ref):
                f.seek(pos)
                f.write(data)
        want = ref.getvalue()
        assert ours.size == len(want) and ours.read_at(0, len(want) + 5) == want
        end = -1
        for start, piece in ours.pieces():  # in order, apart, each what was written there
            assert start > end and bytes(piece) == want[start: start + len(piece)]
            end = start + len(piece)


@pytest.mark.parametrize("to", ["torch", "safetensors", "hf"])
def test_small_tensors_are_written_in_few_vectored_writes(tmp_path, monkeypatch, to):
    """Adjacent tensors (and the header, or the torch zip's records between them) go out in
    one vectored write per run, not one write per tensor."""
    from shardsafe.storage.local import LocalWriteHandle

    calls: list[int] = []
    real = LocalWriteHandle.write

    def spy(self, buffers, offset):
        calls.append(len(buffers))
        return real(self, buffers, offset)

    shardsafe.save({"model": {f"t{i}": torch.full((16,), float(i)) for i in range(300)}}, tmp_path / "ck")
    monkeypatch.setattr(LocalWriteHandle, "write", spy)
    out = tmp_path / f"o{SUFFIX[to]}"
    export_checkpoint(tmp_path / "ck", out, to)
    monkeypatch.undo()
    assert len(calls) <= 2 and sum(calls) >= 300, calls  # the data file(s) only: hf's index and config apart
    full = shardsafe.load_full(tmp_path / "ck")
    if to == "torch":
        assert_bitwise(full, torch.load(out, weights_only=True), "torch export", dict_types=True)
    else:
        from safetensors.torch import load_file

        got = load_file(out) if to == "safetensors" else load_file(next(out.glob("*.safetensors")))
        assert_bitwise(flat_tensors(full), got, f"{to} export")
