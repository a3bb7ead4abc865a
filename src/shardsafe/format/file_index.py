"""A data file's index (format 3.0): what only the file's writer knows.

Written by each saving rank next to its data file, once the file's bytes are hashed:
the byte range and block checksums of every chunk in the file, the file's header size
and digest, this rank's rank-local values and the tensors inside them. The manifest
names every index with its size and XXH3-64 digest, so a reader verifies an index before
trusting it, and reads only the indexes of the files it loads from.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .checksum import checksum
from .chunk_table import HEX, Chunk, ChunkTable
from .refs import DIGEST_HEX, check_digests
from .strict_json import _count, _duplicate, _parse_json, _show
from .values import TENSOR_TAG
from .zindex import ZTable, parse_ztable, z_columns

INDEX_FORMAT = "shardsafe-index"
INDEX_VERSION = (3, 1)
ZIP_VERSION = (3, 2)  # an index with compressed rows (``zchunks``/``zrefs``)
DATA_SUFFIX = ".safetensors"
INDEX_SUFFIX = ".index.json"


def data_name(rank: int, file_id: str = "", index: int = 0) -> str:
    """The data file of saving rank ``rank`` in a format-3 checkpoint whose files carry the
    save id ``file_id`` ("" or "." and up to 64 lowercase letters and digits)."""
    return f"data-r{rank:05d}-{index:02d}{file_id}{DATA_SUFFIX}"


def index_name(data_name: str) -> str:
    """The index file of data file ``data_name`` (``x.safetensors`` -> ``x.index.json``)."""
    stem = data_name[: -len(DATA_SUFFIX)] if data_name.endswith(DATA_SUFFIX) else data_name
    return stem + INDEX_SUFFIX


@dataclass(frozen=True)
class IndexedChunk:
    """One chunk as its writer records it: tensor ordinal (manifest tensors first, then
    this index's own rank-local tensors), box, byte range, block checksums and chunk
    digest; ``ref`` >= 0: the bytes are in the manifest's referenced file ``ref``, not in
    this index's data file (format 3.1)."""

    ordinal: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    start: int
    end: int
    sums: list[str]
    digest: str = ""
    ref: int = -1
    codec: str = ""  # format 3.2: the chunk is stored compressed with this codec ("": raw)
    stored: tuple[int, ...] = ()  # format 3.2: each checksum block's stored length


def build_index(rank: int, header_bytes: int, header_checksum: str, chunks: list[IndexedChunk],
                local_tensors: dict[str, tuple[str, tuple[int, ...]]], rank_local: dict[str, Any]) -> bytes:
    """The index file's bytes (rows sorted by tensor ordinal, then offsets; references in
    their own ``refs`` table). Every chunk carries its digest."""
    def order(c: IndexedChunk) -> tuple:
        return (c.ordinal, c.offsets)

    rows = sorted((c for c in chunks if c.ref < 0 and not c.codec), key=order)
    refs = sorted((c for c in chunks if c.ref >= 0 and not c.codec), key=order)
    zrows = sorted((c for c in chunks if c.ref < 0 and c.codec), key=order)
    zrefs = sorted((c for c in chunks if c.ref >= 0 and c.codec), key=order)
    body: dict[str, Any] = {
        "format": INDEX_FORMAT,
        "version": list(ZIP_VERSION if zrows or zrefs else INDEX_VERSION),
        "rank": rank,
        "header_bytes": header_bytes,
        "header_x": header_checksum,
        "tensors": {k: {"dtype": dt, "shape": list(shape), "kind": "rank_local"} for k, (dt, shape) in
                    local_tensors.items()},
        "chunks": _columns(rows),
        "rank_local": rank_local,
    }
    if refs:
        body["refs"] = {**_columns(refs), "f": [c.ref for c in refs]}
    if zrows:
        body["zchunks"] = z_columns(zrows, _columns)
    if zrefs:
        body["zrefs"] = {**z_columns(zrefs, _columns), "f": [c.ref for c in zrefs]}
    return json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")


def _columns(rows: list[IndexedChunk]) -> dict[str, Any]:
    o: list[int] = []
    n: list[int] = []
    b: list[int] = []
    for c in rows:
        o.extend(c.offsets)
        n.extend(c.lengths)
        b.extend((c.start, c.end))
    if any(len(c.digest) != DIGEST_HEX for c in rows):
        raise ValueError("every chunk of a format-3.1 index needs its digest")
    return {"t": [c.ordinal for c in rows], "o": o, "n": n, "b": b, "x": "".join(s for c in rows for s in c.sums),
            "h": "".join(c.digest for c in rows)}


class FileIndex:
    """A parsed, validated index of data file ``file`` (an index into the manifest's files)."""

    def __init__(self, file: int, rank: int, header_bytes: int, header_checksum: str, table: ChunkTable,
                 ordinals: list[int], local_tensors: dict[str, tuple[str, tuple[int, ...]]],
                 rank_local: dict[str, Any]) -> None:
        self.file = file
        self.rank = rank
        self.header_bytes = header_bytes
        self.header_checksum = header_checksum
        self.table = table
        self.ordinals = ordinals
        self.local_tensors = local_tensors
        self.rank_local = rank_local
        self._rows: dict[tuple[int, tuple[int, ...]], int] | None = None
        self.raw = b""  # the index's bytes, once verified (copies write them unchanged)
        self.digests = ""  # format 3.1: the chunk digest of every row (32 hex digits each)
        self.refs: ChunkTable | None = None  # format 3.1: chunks whose bytes are in referenced files
        self.ref_ordinals: list[int] = []
        self.ref_digests = ""
        self._ref_rows: dict[tuple[int, tuple[int, ...]], int] | None = None
        self.zchunks: ZTable | None = None  # format 3.2: compressed chunks of this file (logical ranges)
        self.zrefs: ZTable | None = None  # format 3.2: references to compressed chunks of referenced files

    def __len__(self) -> int:
        return len(self.ordinals)

    def row(self, ordinal: int, offsets: tuple[int, ...]) -> int | None:
        """The row of the chunk of tensor ``ordinal`` at ``offsets``, or None."""
        if self._rows is None:
            offs = self.table.offsets.tolist()
            dims = self.table.dims.tolist()
            self._rows = {(t, tuple(offs[dims[r]: dims[r + 1]])): r for r, t in enumerate(self.ordinals)}
        return self._rows.get((ordinal, tuple(offsets)))

    def find(self, ordinal: int, offsets: tuple[int, ...]) -> tuple[Chunk, str] | None:
        """The chunk of tensor ``ordinal`` at ``offsets`` (in this file, or a reference:
        its ``file`` is then the manifest's number of the referenced file) and its chunk
        digest ("" when the index has none), or None."""
        row = self.row(ordinal, offsets)
        if row is not None:
            return self.table.chunk(row), self.digests[DIGEST_HEX * row: DIGEST_HEX * (row + 1)]
        for zt in (self.zchunks, self.zrefs):
            r = None if zt is None else zt.row(ordinal, tuple(offsets))
            if r is not None:
                assert zt is not None
                return zt.table.chunk(r), zt.digests[DIGEST_HEX * r: DIGEST_HEX * (r + 1)]
        if self.refs is None:
            return None
        if self._ref_rows is None:
            offs = self.refs.offsets.tolist()
            dims = self.refs.dims.tolist()
            self._ref_rows = {(t, tuple(offs[dims[r]: dims[r + 1]])): r for r, t in enumerate(self.ref_ordinals)}
        r = self._ref_rows.get((ordinal, tuple(offsets)))
        if r is None:
            return None
        return self.refs.chunk(r), self.ref_digests[DIGEST_HEX * r: DIGEST_HEX * (r + 1)]

    def referred(self) -> list[tuple[int, Chunk]]:
        """(tensor ordinal, chunk) of every reference row (chunk.file: the manifest's number)."""
        out = [] if self.refs is None else list(zip(self.ref_ordinals, self.refs.chunks(0, len(self.refs))))
        if self.zrefs is not None:
            out += list(zip(self.zrefs.ordinals, self.zrefs.table.chunks(0, len(self.zrefs.ordinals))))
        return out

    def zrow_count(self) -> int:
        """Rows of the compressed tables (format 3.2)."""
        return sum(len(z.ordinals) for z in (self.zchunks, self.zrefs) if z is not None)

    def chunk(self, row: int) -> Chunk:
        """Row ``row`` as a :class:`Chunk` of this file (its ``file`` and ``rank`` set)."""
        return self.table.chunk(row)

    def rows_of(self, ordinal: int) -> list[int]:
        """The rows of tensor ``ordinal`` (sorted by offsets)."""
        lo = int(np.searchsorted(self._ords_array(), ordinal, side="left"))
        hi = int(np.searchsorted(self._ords_array(), ordinal, side="right"))
        return list(range(lo, hi))

    def _ords_array(self) -> np.ndarray:
        return np.asarray(self.ordinals, dtype=np.int64)

    @staticmethod
    def parse(data: bytes, where: str, *, file: int, rank: int, nbytes: int, block: int,
              tensors: list[tuple[tuple[int, ...], int]], ref_files: list[tuple[str, int]] | None = None,
              first_ref: int = 0) -> FileIndex:
        """Parse and validate index bytes (already checked against the manifest's digest).
        ``tensors`` holds (shape, itemsize) of each manifest tensor, in order;
        ``ref_files`` (name, size) the manifest's referenced files, numbered from
        ``first_ref``; errors name ``where``."""
        body, spans = _parse_json(data, where, "file index")
        try:
            return _parse_body(body, spans, data, where, file, rank, nbytes, block, tensors, ref_files or [],
                               first_ref)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"{where}: corrupt file index: {exc}") from None
        except (KeyError, TypeError, IndexError, AttributeError, ValueError, OverflowError) as exc:
            raise CorruptCheckpointError(f"{where}: corrupt file index: a field is missing or mistyped: "
                                         f"{exc!r}") from None


