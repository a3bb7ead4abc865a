"""Load planning, as plain data: for every destination box, the byte runs it needs from
saved chunks, and the checksum blocks those runs touch.

Each op reads exactly the bytes of one (destination box ∩ saved chunk) intersection.
When that intersection is one contiguous run of the destination's memory the bytes land
there directly; otherwise they go through a staging buffer of at most ``max_buffer``
bytes (ops larger than that are cut into slabs), never through a full tensor. Ops name
their destination by index; the executor resolves the tensors when it runs them.
"""

from __future__ import annotations

from typing import NamedTuple

from ..errors import CorruptCheckpointError
from ..format.dtypes import itemsize, torch_dtype
from ..format.manifest import Chunk, Manifest
from ..gcpause import gc_paused
from ..knobs import MAX_BUFFER as DEFAULT_MAX_BUFFER
from ..layout import Box, boxes_disjoint, byte_runs, intersect


class Dest(NamedTuple):
    """A destination as planning sees it: tensor ``key``'s global box ``box``, and whether
    its memory is a dense CPU tensor that bytes can land in directly."""

    key: str
    box: Box
    direct: bool


class ReadOp(NamedTuple):
    """Read part ``box`` (global coordinates) of destination ``dest`` from ``chunk``.

    ``runs`` are absolute (offset, length) byte ranges in the chunk's file whose
    concatenation is ``box`` in row-major order. ``dest_range`` is the byte range of the
    destination's memory they fill directly, or None when they must be staged."""

    dest: int
    key: str
    chunk: Chunk
    box: Box
    runs: tuple[tuple[int, int], ...]
    dest_range: tuple[int, int] | None

    @property
    def file(self) -> int:
        return self.chunk.file

    @property
    def nbytes(self) -> int:
        runs = self.runs
        return runs[0][1] if len(runs) == 1 else sum([n for _, n in runs])

    @property
    def whole_chunk(self) -> bool:
        return self.box.offsets == self.chunk.offsets and self.box.lengths == self.chunk.lengths


class BlockCheck(NamedTuple):
    """One checksum block to verify: bytes [lo, hi) of file ``file`` must hash to ``expected``."""

    file: int
    lo: int
    hi: int
    expected: str
    key: str


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


def _dest_range(dest: Dest, box: Box, size: int) -> tuple[int, int] | None:
    if not dest.direct:
        return None
    runs = list(byte_runs(box, dest.box, size))
    if len(runs) != 1:
        return None
    start, n = runs[0]
    return start, start + n


def _intersections(dest: Dest, meeting: list[Chunk], size: int, max_buffer: int
                   ) -> tuple[list[tuple[int, Box, tuple[tuple[int, int], ...], tuple[int, int] | None]], int, bool]:
    """For ``dest`` and the chunks it meets: (chunk index, piece, byte runs relative to the
    chunk's start, destination range) of every read, the elements covered, and whether the
    chunks overlap."""
    out = []
    covered = 0
    parts: list[Box] = []
    for i, chunk in enumerate(meeting):
        cbox = Box(chunk.offsets, chunk.lengths)
        part = intersect(dest.box, cbox)
        if part is None:
            continue
        covered += part.numel
        parts.append(part)
        direct = _dest_range(dest, part, size)
        for piece in [part] if direct is not None else slabs(part, size, max_buffer):
            out.append((i, piece, tuple(byte_runs(piece, cbox, size)), direct))
    return out, covered, len(parts) > 1 and not boxes_disjoint(parts)


Boxes = list[tuple[tuple[int, ...], tuple[int, ...], int]]
Geometry = list[Boxes | None] | None
"""Format 3: per destination, the (offsets, lengths, file) boxes it meets (None where
the entry's chunks are not in file indexes); None for a manifest without indexes."""


class IndexNeeds(NamedTuple):
    """What a plan needs from file indexes: the boxes each destination meets, and the
    files whose indexes list them (for the reader's fetch-indexes phase)."""

    geoms: Geometry
    files: set[int]


def index_needs(manifest: Manifest, dests: list[Dest]) -> IndexNeeds:
    """The boxes every destination meets and the files whose indexes hold their byte
    ranges, from the manifest alone (no index is read; cutting a rule beyond the work pool
    needs every index fetched first, see ``Manifest.cuts_need_indexes``)."""
    if not manifest.indexed:
        return IndexNeeds(None, set())
    geoms: list[Boxes | None] = []
    needed: set[int] = set()
    tensors = manifest.tensors
    with gc_paused():
        for dest in dests:
            entry = tensors.get(dest.key)
            box = dest.box
            if entry is None or 0 in box.lengths or not entry.indexed:
                geoms.append(None)
                continue
            geom = entry.boxes_meeting(box.offsets, box.lengths)
            geoms.append(geom)
            needed.update([f for _, _, f in geom] if len(geom) != 1 else (geom[0][2],))
    return IndexNeeds(geoms, needed)


def plan_reads(manifest: Manifest, dests: list[Dest], max_buffer: int = DEFAULT_MAX_BUFFER,
               geoms: Geometry = None) -> list[ReadOp]:
    """Read ops covering every destination exactly; a hole or an overlap in the saved
    chunks is a CorruptCheckpointError naming the tensor. Format 3: the indexes of the
    files the destinations meet must be attached (``geoms``: :func:`index_needs`'s boxes,
    when the caller has them). Pure: nothing is read. (The cyclic GC is paused: the ops
    are many small acyclic objects, and a collection over a big heap per few hundred of
    them tripled planning time at thousands of tensors.)"""
    if geoms is None and manifest.indexed:
        geoms = index_needs(manifest, dests).geoms
    with gc_paused():
        return _plan_reads(manifest, dests, max_buffer, geoms)


