"""Chunk geometry: boxes inside a tensor's global shape, their intersections, and the
byte runs that a box occupies inside a row-major chunk.

Pure functions on tuples of ints: no I/O, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from math import prod


@dataclass(frozen=True)
class Box:
    """An axis-aligned box of a tensor: ``offsets[d] <= i_d < offsets[d] + lengths[d]``."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"offsets {self.offsets} and lengths {self.lengths} differ in rank")
        if any(o < 0 for o in self.offsets) or any(n < 0 for n in self.lengths):
            raise ValueError(f"negative offset or length in box {self.offsets}+{self.lengths}")

    @staticmethod
    def whole(shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape`` (boxes are immutable: one per shape
        is shared, a state repeats a few shapes many times)."""
        try:
            return _whole(shape)  # a torch.Size hashes and compares as the tuple it is
        except TypeError:  # unhashable dims
            return Box(tuple(0 for _ in shape), tuple(int(n) for n in shape))

    @property
    def ndim(self) -> int:
        return len(self.lengths)

    @property
    def numel(self) -> int:
        return prod(self.lengths)

    @property
    def ends(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    def is_empty(self) -> bool:
        return any(n == 0 for n in self.lengths)

    def contains(self, other: Box) -> bool:
        """True when ``other`` (of the same rank) lies wholly inside this box."""
        return self.ndim == other.ndim and all(
            so <= oo and oo + on <= so + sn
            for so, sn, oo, on in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )

    def within(self, shape: Sequence[int]) -> bool:
        """True when the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(e <= s for e, s in zip(self.ends, shape))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of ``outer`` (which must contain it)."""
        return Box(tuple(o - p for o, p in zip(self.offsets, outer.offsets)), self.lengths)

    def slices(self) -> tuple[slice, ...]:
        """Index expression that cuts this box out of a tensor in the same coordinates."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.lengths))


def boxes_disjoint(boxes: Sequence[Box]) -> bool:
    """True when no two of ``boxes`` (of one rank) share an element. A sweep along dim 0
    compares only boxes whose row ranges overlap: about n log n for row or grid layouts."""
    items = sorted((b for b in boxes if not b.is_empty()), key=lambda b: b.offsets)
    if items and items[0].ndim == 0:
        return len(items) <= 1
    # Fast path (row shards, the usual case): row ranges that do not overlap at all.
    if all(a.offsets[0] + a.lengths[0] <= b.offsets[0] for a, b in zip(items, items[1:])):
        return True
    active: list[Box] = []
    for b in items:
        start = b.offsets[0]
        active = [a for a in active if a.offsets[0] + a.lengths[0] > start]
        if any(intersect(a, b) is not None for a in active):
            return False
        active.append(b)
    return True


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same rank, or None when they do not overlap.

    Zero-size boxes intersect nothing (there are no bytes to share)."""
    if a.ndim != b.ndim:
        raise ValueError(f"boxes of rank {a.ndim} and {b.ndim} cannot intersect")
    offsets = []
    lengths = []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo = max(ao, bo)
        hi = min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def row_major_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Element strides of a contiguous row-major tensor of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(int(shape[d + 1]), 1)
    return tuple(strides)


def byte_runs(inner: Box, outer: Box, itemsize: int) -> Iterator[tuple[int, int]]:
    """Byte runs ``(start, length)`` that ``inner`` occupies inside a contiguous
    row-major chunk covering ``outer``, in increasing order, adjacent runs merged.

    The runs list the inner box's elements in its own row-major order, so copying the
    runs back to back yields the inner box as a contiguous tensor."""
    if inner.offsets == outer.offsets and inner.lengths == outer.lengths:  # the whole chunk: one run
        if not inner.is_empty():
            yield (0, prod(inner.lengths) * itemsize)
        return
    if not outer.contains(inner):
        raise ValueError(f"box {inner} is not inside chunk {outer}")
    if inner.is_empty():
        return
    rel = inner.relative_to(outer)
    shape = outer.lengths
    strides = row_major_strides(shape)
    # Trailing dims that the inner box covers fully merge into one contiguous run.
    d = inner.ndim
    run = 1
    while d > 0 and rel.lengths[d - 1] == shape[d - 1]:
        d -= 1
        run *= shape[d]
    if d > 0:
        # The innermost partial dim still contributes a contiguous run of its length.
        d -= 1
        run *= rel.lengths[d]
        inner_start = rel.offsets[d] * strides[d]
    else:
        inner_start = 0
    outer_dims = list(range(d))
    if not outer_dims:
        yield (inner_start * itemsize, run * itemsize)
        return
    # Iterate over the index space of the leading dims in row-major order.
    idx = [0] * len(outer_dims)
    counts = [rel.lengths[k] for k in outer_dims]
    pending_start = -1
    pending_len = 0
    while True:
        elem = inner_start + sum((rel.offsets[k] + idx[k]) * strides[k] for k in outer_dims)
        start = elem * itemsize
        length = run * itemsize
        if pending_start >= 0 and pending_start + pending_len == start:
            pending_len += length
        else:
            if pending_start >= 0:
                yield (pending_start, pending_len)
            pending_start, pending_len = start, length
        k = len(outer_dims) - 1
        while k >= 0:
            idx[k] += 1
            if idx[k] < counts[k]:
                break
            idx[k] = 0
            k -= 1
        if k < 0:
            break
    yield (pending_start, pending_len)


def split_rows(shape: Sequence[int], parts: int) -> list[Box]:
    """Split a tensor into at most ``parts`` boxes of whole rows (dim 0), as even as possible.

    Returns a single whole box for 0-d tensors or when there are fewer rows than parts."""
    if len(shape) == 0 or parts <= 1 or shape[0] <= 1:
        return [Box.whole(shape)]
    rows = int(shape[0])
    parts = min(parts, rows)
    boxes = []
    start = 0
    for p in range(parts):
        n = rows // parts + (1 if p < rows % parts else 0)
        boxes.append(Box((start,) + (0,) * (len(shape) - 1), (n,) + tuple(int(s) for s in shape[1:])))
        start += n
    return boxes


@lru_cache(maxsize=4096)
def _whole(shape: tuple[int, ...]) -> Box:
    return Box(tuple(0 for _ in shape), tuple(int(n) for n in shape))