def _parse_body(body: dict[str, Any], spans: Any, data: bytes, where: str, file: int, rank: int, nbytes: int,
                block: int, tensors: list[tuple[tuple[int, ...], int]], ref_files: list[tuple[str, int]],
                first_ref: int) -> FileIndex:
    """:meth:`FileIndex.parse` of the parsed JSON ``body`` (errors without ``where``)."""
    header_bytes, header_x = _check_head(body, rank, nbytes)
    local_json, rank_local = body["tensors"], body["rank_local"]
    if type(local_json) is not dict or type(rank_local) is not dict:
        raise CorruptCheckpointError("tensors or rank_local is not an object")
    local, shapes, sizes = _local_tensors(local_json, tensors)
    cols = body["chunks"]
    if type(cols) is not dict:
        raise CorruptCheckpointError("chunks is not an object")
    ords = cols.get("t")
    if not (type(ords) is list and set(map(type, ords)) <= {int}):
        raise CorruptCheckpointError("chunks 't' is not a list of tensor ordinals")
    if ords != sorted(ords) or (ords and (ords[0] < 0 or ords[-1] >= len(shapes))):  # sorted: ends bound
        raise CorruptCheckpointError(f"chunks 't' holds an ordinal out of range (0..{len(shapes) - 1}) or "
                                     "is not sorted")
    ndim = np.fromiter(map(len, shapes), dtype=np.int64, count=len(shapes))[np.asarray(ords, dtype=np.int64)]
    table = ChunkTable.from_json({**cols, "f": [0] * len(ords)}, ndim, block, [rank])
    firsts = np.searchsorted(np.asarray(ords, dtype=np.int64), np.arange(len(shapes) + 1), side="left")
    name = where.rsplit("/", 1)[-1]
    bad = table.problem(shapes, sizes, firsts, np.array([header_bytes], dtype=np.int64),
                        np.array([nbytes], dtype=np.int64), [name])
    if bad is not None:
        c, what = bad
        raise CorruptCheckpointError(f"chunk table: {what}" if c < 0 else f"chunk {c}: {what}")
    _check_values(rank_local, local)
    # Validated: the rows' file is this file, written by ``rank``; the columns become
    # Python lists once, so chunks are built without numpy calls.
    table.file = np.full(len(ords), file, dtype=np.int64)
    table.file_ranks = {file: rank}  # type: ignore[assignment]
    table.chunks(0, 0)
    index = FileIndex(file, rank, header_bytes, header_x, table, ords, local, rank_local)
    if "h" in cols:
        index.digests = check_digests(cols["h"], len(ords), "chunks")
    if "refs" in body:
        _parse_refs(index, body["refs"], ref_files, first_ref, shapes[: len(tensors)], sizes[: len(tensors)], block,
                    rank)
    _check_row_order(ords, table)
    if "zchunks" in body or "zrefs" in body:
        _parse_z(index, body, shapes[: len(tensors)], sizes[: len(tensors)], block, header_bytes, nbytes, ref_files,
                 first_ref)
    members = len(local_json) + sum(len(t) for t in local_json.values())
    if members != spans.counted.get("tensors", members):  # fewer parsed than written: a duplicate key
        dup = _duplicate(data[:-1] if data.endswith(b"}") else data, spans)
        if dup:
            raise CorruptCheckpointError(dup)
    return index


