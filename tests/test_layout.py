"""Chunk geometry (layout.py): unit tests and hypothesis properties checked against
brute force on real numpy arrays."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsafe.layout import Box, byte_runs, intersect, row_major_strides, split_rows

# --------------------------------------------------------------------------- Box


def test_box_basics():
    b = Box((1, 2), (3, 4))
    assert b.ndim == 2 and b.numel == 12 and b.ends == (4, 6)
    assert not b.is_empty()
    assert b.slices() == (slice(1, 4), slice(2, 6))
    assert b.within((4, 6)) and not b.within((4, 5)) and not b.within((3, 6)) and not b.within((4, 6, 1))
    assert b.relative_to(Box((1, 1), (5, 5))) == Box((0, 1), (3, 4))
    assert Box.whole((2, 0, 3)) == Box((0, 0, 0), (2, 0, 3))
    assert Box.whole((2, 0, 3)).is_empty() and Box.whole((2, 0, 3)).numel == 0
    scalar = Box.whole(())
    assert scalar.ndim == 0 and scalar.numel == 1 and not scalar.is_empty() and scalar.slices() == ()


def test_box_is_hashable_value():
    assert Box((0,), (2,)) == Box((0,), (2,))
    assert len({Box((0,), (2,)), Box((0,), (2,)), Box((1,), (2,))}) == 2


@pytest.mark.parametrize(
    "offsets, lengths", [((0,), (1, 2)), ((0, 0), (1,)), ((-1,), (2,)), ((0,), (-1,))]
)
def test_box_validation(offsets, lengths):
    with pytest.raises(ValueError):
        Box(offsets, lengths)


def test_contains():
    outer = Box((2, 2), (4, 4))
    assert outer.contains(Box((2, 2), (4, 4)))
    assert outer.contains(Box((3, 5), (1, 1)))
    assert not outer.contains(Box((1, 2), (1, 1)))
    assert not outer.contains(Box((5, 5), (2, 1)))
    assert outer.contains(Box((3, 3), (0, 0)))


def test_contains_rank_mismatch():
    assert not Box((0,), (4,)).contains(Box((0, 0), (1, 1)))
    assert not Box((0, 0), (4, 4)).contains(Box((0,), (1,)))
    with pytest.raises(ValueError):
        list(byte_runs(Box((0, 0), (1, 1)), Box((0,), (4,)), 4))


# --------------------------------------------------------------------------- intersect


def test_intersect_examples():
    a = Box((0, 0), (4, 4))
    assert intersect(a, Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
    assert intersect(a, Box((4, 0), (1, 4))) is None  # touching edges share nothing
    assert intersect(a, Box((1, 1), (0, 2))) is None  # zero-size boxes intersect nothing
    assert intersect(a, a) == a
    assert intersect(Box((), ()), Box((), ())) == Box((), ())
    with pytest.raises(ValueError):
        intersect(a, Box((0,), (1,)))


# --------------------------------------------------------------------------- byte_runs


def test_row_major_strides():
    assert row_major_strides((2, 3, 4)) == (12, 4, 1)
    assert row_major_strides(()) == ()
    assert row_major_strides((5,)) == (1,)


def test_byte_runs_examples():
    outer = Box((10, 20), (4, 6))
    assert list(byte_runs(outer, outer, 4)) == [(0, 96)]
    # Two whole rows: one run.
    assert list(byte_runs(Box((11, 20), (2, 6)), outer, 4)) == [(24, 48)]
    # A column: one run per row.
    assert list(byte_runs(Box((10, 22), (4, 1)), outer, 2)) == [(4, 2), (16, 2), (28, 2), (40, 2)]
    # A 2x2 block in the middle.
    assert list(byte_runs(Box((11, 21), (2, 2)), outer, 1)) == [(7, 2), (13, 2)]
    # A 0-d tensor is one element.
    assert list(byte_runs(Box((), ()), Box((), ()), 8)) == [(0, 8)]
    # Empty boxes yield nothing.
    assert list(byte_runs(Box((10, 20), (0, 6)), outer, 4)) == []
    with pytest.raises(ValueError):
        list(byte_runs(Box((9, 20), (1, 1)), outer, 4))


def test_byte_runs_merges_through_unit_dims():
    # Outer (3, 1, 4): rows of one element of dim 1; inner covers rows 0-1 fully.
    outer = Box((0, 0, 0), (3, 1, 4))
    assert list(byte_runs(Box((0, 0, 0), (2, 1, 4)), outer, 4)) == [(0, 32)]
    assert list(byte_runs(Box((1, 0, 1), (2, 1, 2)), outer, 4)) == [(20, 8), (36, 8)]


# --------------------------------------------------------------------------- properties

DTYPES = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


@st.composite
def box_in(draw, shape):
    """A box inside ``shape`` (possibly empty)."""
    offsets, lengths = [], []
    for s in shape:
        o = draw(st.integers(0, s))
        n = draw(st.integers(0, s - o))
        offsets.append(o)
        lengths.append(n)
    return Box(tuple(offsets), tuple(lengths))


@st.composite
def nested_boxes(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    outer = draw(box_in(shape))
    rel = draw(box_in(outer.lengths))
    inner = Box(tuple(o + r for o, r in zip(outer.offsets, rel.offsets)), rel.lengths)
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    return shape, outer, inner, itemsize


def brute_runs(inner: Box, outer: Box, itemsize: int) -> list[tuple[int, int]]:
    """Maximal contiguous byte ranges of ``inner``'s elements inside the row-major ``outer`` chunk."""
    idx = np.arange(outer.numel, dtype=np.int64).reshape(outer.lengths)
    elems = np.asarray(idx[inner.relative_to(outer).slices()]).reshape(-1)
    runs: list[tuple[int, int]] = []
    for e in elems.tolist():
        start = e * itemsize
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + itemsize)
        else:
            runs.append((start, itemsize))
    return runs