def _plan_reads(manifest: Manifest, dests: list[Dest], max_buffer: int, geoms: Geometry) -> list[ReadOp]:
    ops: list[ReadOp] = []
    append = ops.append
    memo: dict[tuple, tuple] = {}
    tensors = manifest.tensors
    sizes: dict[str, int] = {}
    for index, dest in enumerate(dests):
        key, box = dest.key, dest.box
        entry = tensors[key]
        size = sizes.get(entry.dtype)
        if size is None:
            dtype = torch_dtype(entry.dtype)
            if dtype is None:
                raise CorruptCheckpointError(f"tensor '{key}': unknown dtype {entry.dtype!r}")
            size = sizes[entry.dtype] = itemsize(dtype)
        if 0 in box.lengths:
            continue  # nothing to read (and nothing to cover)
        geom = geoms[index] if geoms is not None else None
        if geom is None:
            meeting = entry.chunks_meeting(box.offsets, box.lengths)
        elif len(geom) == 1:
            meeting = [entry.resolve_box(*geom[0])]
        else:
            meeting = entry.resolve_boxes(geom)
        if len(meeting) == 1:
            chunk = meeting[0]
            if box.offsets == chunk.offsets and box.lengths == chunk.lengths:
                # The common case: one chunk that is exactly the destination box.
                n = chunk.end - chunk.start
                if dest.direct:
                    append(ReadOp(index, key, chunk, box, ((chunk.start, n),), (0, n)))
                    continue
                if n <= max_buffer:
                    append(ReadOp(index, key, chunk, box, ((chunk.start, n),), None))
                    continue
        # What the intersections are depends only on the boxes, the itemsize and how the
        # bytes land: computed once per geometry (a model repeats a few shapes many times).
        memo_key = (box, dest.direct, size, tuple([(c.offsets, c.lengths) for c in meeting]))
        shape = memo.get(memo_key)
        if shape is None:
            shape = memo[memo_key] = _intersections(dest, meeting, size, max_buffer)
        pieces_of, covered, overlap = shape
        if overlap:
            raise CorruptCheckpointError(f"tensor '{key}': saved chunks overlap (the manifest is corrupt)")
        if covered != box.numel:
            raise CorruptCheckpointError(
                f"tensor '{key}': saved chunks cover {covered} of the {box.numel} elements needed "
                "(the manifest is corrupt)"
            )
        for i, piece, runs, direct in pieces_of:
            chunk = meeting[i]
            start = chunk.start
            append(ReadOp(index, key, chunk, piece, ((start + runs[0][0], runs[0][1]),) if len(runs) == 1 else
                          tuple([(start + s, n) for s, n in runs]), direct))
    return ops


def needed_blocks(op: ReadOp, block: int) -> list[int]:
    """Indices of the checksum blocks of ``op.chunk`` that ``op``'s runs touch."""
    start = op.chunk.start
    out: set[int] = set()
    for s, n in op.runs:
        if n == 0:
            continue
        out.update(range((s - start) // block, (s - start + n - 1) // block + 1))
    if not out and op.chunk.end == op.chunk.start:
        out.add(0)
    return sorted(out)


def chunk_checks(key: str, chunk: Chunk, blocks: list[int] | None, block: int) -> list[BlockCheck]:
    """The checks of the given block indices of ``chunk`` (None: every block)."""
    n = chunk.end - chunk.start
    if len(chunk.checksum) != max(1, -(-n // block)):
        raise CorruptCheckpointError(f"manifest: tensor '{key}' has a wrong number of block checksums")
    if n == 0:
        return [BlockCheck(chunk.file, chunk.start, chunk.end, chunk.checksum[0], key)]
    if blocks is None:
        blocks = list(range(len(chunk.checksum)))
    out = []
    for b in blocks:
        lo = chunk.start + b * block
        out.append(BlockCheck(chunk.file, lo, min(chunk.end, lo + block), chunk.checksum[b], key))
    return out


def block_checks(ops: list[ReadOp], block: int) -> list[BlockCheck]:
    """Every checksum block the ops touch, once, sorted by file and offset."""
    with gc_paused():
        return _block_checks(ops, block)


def _block_checks(ops: list[ReadOp], block: int) -> list[BlockCheck]:
    wanted: dict[tuple[int, int], tuple[str, Chunk, set[int]]] = {}
    whole: dict[tuple[int, int], tuple[str, Chunk]] = {}  # chunks read whole: every block, no set
    for op in ops:
        chunk, runs = op.chunk, op.runs
        where = (chunk.file, chunk.start)
        if len(runs) == 1 and runs[0][1] == chunk.end - chunk.start and op.box.offsets == chunk.offsets \
                and op.box.lengths == chunk.lengths:
            whole[where] = (op.key, chunk)
            continue
        entry = wanted.setdefault(where, (op.key, chunk, set()))
        entry[2].update(needed_blocks(op, block))
    checks = [c for where, (key, chunk, bl) in wanted.items() if where not in whole
              for c in chunk_checks(key, chunk, sorted(bl), block)]
    add = checks.append
    for key, chunk in whole.values():
        start, end, sums = chunk.start, chunk.end, chunk.checksum
        if len(sums) == 1 and 0 < end - start <= block:  # one block (checked as chunk_checks does)
            add(BlockCheck(chunk.file, start, end, sums[0], key))
        else:
            checks.extend(chunk_checks(key, chunk, None, block))
    checks.sort()  # by file, then offset (a block's (file, lo) is unique)
    return checks