def _check_head(body: dict[str, Any], rank: int, nbytes: int) -> tuple[int, str]:
    """The index's format, rank and header size and digest, checked."""
    version = body.get("version")
    if body.get("format") != INDEX_FORMAT or not (type(version) is list and len(version) == 2 and all(
            type(v) is int for v in version) and version[0] == INDEX_VERSION[0]):
        raise CorruptCheckpointError(f"not a format-{INDEX_VERSION[0]} shardsafe file index")
    if type(body.get("rank")) is not int or body.get("rank") != rank:  # JSON false equals 0
        raise CorruptCheckpointError(f"index of rank {_show(body.get('rank'))}, the manifest says {rank}")
    header_bytes, header_x = body["header_bytes"], body["header_x"]
    if not (_count(header_bytes) and 8 <= header_bytes <= nbytes):
        raise CorruptCheckpointError(f"header_bytes {_show(header_bytes)} is not from 8 to the file's "
                                     f"{nbytes} bytes")
    if not (type(header_x) is str and len(header_x) == HEX):
        raise CorruptCheckpointError("bad header checksum")
    return header_bytes, header_x


def _local_tensors(local_json: dict[str, Any], tensors: list[tuple[tuple[int, ...], int]]
                   ) -> tuple[dict[str, tuple[str, tuple[int, ...]]], list[tuple[int, ...]], list[int]]:
    """The index's rank-local tensors, and the (shape, itemsize) columns of every tensor
    its rows may name (the manifest's, then these)."""
    from .dtypes import name_itemsize

    local: dict[str, tuple[str, tuple[int, ...]]] = {}
    shapes = [s for s, _ in tensors]
    sizes = [z for _, z in tensors]
    for key, t in local_json.items():
        if type(t) is not dict or set(t) != {"dtype", "shape", "kind"} or t["kind"] != "rank_local":
            raise CorruptCheckpointError(f"rank-local tensor '{key}' is not a dtype, shape and kind")
        dtype, shape = t["dtype"], t["shape"]
        size = name_itemsize(dtype) if isinstance(dtype, str) else None
        if not (size and type(shape) is list and all(_count(d) and d < (1 << 62) for d in shape)
                and prod(shape) * size < (1 << 62)):
            raise CorruptCheckpointError(f"rank-local tensor '{key}': bad dtype {_show(dtype)} or shape")
        local[key] = (dtype, tuple(shape))
        shapes.append(tuple(shape))
        sizes.append(size)
    return local, shapes, sizes


