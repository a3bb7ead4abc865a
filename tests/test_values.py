"""Typed JSON (format/values.py) and state flattening (state/tree.flatten): exact round
trips through real JSON text, and corrupt encodings refused with CorruptCheckpointError."""

from __future__ import annotations

import enum
import json
import math
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bitwise import assert_bitwise
from shardsafe.errors import CorruptCheckpointError, UnsupportedValueError
from shardsafe.format import values as values_mod
from shardsafe.format.values import PICKLE_INT_BOUND, decode, encode_dict_key, encode_scalar
from shardsafe.state.tree import flatten


def through_json(tree):
    """What a manifest round trip does to a typed-JSON tree (no NaN literals allowed)."""
    return json.loads(json.dumps(tree, separators=(",", ":"), allow_nan=False))


def round_trip(value):
    flat = flatten({"v": value})
    assert flat.tensors == {}
    return decode(through_json(flat.tree))["v"]


def fbits(x: float) -> bytes:
    return struct.pack("<d", x)


# --------------------------------------------------------------------------- ints


@pytest.mark.parametrize(
    "value, tagged",
    [
        (0, False),
        (2**53 - 1, False),
        (-(2**53) + 1, False),
        (2**53, True),
        (-(2**53), True),
        (2**63, True),
        (-(2**64), True),
        (2**200, True),
        (-(10**4299) - 7, True),
        (10**4300, True),  # first int that str() refuses by default
        (-(7**20000), True),  # 16902 digits
    ],
    ids=["0", "2^53-1", "-(2^53-1)", "2^53", "-2^53", "2^63", "-2^64", "2^200", "-10^4299-7", "10^4300",
         "-7^20000"],
)
def test_int_encoding(value, tagged):
    if not -PICKLE_INT_BOUND <= value < PICKLE_INT_BOUND:
        # Writers refuse it (every export target must read what is saved), readers accept it
        # (checkpoints written before the bound keep loading).
        with pytest.raises(UnsupportedValueError, match=r"'k'.*at most 2039 bits"):
            encode_scalar(value, "k")
        enc = {"$int": values_mod._int_to_decimal(value)}
    else:
        enc = encode_scalar(value, "k")
    if tagged:
        assert isinstance(enc, dict) and list(enc) == ["$int"]
        assert isinstance(enc["$int"], str)
    else:
        assert enc == value and type(enc) is int
    out = decode(through_json(enc))
    assert type(out) is int and out == value


def test_int_tag_text_is_plain_decimal():
    assert encode_scalar(2**64, "k") == {"$int": "18446744073709551616"}
    assert encode_scalar(-(2**53), "k") == {"$int": "-9007199254740992"}
    text = values_mod._int_to_decimal(10**5000 + 123)  # what writers before the 2039-bit bound wrote
    assert text == "1" + "0" * 4997 + "123"
    assert decode({"$int": text}) == 10**5000 + 123
    assert encode_scalar(PICKLE_INT_BOUND - 1, "k") == {"$int": str(PICKLE_INT_BOUND - 1)}
    assert encode_scalar(-PICKLE_INT_BOUND, "k") == {"$int": str(-PICKLE_INT_BOUND)}
    for value in (PICKLE_INT_BOUND, -PICKLE_INT_BOUND - 1):
        with pytest.raises(UnsupportedValueError, match="at most 2039 bits"):
            encode_scalar(value, "k")


def test_int_bound_is_what_weights_only_torch_load_reads(tmp_path):
    """The writer's bound is exactly the range torch.load(weights_only=True) reads back."""
    for value in (PICKLE_INT_BOUND - 1, -PICKLE_INT_BOUND):
        torch.save({"v": value}, tmp_path / "ok.pt")
        assert torch.load(tmp_path / "ok.pt", weights_only=True)["v"] == value
    torch.save({"v": PICKLE_INT_BOUND}, tmp_path / "big.pt")
    with pytest.raises(Exception, match="(?i)weights.only"):
        torch.load(tmp_path / "big.pt", weights_only=True)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=-PICKLE_INT_BOUND, max_value=PICKLE_INT_BOUND - 1))
def test_int_round_trip_property(value):
    assert round_trip(value) == value


@settings(max_examples=300, deadline=None)
@given(st.floats(allow_nan=True, allow_infinity=True))
def test_float_round_trip_property(value):
    out = round_trip(value)
    assert type(out) is float
    if math.isnan(value):
        assert math.isnan(out)
    else:
        assert fbits(out) == fbits(value)


