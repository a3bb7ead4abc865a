"""The manifest: one JSON file per checkpoint that describes everything in it.

It is written last; a directory without a valid manifest is not a checkpoint. Its own
integrity is protected by a trailing XXH3-64 over the bytes that precede the trailer.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, FormatVersionError
from ..gcpause import gc_paused
from .checksum import ALGORITHM, checksum
from .chunk_table import Chunk, ChunkTable, table_json
from .strict_json import MAX_MEMBER_DEPTH, _count, _duplicate, _parse_json, _show  # noqa: F401 (re-exported)

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardsafe"
FORMAT_VERSION = (2, 0)
READABLE_MAJORS = (1, 2)
_TRAILER = b', "manifest_xxh3_64": "'

KINDS = ("replicated", "sharded", "rank_local")

MAX_CHECKSUM_BLOCK = 1 << 26
"""Largest ``extra.checksum_block`` a reader accepts (64 MiB, the default staging buffer;
shardsafe writes 1 MiB): a partial read never hashes more than that beyond what it needs,
and tools may allocate one block."""
MAX_FILE_NAME_BYTES = 255
MAX_CREATED = 1 << 35
"""``created`` lies in ``[0, 2^35)`` seconds (before the year 3058), so every tool can show it."""


_VECTOR_MIN = 64  # below this many chunks a Python loop beats numpy's per-call overhead


_new_entry = object.__new__


class TensorEntry:
    """A logical tensor: dtype, global shape, kind, and the chunks that cover it.

    An entry built by a writer holds a list of :class:`Chunk`; one parsed from a file
    points into the manifest's :class:`ChunkTable` and builds Chunk objects only when
    ``chunks`` is first read (:meth:`chunks_meeting` needs none for the others)."""

    __slots__ = ("dtype", "shape", "kind", "layout", "_chunks", "_table", "_lo", "_hi")

    def __init__(self, dtype: str, shape: tuple[int, ...], kind: str = "replicated",
                 chunks: list[Chunk] | None = None, layout: dict[str, Any] | None = None) -> None:
        self.dtype = dtype
        self.shape = shape
        self.kind = kind
        self.layout = layout  # the saving layout (mesh, placements), when sharded
        self._chunks: list[Chunk] | None = [] if chunks is None else chunks
        self._table: ChunkTable | None = None
        self._lo = self._hi = 0

    @staticmethod
    def in_table(dtype: str, shape: tuple[int, ...], kind: str, layout: dict[str, Any] | None,
                 table: ChunkTable, lo: int, hi: int) -> TensorEntry:
        """An entry whose chunks are rows ``lo..hi-1`` of ``table``."""
        entry = _new_entry(TensorEntry)  # no __init__: parsing builds 100k+ of these
        entry.dtype, entry.shape, entry.kind, entry.layout = dtype, shape, kind, layout
        entry._chunks, entry._table, entry._lo, entry._hi = None, table, lo, hi
        return entry

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks, sorted by offsets (built from the table on first use)."""
        if self._chunks is None:
            assert self._table is not None
            self._chunks = self._table.chunks(self._lo, self._hi)
        return self._chunks

    @chunks.setter
    def chunks(self, value: list[Chunk]) -> None:
        self._chunks, self._table = value, None

    @property
    def chunk_count(self) -> int:
        """Number of chunks (without building them)."""
        return len(self._chunks) if self._chunks is not None else self._hi - self._lo

    def chunks_meeting(self, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> list[Chunk]:
        """The chunks whose boxes overlap the box ``offsets + lengths``; for a parsed entry
        found with one vectorized test over the table, building only those chunks."""
        if self._chunks is None and self._table is not None and self._hi - self._lo > _VECTOR_MIN:
            return [self._table.chunk(c) for c in self._table.meeting(self._lo, self._hi, offsets, lengths)]
        ends = [o + n for o, n in zip(offsets, lengths)]
        return [c for c in self.chunks if all(
            co < e and co + cn > o and cn > 0 for co, cn, o, e in zip(c.offsets, c.lengths, offsets, ends))]

    def to_json(self) -> dict[str, Any]:
        """A readable description with the chunks inline (tools and tests; files keep the
        chunks in the manifest's chunk table)."""
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "kind": self.kind}
        if self.layout is not None:
            d["layout"] = self.layout
        d["chunks"] = [c.to_json() for c in self.chunks]
        return d

    def __repr__(self) -> str:
        return f"TensorEntry({self.dtype}, {list(self.shape)}, {self.kind}, {self.chunk_count} chunks)"


