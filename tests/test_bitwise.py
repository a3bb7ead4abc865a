"""The comparison every test relies on (tests/bitwise.py) tells apart what it must."""

from __future__ import annotations

import collections
import math

import pytest
import torch

import dist_cases
from bitwise import assert_bitwise, bitwise_equal, first_difference, same_value, tensors_equal


def test_nan_payloads_and_signed_zeros_count_in_tensors():
    quiet = torch.tensor([0x7FC00000], dtype=torch.int32).view(torch.float32)
    other = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert tensors_equal(quiet, quiet.clone())
    assert not tensors_equal(quiet, other)  # both NaN, torch.equal(nan, nan) is False anyway
    assert not tensors_equal(torch.tensor([0.0]), torch.tensor([-0.0]))  # torch.equal says equal
    assert torch.equal(torch.tensor([0.0]), torch.tensor([-0.0]))


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex64, torch.complex128, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.bfloat16, torch.uint64])
def test_every_kind_of_dtype_compares_by_bytes(dtype):
    g = torch.Generator().manual_seed(3)
    a = torch.randint(0, 2, (6, 4), generator=g).to(dtype) if dtype == torch.bool else (
        torch.randint(0, 256, (6, 4 * torch.empty((), dtype=dtype).element_size()), dtype=torch.uint8,
                      generator=g).view(dtype))
    assert tensors_equal(a, a.clone())
    b = a.clone()
    b.view(torch.uint8).view(-1)[5] ^= 1
    assert not tensors_equal(a, b)
    found = first_difference({"t": a}, {"t": b})
    assert found is not None and found.startswith("t: bytes differ: first at element ")
    if dtype != torch.bool:
        assert f"element {5 // a.element_size()} of 24" in found


def test_strides_and_view_bits_do_not_count_dtype_and_shape_do():
    a = torch.arange(12.0).reshape(3, 4)
    assert tensors_equal(a.t(), a.t().contiguous())
    assert tensors_equal(a[:, ::2], a[:, ::2].clone())
    c = torch.randn(5, dtype=torch.complex64)
    assert tensors_equal(c.conj(), c.conj().resolve_conj())
    assert not tensors_equal(c.conj(), c)
    assert tensors_equal(torch.ones(3).expand(2, 3), torch.ones(2, 3))
    assert not tensors_equal(a, a.to(torch.float64))
    assert not tensors_equal(a, a.reshape(4, 3))
    assert not tensors_equal(a, torch.nn.Parameter(a.clone()))  # the type counts too
    assert tensors_equal(torch.empty(0, 3), torch.empty(0, 3))
    assert first_difference(a, a.to(torch.int64)) == "<root>: torch.float32[3, 4] vs torch.int64[3, 4]"


def test_plain_values_keep_their_types_and_float_bits():
    assert not same_value(1, True) and not same_value(1, 1.0) and not same_value(0.0, -0.0)
    assert same_value(math.nan, -math.nan) and same_value(b"\x00", b"\x00") and same_value(None, None)
    assert not same_value(complex(0.0, 1.0), complex(-0.0, 1.0))
    assert not bitwise_equal([1, 2], (1, 2))
    assert not bitwise_equal({1: "a"}, {True: "a"})  # key types count
    assert first_difference({"a": {"b": [1, (2, 3.0)]}}, {"a": {"b": [1, (2, 3)]}}) == (
        "a.b[1][1]: float vs int (3.0 vs 3)")


def test_dict_order_and_class_count_when_asked():
    a, b = {"x": 1, "y": 2}, {"y": 2, "x": 1}
    assert first_difference(a, b, ordered=True) == "<root>: key order ['x', 'y'] vs ['y', 'x']"
    assert bitwise_equal(a, b)
    od = collections.OrderedDict(a)
    assert bitwise_equal(a, od) and not bitwise_equal(a, od, dict_types=True)
    assert first_difference(a, od, dict_types=True).startswith("<root>: dict vs OrderedDict (")
    assert first_difference({"x": 1}, {"z": 1}) == "<root>: keys only in the first ['x'], only in the second ['z']"
    with pytest.raises(AssertionError, match=r"^state\.x: 1 vs 2$"):
        assert_bitwise({"x": 1}, {"x": 2}, "state")


def test_dtensors_compare_their_shards_and_placements(pg_pool):
    found = pg_pool(2).run(dist_cases.dtensor_differences)
    shard = "t: bytes differ: first at element 0 of 2 ([0, 0, 0, 0] vs [0, 0, 128, 63])"
    assert found == [{"same": None, "shard": shard,
                      "placement": "t: placements (Shard(dim=0),) on mesh (2,) vs (Replicate(),) on (2,)",
                      "plain": "t: DTensor vs Tensor"}] * 2