@pytest.mark.parametrize(
    "value", [0.1, -0.0, 0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1.7976931348623157e308, 1e16, 2.0**63, 1 / 3]
)
def test_float_round_trip_exact(value):
    enc = encode_scalar(value, "k")
    assert type(enc) is float
    text = json.dumps(enc)
    assert text == repr(value)  # shortest round-trip repr
    assert "." in text or "e" in text  # never written as a JSON integer
    assert fbits(round_trip(value)) == fbits(value)


def test_non_finite_floats_are_tagged():
    assert encode_scalar(float("nan"), "k") == {"$float": "nan"}
    assert encode_scalar(float("inf"), "k") == {"$float": "inf"}
    assert encode_scalar(float("-inf"), "k") == {"$float": "-inf"}
    assert math.isnan(decode({"$float": "nan"}))
    assert decode({"$float": "-inf"}) == -math.inf


# --------------------------------------------------------------------------- bytes, str, containers


@pytest.mark.parametrize("value", [b"", b"\x00", bytes(range(256)), b"\xff" * 1000])
def test_bytes_round_trip(value):
    enc = encode_scalar(value, "k")
    assert list(enc) == ["$bytes"]
    out = round_trip(value)
    assert type(out) is bytes and out == value


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_str_round_trip_property(value):
    out = round_trip(value)
    assert type(out) is str and out == value


json_leaves = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=False), st.text(max_size=8), st.binary(max_size=8),
)
values = st.recursive(
    json_leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.lists(children, max_size=4).map(tuple),
        st.dictionaries(st.text(max_size=5), children, max_size=4),
        st.dictionaries(st.integers(min_value=-(2**70), max_value=2**70), children, max_size=4),
    ),
    max_leaves=30,
)


@settings(max_examples=300, deadline=None)
@given(values)
def test_nested_values_round_trip_property(value):
    # types (1 != 1.0 != True), float bits (-0.0 != 0.0), key order and dict classes all count
    assert_bitwise(round_trip(value), value, "value", ordered=True, dict_types=True)


def test_dollar_keys_are_escaped():
    value = {"$tensor": "not-a-ref", "$int": "5", "$": 1, "plain": {"$dict": []}}
    flat = flatten({"v": value})
    assert list(flat.tree["v"]) == ["$dict"]
    out = round_trip(value)
    assert out == value and list(out) == list(value)
    # A single '$' key that matches a tag is not mistaken for the tag.
    assert round_trip({"$tuple": [1, 2]}) == {"$tuple": [1, 2]}
    assert round_trip({"$bytes": "AA=="}) == {"$bytes": "AA=="}


def test_int_and_mixed_keys():
    value = {3: "a", -1: "b", 2**64: "c", "3": "d"}
    out = round_trip(value)
    assert list(out) == [3, -1, 2**64, "3"]
    assert out[3] == "a" and out["3"] == "d" and out[2**64] == "c"


def test_tuple_stays_tuple_and_list_stays_list():
    out = round_trip(((1, [2, (3,)]), [()]))
    assert type(out) is tuple and type(out[0]) is tuple and type(out[0][1]) is list
    assert type(out[0][1][1]) is tuple and type(out[1]) is list and out[1][0] == ()


def test_strings_that_look_like_tags_stay_strings():
    for s in ["$int", "$tensor", "{\"$int\": \"5\"}", "nan", "inf"]:
        assert round_trip(s) == s
        assert round_trip([s]) == [s]


# --------------------------------------------------------------------------- flatten


def test_flatten_names_tensors_by_dotted_path():
    a, b, c = torch.ones(1), torch.zeros(2), torch.arange(3)
    flat = flatten({"m": {"w": a, "layers": [b, (c,)]}, "n": 1})
    assert flat.tensors.keys() == {"m.w", "m.layers.0", "m.layers.1.0"}
    assert flat.tensors["m.w"] is a and flat.tensors["m.layers.1.0"] is c
    assert flat.tree == {
        "m": {
            "w": {"$tensor": "m.w"},
            "layers": [{"$tensor": "m.layers.0"}, {"$tuple": [{"$tensor": "m.layers.1.0"}]}],
        },
        "n": 1,
    }
    refs = {}
    out = decode(through_json(flat.tree), lambda tag, key: refs.setdefault(key, (tag, key)))
    assert out["m"]["layers"][1] == (("$tensor", "m.layers.1.0"),)
    assert set(refs) == set(flat.tensors)


def test_flatten_int_keyed_tensor_paths():
    t = torch.ones(1)
    flat = flatten({"state": {0: {"exp_avg": t}, 10: {"exp_avg": t}}})
    assert flat.tensors.keys() == {"state.0.exp_avg", "state.10.exp_avg"}