def _check_row_order(ords: list[int], table: ChunkTable) -> None:
    """Rows sorted by (ordinal, offsets), no two at one place (a given when every ordinal
    is listed once: they are sorted already)."""
    if len(set(ords)) == len(ords):
        return
    offsets = table.offsets.tolist()
    dims = table.dims.tolist()
    previous: tuple[int, list[int]] | None = None
    for r, t in enumerate(ords):
        here = (t, offsets[dims[r]: dims[r + 1]])
        if previous is not None and here <= previous:
            raise CorruptCheckpointError(f"chunk {r}: rows are not sorted by tensor and offsets, or tensor {t} "
                                         f"has two chunks at {here[1]}")
        previous = here


def _parse_refs(index: FileIndex, cols: Any, ref_files: list[tuple[str, int]], first_ref: int,
                shapes: list[tuple[int, ...]], sizes: list[int], block: int, rank: int) -> None:
    """The ``refs`` table (format 3.1): rows of manifest tensors only, sorted by (tensor,
    offsets), in the referenced files' data areas, none at a place the file's own rows hold."""
    if type(cols) is not dict:
        raise CorruptCheckpointError("refs is not an object")
    ords = cols.get("t")
    if not (type(ords) is list and all(type(t) is int and 0 <= t < len(shapes) for t in ords)
            and all(a <= b for a, b in zip(ords, ords[1:]))):
        raise CorruptCheckpointError(f"refs 't' is not a sorted list of tensor ordinals below {len(shapes)}")
    if ords and not ref_files:
        raise CorruptCheckpointError("refs rows, but the manifest lists no referenced file")
    ndim = np.array([len(shapes[t]) for t in ords], dtype=np.int64)
    table = ChunkTable.from_json(cols, ndim, block, [rank] * max(1, len(ref_files)))
    firsts = np.searchsorted(np.asarray(ords, dtype=np.int64), np.arange(len(shapes) + 1), side="left")
    bad = table.problem(shapes, sizes, firsts, np.full(max(1, len(ref_files)), 8, dtype=np.int64),
                        np.array([n for _, n in ref_files] or [0], dtype=np.int64), [n for n, _ in ref_files] or [""])
    if bad is not None:
        c, what = bad
        raise CorruptCheckpointError(f"refs table: {what}" if c < 0 else f"reference {c}: {what}")
    index.ref_digests = check_digests(cols.get("h"), len(ords), "refs")
    offsets = table.offsets.tolist()
    dims = table.dims.tolist()
    previous: tuple[int, list[int]] | None = None
    for r, t in enumerate(ords):
        here = (t, offsets[dims[r]: dims[r + 1]])
        if (previous is not None and here <= previous) or index.row(t, tuple(here[1])) is not None:
            raise CorruptCheckpointError(f"reference {r}: rows are not sorted by tensor and offsets, or tensor {t} "
                                         f"has two chunks at {here[1]}")
        previous = here
    table.file = table.file + first_ref
    table.file_ranks = {first_ref + j: rank for j in range(len(ref_files))}  # type: ignore[assignment]
    table.chunks(0, 0)
    index.refs, index.ref_ordinals = table, ords


