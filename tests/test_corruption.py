"""Damaged checkpoints: flipped bytes, truncated or missing files, foreign format
versions, leftovers of interrupted saves, and files that would run code if unpickled."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch

import shardsafe
from bitwise import tensor_bytes, tensors_equal
from format2 import as_format2
from shardsafe import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
)
from shardsafe.format.manifest import MANIFEST_NAME, Manifest

MIB = 1 << 20


def state() -> dict:
    g = torch.Generator().manual_seed(1234)
    return {
        # 2.5 MiB: three checksum blocks (1 MiB each)
        "big": torch.randn(640 * 1024, generator=g),
        "model": {"w": torch.randn(64, 33, generator=g), "b": torch.randint(-99, 99, (17,), generator=g)},
        "half": torch.randn(10, 10, generator=g).to(torch.bfloat16),
        "last": torch.arange(40, dtype=torch.int16),
        "step": 12,
    }


def sentinel_dest() -> dict:
    """Destinations for an in-place load, prefilled with a recognisable pattern."""
    return {
        "big": torch.full((640 * 1024,), -1.5),
        "model": {"w": torch.full((64, 33), 7.0), "b": torch.full((17,), 3, dtype=torch.int64)},
        "half": torch.full((10, 10), 2.0, dtype=torch.bfloat16),
        "last": torch.full((40,), -9, dtype=torch.int16),
        "step": -1,
    }


def assert_dest_untouched(dest: dict) -> None:
    fresh = sentinel_dest()
    assert dest["step"] == -1
    for get in (lambda d: d["big"], lambda d: d["model"]["w"], lambda d: d["model"]["b"],
                lambda d: d["half"], lambda d: d["last"]):
        assert tensors_equal(get(dest), get(fresh)), "a failed load wrote into the destination"


def assert_loads_correctly(path: Path) -> None:
    want = state()
    out = shardsafe.load_full(path)
    assert out["step"] == 12
    assert tensors_equal(out["big"], want["big"])
    assert tensors_equal(out["model"]["w"], want["model"]["w"])
    assert tensors_equal(out["last"], want["last"])


def make_ckpt(tmp_path: Path, fmt: int = 3) -> tuple[Path, Path]:
    """A saved checkpoint (rewritten as format 2.0 with ``fmt=2``) and its data file."""
    path = tmp_path / "ckpt"
    shardsafe.save(state(), path)
    if fmt == 2:
        as_format2(path)
    (data,) = sorted(path.glob("*.safetensors"))
    return path, data


def chunk_range(path: Path, key: str) -> tuple[int, int]:
    m = shardsafe.read_manifest(path)
    (c,) = m.tensors[key].chunks
    return c.start, c.end


def flip(file: Path, pos: int, mask: int = 0x5A) -> None:
    data = bytearray(file.read_bytes())
    data[pos] ^= mask
    file.write_bytes(bytes(data))


# --------------------------------------------------------------------------- data file bytes

DATA_POSITIONS = {
    # name: (where, tensor key named in the error or None for the header)
    "length_prefix": ("header", 0),
    "header_json_start": ("header", 8),
    "header_json_middle": ("header", "middle"),
    "header_last_byte": ("header", "last"),
    "big_first_block": ("big", 100),
    "big_middle_block": ("big", "middle"),
    "big_last_byte": ("big", "end"),
    "model.w_middle": ("model.w", "middle"),
    "model.b_first": ("model.b", 0),
    "last_byte_of_file": ("<key of the last chunk>", "end"),
}


def last_key(path: Path, data: Path) -> str:
    """The key whose chunk ends the data file."""
    m = shardsafe.read_manifest(path)
    (key,) = [k for k, t in m.tensors.items() if t.chunks[0].end == data.stat().st_size]
    return key


def resolve(path: Path, data: Path, where: str, at) -> int:
    if where == "header":
        hdr = shardsafe.read_manifest(path).files[0].header_bytes
        return {"middle": hdr // 2, "last": hdr - 1}.get(at, at)
    start, end = chunk_range(path, where)
    return {"middle": (start + end) // 2, "end": end - 1}.get(at, start + at if isinstance(at, int) else at)


@pytest.mark.parametrize("case", list(DATA_POSITIONS))
def test_flipped_data_byte_detected(tmp_path, case):
    path, data = make_ckpt(tmp_path)
    where, at = DATA_POSITIONS[case]
    if case == "last_byte_of_file":
        where = last_key(path, data)
    pos = resolve(path, data, where, at)
    if case == "last_byte_of_file":
        assert pos == data.stat().st_size - 1
    flip(data, pos)

    for load in (lambda: shardsafe.load_full(path), lambda: shardsafe.load(sentinel_dest(), path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            load()
        msg = str(ei.value)
        assert data.name in msg
        if where != "header":
            assert f"'{where}'" in msg

    dest = sentinel_dest()
    with pytest.raises(CorruptCheckpointError):
        shardsafe.load(dest, path)
    assert_dest_untouched(dest)

    if where != "header":
        # Loading only other keys does not need the damaged bytes.
        other = "last" if where != "last" else "big"
        out = shardsafe.load_full(path, keys=[other])
        assert tensors_equal(out[other], state()[other])


@pytest.mark.parametrize("key", ["big", "model.w", "last"])
def test_verify_false_skips_data_checksums(tmp_path, key):
    path, data = make_ckpt(tmp_path)
    start, end = chunk_range(path, key)
    pos = (start + end) // 2
    flip(data, pos, 0xFF)
    out = shardsafe.load_full(path, verify=False)
    got = out
    for part in key.split("."):
        got = got[part]
    want = state()
    for part in key.split("."):
        want = want[part]
    diff = (tensor_bytes(got) != tensor_bytes(want)).nonzero().reshape(-1).tolist()
    assert diff == [pos - start], "verify=False must load the bytes as they are on disk"

    dest = sentinel_dest()
    shardsafe.load(dest, path, verify=False)
    assert dest["step"] == 12
    target = dest
    for part in key.split("."):
        target = target[part]
    assert tensors_equal(target, got)


def test_stateful_destination_untouched_on_corruption(tmp_path):
    model = torch.nn.Linear(8, 4)
    path = tmp_path / "c"
    shardsafe.save({"model": model}, path)
    start, end = chunk_range(path, "model.weight")
    (data,) = path.glob("*.safetensors")
    flip(data, start + 3)
    dst = torch.nn.Linear(8, 4)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    with pytest.raises(CorruptCheckpointError) as ei:
        shardsafe.load({"model": dst}, path)
    assert "'model.weight'" in str(ei.value)
    for k, v in dst.state_dict().items():
        assert tensors_equal(v, before[k])


# --------------------------------------------------------------------------- manifest bytes


@pytest.mark.parametrize("where", [0, 1, "quarter", "half", "three_quarters", "trailer_key", "checksum", -3, -2, -1])
def test_flipped_manifest_byte_detected(tmp_path, where):
    path, _ = make_ckpt(tmp_path)
    mfile = path / MANIFEST_NAME
    text = mfile.read_bytes()
    n = len(text)
    trailer = text.rfind(b'"manifest_xxh3_64"')
    assert trailer > 0
    pos = {
        "quarter": n // 4,
        "half": n // 2,
        "three_quarters": 3 * n // 4,
        "trailer_key": trailer + 5,
        "checksum": trailer + len(b'"manifest_xxh3_64": "') + 3,
    }.get(where, where)
    flip(mfile, pos, 0x01)
    for call in (lambda: shardsafe.load_full(path), lambda: shardsafe.load(sentinel_dest(), path),
                 lambda: shardsafe.read_manifest(path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert MANIFEST_NAME in str(ei.value)
    dest = sentinel_dest()
    with pytest.raises(CorruptCheckpointError):
        shardsafe.load(dest, path)
    assert_dest_untouched(dest)


@pytest.mark.parametrize("keep", [0, 1, 10, "half", -3])
def test_truncated_manifest(tmp_path, keep):
    path, _ = make_ckpt(tmp_path)
    mfile = path / MANIFEST_NAME
    text = mfile.read_bytes()
    keep = len(text) // 2 if keep == "half" else keep
    mfile.write_bytes(text[:keep])
    with pytest.raises(CorruptCheckpointError) as ei:
        shardsafe.load_full(path)
    assert MANIFEST_NAME in str(ei.value)


def test_manifest_with_junk_appended(tmp_path):
    path, _ = make_ckpt(tmp_path)
    mfile = path / MANIFEST_NAME
    mfile.write_bytes(mfile.read_bytes() + b'{"x": 1}\n')
    with pytest.raises(CorruptCheckpointError) as ei:
        shardsafe.load_full(path)
    assert MANIFEST_NAME in str(ei.value)


def test_missing_manifest(tmp_path):
    path, _ = make_ckpt(tmp_path)
    (path / MANIFEST_NAME).unlink()
    for call in (lambda: shardsafe.load_full(path), lambda: shardsafe.load({"step": 0}, path),
                 lambda: shardsafe.read_manifest(path)):
        with pytest.raises(CheckpointNotFoundError) as ei:
            call()
        assert f"no checkpoint at {path}" in str(ei.value)
    assert isinstance(ei.value, FileNotFoundError)


def test_no_directory_at_all(tmp_path):
    path = tmp_path / "never-saved"
    with pytest.raises(CheckpointNotFoundError) as ei:
        shardsafe.load_full(path)
    assert f"no checkpoint at {path}" in str(ei.value)
    assert not path.exists()


# --------------------------------------------------------------------------- data file size / presence


@pytest.mark.parametrize("cut", [1, 1000, "half", "all_but_header"])
def test_truncated_data_file(tmp_path, cut):
    path, data = make_ckpt(tmp_path)
    blob = data.read_bytes()
    header = shardsafe.read_manifest(path).files[0].header_bytes
    keep = {"half": len(blob) // 2, "all_but_header": header}.get(cut, len(blob) - cut if isinstance(cut, int) else 0)
    data.write_bytes(blob[:keep])
    dest = sentinel_dest()
    for call in (lambda: shardsafe.load_full(path), lambda: shardsafe.load(dest, path),
                 lambda: shardsafe.load_full(path, verify=False)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert data.name in str(ei.value)
    assert_dest_untouched(dest)


def test_extended_data_file(tmp_path):
    path, data = make_ckpt(tmp_path)
    with open(data, "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(CorruptCheckpointError) as ei:
        shardsafe.load_full(path)
    assert data.name in str(ei.value)


def test_missing_data_file(tmp_path):
    path, data = make_ckpt(tmp_path)
    data.unlink()
    dest = sentinel_dest()
    for call in (lambda: shardsafe.load_full(path), lambda: shardsafe.load(dest, path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert data.name in str(ei.value)
    assert_dest_untouched(dest)
    # Values-only loads do not need the data file.
    assert shardsafe.load_full(path, keys="step") == {"step": 12}


def test_replaced_data_file_same_size(tmp_path):
    """Another checkpoint's data file of the same size put in place is caught by checksums."""
    path, data = make_ckpt(tmp_path)
    other = tmp_path / "other"
    st = state()
    st["big"] = st["big"] + 1
    shardsafe.save(st, other)
    (odata,) = other.glob("*.safetensors")
    assert odata.stat().st_size == data.stat().st_size
    os.replace(odata, data)
    with pytest.raises(CorruptCheckpointError) as ei:
        shardsafe.load_full(path)
    assert "'big'" in str(ei.value)


