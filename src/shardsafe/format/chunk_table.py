"""Chunk tables, stored column-wise: a format-2 manifest's (every saved chunk of every
tensor) and each format-3 file index's (the chunks of one data file).

One flat integer list per field (offsets, lengths, file, byte range) and one string of
concatenated block checksums. Parsing 100k+ chunks is then a
handful of ``json.loads`` lists turned into numpy arrays and checked with vectorized
comparisons; :class:`Chunk` objects are built only for the chunks a caller asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from ..gcpause import gc_paused
from .strict_json import SIZE_LIMIT

HEX = 16  # characters per XXH3-64 digest


@dataclass
class Chunk:
    """One saved box of a tensor, stored contiguously (row-major) in one data file."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int  # index into Manifest.files
    start: int  # absolute byte range in the file
    end: int
    checksum: list[str]  # XXH3-64 of each checksum block of the byte range
    rank: int  # the saving rank that wrote it (the rank of its file)

    def to_json(self) -> dict[str, Any]:
        """A readable description (tools and tests; the file stores chunks in the table)."""
        return {"o": list(self.offsets), "n": list(self.lengths), "f": self.file,
                "b": [self.start, self.end], "x": self.checksum, "r": self.rank}


def table_json(chunks: Sequence[Chunk]) -> dict[str, Any]:
    """The ``chunks`` member of a format-2 manifest for ``chunks`` (in table order), built
    in one pass over them."""
    o: list[int] = []
    n: list[int] = []
    f: list[int] = []
    b: list[int] = []
    x: list[str] = []
    o_ext, n_ext, f_add, b_ext, x_ext = o.extend, n.extend, f.append, b.extend, x.extend
    for c in chunks:
        o_ext(c.offsets)
        n_ext(c.lengths)
        f_add(c.file)
        b_ext((c.start, c.end))
        x_ext(c.checksum)
    return {"o": o, "n": n, "f": f, "b": b, "x": "".join(x)}


def _ints(value: Any, n: int, what: str) -> np.ndarray:
    """A JSON list of ``n`` integers as an int64 array; raises on anything else."""
    if not isinstance(value, list) or len(value) != n:
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise CorruptCheckpointError(f"chunk table: '{what}' must be a list of {n} integers (got {got})")
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if not set(map(type, value)) <= {int}:  # JSON true/false are ints to numpy and to Python
        raise CorruptCheckpointError(f"chunk table: '{what}' holds something other than integers")
    try:
        arr = np.array(value)
    except (ValueError, OverflowError):
        arr = np.zeros(0)
    if arr.ndim != 1 or arr.dtype.kind not in "iu" or len(arr) != n:
        raise CorruptCheckpointError(f"chunk table: '{what}' holds something other than integers")
    if arr.dtype.kind == "u" and arr.max(initial=0) > np.iinfo(np.int64).max:
        raise CorruptCheckpointError(f"chunk table: '{what}' holds an integer out of range")
    return arr.astype(np.int64, copy=False)