@settings(max_examples=500, deadline=None)
@given(nested_boxes(), st.integers(0, 2**32 - 1))
def test_byte_runs_property(case, seed):
    shape, outer, inner, itemsize = case
    assert outer.within(shape) and outer.contains(inner)
    rng = np.random.default_rng(seed)
    chunk = rng.integers(0, 2 ** (8 * itemsize), size=outer.lengths, dtype=DTYPES[itemsize], endpoint=False)
    data = chunk.tobytes()  # row-major bytes of the chunk
    assert len(data) == outer.numel * itemsize

    runs = list(byte_runs(inner, outer, itemsize))
    got = b"".join(data[s: s + n] for s, n in runs)
    want = np.ascontiguousarray(chunk[inner.relative_to(outer).slices()]).tobytes()
    assert got == want
    assert len(got) == inner.numel * itemsize

    # Increasing, inside the chunk, non-empty, non-overlapping and merged.
    for s, n in runs:
        assert n > 0 and s >= 0 and s + n <= len(data)
        assert s % itemsize == 0 and n % itemsize == 0
    for (s1, n1), (s2, _) in itertools.pairwise(runs):
        assert s1 + n1 < s2, "runs must increase and adjacent runs must be merged"
    assert runs == brute_runs(inner, outer, itemsize)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_intersect_property(data):
    shape = tuple(data.draw(st.lists(st.integers(0, 5), min_size=0, max_size=3)))
    a = data.draw(box_in(shape))
    b = data.draw(box_in(shape))
    ab, ba = intersect(a, b), intersect(b, a)
    assert ab == ba
    mask_a = np.zeros(shape, dtype=bool)
    mask_b = np.zeros(shape, dtype=bool)
    mask_a[a.slices()] = True
    mask_b[b.slices()] = True
    both = mask_a & mask_b
    if ab is None:
        assert not both.any()
    else:
        assert not ab.is_empty()
        assert a.contains(ab) and b.contains(ab)
        mask = np.zeros(shape, dtype=bool)
        mask[ab.slices()] = True
        assert (mask == both).all()
        assert ab.numel == int(both.sum())


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=0, max_size=4), st.integers(-1, 12))
def test_split_rows_property(shape, parts):
    shape = tuple(shape)
    boxes = split_rows(shape, parts)
    assert boxes, "at least one box"
    for b in boxes:
        assert b.within(shape)
        assert b.offsets[1:] == (0,) * (len(shape) - 1)
        assert b.lengths[1:] == shape[1:]
    if not shape:
        assert boxes == [Box((), ())]
        return
    rows = shape[0]
    assert len(boxes) <= max(1, parts)
    assert sum(b.lengths[0] for b in boxes) == rows
    covered = [r for b in boxes for r in range(b.offsets[0], b.ends[0])]
    assert covered == list(range(rows)), "every row exactly once, in order"
    assert sum(b.numel for b in boxes) == math.prod(shape)
    if rows >= 2 and parts >= 2:
        assert len(boxes) == min(parts, rows)
        sizes = [b.lengths[0] for b in boxes]
        assert max(sizes) - min(sizes) <= 1
        assert all(n > 0 for n in sizes)


def test_split_rows_examples():
    assert split_rows((10, 3), 3) == [Box((0, 0), (4, 3)), Box((4, 0), (3, 3)), Box((7, 0), (3, 3))]
    assert split_rows((2, 5), 8) == [Box((0, 0), (1, 5)), Box((1, 0), (1, 5))]
    assert split_rows((0, 4), 4) == [Box((0, 0), (0, 4))]
    assert split_rows((7,), 1) == [Box((0,), (7,))]
    assert split_rows((), 4) == [Box((), ())]