# --------------------------------------------------------------------------- format version


def rewrite_manifest(path: Path, edit) -> None:
    mfile = path / MANIFEST_NAME
    m = Manifest.from_bytes(mfile.read_bytes())
    edit(m)
    mfile.write_bytes(m.to_bytes())


def test_future_major_version_refused(tmp_path):
    path, _ = make_ckpt(tmp_path)

    def bump(m):
        m.version = (4, 0)

    rewrite_manifest(path, bump)
    json.loads((path / MANIFEST_NAME).read_bytes())  # still well-formed
    dest = sentinel_dest()
    for call in (lambda: shardsafe.load_full(path), lambda: shardsafe.load(dest, path),
                 lambda: shardsafe.read_manifest(path)):
        with pytest.raises(FormatVersionError) as ei:
            call()
        assert "4.0" in str(ei.value) and MANIFEST_NAME in str(ei.value)
    assert_dest_untouched(dest)


@pytest.mark.parametrize("fmt", [2, 3])
def test_newer_minor_version_still_loads(tmp_path, fmt):
    path, _ = make_ckpt(tmp_path, fmt)

    def bump(m):
        m.version = (fmt, 9)

    rewrite_manifest(path, bump)
    assert shardsafe.read_manifest(path).version == (fmt, 9)
    assert_loads_correctly(path)


