"""Compressed chunk rows of a file index (format 3.2): the ``zchunks`` and ``zrefs`` tables.

A compressed chunk's bytes in its data file are its checksum blocks one after another,
each stored compressed or raw (docs/format.md, "Compressed chunks"). Its index row has the
columns of ``chunks`` (``b``: the *stored* byte range) plus ``c``, the codec of the row,
and ``s``, the stored length of each of its checksum blocks (a block stored with its
raw length is raw). Checksums and chunk digests stay over the uncompressed bytes.

A reader gives every compressed chunk a *logical* byte range beyond any real file
offset: ``LOGICAL_BASE + stored_start * 2^20`` up to that plus the chunk's raw length
(a function of the file and the stored range alone, so rows of several indexes that name
one file agree). Everything above the data-file handle (load plans, verification,
landing) then works on logical ranges as on raw ones; the handle of a file with
compressed rows (engine/zread.py) maps them back to stored blocks and decompresses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .chunk_table import ChunkTable
from .codecs import CODECS
from .refs import check_digests

LOGICAL_BASE = 1 << 61
"""Logical byte ranges of compressed chunks start here (real files are smaller than 2^41 bytes)."""
SCALE_SHIFT = 20
"""A compressed chunk's logical start is LOGICAL_BASE + its stored start << SCALE_SHIFT."""
MAX_STORED_END = 1 << 41
"""Stored bytes of compressed chunks lie below this offset of their file."""


@dataclass(frozen=True)
class ZRow:
    """Where a compressed chunk's blocks are: file, stored range, each block's stored length."""

    file: int
    key: str
    ordinal: int
    codec: str
    itemsize: int
    start: int  # stored byte range in the file
    end: int
    lengths: tuple[int, ...]  # stored length of each checksum block
    logical: int  # first logical byte
    raw: int  # uncompressed bytes
    sums: tuple[str, ...]  # block checksums (of the uncompressed blocks)

    def offset(self, b: int) -> int:
        """Where block ``b`` starts, relative to the stored start (``b`` = count: the end)."""
        ends = self.__dict__.get("_ends")
        if ends is None:
            ends = [0]
            for n in self.lengths:
                ends.append(ends[-1] + n)
            object.__setattr__(self, "_ends", ends)
        return ends[b]

    def block_at(self, logical: int, block: int) -> int:
        """The block holding logical byte ``logical`` (inside this row)."""
        return (logical - self.logical) // block


def logical_start(stored_start: int) -> int:
    """The first logical byte of a compressed chunk stored from ``stored_start``."""
    return LOGICAL_BASE + (stored_start << SCALE_SHIFT)


def stored_key(logical: int) -> int:
    """A stored offset inside the stored range of the compressed chunk holding ``logical``."""
    return (logical - LOGICAL_BASE) >> SCALE_SHIFT


def z_columns(rows: list, columns: Any) -> dict[str, Any]:
    """The columns of a ``zchunks``/``zrefs`` table: ``columns(rows)`` plus ``c`` and ``s``."""
    return {**columns(rows), "c": [r.codec for r in rows], "s": [n for r in rows for n in r.stored]}


@dataclass
class ZTable:
    """A parsed ``zchunks`` or ``zrefs`` table: rows with logical ranges, digests, stored layout."""

    table: ChunkTable
    ordinals: list[int]
    digests: str
    codecs: list[str]
    stored: list[tuple[int, int, tuple[int, ...]]]  # per row: stored start, end, block lengths
    _rows: dict[tuple[int, tuple[int, ...]], int] | None = None

    def row(self, ordinal: int, offsets: tuple[int, ...]) -> int | None:
        if self._rows is None:
            offs, dims = self.table.offsets.tolist(), self.table.dims.tolist()
            self._rows = {(t, tuple(offs[dims[r]: dims[r + 1]])): r for r, t in enumerate(self.ordinals)}
        return self._rows.get((ordinal, tuple(offsets)))