@dataclass
class FileEntry:
    """A data file: its name in the checkpoint directory, size, writer and header checksum."""

    name: str
    nbytes: int
    rank: int
    header_bytes: int
    header_checksum: str

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.nbytes, "rank": self.rank,
                "header_bytes": self.header_bytes, "header_x": self.header_checksum}

    @staticmethod
    def from_json(d: dict[str, Any]) -> FileEntry:
        return FileEntry(d["name"], d["bytes"], d["rank"], d["header_bytes"], d["header_x"])


@dataclass
class Manifest:
    """Everything a reader needs: files, tensors, the typed-JSON value tree."""

    tree: Any
    tensors: dict[str, TensorEntry]
    files: list[FileEntry]
    world_size: int = 1
    rank_local: dict[str, list[Any]] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    writer: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = FORMAT_VERSION

    def chunks_in_file(self, index: int) -> list[tuple[str, Chunk]]:
        """(tensor key, chunk) of every chunk stored in file ``index``. For a parsed
        manifest the chunk table is searched with one vectorized test and only those
        chunks are built."""
        tables = {id(e._table): e._table for e in self.tensors.values() if e._chunks is None and e._table is not None}
        if len(tables) == 1 and all(e._chunks is None for e in self.tensors.values()):
            table = next(iter(tables.values()))
            keys = list(self.tensors)
            los = np.array([self.tensors[k]._lo for k in keys], dtype=np.int64)
            rows = np.flatnonzero(table.file == index)
            owners = np.searchsorted(los, rows, side="right") - 1
            return [(keys[int(t)], table.chunk(int(r))) for r, t in zip(rows, owners)]
        return [(k, c) for k, e in self.tensors.items() for c in e.chunks if c.file == index]

    def to_bytes(self) -> bytes:
        """Serialize (in the current format version) with the integrity trailer;
        ``from_bytes`` is its inverse."""
        with gc_paused():
            return self._to_bytes()

    def _to_bytes(self) -> bytes:
        entries: dict[str, Any] = {}
        every: list[Chunk] = []
        for key, t in self.tensors.items():
            chunks = t.chunks
            d: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "kind": t.kind}
            if t.layout is not None:
                d["layout"] = t.layout
            d["chunks"] = [len(every), len(chunks)]
            entries[key] = d
            every.extend(chunks)
        body = {
            "format": FORMAT_NAME,
            # The layout written is always the current one; a parsed older manifest is upgraded.
            "version": list(self.version if self.version[0] >= FORMAT_VERSION[0] else FORMAT_VERSION),
            "checksum_algorithm": ALGORITHM,
            "created": self.created,
            "writer": self.writer,
            "world_size": self.world_size,
            "extra": self.extra,
            "files": [f.to_json() for f in self.files],
            "tensors": entries,
            "chunks": table_json(every),
            "rank_local": self.rank_local,
            "tree": self.tree,
        }
        text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
        head = text[:-1]  # drop the closing brace; the trailer closes the object
        return head + _TRAILER + checksum(head).encode("ascii") + b'"}\n'

    @staticmethod
    def from_bytes(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and verify a manifest (format 1.x or 2.x); errors name ``where``."""
        with gc_paused():
            return Manifest._from_bytes(data, where)

    @staticmethod
    def _from_bytes(data: bytes, where: str) -> Manifest:
        cut = data.rfind(_TRAILER)
        if cut < 0:
            raise CorruptCheckpointError(f"{where}: manifest has no integrity trailer (truncated or not ours)")
        head = data[:cut]
        stored = data[cut + len(_TRAILER): cut + len(_TRAILER) + 16].decode("ascii", "replace")
        if data[cut + len(_TRAILER) + 16:].rstrip(b"\n") != b'"}' or checksum(head) != stored:
            raise CorruptCheckpointError(f"{where}: manifest checksum mismatch (the file is corrupt)")
        body, spans = _parse_json(head + b"}", where)
        if body.get("format") != FORMAT_NAME:
            raise CorruptCheckpointError(f"{where}: not a shardsafe manifest")
        version = body.get("version")
        if not (isinstance(version, list) and len(version) == 2 and all(type(v) is int for v in version)):
            raise CorruptCheckpointError(f"{where}: bad format version {version!r}")
        if version[0] not in READABLE_MAJORS:
            raise FormatVersionError(
                f"{where}: format version {version[0]}.{version[1]} is not readable by this shardsafe "
                f"(reads {', '.join(f'{m}.x' for m in READABLE_MAJORS)}); upgrade shardsafe to load it"
            )
        if body.get("checksum_algorithm") != ALGORITHM:
            raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {body.get('checksum_algorithm')!r}")
        try:
            if not isinstance(body["files"], list):
                raise CorruptCheckpointError("inconsistent manifest: files is not a list")
            files = [FileEntry.from_json(f) for f in body["files"]]  # so every file is an object
            world_size = body["world_size"]
            extra = body.get("extra", {})
            problem = _header_problem(world_size, extra, body.get("writer", {}), body.get("rank_local", {}), files)
            if problem:
                raise CorruptCheckpointError(f"{where}: inconsistent manifest: {problem}")
            created = body.get("created", 0.0)
            if not (type(created) in (int, float) and 0 <= created < MAX_CREATED):  # NaN fails too
                raise CorruptCheckpointError(
                    f"inconsistent manifest: created {_show(created)} is not a finite number of seconds in "
                    f"[0, 2^35)")
            if version[0] == 1:
                tensors_json, chunks_json = _v1_to_v2(body["tensors"])
            else:
                tensors_json, chunks_json = body["tensors"], body["chunks"]
            tensors, members = _parse_tensors(tensors_json, chunks_json, files, extra["checksum_block"], where)
            if version[0] == 1 or members != spans.counted["tensors"] or \
                    sum(map(len, body["files"])) != spans.counted["files"]:
                # Fewer members parsed than written: a duplicate key, or members of objects
                # not counted here (a newer minor's); a strict parse tells which.
                duplicate = _duplicate(head, spans)
                if duplicate:
                    raise CorruptCheckpointError(f"manifest is not valid JSON: {duplicate}")
            return Manifest(
                tree=body["tree"],
                tensors=tensors,
                files=files,
                world_size=world_size,
                rank_local=body.get("rank_local", {}),
                created=created,
                writer=body.get("writer", {}),
                extra=extra,
                version=(version[0], version[1]),
            )
        except CorruptCheckpointError as exc:
            # A duplicate key in tensors or files can break a rule; say so rather than what it broke.
            duplicate = _duplicate(head, spans)
            msg = f"manifest is not valid JSON: {duplicate}" if duplicate else str(exc)
            raise CorruptCheckpointError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        except (KeyError, TypeError, IndexError, AttributeError, ValueError, OverflowError, MemoryError) as exc:
            duplicate = _duplicate(head, spans)
            msg = f"manifest is not valid JSON: {duplicate}" if duplicate else \
                f"a manifest field is missing or mistyped: {exc!r}"
            raise CorruptCheckpointError(f"{where}: {msg}") from None


# strict JSON parsing lives in strict_json.py

# Characters a data file name may not hold: path separators, C0/C1 controls, lone surrogates.
_NOT_IN_NAME = re.compile(r"[/\\\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def _file_names_problem(names: list[Any]) -> str | None:
    """What makes a data file name other than a plain, unique one (docs/format.md,
    "files"), or None; all names are checked at once, one by one only to say which."""
    if (set(map(type, names)) <= {str} and not _NOT_IN_NAME.search("".join(names))
            and not {"", ".", ".."} & set(names) and len(set(names)) == len(names)
            and max(map(len, names), default=0) * 4 <= MAX_FILE_NAME_BYTES):  # at most 4 bytes a character
        return None
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not (isinstance(name, str) and name not in ("", ".", "..") and not _NOT_IN_NAME.search(name)
                and len(name.encode("utf-8")) <= MAX_FILE_NAME_BYTES):
            return (f"file {i}: name {_show(name)} is not a plain file name (no path separators, control "
                    f"characters or lone surrogates, at most {MAX_FILE_NAME_BYTES} bytes)")
        if name in seen:
            return f"file {i}: name {name!r} is listed twice"
        seen.add(name)
    return None


def _header_problem(world_size: Any, extra: Any, writer: Any, rank_local: Any, files: list[FileEntry]) -> str | None:
    """What is wrong with the manifest's top-level members and file list, or None."""
    if not (_count(world_size) and world_size >= 1):
        return f"world_size {world_size!r}"
    for name, part in (("extra", extra), ("writer", writer), ("rank_local", rank_local)):
        if not isinstance(part, dict):
            return f"{name} is not an object"
    block = extra.get("checksum_block")
    if not (_count(block) and 1 <= block <= MAX_CHECKSUM_BLOCK):
        return f"extra.checksum_block {_show(block)} is not an integer from 1 to {MAX_CHECKSUM_BLOCK} (64 MiB)"
    problem = _file_names_problem([f.name for f in files])
    if problem:
        return problem
    for f in files:
        if not (_count(f.nbytes) and _count(f.rank) and _count(f.header_bytes)
                and 8 <= f.header_bytes <= f.nbytes < _LIMIT):
            return f"file {f.name!r}: bad sizes (bytes {f.nbytes!r}, header_bytes {f.header_bytes!r})"
        if not isinstance(f.header_checksum, str):
            return f"file {f.name!r}: bad header checksum"
    return None


_LIMIT = 1 << 62  # bound on sizes in bytes, so that int64 arithmetic cannot overflow


def _parse_tensors(tensors_json: Any, chunks_json: Any, files: list[FileEntry], block: int,
                   where: str) -> tuple[dict[str, TensorEntry], int]:
    """Tensor entries over a validated chunk table (the rules are in docs/format.md), and
    the number of object members in ``tensors_json`` (its own, its entries', their
    layouts'): fewer than its raw text holds means a duplicate key (see _parse_json)."""
    from .dtypes import name_itemsize

    if not isinstance(tensors_json, dict):
        raise CorruptCheckpointError("inconsistent manifest: tensors is not an object")
    keys = list(tensors_json)
    shapes: list[tuple[int, ...]] = []
    sizes: list[int] = []
    firsts = [0]
    heads: list[tuple[str, tuple[int, ...], str, Any]] = []
    members = len(tensors_json)
    known: dict[tuple[Any, tuple[Any, ...]], int] = {}  # (dtype, shape) -> itemsize, once validated
    dims: list[Any] = []
    first = 0
    for key, t in tensors_json.items():
        if type(t) is not dict:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}' is not an object")
        members += len(t)
        dtype, shape, kind, layout, span = t["dtype"], t["shape"], t.get("kind", "replicated"), t.get("layout"), \
            t["chunks"]
        if kind not in KINDS or not (layout is None or type(layout) is dict):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad kind or layout")
        if layout is not None:
            members += _object_members(layout)
        shape_t = tuple(shape) if type(shape) is list else ()
        try:
            size = known.get((dtype, shape_t)) if type(shape) is list else None
        except TypeError:  # unhashable: not a str dtype or int dims, refused just below
            size = None
        if size is None:  # the first entry of its dtype and shape: validate them
            size = known[(dtype, shape_t)] = _head_itemsize(key, dtype, shape, name_itemsize)
        dims.extend(shape)  # a hit is equal to a validated shape: only the dims' types are left to check
        if not (type(span) is list and len(span) == 2 and type(span[0]) is int and type(span[1]) is int
                and span[0] == first and first < _LIMIT and 1 <= span[1] < _LIMIT):
            raise CorruptCheckpointError(
                f"inconsistent manifest: tensor '{key}': chunk range {span!r} is not [first, count] with first "
                f"{first} (where the previous tensor's chunks end) and count >= 1")
        first += span[1]
        shapes.append(shape_t)
        sizes.append(size)
        firsts.append(first)
        heads.append((dtype, shape_t, kind, layout))
    if not set(map(type, dims)) <= {int}:  # 1.0 and True equal 1: find the entry that holds one
        key, t = next((k, t) for k, t in tensors_json.items() if any(type(d) is not int for d in t["shape"]))
        _head_itemsize(key, t["dtype"], t["shape"], name_itemsize)
    rows = chunks_json.get("f") if isinstance(chunks_json, dict) else None
    if not (isinstance(rows, list) and len(rows) == firsts[-1]):
        # Checked before anything is sized by the tensors' counts (a tiny manifest must
        # not make the reader allocate per claimed chunk).
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise CorruptCheckpointError(f"inconsistent manifest: the tensors claim {firsts[-1]} chunks, the chunk "
                                     f"table has {got}")
    first_arr = np.array(firsts, dtype=np.int64)
    ndim = np.repeat(np.array([len(s) for s in shapes], dtype=np.int64), np.diff(first_arr))
    table = ChunkTable.from_json(chunks_json, ndim, block, [f.rank for f in files])
    bad = table.problem(shapes, sizes, first_arr, np.array([f.header_bytes for f in files], dtype=np.int64),
                        np.array([f.nbytes for f in files], dtype=np.int64), [f.name for f in files])
    if bad is not None:
        c, what = bad
        if c < 0:
            raise CorruptCheckpointError(f"inconsistent manifest: chunk table: {what}")
        t = int(np.searchsorted(first_arr, c, side="right")) - 1
        t = min(max(t, 0), len(keys) - 1)
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{keys[t]}', chunk {c - firsts[t]}: {what}")
    in_table = TensorEntry.in_table
    return {key: in_table(*head, table, lo, hi) for key, head, lo, hi in zip(keys, heads, firsts, firsts[1:])}, \
        members


