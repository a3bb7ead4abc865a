"""The manifest: one JSON file per checkpoint that describes everything in it.

It is written last; a directory without a valid manifest is not a checkpoint. Its own
integrity is protected by a trailing XXH3-64 over the bytes that precede the trailer.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, FormatVersionError
from ..gcpause import gc_paused
from .checksum import ALGORITHM, checksum
from .chunk_table import Chunk, ChunkTable, table_json

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardsafe"
FORMAT_VERSION = (2, 0)
READABLE_MAJORS = (1, 2)
_TRAILER = b', "manifest_xxh3_64": "'

KINDS = ("replicated", "sharded", "rank_local")


_VECTOR_MIN = 64  # below this many chunks a Python loop beats numpy's per-call overhead


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
        entry = TensorEntry(dtype, shape, kind, None, layout)
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
        try:
            body = json.loads(head + b"}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(f"{where}: manifest is not valid JSON: {exc}") from None
        if not isinstance(body, dict) or body.get("format") != FORMAT_NAME:
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
            files = [FileEntry.from_json(f) for f in body["files"]]
            world_size = body["world_size"]
            extra = body.get("extra", {})
            problem = _header_problem(world_size, extra, body.get("writer", {}), body.get("rank_local", {}), files)
            if problem:
                raise CorruptCheckpointError(f"{where}: inconsistent manifest: {problem}")
            if version[0] == 1:
                tensors_json, chunks_json = _v1_to_v2(body["tensors"])
            else:
                tensors_json, chunks_json = body["tensors"], body["chunks"]
            tensors = _parse_tensors(tensors_json, chunks_json, files, extra["checksum_block"], where)
            return Manifest(
                tree=body["tree"],
                tensors=tensors,
                files=files,
                world_size=world_size,
                rank_local=body.get("rank_local", {}),
                created=body.get("created", 0.0),
                writer=body.get("writer", {}),
                extra=extra,
                version=(version[0], version[1]),
            )
        except CorruptCheckpointError as exc:
            msg = str(exc)
            raise CorruptCheckpointError(msg if msg.startswith(where) else f"{where}: {msg}") from None
        except (KeyError, TypeError, IndexError, AttributeError, ValueError, OverflowError, MemoryError) as exc:
            raise CorruptCheckpointError(f"{where}: a manifest field is missing or mistyped: {exc!r}") from None


def _count(v: Any) -> bool:
    """A non-negative JSON integer (not a bool)."""
    return type(v) is int and v >= 0


def _header_problem(world_size: Any, extra: Any, writer: Any, rank_local: Any, files: list[FileEntry]) -> str | None:
    """What is wrong with the manifest's top-level members and file list, or None."""
    if not (_count(world_size) and world_size >= 1):
        return f"world_size {world_size!r}"
    for name, part in (("extra", extra), ("writer", writer), ("rank_local", rank_local)):
        if not isinstance(part, dict):
            return f"{name} is not an object"
    if not (_count(extra.get("checksum_block")) and 0 < extra["checksum_block"] < _LIMIT):
        return f"extra.checksum_block {extra.get('checksum_block')!r} is not a positive integer"
    for i, f in enumerate(files):
        if not (isinstance(f.name, str) and f.name not in ("", ".", "..") and not any(c in f.name for c in "/\\\0")):
            return f"file {i}: name {f.name!r} is not a plain file name"
        if not (_count(f.nbytes) and _count(f.rank) and _count(f.header_bytes)
                and 8 <= f.header_bytes <= f.nbytes < _LIMIT):
            return f"file {f.name!r}: bad sizes (bytes {f.nbytes!r}, header_bytes {f.header_bytes!r})"
        if not isinstance(f.header_checksum, str):
            return f"file {f.name!r}: bad header checksum"
    return None


_LIMIT = 1 << 62  # bound on sizes in bytes, so that int64 arithmetic cannot overflow


def _parse_tensors(tensors_json: Any, chunks_json: Any, files: list[FileEntry], block: int,
                   where: str) -> dict[str, TensorEntry]:
    """Tensor entries over a validated chunk table (the rules are in docs/format.md)."""
    from .dtypes import itemsize, torch_dtype

    if not isinstance(tensors_json, dict):
        raise CorruptCheckpointError("inconsistent manifest: tensors is not an object")
    keys: list[str] = []
    shapes: list[tuple[int, ...]] = []
    sizes: list[int] = []
    firsts = [0]
    heads: list[tuple[str, tuple[int, ...], str, Any]] = []
    for key, t in tensors_json.items():
        if not isinstance(t, dict):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}' is not an object")
        dtype, shape, kind, layout, span = t["dtype"], t["shape"], t.get("kind", "replicated"), t.get("layout"), \
            t["chunks"]
        if kind not in KINDS or not isinstance(layout, (dict, type(None))):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad kind or layout")
        if not (isinstance(dtype, str) and isinstance(shape, list) and all(_count(s) and s < _LIMIT for s in shape)):
            raise CorruptCheckpointError(
                f"inconsistent manifest: tensor '{key}': bad dtype {dtype!r} or shape {shape!r}")
        if not (isinstance(span, list) and len(span) == 2 and all(_count(v) and v < _LIMIT for v in span)
                and span[0] == firsts[-1] and span[1] >= 1):
            raise CorruptCheckpointError(
                f"inconsistent manifest: tensor '{key}': chunk range {span!r} is not [first, count] with first "
                f"{firsts[-1]} (where the previous tensor's chunks end) and count >= 1")
        dt = torch_dtype(dtype)
        size = itemsize(dt) if dt is not None else 0
        shape_t = tuple(shape)
        if prod(shape_t) * max(size, 1) >= _LIMIT:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': shape {shape!r} is too large")
        keys.append(key)
        shapes.append(shape_t)
        sizes.append(size)
        firsts.append(span[0] + span[1])
        heads.append((dtype, shape_t, kind, layout))
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
    return {key: TensorEntry.in_table(*head, table, firsts[i], firsts[i + 1])
            for i, (key, head) in enumerate(zip(keys, heads))}


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
