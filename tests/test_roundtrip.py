"""Round trips through save / load / load_full: tensors of every dtype and layout,
typed Python values, Statefuls, strict-key semantics, overwrite rules, partial loads,
and the on-disk contract (safetensors-readable data files, a JSON manifest)."""

from __future__ import annotations

import collections
import enum
import errno
import json
import math
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import shardsafe
from bitwise import assert_bitwise
from shardsafe import (
    CheckpointError,
    CheckpointExistsError,
    DtypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    UnexpectedKeysError,
    UnsupportedValueError,
)
from shardsafe.format.checksum import checksum
from shardsafe.format.dtypes import NAME_TO_TORCH
from shardsafe.storage.faults import Fault, FaultyBackend

# --------------------------------------------------------------------------- helpers

EXPECTED_DTYPES = {
    "bool", "uint8", "int8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
    "float16", "bfloat16", "float32", "float64", "complex64",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
}
DTYPE_NAMES = sorted(NAME_TO_TORCH)


def assert_same(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` is a CPU tensor bitwise equal to ``want``."""
    assert_bitwise(got, want)
    assert got.device.type == "cpu"


def make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A tensor of ``shape`` with random bytes (random bit patterns, NaNs included)."""
    g = torch.Generator().manual_seed(seed)
    numel = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, (numel,), generator=g).bool().reshape(shape)
    size = torch.empty((), dtype=dtype).element_size()
    b = torch.randint(0, 256, (numel * size,), dtype=torch.uint8, generator=g)
    return b.view(dtype).reshape(shape)


def zeros(shape, dtype) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype)


def data_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


# --------------------------------------------------------------------------- tensors


def test_dtype_list_is_complete():
    assert EXPECTED_DTYPES <= set(NAME_TO_TORCH)


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_every_dtype_round_trips_bitwise(tmp_path, name):
    dt = NAME_TO_TORCH[name]
    base = make(dt, (6, 10), seed=1)
    sd = {
        "plain": make(dt, (7, 5), seed=2),
        "scalar": make(dt, (), seed=3),
        "empty": zeros((0, 4), dt),
        "transposed": base.t(),
        "stepped": base[::2, 1::3],
        "expanded": make(dt, (1, 4), seed=4).expand(3, 4),
        "nested": {"deep": [make(dt, (3,), seed=5)]},
    }
    path = tmp_path / "ckpt"
    info = shardsafe.save(sd, path)
    assert info.tensors == 7 and info.files == 1
    assert info.bytes_written == sum(f.stat().st_size for f in data_files(path))

    out = shardsafe.load_full(path)
    assert set(out) == set(sd)
    for key in ("plain", "scalar", "empty", "transposed", "stepped", "expanded"):
        assert_same(out[key], sd[key])
    assert_same(out["nested"]["deep"][0], sd["nested"]["deep"][0])

    # In place, into zeroed destinations of the right shape (some non-contiguous).
    dest = {
        "plain": zeros((7, 5), dt),
        "scalar": zeros((), dt),
        "empty": zeros((0, 4), dt),
        "transposed": zeros((6, 10), dt).t(),  # non-contiguous destination
        "stepped": zeros((3, 3), dt),
        "expanded": zeros((3, 4), dt),
        "nested": {"deep": [zeros((3,), dt)]},
    }
    keep = {k: v for k, v in dest.items() if isinstance(v, torch.Tensor)}
    shardsafe.load(dest, path)
    for key, t in keep.items():
        assert dest[key] is t, "in-place load must fill the destination tensor, not replace it"
        assert_same(t, sd[key])
    assert_same(dest["nested"]["deep"][0], sd["nested"]["deep"][0])


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_data_file_opens_with_safetensors(tmp_path, name):
    dt = NAME_TO_TORCH[name]
    sd = {"a": make(dt, (4, 6), seed=7), "b": {"c": make(dt, (5,), seed=8)}, "s": make(dt, (), seed=9)}
    shardsafe.save(sd, tmp_path / "ckpt")
    (file,) = data_files(tmp_path / "ckpt")
    with safe_open(str(file), "pt") as f:
        assert set(f.keys()) == {"a", "b.c", "s"}
        assert_same(f.get_tensor("a"), sd["a"])
        assert_same(f.get_tensor("b.c"), sd["b"]["c"])
        assert_same(f.get_tensor("s"), sd["s"])


def test_zero_size_and_scalar_tensors(tmp_path):
    sd = {
        "e1": torch.empty(0),
        "e2": torch.empty(3, 0, dtype=torch.int64),
        "e3": torch.empty(0, 5, 2, dtype=torch.bfloat16),
        "s_f": torch.tensor(3.25),
        "s_b": torch.tensor(True),
        "s_i": torch.tensor(-(2**62), dtype=torch.int64),
        "s_h": torch.tensor(float("-inf"), dtype=torch.float16),
    }
    shardsafe.save(sd, tmp_path / "c")
    out = shardsafe.load_full(tmp_path / "c")
    for k, v in sd.items():
        assert_same(out[k], v)
    assert out["s_i"].item() == -(2**62)
    dest = {k: torch.zeros_like(v) for k, v in sd.items()}
    shardsafe.load(dest, tmp_path / "c")
    for k, v in sd.items():
        assert_same(dest[k], v)


def test_views_sharing_storage_and_conj(tmp_path):
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    c = make(torch.complex64, (4, 3), seed=11)
    sd = {
        "base": base,
        "rows": base[1:4],  # shares storage with base
        "cols": base[:, 2:5],  # shares storage, non-contiguous
        "again": base.t(),  # third view of the same storage
        "conj": c.conj(),  # lazy conjugation view
        "negimag": c.conj().imag,  # lazy negation view
        "same_obj_1": c,
        "same_obj_2": c,  # one tensor at two keys
    }
    assert sd["conj"].is_conj() and sd["negimag"].is_neg()
    shardsafe.save(sd, tmp_path / "c")
    out = shardsafe.load_full(tmp_path / "c")
    for k, v in sd.items():
        assert_same(out[k], v)
    assert torch.equal(out["conj"], c.conj().resolve_conj())
    assert not out["conj"].is_conj()
    # The loaded views are independent tensors.
    out["rows"].fill_(-1)
    assert torch.equal(out["base"], base)


def test_in_place_load_into_view_of_larger_buffer(tmp_path):
    src = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    shardsafe.save({"w": src}, tmp_path / "c")
    big = torch.full((5, 4), -7, dtype=torch.int32)
    shardsafe.load({"w": big[1:4]}, tmp_path / "c")
    assert torch.equal(big[1:4], src)
    assert (big[0] == -7).all() and (big[4] == -7).all()
    strided = torch.full((3, 8), -7, dtype=torch.int32)
    shardsafe.load({"w": strided[:, ::2]}, tmp_path / "c")
    assert torch.equal(strided[:, ::2], src)
    assert (strided[:, 1::2] == -7).all()


def test_parameters_and_grad_tensors(tmp_path):
    p = torch.nn.Parameter(torch.randn(3, 3))
    shardsafe.save({"p": p}, tmp_path / "c")
    out = shardsafe.load_full(tmp_path / "c")["p"]
    assert_same(out, p.detach())
    assert not out.requires_grad


def test_unsupported_tensor_dtype_refused(tmp_path):
    path = tmp_path / "c"
    with pytest.raises(UnsupportedValueError) as ei:
        shardsafe.save({"ok": torch.ones(2), "model": {"z": torch.ones(2, dtype=torch.complex128)}}, path)
    assert "model.z" in str(ei.value) and "complex128" in str(ei.value)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- values


def test_python_values_round_trip_exactly(tmp_path):
    values = {
        "none": None,
        "t": True,
        "f": False,
        "small": 7,
        "neg": -3,
        "edge_lo": -(2**53) + 1,
        "edge_hi": 2**53 - 1,
        "edge_big": 2**53,
        "big": 2**200,
        "negbig": -(2**64),
        "huge": 2**2039 - 1,  # the largest int a writer saves (what torch.load(weights_only=True) reads)
        "neghuge": -(2**2039),
        "floats": [0.1, 1e-310, 5e-324, 1.7976931348623157e308, 1e16, 2.0**70, 3.0],
        "text": "héllo wörld ✓ 𝄞 \x00 \n \"quoted\" \\ $tensor",
        "empty_str": "",
        "bytes": bytes(range(256)),
        "empty_bytes": b"",
        "list": [1, "a", None, [2, [3]]],
        "tuple": (1, (2, 3), [4, (5,)], ()),
        "dict_str": {"a": 1, "b": {"c": 2}},
        "dict_int": {0: "zero", -1: "minus", 2**70: "big", 5: {"x": 1}},
        "dict_dollar": {"$tensor": "not a ref", "$dict": 1, "$": {"$int": "x"}},
        "dict_mixed": {"a": 1, 2: "b"},
        "empty_dict": {},
        "empty_list": [],
    }
    shardsafe.save(values, tmp_path / "c")
    out = shardsafe.load_full(tmp_path / "c")
    assert out == values
    # Types are kept, not just equality (True == 1, (1,) != [1] but check anyway).
    assert out["t"] is True and out["f"] is False and out["none"] is None
    assert type(out["small"]) is int and type(out["big"]) is int and type(out["huge"]) is int
    assert type(out["tuple"]) is tuple and type(out["tuple"][1]) is tuple
    assert type(out["tuple"][2]) is list and type(out["tuple"][2][1]) is tuple
    assert type(out["list"]) is list
    assert type(out["bytes"]) is bytes
    assert list(out["dict_int"]) == [0, -1, 2**70, 5]
    assert all(type(k) is int for k in out["dict_int"])
    assert list(out["dict_mixed"]) == ["a", 2]
    for a, b in zip(out["floats"], values["floats"]):
        assert type(a) is float and struct.pack("<d", a) == struct.pack("<d", b)


def test_special_floats(tmp_path):
    sd = {"nan": float("nan"), "inf": float("inf"), "ninf": float("-inf"), "nzero": -0.0, "zero": 0.0,
          "in_list": [float("nan"), -0.0], "in_tuple": (float("inf"),)}
    shardsafe.save(sd, tmp_path / "c")
    out = shardsafe.load_full(tmp_path / "c")
    assert math.isnan(out["nan"]) and math.isnan(out["in_list"][0])
    assert out["inf"] == math.inf and out["ninf"] == -math.inf and out["in_tuple"] == (math.inf,)
    assert out["nzero"] == 0.0 and math.copysign(1.0, out["nzero"]) == -1.0
    assert math.copysign(1.0, out["in_list"][1]) == -1.0
    assert math.copysign(1.0, out["zero"]) == 1.0


def test_deeply_nested(tmp_path):
    leaf = torch.arange(5, dtype=torch.int16)
    tree = {"leaf": leaf, "v": "bottom"}
    for i in range(100):
        if i % 3 == 0:
            tree = [tree, i]
        elif i % 3 == 1:
            tree = {"k": tree, "i": i}
        else:
            tree = (tree,)
    shardsafe.save({"root": tree}, tmp_path / "c")
    out = shardsafe.load_full(tmp_path / "c")["root"]
    node = out
    for i in reversed(range(100)):
        if i % 3 == 0:
            assert type(node) is list and node[1] == i
            node = node[0]
        elif i % 3 == 1:
            assert type(node) is dict and node["i"] == i
            node = node["k"]
        else:
            assert type(node) is tuple and len(node) == 1
            node = node[0]
    assert node["v"] == "bottom"
    assert_same(node["leaf"], leaf)


class _Custom:
    pass


class _Color(enum.IntEnum):
    RED = 1


class _Mode(str, enum.Enum):  # noqa: UP042 - the classic str-mixin enum
    TRAIN = "train"


_Point = collections.namedtuple("_Point", "x y")


@pytest.mark.parametrize(
    "value, type_name",
    [
        (_Custom(), "_Custom"),
        ({1, 2}, "set"),
        (torch.device("cpu"), "device"),
        (_Point(1, 2), "_Point"),
        (_Color.RED, "_Color"),
        (frozenset(), "frozenset"),
        (1 + 2j, "complex"),
        (torch.float32, "dtype"),
        (_Mode.TRAIN, "_Mode"),
        (bytearray(b"abc"), "bytearray"),
    ],
    ids=["custom", "set", "device", "namedtuple", "intenum", "frozenset", "complex", "dtype", "strenum",
         "bytearray"],
)
def test_arbitrary_objects_refused(tmp_path, value, type_name):
    path = tmp_path / "ckpt"
    state = {"w": torch.ones(3), "cfg": {"items": [0, {"bad": value}]}}
    with pytest.raises(UnsupportedValueError) as ei:
        shardsafe.save(state, path)
    msg = str(ei.value)
    assert "cfg.items.1.bad" in msg
    assert type_name in msg
    assert list(tmp_path.iterdir()) == [], "a refused save must leave nothing behind"


def test_refused_save_keeps_existing_checkpoint(tmp_path):
    path = tmp_path / "ckpt"
    shardsafe.save({"w": torch.ones(3), "v": 1}, path)
    before = sorted(p.name for p in path.iterdir())
    with pytest.raises(UnsupportedValueError):
        shardsafe.save({"w": torch.zeros(3), "v": {3, 4}}, path, overwrite=True)
    assert sorted(p.name for p in path.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    out = shardsafe.load_full(path)
    assert out["v"] == 1 and torch.equal(out["w"], torch.ones(3))


@pytest.mark.parametrize("key", [True, 1.5, None, (1, 2)], ids=["bool", "float", "none", "tuple"])
def test_bad_dict_keys_refused(tmp_path, key):
    with pytest.raises(UnsupportedValueError) as ei:
        shardsafe.save({"outer": {"inner": {key: 1}}}, tmp_path / "c")
    assert "outer.inner" in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_colliding_dotted_keys_refused(tmp_path):
    with pytest.raises(UnsupportedValueError) as ei:
        shardsafe.save({"a.b": torch.ones(1), "a": {"b": torch.zeros(1)}}, tmp_path / "c")
    assert "a.b" in str(ei.value)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- Statefuls


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.LayerNorm(16), torch.nn.GELU(), torch.nn.Linear(16, 3)
    )


def _train(model, opt, steps: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 6, generator=g)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_model_and_optimizer_into_fresh_objects(tmp_path):
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05, betas=(0.8, 0.95))
    _train(model, opt, 3, seed=1)
    shardsafe.save({"model": model, "optim": opt, "step": 3}, tmp_path / "c")

    model2 = _model(123)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1.0)
    assert opt2.state_dict()["state"] == {}
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    dest = {"model": model2, "optim": opt2, "step": 0}
    shardsafe.load(dest, tmp_path / "c")

    assert dest["step"] == 3
    assert dest["model"] is model2 and dest["optim"] is opt2
    for (k1, a), (k2, b) in zip(model.state_dict().items(), model2.state_dict().items()):
        assert k1 == k2
        assert_same(b, a)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s2["param_groups"] == s1["param_groups"]
    assert s2["param_groups"][0]["betas"] == (0.8, 0.95)
    assert opt2.param_groups[0]["lr"] == 3e-3
    assert set(s2["state"]) == set(s1["state"]) == set(range(len(list(model.parameters()))))
    for pid, st in s1["state"].items():
        assert set(s2["state"][pid]) == set(st)
        for name, v in st.items():
            assert_same(s2["state"][pid][name], v)
    # Training continues identically.
    _train(model, opt, 2, seed=2)
    _train(model2, opt2, 2, seed=2)
    for a, b in zip(model.parameters(), model2.parameters()):
        assert_same(b, a)


class _Recorder:
    """A user Stateful that records what load_state_dict received."""

    def __init__(self, n: int, t: torch.Tensor) -> None:
        self.n = n
        self.t = t
        self.loaded: list = []

    def state_dict(self):
        return {"n": self.n, "t": self.t, "meta": ("x", 1)}

    def load_state_dict(self, sd):
        self.loaded.append(sd)
        self.n = sd["n"]


def test_custom_stateful(tmp_path):
    src = _Recorder(41, torch.arange(4.0))
    shardsafe.save({"obj": src, "plain": {"lr": 0.5}}, tmp_path / "c")
    full = shardsafe.load_full(tmp_path / "c")
    assert set(full) == {"obj", "plain"} and set(full["obj"]) == {"n", "t", "meta"}
    assert full["plain"] == {"lr": 0.5}
    assert full["obj"]["n"] == 41 and full["obj"]["meta"] == ("x", 1)
    assert_same(full["obj"]["t"], torch.arange(4.0))

    buf = torch.zeros(4)
    dst = _Recorder(0, buf)
    dest = {"obj": dst, "plain": {"lr": 0.0}}
    shardsafe.load(dest, tmp_path / "c")
    assert dst.n == 41
    assert len(dst.loaded) == 1
    assert dst.loaded[0]["meta"] == ("x", 1)
    assert dst.loaded[0]["t"] is buf
    assert torch.equal(buf, torch.arange(4.0))
    assert dest["plain"] == {"lr": 0.5}


# --------------------------------------------------------------------------- strict semantics


def _saved(tmp_path) -> Path:
    path = tmp_path / "c"
    shardsafe.save(
        {"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(6, dtype=torch.int32), "v": 7,
         "n": {"x": torch.ones(2)}, "extra": torch.full((3,), 9.0)},
        path,
    )
    return path


def test_missing_key_strict_raises_and_changes_nothing(tmp_path):
    path = _saved(tmp_path)
    a = torch.zeros(3, 4)
    rec = _Recorder(0, torch.zeros(1))
    dest = {"a": a, "v": 0, "n": {"x": torch.zeros(2)}, "absent": torch.zeros(1), "rec": rec}
    with pytest.raises(MissingKeysError) as ei:
        shardsafe.load(dest, path)
    assert "absent" in str(ei.value)
    assert torch.equal(a, torch.zeros(3, 4)) and dest["a"] is a
    assert dest["v"] == 0
    assert torch.equal(dest["n"]["x"], torch.zeros(2))
    assert rec.loaded == []


def test_missing_nested_key_strict(tmp_path):
    path = _saved(tmp_path)
    dest = {"n": {"x": torch.zeros(2), "y": 5}}
    with pytest.raises(MissingKeysError) as ei:
        shardsafe.load(dest, path)
    assert "n.y" in str(ei.value)
    assert torch.equal(dest["n"]["x"], torch.zeros(2)) and dest["n"]["y"] == 5


def test_missing_key_non_strict_skips(tmp_path):
    path = _saved(tmp_path)
    absent = torch.full((1,), 5.0)
    dest = {"a": torch.zeros(3, 4), "v": 0, "absent": absent}
    shardsafe.load(dest, path, strict=False)
    assert torch.equal(dest["a"], torch.arange(12.0).reshape(3, 4))
    assert dest["v"] == 7
    assert dest["absent"] is absent and torch.equal(absent, torch.full((1,), 5.0))


def test_shape_mismatch(tmp_path):
    path = _saved(tmp_path)
    a = torch.zeros(4, 3)
    b = torch.zeros(6, dtype=torch.int32)
    dest = {"a": a, "b": b, "v": 0}
    with pytest.raises(ShapeMismatchError) as ei:
        shardsafe.load(dest, path)
    msg = str(ei.value)
    assert "'a'" in msg and "[3, 4]" in msg and "[4, 3]" in msg
    assert torch.equal(a, torch.zeros(4, 3))
    assert torch.equal(b, torch.zeros(6, dtype=torch.int32))
    assert dest["v"] == 0


def test_dtype_mismatch(tmp_path):
    path = _saved(tmp_path)
    a = torch.zeros(3, 4)
    b = torch.zeros(6, dtype=torch.int64)
    dest = {"a": a, "b": b}
    with pytest.raises(DtypeMismatchError) as ei:
        shardsafe.load(dest, path)
    msg = str(ei.value)
    assert "'b'" in msg and "int32" in msg and "int64" in msg
    assert torch.equal(a, torch.zeros(3, 4)) and torch.equal(b, torch.zeros(6, dtype=torch.int64))


def test_tensor_where_checkpoint_has_value(tmp_path):
    path = _saved(tmp_path)
    with pytest.raises(UnexpectedKeysError) as ei:
        shardsafe.load({"v": torch.zeros(1)}, path)
    assert "'v'" in str(ei.value)


def test_extra_checkpoint_keys_ignored_and_values_replaced(tmp_path):
    path = _saved(tmp_path)
    a = torch.zeros(3, 4)
    dest = {"a": a, "v": "old"}
    info = shardsafe.load(dest, path)
    assert set(dest) == {"a", "v"}
    assert dest["a"] is a and torch.equal(a, torch.arange(12.0).reshape(3, 4))
    assert dest["v"] == 7
    assert info.tensors == 1


def test_nested_dict_receives_all_saved_entries(tmp_path):
    path = tmp_path / "c"
    shardsafe.save({"cfg": {"lr": 0.1, "betas": (0.9, 0.99), "sched": {"warmup": 10}}}, path)
    dest = {"cfg": {"lr": 0.0}}
    shardsafe.load(dest, path)
    assert dest == {"cfg": {"lr": 0.1, "betas": (0.9, 0.99), "sched": {"warmup": 10}}}


# --------------------------------------------------------------------------- overwrite


def test_overwrite_semantics(tmp_path):
    path = tmp_path / "c"
    shardsafe.save({"w": torch.ones(4), "v": "first"}, path)
    with pytest.raises(CheckpointExistsError) as ei:
        shardsafe.save({"w": torch.zeros(4), "v": "second"}, path)
    assert str(path) in str(ei.value)
    out = shardsafe.load_full(path)
    assert out["v"] == "first" and torch.equal(out["w"], torch.ones(4))

    shardsafe.save({"w2": torch.full((2,), 3.0), "v": "second"}, path, overwrite=True)
    out = shardsafe.load_full(path)
    assert set(out) == {"w2", "v"}
    assert out["v"] == "second" and torch.equal(out["w2"], torch.full((2,), 3.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"], "no temp or old directory left behind"


def test_save_refuses_non_checkpoint_directory(tmp_path):
    path = tmp_path / "notes"
    path.mkdir()
    (path / "readme.txt").write_text("precious")
    for overwrite in (False, True):
        with pytest.raises(CheckpointError) as ei:
            shardsafe.save({"w": torch.ones(1)}, path, overwrite=overwrite)
        assert not isinstance(ei.value, CheckpointExistsError)
        assert str(path) in str(ei.value)
    assert sorted(p.name for p in path.iterdir()) == ["readme.txt"]
    assert (path / "readme.txt").read_text() == "precious"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_save_refuses_file_path(tmp_path):
    path = tmp_path / "afile"
    path.write_text("x")
    with pytest.raises(CheckpointError) as ei:
        shardsafe.save({"w": torch.ones(1)}, path, overwrite=True)
    assert str(path) in str(ei.value)
    assert path.read_text() == "x"


def test_save_into_empty_directory_and_new_parents(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    shardsafe.save({"w": torch.ones(2)}, empty)
    assert torch.equal(shardsafe.load_full(empty)["w"], torch.ones(2))
    deep = tmp_path / "x" / "y" / "z"
    shardsafe.save({"w": torch.ones(2)}, str(deep))
    assert torch.equal(shardsafe.load_full(str(deep))["w"], torch.ones(2))


# --------------------------------------------------------------------------- partial load_full


def _partial(tmp_path) -> tuple[Path, dict]:
    sd = {
        "model": {"w": torch.arange(6.0), "b": torch.arange(3, dtype=torch.int8), "sub": {"k": 1}},
        "optim": {"state": {0: {"m": torch.ones(2)}}, "lr": 0.1},
        "step": 5,
        "xs": [torch.zeros(2), torch.full((2,), 7.0)],
    }
    path = tmp_path / "c"
    shardsafe.save(sd, path)
    return path, sd


def test_load_full_keys_prefix(tmp_path):
    path, sd = _partial(tmp_path)
    out = shardsafe.load_full(path, keys="model")
    assert set(out) == {"model"}
    assert set(out["model"]) == {"w", "b", "sub"}
    assert_same(out["model"]["w"], sd["model"]["w"])
    assert_same(out["model"]["b"], sd["model"]["b"])
    assert out["model"]["sub"] == {"k": 1}


def test_load_full_keys_exact(tmp_path):
    path, sd = _partial(tmp_path)
    out = shardsafe.load_full(path, keys=["model.w"])
    assert out.keys() == {"model"} and out["model"].keys() == {"w"}
    assert_same(out["model"]["w"], sd["model"]["w"])
    out = shardsafe.load_full(path, keys=["model.w", "step", "optim.state"])
    assert out["step"] == 5
    assert out["optim"].keys() == {"state"}
    assert list(out["optim"]["state"]) == [0]
    assert_same(out["optim"]["state"][0]["m"], torch.ones(2))


@pytest.mark.parametrize("key", ["nope", "model.nope", "model.w.x", "mod", "step.0"])
def test_load_full_unknown_key(tmp_path, key):
    path, _ = _partial(tmp_path)
    with pytest.raises(MissingKeysError) as ei:
        shardsafe.load_full(path, keys=[key])
    assert repr(key) in str(ei.value) or key in str(ei.value)


def test_load_full_keys_inside_list(tmp_path):
    path, sd = _partial(tmp_path)
    out = shardsafe.load_full(path, keys="xs.1")  # 'xs.1' is a tensor key in the manifest
    assert "xs" in out
    leaves = out["xs"].values() if isinstance(out["xs"], dict) else out["xs"]
    assert any(isinstance(t, torch.Tensor) and torch.equal(t, sd["xs"][1]) for t in leaves)


# --------------------------------------------------------------------------- on-disk contract


def test_manifest_is_json_and_describes_tensors(tmp_path):
    sd = {"a": torch.ones(2, 3, dtype=torch.bfloat16), "v": {"x": (1, 2)}, "big": 2**100}
    path = tmp_path / "c"
    shardsafe.save(sd, path)
    names = sorted(p.name for p in path.iterdir())
    assert names == ["data-r00000-00.index.json", "data-r00000-00.safetensors", "manifest.json"]
    body = json.loads((path / "manifest.json").read_bytes())
    assert body["format"] == "shardsafe" and body["version"] == [3, 1]
    assert body["tensors"]["a"]["dtype"] == "bfloat16" and body["tensors"]["a"]["shape"] == [2, 3]
    # The geometry table (docs/format.md): tensor "a" owns row 0, one box in file 0.
    (first, count) = body["tensors"]["a"]["chunks"]
    table = body["chunks"]
    assert (first, count) == (0, 1) and table["o"][:2] == [0, 0] and table["n"][:2] == [2, 3] and table["f"] == [0]
    index_bytes = (path / "data-r00000-00.index.json").read_bytes()
    assert body["files"]["rank"] == [0] and body["files"]["index_bytes"] == [len(index_bytes)]
    assert body["files"]["index_x"] == checksum(index_bytes)
    # The file's index: tensor 0 ("a") has one chunk of 12 bf16 bytes, with one block checksum.
    index = json.loads(index_bytes)
    assert index["chunks"]["t"] == [0] and index["chunks"]["o"] == [0, 0] and index["chunks"]["n"] == [2, 3]
    start, end = index["chunks"]["b"]
    assert end - start == 12 and len(index["chunks"]["x"]) == 16
    # 3.1: the chunk digest, XXH3-128 over its blocks' XXH3-128 digests (one block here).
    import xxhash

    data = (path / "data-r00000-00.safetensors").read_bytes()[start:end]
    assert index["version"] == [3, 1] and "refs" not in index and "refs" not in body
    assert index["chunks"]["h"] == xxhash.xxh3_128_hexdigest(xxhash.xxh3_128_digest(data))
    assert body["tree"]["a"] == {"$tensor": "a"}
    assert body["tree"]["v"] == {"x": {"$tuple": [1, 2]}}
    assert body["tree"]["big"] == {"$int": str(2**100)}
    m = shardsafe.read_manifest(path)
    assert m.tensors["a"].shape == (2, 3) and m.tensors["a"].dtype == "bfloat16"
    assert [f.name for f in m.files] == ["data-r00000-00.safetensors"]


def test_values_only_checkpoint(tmp_path):
    path = tmp_path / "c"
    shardsafe.save({"step": 1, "cfg": {"a": [1, 2]}}, path)
    assert shardsafe.load_full(path) == {"step": 1, "cfg": {"a": [1, 2]}}
    dest = {"step": 0}
    shardsafe.load(dest, path)
    assert dest == {"step": 1}


def test_overlapping_destination_refused_before_any_write(tmp_path):
    path = tmp_path / "c"
    shardsafe.save({"a": torch.arange(12.0).reshape(3, 4), "b": torch.arange(6, dtype=torch.int32)}, path)
    b = torch.zeros(6, dtype=torch.int32)
    dest = {"a": torch.zeros(1, 4).expand(3, 4), "b": b}
    with pytest.raises(CheckpointError) as ei:
        shardsafe.load(dest, path)
    assert "'a'" in str(ei.value)
    assert torch.equal(b, torch.zeros(6, dtype=torch.int32)), "a failed load must not touch the destination"


FAULTS = {
    "header_write": Fault("write", errno.ENOSPC, name="data-r"),  # the first write of a data file is its header
    "data_write": Fault("write", errno.ENOSPC, name="data-r", skip=1),
    "data_fsync": Fault("finish", errno.EIO, name="data-r"),
    "manifest_write": Fault("write", errno.ENOSPC, name="manifest"),
    "commit_sync": Fault("sync", errno.EIO),
    "commit_rename": Fault("exchange", errno.EIO),
}


@pytest.mark.parametrize("fail_at", list(FAULTS))
def test_failed_overwrite_keeps_old_checkpoint(tmp_path, fail_at):
    """A failing disk at any step of an overwrite: a StorageError that keeps errno and the
    file name, the old checkpoint intact, no temp folder left."""
    path = tmp_path / "c"
    shardsafe.save({"w": torch.ones(64), "v": "old"}, path)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    fault = FAULTS[fail_at]
    with shardsafe.Checkpointer(storage=FaultyBackend(faults=[fault])) as cp:
        with pytest.raises(shardsafe.StorageError) as ei:
            cp.save({"w": torch.zeros(64), "v": "new"}, path, overwrite=True)
    assert "injected" in str(ei.value) and ei.value.errno == fault.errno and ei.value.filename
    assert isinstance(ei.value.__cause__, OSError)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"], "the temp directory must be removed"
    out = shardsafe.load_full(path)
    assert out["v"] == "old" and torch.equal(out["w"], torch.ones(64))


@pytest.mark.parametrize("view", ["conj", "neg"])
def test_load_into_lazy_view_destination(tmp_path, view):
    src = make(torch.complex64, (5,), seed=3) if view == "conj" else torch.arange(5.0)
    shardsafe.save({"x": src}, tmp_path / "c")
    storage = torch.zeros_like(src)
    dest = storage.conj() if view == "conj" else torch._neg_view(storage)
    assert dest.is_conj() or dest.is_neg()
    shardsafe.load({"x": dest}, tmp_path / "c")
    assert torch.equal(dest, src)