def to_v1(body: dict) -> dict:
    """The same manifest in the format-1.0 layout (chunks inline, one object each)."""
    table, ranks = body["chunks"], [f["rank"] for f in body["files"]]
    dims = 0
    blocks = 0
    tensors = {}
    block = body["extra"]["checksum_block"]
    for key, t in body["tensors"].items():
        first, count = t["chunks"]
        nd = len(t["shape"])
        chunks = []
        for c in range(first, first + count):
            start, end = table["b"][2 * c: 2 * c + 2]
            nb = max(1, -(-(end - start) // block))
            sums = [table["x"][16 * i: 16 * i + 16] for i in range(blocks, blocks + nb)]
            chunks.append({"o": table["o"][dims: dims + nd], "n": table["n"][dims: dims + nd], "f": table["f"][c],
                           "b": [start, end], "x": sums, "r": ranks[table["f"][c]]})
            dims += nd
            blocks += nb
        tensors[key] = {**{k: v for k, v in t.items() if k != "chunks"}, "chunks": chunks}
    out = {k: v for k, v in body.items() if k != "chunks"}
    out["version"], out["tensors"] = [1, 0], tensors
    return out


def test_format_1_checkpoint_still_loads(tmp_path):
    """Checkpoints written in format 1.0 (chunks inline) load bitwise, in place and full."""
    path, _ = make_ckpt(tmp_path, 2)
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    v1 = to_v1(body)
    write_body(path, v1)
    assert json.loads((path / MANIFEST_NAME).read_bytes())["tensors"]["big"]["chunks"][0]["x"][2]
    m = shardsafe.read_manifest(path)
    assert m.version == (1, 0) and [c.to_json() for c in m.tensors["big"].chunks] == v1["tensors"]["big"]["chunks"]
    assert_loads_correctly(path)
    dest = sentinel_dest()
    shardsafe.load(dest, path)
    want = state()
    for k in ("big", "half", "last"):
        assert tensors_equal(dest[k], want[k])
    assert tensors_equal(dest["model"]["w"], want["model"]["w"]) and dest["step"] == 12


@pytest.mark.parametrize("case", ["chunk_not_object", "checksums_not_list", "box_rank_differs", "byte_range_past_end"])
def test_inconsistent_format_1_manifest_refused(tmp_path, case):
    path, _ = make_ckpt(tmp_path, 2)
    v1 = to_v1(json.loads((path / MANIFEST_NAME).read_bytes()))
    chunk = v1["tensors"]["last"]["chunks"][0]
    if case == "chunk_not_object":
        v1["tensors"]["last"]["chunks"] = [5]
    elif case == "checksums_not_list":
        chunk["x"] = chunk["x"][0]
    elif case == "box_rank_differs":
        chunk["n"] = [20, 2]
    else:
        chunk["b"] = [v1["files"][0]["bytes"] - 40, v1["files"][0]["bytes"] + 40]
    write_body(path, v1)
    dest = sentinel_dest()
    for call in (lambda: shardsafe.read_manifest(path), lambda: shardsafe.load(dest, path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert MANIFEST_NAME in str(ei.value) and "'last'" in str(ei.value), str(ei.value)
    assert_dest_untouched(dest)


def test_rewritten_manifest_round_trips(tmp_path):
    """The helper above is faithful: re-serialising an unchanged manifest changes nothing."""
    path, _ = make_ckpt(tmp_path)
    before = (path / MANIFEST_NAME).read_bytes()
    rewrite_manifest(path, lambda m: None)
    assert (path / MANIFEST_NAME).read_bytes() == before


# --------------------------------------------------------------------------- leftovers


def test_leftover_temp_directories_are_ignored(tmp_path):
    path, _ = make_ckpt(tmp_path)
    tmp = tmp_path / ".ckpt.shardsafe-tmp-xyz"
    tmp.mkdir()
    (tmp / MANIFEST_NAME).write_bytes(b"{junk")
    (tmp / "data-r00000-00.safetensors").write_bytes(os.urandom(1000))
    (tmp_path / "junk.bin").write_bytes(os.urandom(100))
    (path / "stray.txt").write_text("not part of the checkpoint")
    assert_loads_correctly(path)
    dest = sentinel_dest()
    shardsafe.load(dest, path)
    assert dest["step"] == 12

    # A later overwrite cleans the stale temp directory and keeps loading.
    shardsafe.save(state(), path, overwrite=True)
    assert not tmp.exists()
    assert (tmp_path / "junk.bin").exists()
    assert_loads_correctly(path)


def test_interrupted_first_save_leaves_no_checkpoint(tmp_path):
    """A temp directory without a committed sibling is not a checkpoint."""
    tmp = tmp_path / ".ckpt.shardsafe-tmp-abc"
    tmp.mkdir()
    src, _ = make_ckpt(tmp_path / "src")
    for f in src.iterdir():
        (tmp / f.name).write_bytes(f.read_bytes())
    with pytest.raises(CheckpointNotFoundError):
        shardsafe.load_full(tmp_path / "ckpt")
    shardsafe.save({"x": 1}, tmp_path / "ckpt")
    assert shardsafe.load_full(tmp_path / "ckpt") == {"x": 1}
    assert not tmp.exists()


# --------------------------------------------------------------------------- pickle safety


class _Evil:
    """Unpickling this creates ``marker`` (a stand-in for running arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


class _EvilSystem:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_payloads_in_directory_never_run(tmp_path):
    path, _ = make_ckpt(tmp_path)
    marker = tmp_path / "PWNED"
    payloads = {
        "data.pkl": pickle.dumps(_Evil(marker)),
        ".metadata": pickle.dumps(_EvilSystem(marker)),
        "__0_0.distcp": pickle.dumps({"state": _Evil(marker)}),
        "model.pt": pickle.dumps(_EvilSystem(marker)),
    }
    for name, blob in payloads.items():
        (path / name).write_bytes(blob)

    # The payloads are live: unpickling one elsewhere does create its marker.
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Evil(probe))).close()
    assert probe.exists()

    assert_loads_correctly(path)
    dest = sentinel_dest()
    shardsafe.load(dest, path)
    assert dest["step"] == 12
    shardsafe.read_manifest(path)
    assert not marker.exists()


def test_no_pickle_used_on_save_or_load(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("pickle / torch.load must not be used")

    class NoUnpickler:
        def __init__(self, *args, **kwargs):
            boom()

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sd = {"model": model, "optim": opt, "extra": state()}

    monkeypatch.setattr(pickle, "loads", boom)
    monkeypatch.setattr(pickle, "load", boom)
    monkeypatch.setattr(pickle, "dumps", boom)
    monkeypatch.setattr(pickle, "dump", boom)
    monkeypatch.setattr(pickle, "Unpickler", NoUnpickler)
    monkeypatch.setattr(pickle, "Pickler", NoUnpickler)
    monkeypatch.setattr(torch, "load", boom)
    monkeypatch.setattr(torch.serialization, "load", boom)
    monkeypatch.setattr(torch, "save", boom)

    path = tmp_path / "c"
    shardsafe.save(sd, path)
    out = shardsafe.load_full(path)
    assert torch.equal(out["model"]["weight"], model.weight.detach())
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters())
    shardsafe.load({"model": model2, "optim": opt2, "extra": sentinel_dest()}, path)
    assert torch.equal(model2.weight, model.weight)
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


# --------------------------------------------------------------------------- crafted manifests

TRAILER = b', "manifest_xxh3_64": "'


def write_body(path: Path, body: dict) -> None:
    """Write a manifest body with a correct integrity trailer (docs/format.md)."""
    from shardsafe.format.checksum import checksum

    body = {k: v for k, v in body.items() if k != "manifest_xxh3_64"}
    head = json.dumps(body, separators=(",", ":")).encode()[:-1]
    (path / MANIFEST_NAME).write_bytes(head + TRAILER + checksum(head).encode() + b'"}\n')


def _row(body: dict, key: str) -> int:
    """Index in the chunk table of the first chunk of ``key`` (docs/format.md)."""
    return body["tensors"][key]["chunks"][0]


def _dims(body: dict, key: str) -> int:
    """Index in the flat ``o``/``n`` columns of the first offset of ``key``'s first chunk."""
    pos = 0
    for k, t in body["tensors"].items():
        if k == key:
            return pos
        pos += len(t["shape"]) * t["chunks"][1]
    raise KeyError(key)


def _set(body: dict, key: str, column: str, value) -> None:
    """Overwrite one field of ``key``'s first chunk in the chunk table."""
    table, row = body["chunks"], _row(body, key)
    if column == "f":
        table["f"][row] = value
    elif column == "b":
        table["b"][2 * row: 2 * row + 2] = value
    else:  # "o" / "n": one value per dim
        d = _dims(body, key)
        table[column][d: d + len(value)] = value


def _range(body: dict, key: str) -> list[int]:
    return body["chunks"]["b"][2 * _row(body, key): 2 * _row(body, key) + 2]


CRAFTED = {
    "tensors_not_object": lambda b: b.__setitem__("tensors", []),
    "files_not_list": lambda b: b.__setitem__("files", {}),
    "extra_not_object": lambda b: b.__setitem__("extra", [1]),
    "checksum_block_missing": lambda b: b["extra"].pop("checksum_block"),
    "rank_local_not_object": lambda b: b.__setitem__("rank_local", [1]),
    "world_size_zero": lambda b: b.__setitem__("world_size", 0),
    "file_index_out_of_range": lambda b: _set(b, "last", "f", 3),
    "file_index_negative": lambda b: _set(b, "last", "f", -1),
    "byte_range_too_short": lambda b: _set(b, "last", "b", [_range(b, "last")[0], _range(b, "last")[0] + 8]),
    "byte_range_past_end": lambda b: _set(b, "last", "b", [b["files"][0]["bytes"] - 40, b["files"][0]["bytes"] + 40]),
    "byte_range_in_header": lambda b: _set(b, "last", "b", [0, 80]),
    "byte_range_reversed": lambda b: _set(b, "last", "b", list(reversed(_range(b, "last")))),
    "box_outside_shape": lambda b: _set(b, "model.w", "o", [1, 0]),
    "box_negative": lambda b: _set(b, "model.w", "n", [-64, 33]),
    "box_rank_differs": lambda b: b["chunks"]["n"].pop(),
    "shape_negative": lambda b: b["tensors"]["last"].__setitem__("shape", [-40]),
    "shape_not_ints": lambda b: b["tensors"]["last"].__setitem__("shape", ["40"]),
    "shape_too_large": lambda b: b["tensors"]["last"].__setitem__("shape", [2**62]),
    "dtype_not_string": lambda b: b["tensors"]["last"].__setitem__("dtype", 5),
    "unknown_kind": lambda b: b["tensors"]["last"].__setitem__("kind", "weird"),
    "checksums_not_string": lambda b: b["chunks"].__setitem__("x", ["0123456789abcdef"]),
    "checksums_one_short": lambda b: b["chunks"].__setitem__("x", b["chunks"]["x"][:-16]),
    "checksums_not_hex": lambda b: b["chunks"].__setitem__("x", "zz" + b["chunks"]["x"][2:]),
    "column_not_ints": lambda b: b["chunks"]["f"].__setitem__(0, "0"),
    "column_has_float": lambda b: b["chunks"]["b"].__setitem__(1, float(b["chunks"]["b"][1])),
    "column_too_big": lambda b: b["chunks"]["b"].__setitem__(1, 2**70),
    "chunk_table_not_object": lambda b: b.__setitem__("chunks", [5]),
    "chunk_table_missing": lambda b: b.pop("chunks"),
    "chunk_range_not_pair": lambda b: b["tensors"]["last"].__setitem__("chunks", [5]),
    "chunk_ranges_overlap": lambda b: b["tensors"]["last"].__setitem__("chunks", [0, 1]),
    "chunks_claimed_huge": lambda b: b["tensors"]["last"].__setitem__("chunks", [_row(b, "last"), 50_000_000]),
    "chunk_count_overflow": lambda b: b["tensors"]["last"].__setitem__("chunks", [_row(b, "last"), 2**64]),
    "tensor_without_chunks": lambda b: b["tensors"]["last"].__setitem__("chunks", [_row(b, "last"), 0]),
    "shape_dim_overflow": lambda b: b["tensors"]["last"].__setitem__("shape", [0, 2**70]),
    "checksum_block_overflow": lambda b: b["extra"].__setitem__("checksum_block", 2**70),
    "checksums_with_spaces": lambda b: b["chunks"].__setitem__("x", "  " + b["chunks"]["x"][2:]),
    "file_name_escapes": lambda b: b["files"][0].__setitem__("name", "../other/data-r00000-00.safetensors"),
    "file_name_absolute": lambda b: b["files"][0].__setitem__("name", "/etc/hostname"),
    "header_bytes_huge": lambda b: b["files"][0].__setitem__("header_bytes", 10**13),
    "file_bytes_not_int": lambda b: b["files"][0].__setitem__("bytes", "many"),
    "missing_world_size": lambda b: b.pop("world_size"),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_inconsistent_manifest_refused(tmp_path, case):
    """A manifest with a valid trailer but impossible contents is refused up front, with
    CorruptCheckpointError naming the manifest, never read on trust (format 2.x)."""
    path, _ = make_ckpt(tmp_path, 2)
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    CRAFTED[case](body)
    write_body(path, body)
    dest = sentinel_dest()
    for call in (lambda: shardsafe.read_manifest(path), lambda: shardsafe.load_full(path),
                 lambda: shardsafe.load(dest, path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert MANIFEST_NAME in str(ei.value)
    assert_dest_untouched(dest)


@pytest.mark.parametrize("fmt", [2, 3])
def test_crafted_manifest_helper_is_faithful(tmp_path, fmt):
    path, _ = make_ckpt(tmp_path, fmt)
    write_body(path, json.loads((path / MANIFEST_NAME).read_bytes()))
    assert_loads_correctly(path)


# --------------------------------------------------------------------------- format 3: files, rules, indexes

INDEX = "data-r00000-00.index.json"


def write_index(path: Path, edit) -> None:
    """Apply ``edit`` to the data file's index and record its new size and digest in the
    manifest (so only the index's contents are wrong, never its digest)."""
    from shardsafe.format.checksum import checksum

    index = json.loads((path / INDEX).read_bytes())
    edit(index)
    data = json.dumps(index, separators=(",", ":")).encode()
    (path / INDEX).write_bytes(data)
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    body["files"]["index_bytes"] = [len(data)]
    body["files"]["index_x"] = checksum(data)
    write_body(path, body)


def _as_rule(b: dict, mesh: dict | None = None, placements=None, salt=0) -> None:
    """Store tensor 'last' (40 elements, one chunk in rank 0's file) by rule: a one-rank mesh."""
    t = b["tensors"]["last"]
    first, count = t.pop("chunks")
    nd = len(t["shape"])
    dims = sum(len(u["shape"]) * u["chunks"][1] for k, u in b["tensors"].items() if k < "last" and "chunks" in u)
    del b["chunks"]["o"][dims: dims + nd], b["chunks"]["n"][dims: dims + nd], b["chunks"]["f"][first]
    for u in b["tensors"].values():
        if "chunks" in u and u["chunks"][0] > first:
            u["chunks"][0] -= count
    b["meshes"] = [mesh or {"shape": [1], "ranks": [0], "dim_names": None}]
    t["kind"] = "sharded"
    t["rule"] = {"mesh": 0, "placements": placements or [["S", 0]], "salt": salt}


def test_a_rule_resolves_through_the_index(tmp_path):
    """A tensor stored by rule (here a one-rank mesh) computes its box and finds its byte
    range in the index: the same bytes load."""
    path, _ = make_ckpt(tmp_path)
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    _as_rule(body)
    write_body(path, body)
    m = shardsafe.read_manifest(path)
    assert m.tensors["last"].rule is not None and m.tensors["last"].chunk_count == 1
    assert_loads_correctly(path)


CRAFTED3 = {
    "files_not_object": lambda b: b.__setitem__("files", []),
    "file_id_with_slash": lambda b: b["files"].__setitem__("id", "/../x"),
    "file_rank_past_world": lambda b: b["files"].__setitem__("rank", [1]),
    "file_ranks_unequal_columns": lambda b: b["files"]["bytes"].append(100),
    "file_too_small": lambda b: b["files"].__setitem__("bytes", [4]),
    "index_digest_not_hex": lambda b: b["files"].__setitem__("index_x", "z" * 16),
    "index_digest_wrong": lambda b: b["files"].__setitem__("index_x", "0" * 16),
    "index_size_wrong": lambda b: b["files"].__setitem__("index_bytes", [b["files"]["index_bytes"][0] + 1]),
    "rank_local_not_list": lambda b: b.__setitem__("rank_local", {}),
    "meshes_not_list": lambda b: b.__setitem__("meshes", {}),
    "geometry_file_out_of_range": lambda b: b["chunks"]["f"].__setitem__(0, 5),
    "geometry_box_outside_shape": lambda b: b["chunks"]["o"].__setitem__(0, 10**6),
    "kind_rank_local_in_manifest": lambda b: b["tensors"]["last"].__setitem__("kind", "rank_local"),
    "rule_mesh_out_of_range": lambda b: (_as_rule(b), b["tensors"]["last"]["rule"].__setitem__("mesh", 3)),
    "rule_bad_placement": lambda b: _as_rule(b, placements=[["S", 1]]),
    "rule_placements_count": lambda b: _as_rule(b, placements=[["S", 0], ["R"]]),
    "rule_unknown_placement": lambda b: _as_rule(b, placements=[["P"]]),
    "rule_negative_salt": lambda b: _as_rule(b, salt=-1),
    "rule_mesh_rank_past_world": lambda b: _as_rule(b, mesh={"shape": [1], "ranks": [3], "dim_names": None}),
    "rule_mesh_size_wrong": lambda b: _as_rule(b, mesh={"shape": [2], "ranks": [0], "dim_names": None}),
}


@pytest.mark.parametrize("case", list(CRAFTED3))
def test_inconsistent_format_3_manifest_refused(tmp_path, case):
    """Format 3: files, meshes, rules and the geometry table are checked up front; a file
    index that does not match its digest is refused; nothing lands."""
    path, _ = make_ckpt(tmp_path)
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    CRAFTED3[case](body)
    write_body(path, body)
    dest = sentinel_dest()
    for call in (lambda: shardsafe.read_manifest(path), lambda: shardsafe.load_full(path),
                 lambda: shardsafe.load(dest, path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert MANIFEST_NAME in str(ei.value) or INDEX in str(ei.value), str(ei.value)
    assert_dest_untouched(dest)


def _chunk_row(index: dict, ordinal: int) -> int:
    return index["chunks"]["t"].index(ordinal)


CRAFTED_INDEX = {
    "not_an_index": lambda i: i.__setitem__("format", "other"),
    "rank_differs": lambda i: i.__setitem__("rank", 1),
    "header_bytes_huge": lambda i: i.__setitem__("header_bytes", 10**12),
    "header_x_short": lambda i: i.__setitem__("header_x", "abc"),
    "ordinal_out_of_range": lambda i: i["chunks"]["t"].__setitem__(-1, 99),
    "ordinals_unsorted": lambda i: i["chunks"].__setitem__("t", list(reversed(i["chunks"]["t"]))),
    "byte_range_past_end": lambda i: i["chunks"]["b"].__setitem__(1, 10**9),
    "byte_range_short": lambda i: i["chunks"]["b"].__setitem__(1, i["chunks"]["b"][0] + 2),
    "checksums_one_short": lambda i: i["chunks"].__setitem__("x", i["chunks"]["x"][:-16]),
    "chunk_missing": lambda i: [i["chunks"][c].__delitem__(slice(-n, None)) for c, n in
                                (("t", 1), ("o", 1), ("n", 1), ("b", 2))] and i["chunks"].__setitem__(
                                    "x", i["chunks"]["x"][:-16]),
    "rank_local_tensor_bad_dtype": lambda i: i["tensors"].__setitem__(
        "x#rank0", {"dtype": "pickle", "shape": [1], "kind": "rank_local"}),
    "rank_local_value_names_unknown_tensor": lambda i: i["rank_local"].__setitem__("r", {"$tensor": "nope"}),
}


@pytest.mark.parametrize("case", list(CRAFTED_INDEX))
def test_inconsistent_file_index_refused(tmp_path, case):
    """An index whose digest matches the manifest but whose contents are impossible is
    refused with CorruptCheckpointError naming the index file; nothing lands."""
    path, _ = make_ckpt(tmp_path)
    write_index(path, CRAFTED_INDEX[case])
    dest = sentinel_dest()
    for call in (lambda: shardsafe.read_manifest(path), lambda: shardsafe.load_full(path),
                 lambda: shardsafe.load(dest, path)):
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert INDEX in str(ei.value), str(ei.value)
    assert_dest_untouched(dest)


def test_flipped_or_missing_index_is_reported(tmp_path):
    path, _ = make_ckpt(tmp_path)
    raw_index = bytearray((path / INDEX).read_bytes())
    raw_index[40] ^= 1
    (path / INDEX).write_bytes(bytes(raw_index))
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest"):
        shardsafe.load_full(path)
    report = shardsafe.tools.verify_checkpoint(path)
    assert not report.ok and any(INDEX in str(p) for p in report.problems), report.problems
    (path / INDEX).unlink()
    with pytest.raises(CorruptCheckpointError, match=f"file index .*{INDEX} is missing"):
        shardsafe.load_full(path)


@pytest.mark.parametrize("case", ["huge_split_factor", "huge_strided_dim", "many_pieces"])
def test_rule_claiming_too_many_pieces_is_refused_before_any_work(tmp_path, case):
    """A rule's boxes are bounded before anything is cut: a hostile split factor or a huge
    strided dim cannot make a reader allocate or loop in proportion to what it claims."""
    import time

    path, _ = make_ckpt(tmp_path)
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    if case == "huge_split_factor":
        _as_rule(body, placements=[["SS", 0, 2**31 - 1]])
    elif case == "huge_strided_dim":  # 2^36 rows: a per-position array would need 512 GiB
        _as_rule(body, placements=[["SS", 0, 1]])
        body["tensors"]["last"]["shape"] = [2**36]
    else:  # a mesh of many ranks, each with its own piece: more pieces than the indexes could list
        body["world_size"] = 1 << 20
        _as_rule(body, mesh={"shape": [1 << 20], "ranks": list(range(1 << 20)), "dim_names": None})
        body["tensors"]["last"]["shape"] = [1 << 20]
    write_body(path, body)
    dest = sentinel_dest()
    t0 = time.perf_counter()
    calls = [lambda: shardsafe.load_full(path), lambda: shardsafe.load(dest, path)]
    if case != "huge_strided_dim":  # refused with the manifest
        calls += [lambda: shardsafe.read_manifest(path), lambda: shardsafe.tools.inspect_checkpoint(path)]
    for call in calls:  # (the huge dim: one cheap box, which its index does not list; in place, a shape mismatch)
        with pytest.raises(shardsafe.CheckpointError) as ei:
            call()
        assert "'last'" in str(ei.value) or "chunks than the file indexes" in str(ei.value), str(ei.value)
    if case == "huge_strided_dim":
        assert not shardsafe.tools.verify_checkpoint(path).ok
    assert time.perf_counter() - t0 < 30
    assert_dest_untouched(dest)