def _parse_z(index: FileIndex, body: dict[str, Any], shapes: list[tuple[int, ...]], sizes: list[int], block: int,
             header_bytes: int, nbytes: int, ref_files: list[tuple[str, int]], first_ref: int) -> None:
    """The compressed tables (format 3.2): ``zchunks`` in this file's data area, ``zrefs``
    in referenced files (after their first 8 bytes); no box listed twice across tables."""
    if "zchunks" in body:
        zt = parse_ztable(body["zchunks"], "zchunks", shapes, sizes, block, [index.rank], [header_bytes], [nbytes],
                          own_file=index.file)
        zt.table.file = np.full(len(zt.ordinals), index.file, dtype=np.int64)
        zt.table.file_ranks = {index.file: index.rank}  # type: ignore[assignment]
        index.zchunks = zt
    if "zrefs" in body:
        if not ref_files:
            raise CorruptCheckpointError("zrefs rows, but the manifest lists no referenced file")
        zt = parse_ztable(body["zrefs"], "zrefs", shapes, sizes, block, [index.rank] * len(ref_files),
                          [8] * len(ref_files), [n for _, n in ref_files], own_file=None)
        zt.table.file = zt.table.file + first_ref
        zt.table.file_ranks = {first_ref + j: index.rank for j in range(len(ref_files))}  # type: ignore[assignment]
        index.zrefs = zt
    seen: set[tuple[int, tuple[int, ...]]] = set()
    ref_boxes = _ref_boxes(index)
    for what, zt in (("zchunks", index.zchunks), ("zrefs", index.zrefs)):
        if zt is None:
            continue
        offs, dims = zt.table.offsets.tolist(), zt.table.dims.tolist()
        previous = None
        for r, t in enumerate(zt.ordinals):
            here = (t, tuple(offs[dims[r]: dims[r + 1]]))
            if (previous is not None and here <= previous) or here in seen or index.row(*here) is not None or (
                    here in ref_boxes):
                raise CorruptCheckpointError(f"{what} row {r}: rows are not sorted by tensor and offsets, or tensor "
                                             f"{t} has two chunks at {list(here[1])}")
            seen.add(here)
            previous = here
        zt.table.chunks(0, 0)


def _ref_boxes(index: FileIndex) -> set[tuple[int, tuple[int, ...]]]:
    """The (tensor, offsets) of the ``refs`` rows."""
    if index.refs is None:
        return set()
    offs, dims = index.refs.offsets.tolist(), index.refs.dims.tolist()
    return {(t, tuple(offs[dims[r]: dims[r + 1]])) for r, t in enumerate(index.ref_ordinals)}


def _check_values(rank_local: dict[str, Any], local: dict[str, Any]) -> None:
    """Decode every rank-local value once (as a load would): malformed typed JSON, or a
    placeholder that names no tensor of this index, is a corrupt index."""
    from .values import decode

    def on_ref(tag: str, key: str) -> None:
        if tag != TENSOR_TAG or key not in local:
            raise CorruptCheckpointError(f"a rank-local value refers to {tag[1:]} {key!r}, which the index does not "
                                         "hold")

    for key, value in rank_local.items():
        decode(value, on_ref, key)


def verify_index(data: bytes, expected_bytes: int, expected_checksum: str, where: str) -> None:
    """Refuse index bytes whose size or XXH3-64 differs from what the manifest says."""
    if len(data) != expected_bytes or checksum(data) != expected_checksum:
        raise CorruptCheckpointError(
            f"{where}: file index does not match the manifest ({len(data)} bytes, the manifest says "
            f"{expected_bytes}; {'same' if len(data) == expected_bytes else 'different'} size, digest mismatch)")


__all__ = ["FileIndex", "IndexedChunk", "build_index", "data_name", "index_name", "verify_index"]