class ChunkTable:
    """All chunks of a checkpoint, tensor after tensor: columns of numpy int64 arrays.

    Chunk ``c`` has ``ndim[c]`` offsets and lengths at ``dims[c]:dims[c+1]`` of the flat
    ``offsets``/``lengths`` arrays, lies in file ``file[c]`` at bytes
    ``[start[c], end[c])`` and has the block checksums ``sums[xs[c]:xs[c+1]]`` (indices
    into the list of 16-hex digests held in one string)."""

    def __init__(self, offsets: np.ndarray, lengths: np.ndarray, ndim: np.ndarray, file: np.ndarray,
                 start: np.ndarray, end: np.ndarray, sums: str, block: int, file_ranks: Sequence[int]) -> None:
        self.offsets = offsets
        self.lengths = lengths
        self.ndim = ndim
        self.file = file
        self.start = start
        self.end = end
        self.sums = sums
        self.block = block
        self.file_ranks = list(file_ranks)
        self.dims = np.concatenate(([0], np.cumsum(ndim))).astype(np.int64)
        nblocks = np.maximum(1, -(-(end - start) // block))
        # The block counts are summed in int64 only when the exact sum fits: each count is
        # below 2^62, but their sum can wrap (eight of 2^61 sum to 2^64 = 0 mod 2^64), and
        # a wrapped sum would match an empty checksum string. A float64 sum is within a
        # relative 2^-40 of the exact one for any table that fits in memory.
        self.blocks_overflow = bool(len(nblocks)) and float(nblocks.sum(dtype=np.float64)) >= float(SIZE_LIMIT)
        if self.blocks_overflow:
            nblocks = np.minimum(nblocks, 1)  # refused by problem(); the columns stay consistent meanwhile
        self.xs = np.concatenate(([0], np.cumsum(nblocks))).astype(np.int64)
        self._lists: tuple[list[int], ...] | None = None

    def __len__(self) -> int:
        return len(self.file)

    # ------------------------------------------------------------------ building

    @staticmethod
    def from_json(d: Any, ndim_per_chunk: np.ndarray, block: int, file_ranks: Sequence[int]) -> ChunkTable:
        """Parse the ``chunks`` member; ``ndim_per_chunk`` comes from the tensor entries.
        Checks only the column types and lengths (see :meth:`problem` for the rest)."""
        if not isinstance(d, dict):
            raise CorruptCheckpointError("chunk table: 'chunks' is not an object")
        count = len(ndim_per_chunk)
        total_dims = int(ndim_per_chunk.sum())
        file = _ints(d.get("f"), count, "f")
        se = _ints(d.get("b"), 2 * count, "b")
        offsets = _ints(d.get("o"), total_dims, "o")
        lengths = _ints(d.get("n"), total_dims, "n")
        sums = d.get("x")
        if not isinstance(sums, str):
            raise CorruptCheckpointError("chunk table: 'x' is not a string of block checksums")
        return ChunkTable(offsets, lengths, ndim_per_chunk, file, se[0::2].copy(), se[1::2].copy(), sums, block,
                          file_ranks)

    # ------------------------------------------------------------------ validation

    def problem(self, shapes: list[tuple[int, ...]], itemsizes: list[int], firsts: np.ndarray,
                header_bytes: np.ndarray, file_bytes: np.ndarray, file_names: list[str]) -> tuple[int, str] | None:
        """The first chunk that breaks a rule, as (chunk index, what is wrong), or None
        (chunk index -1: the table as a whole).

        ``shapes``/``itemsizes`` are per tensor (itemsize 0: unknown dtype, size not
        checked) and tensor ``t`` owns chunks ``firsts[t]:firsts[t+1]``. Rules: boxes lie
        inside their tensor, byte ranges inside the data area of an existing file and
        exactly ``numel x itemsize`` long, one 16-hex digest per checksum block."""
        count = len(self)
        if count == 0:
            return None if self.sums == "" else (-1, "block checksums without chunks")
        owner = np.repeat(np.arange(len(shapes), dtype=np.int64), np.diff(firsts))
        # Each flat dim's bound: the shape of the chunk's tensor at that dim.
        shape_flat = np.array([s for shape in shapes for s in shape], dtype=np.int64)
        shape_first = np.concatenate(([0], np.cumsum([len(s) for s in shapes]))).astype(np.int64)
        dim_index = np.arange(len(self.offsets), dtype=np.int64) - np.repeat(self.dims[:-1], self.ndim)
        bound = shape_flat[np.repeat(shape_first[owner], self.ndim) + dim_index]
        bad_dim = (self.offsets < 0) | (self.lengths < 0) | (self.offsets > bound - self.lengths)
        bad = np.zeros(count, dtype=bool)
        if bad_dim.any():
            bad[np.repeat(np.arange(count), self.ndim)[bad_dim]] = True
            c = int(np.argmax(bad))
            return c, f"box {self._box(c)} is not inside shape {list(shapes[owner[c]])}"
        bad = (self.file < 0) | (self.file >= len(file_bytes))
        if bad.any():
            c = int(np.argmax(bad))
            return c, f"file index {int(self.file[c])} is out of range"
        f = self.file
        bad = (self.start < header_bytes[f]) | (self.start > self.end) | (self.end > file_bytes[f])
        if bad.any():
            c = int(np.argmax(bad))
            return c, f"byte range {int(self.start[c])}-{int(self.end[c])} is outside the data of {file_names[f[c]]}"
        numel = self.numel()
        size = np.array(itemsizes, dtype=np.int64)[owner]
        bad = (size > 0) & (self.end - self.start != numel * size)
        if bad.any():
            c = int(np.argmax(bad))
            return c, (f"byte range {int(self.start[c])}-{int(self.end[c])} does not hold "
                       f"{int(numel[c])} elements of {int(size[c])} bytes")
        if self.blocks_overflow:
            return -1, f"the chunks claim 2^62 or more checksum blocks; {len(self.sums) // HEX} are listed"
        if len(self.sums) != HEX * int(self.xs[-1]):
            return -1, f"{len(self.sums)} block checksum characters, {HEX * int(self.xs[-1])} expected"
        try:
            hex_ok = 2 * len(bytes.fromhex(self.sums)) == len(self.sums)  # fromhex skips spaces
        except ValueError:
            hex_ok = False
        if not hex_ok:
            return -1, "block checksums are not hexadecimal"
        if self.sums != self.sums.lower():
            return -1, "block checksums must be lowercase hexadecimal"
        return None

    def numel(self) -> np.ndarray:
        """Elements per chunk (1 for 0-d chunks)."""
        padded = np.concatenate((self.lengths, [1]))
        starts = np.minimum(self.dims[:-1], len(self.lengths))
        prod = np.multiply.reduceat(padded, starts) if len(padded) else np.ones(len(self), dtype=np.int64)
        return np.where(self.ndim == 0, 1, prod)

    # ------------------------------------------------------------------ access

    def _box(self, c: int) -> str:
        a, b = self.dims[c], self.dims[c + 1]
        return f"{self.offsets[a:b].tolist()}+{self.lengths[a:b].tolist()}"

    def chunk(self, c: int) -> Chunk:
        """Chunk ``c`` as an object."""
        if self._lists is not None:
            return self._chunk_from_lists(c)
        a, b = int(self.dims[c]), int(self.dims[c + 1])
        x0, x1 = int(self.xs[c]) * HEX, int(self.xs[c + 1]) * HEX
        f = int(self.file[c])
        return Chunk(tuple(self.offsets[a:b].tolist()), tuple(self.lengths[a:b].tolist()), f,
                     int(self.start[c]), int(self.end[c]),
                     [self.sums[i: i + HEX] for i in range(x0, x1, HEX)], self.file_ranks[f])

    def chunks(self, lo: int, hi: int) -> list[Chunk]:
        """Chunks ``lo..hi-1`` as objects (the first call turns the columns into Python
        lists once, so that building many chunks costs no numpy call per chunk)."""
        if self._lists is None:
            self._lists = (self.offsets.tolist(), self.lengths.tolist(), self.dims.tolist(), self.xs.tolist(),
                           self.file.tolist(), self.start.tolist(), self.end.tolist())
        if hi - lo < 1024:
            return [self._chunk_from_lists(c) for c in range(lo, hi)]
        with gc_paused():  # many new objects: no collections while they pile up
            return [self._chunk_from_lists(c) for c in range(lo, hi)]

    def _chunk_from_lists(self, c: int) -> Chunk:
        offsets, lengths, dims, xs, file, start, end = self._lists  # type: ignore[misc]
        a, b = dims[c], dims[c + 1]
        sums = self.sums
        f = file[c]
        x0, x1 = xs[c] * HEX, xs[c + 1] * HEX
        if b - a == 1:  # (one dim: the common case, without the list slices)
            return Chunk((offsets[a],), (lengths[a],), f, start[c], end[c],
                         [sums[x0:x1]] if x1 - x0 == HEX else [sums[i: i + HEX] for i in range(x0, x1, HEX)],
                         self.file_ranks[f])
        return Chunk(tuple(offsets[a:b]), tuple(lengths[a:b]), f, start[c], end[c],
                     [sums[x0:x1]] if x1 - x0 == HEX else [sums[i: i + HEX] for i in range(x0, x1, HEX)],
                     self.file_ranks[f])

    def meeting(self, lo: int, hi: int, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> list[int]:
        """Indices in ``lo..hi-1`` (chunks of one tensor, all of rank ``len(offsets)``)
        of the chunks whose boxes overlap the box ``offsets + lengths``."""
        nd = len(offsets)
        if hi <= lo:
            return []
        if nd == 0:
            return list(range(lo, hi))
        a, b = int(self.dims[lo]), int(self.dims[hi])
        o = self.offsets[a:b].reshape(hi - lo, nd)
        n = self.lengths[a:b].reshape(hi - lo, nd)
        qo = np.array(offsets, dtype=np.int64)
        qe = qo + np.array(lengths, dtype=np.int64)
        hit = ((o < qe) & (o + n > qo) & (n > 0)).all(axis=1)
        return (np.flatnonzero(hit) + lo).tolist()


__all__ = ["Chunk", "ChunkTable", "table_json"]