def parse_ztable(cols: Any, what: str, shapes: list[tuple[int, ...]], sizes: list[int], block: int,
                 ranks: list[int], lows: list[int], highs: list[int], own_file: int | None) -> ZTable:
    """Validate a compressed table (``what``: its name) whose rows name manifest tensors
    (``shapes``/``sizes``); stored ranges must lie in ``[lows[f], highs[f])`` of their file
    ``f`` (``own_file``: every row is in that file, the table has no ``f`` column)."""
    if type(cols) is not dict:
        raise CorruptCheckpointError(f"{what} is not an object")
    ords = cols.get("t")
    if not (type(ords) is list and all(type(t) is int and 0 <= t < len(shapes) for t in ords)
            and all(a <= b for a, b in zip(ords, ords[1:]))):
        raise CorruptCheckpointError(f"{what} 't' is not a sorted list of tensor ordinals below {len(shapes)}")
    codecs = cols.get("c")
    if not (type(codecs) is list and len(codecs) == len(ords) and all(type(c) is str for c in codecs)):
        raise CorruptCheckpointError(f"{what} 'c' is not a list of one codec name per row")
    bad = [c for c in codecs if c not in CODECS]
    if bad:
        raise CorruptCheckpointError(f"{what}: unknown codec {bad[0][:40]!r} (this reader knows "
                                     f"{', '.join(CODECS)}; upgrade shardsafe to read it)")
    ndim = np.array([len(shapes[t]) for t in ords], dtype=np.int64)
    files = cols.get("f") if own_file is None else [0] * len(ords)
    table = ChunkTable.from_json({**cols, "f": files}, ndim, block, ranks)
    if own_file is None and bool(((table.file < 0) | (table.file >= len(highs))).any()):
        raise CorruptCheckpointError(f"{what}: a file index out of range")
    stored = _stored_layout(cols.get("s"), what, table, ords, sizes, block, lows, highs)
    # Logical ranges, then the common checks (boxes, raw sizes, checksum counts).
    raw = table.numel().tolist()
    b = []
    for (lo, _, _), n, t in zip(stored, raw, ords):
        b += [logical_start(lo), logical_start(lo) + n * sizes[t]]
    table = ChunkTable.from_json({**cols, "f": files, "b": b}, ndim, block, ranks)
    firsts = np.searchsorted(np.asarray(ords, dtype=np.int64), np.arange(len(shapes) + 1), side="left")
    nf = max(1, len(highs))
    bad_row = table.problem(shapes, sizes, firsts, np.full(nf, LOGICAL_BASE, dtype=np.int64),
                            np.full(nf, LOGICAL_BASE + (MAX_STORED_END << SCALE_SHIFT) - 1, dtype=np.int64),
                            [what] * nf)
    if bad_row is not None:
        c, why = bad_row
        raise CorruptCheckpointError(f"{what} table: {why}" if c < 0 else f"{what} row {c}: {why}")
    digests = check_digests(cols.get("h"), len(ords), what)
    return ZTable(table, ords, digests, codecs, stored)


def _stored_layout(s: Any, what: str, table: ChunkTable, ords: list[int], sizes: list[int], block: int,
                   lows: list[int], highs: list[int]) -> list[tuple[int, int, tuple[int, ...]]]:
    """Each row's stored range and block lengths, checked: inside its file's data, the
    blocks' lengths summing to the range, none longer than its raw block, at most 2^20
    raw bytes per stored byte (logical ranges stay apart)."""
    if not (type(s) is list and all(type(n) is int for n in s)):
        raise CorruptCheckpointError(f"{what} 's' is not a list of stored block lengths")
    starts, ends, files = table.start.tolist(), table.end.tolist(), table.file.tolist()
    numel = table.numel().tolist()
    out = []
    pos = 0
    for r, t in enumerate(ords):
        raw = numel[r] * sizes[t]
        nblk = max(1, -(-raw // block))
        lens = s[pos: pos + nblk]
        pos += nblk
        lo, hi, f = starts[r], ends[r], files[r]
        if len(lens) != nblk:
            raise CorruptCheckpointError(f"{what} 's' lists fewer stored block lengths than the rows' blocks")
        if not (lows[f] <= lo <= hi <= highs[f] and hi <= MAX_STORED_END):
            raise CorruptCheckpointError(f"{what} row {r}: stored byte range {lo}-{hi} is outside the file's data")
        if sum(lens) != hi - lo or any(n < 0 or n > min(block, raw - b * block) or (n == 0 and raw)
                                       for b, n in enumerate(lens)):
            raise CorruptCheckpointError(f"{what} row {r}: stored block lengths {lens[:8]}... do not fit its "
                                         f"{raw} bytes in {hi - lo} stored bytes")
        if raw > (hi - lo) << SCALE_SHIFT:
            raise CorruptCheckpointError(f"{what} row {r}: {raw} bytes from {hi - lo} stored bytes (at most 2^20 "
                                         "per stored byte)")
        out.append((lo, hi, tuple(lens)))
    if pos != len(s):
        raise CorruptCheckpointError(f"{what} 's' lists more stored block lengths than the rows' blocks")
    return out


def zrows(zt: ZTable, keys: list[str], sizes: list[int], file_of_row: list[int] | None, own_file: int) -> list[ZRow]:
    """The :class:`ZRow` of every row of ``zt`` (``file_of_row``: for ``zrefs``, each row's file)."""
    out = []
    starts = zt.table.start.tolist()
    ends = zt.table.end.tolist()
    sums = zt.table.sums
    xs = zt.table.xs.tolist()
    for r, t in enumerate(zt.ordinals):
        lo, hi, lens = zt.stored[r]
        f = own_file if file_of_row is None else file_of_row[r]
        out.append(ZRow(f, keys[t], t, zt.codecs[r], sizes[t], lo, hi, lens, starts[r], ends[r] - starts[r],
                        tuple(sums[i: i + 16] for i in range(xs[r] * 16, xs[r + 1] * 16, 16))))
    return out


__all__ = ["LOGICAL_BASE", "MAX_STORED_END", "SCALE_SHIFT", "ZRow", "ZTable", "logical_start", "parse_ztable",
           "stored_key", "z_columns", "zrows"]
