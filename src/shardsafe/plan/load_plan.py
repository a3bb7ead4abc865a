"""Load planning: for every destination box, the byte runs it needs from saved chunks.

Each op reads exactly the bytes of one (destination box ∩ saved chunk) intersection.
When that intersection is one contiguous run of the destination's memory the bytes land
there directly; otherwise they go through a staging buffer of at most ``max_buffer``
bytes (ops larger than that are cut into slabs), never through a full tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CorruptCheckpointError, MissingKeysError
from ..format.dtypes import itemsize, torch_dtype
from ..format.manifest import Chunk, Manifest
from ..layout import Box, boxes_disjoint, byte_runs, intersect
from ..state.match import Fill

DEFAULT_MAX_BUFFER = 64 << 20


@dataclass
class ReadOp:
    """Read part ``box`` (global coordinates) of ``fill`` from ``chunk``.

    ``runs`` are absolute (offset, length) byte ranges in the chunk's file whose
    concatenation is ``box`` in row-major order. ``dest_range`` is the byte range of the
    destination's memory they fill directly, or None when they must be staged."""

    fill: Fill
    chunk: Chunk
    box: Box
    runs: list[tuple[int, int]]
    dest_range: tuple[int, int] | None

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def whole_chunk(self) -> bool:
        return self.box == Box(self.chunk.offsets, self.chunk.lengths)


def _dest_range(fill: Fill, box: Box, size: int) -> tuple[int, int] | None:
    t = fill.tensor
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg():
        return None  # lazy conj/neg views take their values through copy_()
    runs = list(byte_runs(box, fill.box, size))
    if len(runs) != 1:
        return None
    start, n = runs[0]
    return start, start + n


def slabs(box: Box, size: int, max_bytes: int) -> list[Box]:
    """Cut ``box`` into consecutive slabs of at most ``max_bytes`` (one element at the least)."""
    if box.numel * size <= max_bytes or box.is_empty():
        return [box]
    for d, n in enumerate(box.lengths):
        if n > 1:
            inner = box.numel // n * size
            step = max(1, max_bytes // inner)
            out: list[Box] = []
            for s in range(0, n, step):
                o = list(box.offsets)
                ln = list(box.lengths)
                o[d] += s
                ln[d] = min(step, n - s)
                out.extend(slabs(Box(tuple(o), tuple(ln)), size, max_bytes))
            return out
    return [box]


def plan_reads(manifest: Manifest, fills: list[Fill], max_buffer: int = DEFAULT_MAX_BUFFER) -> list[ReadOp]:
    """Read ops covering every fill exactly; raises if the saved chunks leave a hole."""
    ops: list[ReadOp] = []
    for fill in fills:
        entry = manifest.tensors[fill.key]
        dtype = torch_dtype(entry.dtype)
        if dtype is None:
            raise CorruptCheckpointError(f"tensor '{fill.key}': unknown dtype {entry.dtype!r}")
        size = itemsize(dtype)
        covered = 0
        parts: list[Box] = []
        if not fill.box.is_empty():
            meeting = entry.chunks_meeting(fill.box.offsets, fill.box.lengths)
            if len(meeting) == 1 and fill.box.offsets == meeting[0].offsets and \
                    fill.box.lengths == meeting[0].lengths:
                # The common case: one chunk that is exactly the destination box.
                chunk = meeting[0]
                t = fill.tensor
                direct = t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()
                n = chunk.end - chunk.start
                ops.append(ReadOp(fill, chunk, fill.box, [(chunk.start, n)], (0, n) if direct else None))
                if direct or n <= max_buffer:
                    continue
                ops.pop()  # too large to stage at once: fall through to slabs
            for chunk in meeting:
                cbox = Box(chunk.offsets, chunk.lengths)
                part = intersect(fill.box, cbox)
                if part is None:
                    continue
                covered += part.numel
                parts.append(part)
                direct = _dest_range(fill, part, size)
                pieces = [part] if direct is not None else slabs(part, size, max_buffer)
                for piece in pieces:
                    runs = [(chunk.start + s, n) for s, n in byte_runs(piece, cbox, size)]
                    dest = direct if direct is not None else None
                    ops.append(ReadOp(fill, chunk, piece, runs, dest))
        if len(parts) > 1 and not boxes_disjoint(parts):
            raise CorruptCheckpointError(f"tensor '{fill.key}': saved chunks overlap (the manifest is corrupt)")
        if covered != fill.box.numel:
            raise MissingKeysError(
                f"tensor '{fill.key}': saved chunks cover {covered} of the {fill.box.numel} elements needed"
            )
    return ops