def test_flatten_calls_state_dict_of_statefuls():
    class S:
        def state_dict(self):
            return {"t": torch.ones(2), "k": 3}

        def load_state_dict(self, sd):
            pass

    flat = flatten({"obj": S()})
    assert flat.tree == {"obj": {"t": {"$tensor": "obj.t"}, "k": 3}}


class _E(enum.IntEnum):
    A = 1


class _F(float):
    pass


class _S(str, enum.Enum):  # noqa: UP042 - the classic str-mixin enum
    X = "x"


@pytest.mark.parametrize(
    "value, needle",
    [
        (_E.A, "_E"),
        (_F(1.0), "_F"),
        (_S.X, "_S"),
        (bytearray(b"x"), "bytearray"),
        (object(), "object"),
        ({1}, "set"),
        (1j, "complex"),
    ],
)
def test_unsupported_scalars_name_path_and_type(value, needle):
    with pytest.raises(UnsupportedValueError) as ei:
        flatten({"cfg": {"opts": [None, value]}})
    assert "cfg.opts.1" in str(ei.value) and needle in str(ei.value)


@pytest.mark.parametrize("key", [True, False, 1.0, None, (1,), b"k", _E.A], ids=repr)
def test_bad_dict_keys(key):
    with pytest.raises(UnsupportedValueError) as ei:
        encode_dict_key(key, "a.b")
    assert "a.b" in str(ei.value)
    with pytest.raises(UnsupportedValueError):
        flatten({"a": {"b": {key: 1}}})


def test_colliding_keys_refused():
    with pytest.raises(UnsupportedValueError) as ei:
        flatten({"x": {"1": torch.ones(1)}, "y": 0, "x.1": torch.ones(1)})
    assert "x.1" in str(ei.value)
    with pytest.raises(UnsupportedValueError) as ei:
        flatten({"x": {1: torch.ones(1), "1": torch.ones(1)}})
    assert "x.1" in str(ei.value)


# --------------------------------------------------------------------------- corrupt encodings


CORRUPT = [
    {"$int": "abc"},
    {"$int": "1e5"},
    {"$int": " 12"},
    {"$int": "1_000"},
    {"$int": "12.0"},
    {"$int": ""},
    {"$int": "-"},
    {"$int": "١٢"},  # non-ASCII digits
    {"$int": 12.5},
    {"$int": True},
    {"$int": None},
    {"$int": [1]},
    {"$float": "NaN"},
    {"$float": "Infinity"},
    {"$float": "1.5"},
    {"$float": 1.5},
    {"$float": None},
    {"$bytes": "a"},
    {"$bytes": "!!!!"},
    {"$bytes": "YQ"},
    {"$bytes": 5},
    {"$bytes": ["AA=="]},
    {"$bytes": "é="},
    {"$tuple": "abc"},
    {"$tuple": 5},
    {"$tuple": {"a": 1}},
    {"$tuple": [{"$int": "x"}]},
    {"$dict": "ab"},
    {"$dict": ["ab"]},
    {"$dict": [["k"]]},
    {"$dict": [["k", 1, 2]]},
    {"$dict": [[1.5, 2]]},
    {"$dict": [[None, 2]]},
    {"$dict": [[True, 2]]},
    {"$dict": [[[1], 2]]},
    {"$dict": [[{"$tuple": [1]}, 2]]},
    {"$dict": [[{"$int": "z"}, 2]]},
    {"$dict": [[1, 2], [1, 3]]},
    {"$dict": {"ab": 1}},
    {"$dict": 7},
    {"$unknown": 1},
    {"$": 1},
    {"a": 1, "$int": "5"},
    {"$tensor": "x"},  # a placeholder where no reference is allowed
    {"$rank_local": "x"},
    [1, {"$int": "bad"}],
    {"ok": {"$tuple": [1, {"$bytes": 3}]}},
]


@pytest.mark.parametrize("obj", CORRUPT, ids=[json.dumps(c, ensure_ascii=True)[:40] for c in CORRUPT])
def test_corrupt_tags_raise(obj):
    with pytest.raises(CorruptCheckpointError) as ei:
        decode(obj)
    assert "manifest" in str(ei.value)


def test_corrupt_reference_payload_with_resolver():
    calls = []
    with pytest.raises(CorruptCheckpointError):
        decode({"$tensor": 5}, lambda tag, key: calls.append(key))
    assert calls == []


def test_non_json_objects_raise():
    with pytest.raises(CorruptCheckpointError):
        decode({1, 2})
    with pytest.raises(CorruptCheckpointError):
        decode((1, 2))