def _head_itemsize(key: str, dtype: Any, shape: Any, name_itemsize: Callable[[str], int | None]) -> int:
    """The itemsize of a tensor entry's dtype (0 when unknown) once its dtype and shape are
    valid (a str; non-negative int dims with a total size below 2^62)."""
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(_count(s) and s < _LIMIT for s in shape)):
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad dtype {dtype!r} or shape {shape!r}")
    size = name_itemsize(dtype)
    if not size:
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': unknown dtype {dtype!r}")
    if prod(shape) * size >= _LIMIT:
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': shape {shape!r} is too large")
    return size


def _object_members(value: Any) -> int:
    """Members of all JSON objects in ``value`` (without recursion)."""
    count = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            count += len(v)
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
    return count


def _v1_to_v2(tensors: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Format 1.x keeps each tensor's chunks inline as objects; rewrite them as the
    format-2 chunk table (the per-chunk rank, always the file's rank, is dropped)."""
    if not isinstance(tensors, dict):
        raise CorruptCheckpointError("inconsistent manifest: tensors is not an object")
    out: dict[str, Any] = {}
    o: list[Any] = []
    n: list[Any] = []
    f: list[Any] = []
    b: list[Any] = []
    x: list[str] = []
    count = 0
    for key, t in tensors.items():
        chunks = t["chunks"]
        if not isinstance(chunks, list):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': chunks is not a list")
        for c in chunks:
            if not isinstance(c, dict):
                raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': a chunk is not an object")
            if not (isinstance(c["o"], list) and isinstance(c["n"], list) and len(c["o"]) == len(c["n"])
                    == len(t["shape"])):
                raise CorruptCheckpointError(
                    f"inconsistent manifest: tensor '{key}', chunk at {c['o']!r}: box does not match the shape's rank")
            sums = c["x"]
            if not (isinstance(sums, list) and sums and all(isinstance(s, str) and len(s) == 16 for s in sums)):
                raise CorruptCheckpointError(
                    f"inconsistent manifest: tensor '{key}', chunk at {c['o']!r}: bad block checksums")
            o.extend(c["o"])
            n.extend(c["n"])
            f.append(c["f"])
            b.extend(c["b"] if isinstance(c["b"], list) and len(c["b"]) == 2 else [None, None])
            x.extend(sums)
        out[key] = {**{k: v for k, v in t.items() if k != "chunks"}, "chunks": [count, len(chunks)]}
        count += len(chunks)
    return out, {"o": o, "n": n, "f": f, "b": b, "x": "".join(x)}
