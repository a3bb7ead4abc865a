"""The manifest: one JSON file per checkpoint that describes everything in it.

It is written last; a directory without a valid manifest is not a checkpoint. Its own
integrity is protected by a trailing XXH3-64 over the bytes that precede the trailer.
Format 3 (what saves write) keeps it O(tensors + files): rule tensors' chunks are computed
(rules.py) and byte ranges, checksums and rank-local values are read from the indexes of
the files a caller needs (file_index.py), verified against digests listed here. Formats 1
and 2 (every chunk in the manifest) are still read.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from math import prod
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, FormatVersionError
from ..gcpause import gc_paused
from .checksum import ALGORITHM, checksum
from .chunk_table import HEX, Chunk, ChunkTable, table_json
from .file_index import FileIndex, data_name, index_name, verify_index
from .refs import RefFile, parse_refs, refs_json
from .rules import (
    FREE_BOXES,
    INDEX_BYTES_PER_ROW,
    RULE_SLACK,
    Backing,
    Mesh,
    Rule,
    allowance,
    free_boxes,
    parse_placement,
)
from .strict_json import (  # noqa: F401 (MAX_MEMBER_DEPTH re-exported)
    MAX_MEMBER_DEPTH,
    MAX_NAME_BYTES,
    NOT_IN_NAME,
    SIZE_LIMIT,
    _count,
    _duplicate,
    _parse_json,
    _show,
)

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardsafe"
FORMAT_VERSION = (3, 1)
"""What saves write: layouts as rules, byte ranges and checksums in per-file indexes, chunk
digests, and (incremental saves) references to other checkpoints' data files."""
TABLE_VERSION = (2, 0)
"""The layout of a Manifest built from explicit chunk lists (every chunk in one table)."""
READABLE_MAJORS = (1, 2, 3)
_TRAILER = b', "manifest_xxh3_64": "'

KINDS = ("replicated", "sharded", "rank_local")

MAX_CHECKSUM_BLOCK = 1 << 26
"""Largest ``extra.checksum_block`` a reader accepts (64 MiB, the default staging buffer;
shardsafe writes 1 MiB): a partial read never hashes more than that beyond what it needs,
and tools may allocate one block."""
MAX_FILE_NAME_BYTES = MAX_NAME_BYTES
MAX_WORLD = 1 << 20
"""Largest ``world_size`` of a format-3 manifest (tools list per-rank values by rank)."""
MAX_CREATED = 1 << 35
"""``created`` lies in ``[0, 2^35)`` seconds (before the year 3058), so every tool can show it."""


_VECTOR_MIN = 64  # below this many chunks a Python loop beats numpy's per-call overhead


_new_entry = object.__new__


class TensorEntry:
    """A logical tensor: dtype, global shape, kind, and the chunks that cover it.

    An entry holds a list of :class:`Chunk` (built by a writer, or a rank-local tensor
    from a file index), or points into a format-2 manifest's :class:`ChunkTable`, or
    (format 3) has a ``rule`` or explicit boxes whose byte ranges its manifest resolves
    through file indexes. Chunk objects are built only when asked for (``chunks``,
    :meth:`chunks_meeting`); :meth:`boxes_meeting` needs no index at all."""

    __slots__ = ("dtype", "shape", "kind", "layout", "_chunks", "_table", "_lo", "_hi", "rule", "_geom", "_owner",
                 "_ord")

    def __init__(self, dtype: str, shape: tuple[int, ...], kind: str = "replicated",
                 chunks: list[Chunk] | None = None, layout: dict[str, Any] | None = None) -> None:
        self.dtype = dtype
        self.shape = shape
        self.kind = kind
        self.layout = layout  # the saving layout (mesh, placements), when sharded
        self._chunks: list[Chunk] | None = [] if chunks is None else chunks
        self._table: ChunkTable | None = None
        self._lo = self._hi = 0
        self.rule: Rule | None = None  # format 3: the chunks follow from this rule
        self._geom: list[tuple[tuple[int, ...], tuple[int, ...], int]] | None = None  # format 3: explicit boxes
        self._owner: Manifest | None = None  # format 3: resolves byte ranges through file indexes
        self._ord = -1

    @staticmethod
    def by_rule(dtype: str, shape: tuple[int, ...], kind: str, rule: Rule) -> TensorEntry:
        """A format-3 entry whose chunks follow from ``rule``."""
        entry = TensorEntry(dtype, shape, kind, None, rule_layout(rule))
        entry._chunks, entry.rule = None, rule
        return entry

    @staticmethod
    def by_boxes(dtype: str, shape: tuple[int, ...], kind: str,
                 boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]],
                 layout: dict[str, Any] | None = None) -> TensorEntry:
        """A format-3 entry with explicit chunk boxes (offsets, lengths, file index)."""
        entry = _new_entry(TensorEntry)  # no __init__: parsing builds 100k+ of these
        entry.dtype, entry.shape, entry.kind, entry.layout = dtype, shape, kind, layout
        entry._chunks, entry._geom = None, sorted(boxes) if len(boxes) > 1 else list(boxes)
        entry._table = entry.rule = entry._owner = None
        entry._lo = entry._hi = 0
        entry._ord = -1
        return entry

    @staticmethod
    def in_table(dtype: str, shape: tuple[int, ...], kind: str, layout: dict[str, Any] | None,
                 table: ChunkTable, lo: int, hi: int) -> TensorEntry:
        """An entry whose chunks are rows ``lo..hi-1`` of ``table``."""
        entry = _new_entry(TensorEntry)  # no __init__: parsing builds 100k+ of these
        entry.dtype, entry.shape, entry.kind, entry.layout = dtype, shape, kind, layout
        entry._chunks, entry._table, entry._lo, entry._hi = None, table, lo, hi
        entry.rule = entry._geom = entry._owner = None
        entry._ord = -1
        return entry

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks, sorted by offsets (built from the table, or for format 3 computed
        and resolved through the file indexes, on first use)."""
        if self._chunks is None:
            if self._table is not None:
                self._chunks = self._table.chunks(self._lo, self._hi)
            else:
                self._chunks = self._resolve(self.boxes())
        return self._chunks

    @chunks.setter
    def chunks(self, value: list[Chunk]) -> None:
        self._chunks, self._table, self.rule, self._geom = value, None, None, None

    @property
    def chunk_count(self) -> int:
        """Number of chunks (without building them)."""
        if self.rule is not None:
            return self.rule.count()
        if self._geom is not None:
            return len(self._geom)
        return len(self._chunks) if self._chunks is not None else self._hi - self._lo

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """(offsets, lengths, file index) of every chunk, without reading any file index."""
        if self.rule is not None:
            return self._to_files(self.rule.all_boxes())
        if self._geom is not None:
            return list(self._geom)
        return [(c.offsets, c.lengths, c.file) for c in self.chunks]

    def boxes_meeting(self, offsets: tuple[int, ...], lengths: tuple[int, ...]
                      ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """(offsets, lengths, file index) of the chunks that overlap the box ``offsets +
        lengths``, without reading any file index."""
        if self.rule is not None:
            return self._to_files(self.rule.boxes_meeting(offsets, lengths))
        if self._geom is not None:
            geom = self._geom
            if len(geom) == 1 and geom[0][0] == offsets and geom[0][1] == lengths:  # one chunk, the box itself
                return list(geom) if 0 not in lengths else []
            ends = [o + n for o, n in zip(offsets, lengths)]
            return [g for g in self._geom if all(
                co < e and co + cn > o and cn > 0 for co, cn, o, e in zip(g[0], g[1], offsets, ends))]
        return [(c.offsets, c.lengths, c.file) for c in self.chunks_meeting(offsets, lengths)]

    def _to_files(self, boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]]
                  ) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        """Rule boxes (offsets, lengths, saving rank) with the rank replaced by its file."""
        assert self._owner is not None
        of_rank = self._owner.file_of_rank
        try:
            return [(o, n, of_rank[r]) for o, n, r in boxes]
        except KeyError as exc:
            raise CorruptCheckpointError(f"tensor '{self._owner.key_of(self._ord)}': its rule puts a chunk in the "
                                         f"file of rank {exc.args[0]}, which wrote none") from None

    @property
    def indexed(self) -> bool:
        """True for a format-3 entry whose byte ranges are in file indexes."""
        return self._owner is not None and self._chunks is None and self._table is None

    def resolve_boxes(self, boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]]) -> list[Chunk]:
        """The chunks at the given (offsets, lengths, file) of this format-3 entry."""
        return self._resolve(boxes)

    def resolve_box(self, offsets: tuple[int, ...], lengths: tuple[int, ...], f: int) -> Chunk:
        """The chunk at one (offsets, lengths, file) of this format-3 entry."""
        assert self._owner is not None
        return self._owner.resolve_one(self._ord, offsets, lengths, f)

    def _resolve(self, boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]]) -> list[Chunk]:
        assert self._owner is not None
        return self._owner.resolve(self._ord, boxes)

    def chunks_meeting(self, offsets: tuple[int, ...], lengths: tuple[int, ...]) -> list[Chunk]:
        """The chunks whose boxes overlap the box ``offsets + lengths``; for a parsed entry
        found with one vectorized test over the table (format 2) or computed from the
        rule (format 3), building only those chunks."""
        if self._chunks is None and self._table is None:
            return self._resolve(self.boxes_meeting(offsets, lengths))
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
    header_bytes: int  # format 3: 0 until the file's index is read
    header_checksum: str
    index_bytes: int = 0  # format 3: the size and XXH3-64 of the file's index
    index_checksum: str = ""

    @property
    def index_name(self) -> str:
        """The file's index (format 3)."""
        return index_name(self.name)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "bytes": self.nbytes, "rank": self.rank,
                "header_bytes": self.header_bytes, "header_x": self.header_checksum}

    @staticmethod
    def from_json(d: dict[str, Any]) -> FileEntry:
        return FileEntry(d["name"], d["bytes"], d["rank"], d["header_bytes"], d["header_x"])


@dataclass
class Manifest:
    """Everything a reader needs: files, tensors, the typed-JSON value tree. A format-3
    manifest answers for a chunk's byte range or a rank-local value once the index of its
    file is attached (:meth:`attach_indexes`: the reader's fetch-indexes phase hands the
    bytes in); it never reads storage itself."""

    tree: Any
    tensors: dict[str, TensorEntry]
    files: list[FileEntry]
    world_size: int = 1
    rank_local: dict[str, list[Any]] = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    writer: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    version: tuple[int, int] = TABLE_VERSION
    meshes: list[Mesh] = field(default_factory=list)  # format 3: the meshes rules refer to
    file_id: str = ""  # format 3: the save id in the data file names ("" or "." + hex)
    refs: list[RefFile] = field(default_factory=list)  # format 3.1: files numbered len(files) + j

    def __post_init__(self) -> None:
        self._indexes: dict[int, FileIndex] = {}  # attached by a reader's fetch-indexes phase
        self._refused: dict[int, str] = {}  # file -> why its index bytes were refused
        self.backing: Backing | None = None  # format 3: rules beyond the free allowance, backed by index rows
        self.file_of_rank: dict[int, int] = {f.rank: i for i, f in enumerate(self.files)}
        self._keys = list(self.tensors)
        self._local_keys: dict[tuple[int, int], str] = {}  # (file, ordinal) -> rank-local tensor key
        if self.version[0] >= 3:
            for i, entry in enumerate(self.tensors.values()):
                entry._owner, entry._ord = self, i
            if not isinstance(self.rank_local, RankLocalValues):
                self.rank_local = RankLocalValues(self, sorted(self.rank_local))

    @property
    def indexed(self) -> bool:
        """True for format 3: byte ranges and checksums live in per-file indexes."""
        return self.version[0] >= 3

    def own_tensors(self) -> dict[str, TensorEntry]:
        """The manifest's tensors (format 3: without the rank-local tensors that file
        indexes added)."""
        return {k: self.tensors[k] for k in self._keys}

    def with_file_id(self, file_id: str) -> Manifest:
        """A format-3 manifest like this one whose files carry the save id ``file_id``
        (``shardsafe copy``: the data files and indexes are copied byte for byte)."""
        tensors = {}
        for key, e in self.own_tensors().items():
            tensors[key] = TensorEntry.by_rule(e.dtype, e.shape, e.kind, e.rule) if e.rule is not None else \
                TensorEntry.by_boxes(e.dtype, e.shape, e.kind, e.boxes(), e.layout)
        files = [FileEntry(data_name(f.rank, file_id), f.nbytes, f.rank, f.header_bytes, f.header_checksum,
                           f.index_bytes, f.index_checksum) for f in self.files]
        return Manifest(self.tree, tensors, files, self.world_size, list(self.rank_local), self.created, self.writer,
                        self.extra, self.version, self.meshes, file_id, list(self.refs))

    def ref_file(self, file: int) -> RefFile | None:
        """The referenced file numbered ``file`` (None for the checkpoint's own files)."""
        return self.refs[file - len(self.files)] if file >= len(self.files) else None

    def key_of(self, ordinal: int) -> str:
        """The key of manifest tensor ``ordinal``."""
        return self._keys[ordinal]

    # ------------------------------------------------------------------ file indexes (format 3)

    def index_requests(self, files: Iterable[int]) -> list[tuple[int, str, int]]:
        """(file, index name, stated size) of the given files' indexes not attached yet, by
        file: what a reader's fetch-indexes phase reads (none before format 3)."""
        if not self.indexed:
            return []
        return [(f, self.files[f].index_name, self.files[f].index_bytes)
                for f in sorted({f for f in files if f not in self._indexes})]

    def attach_indexes(self, fetched: list[tuple[int, bytes]]) -> None:
        """Verify (against the manifest's size and digest), parse and attach the bytes of
        file indexes, in order; the first bad one raises CorruptCheckpointError. The bytes
        are handed in by the reader's fetch-indexes phase: the manifest reads nothing."""
        meta = self._tensor_meta()
        block = self.extra["checksum_block"]
        ref_files = [(r.name, r.nbytes) for r in self.refs]
        for f, data in fetched:
            if f in self._indexes:
                continue
            entry = self.files[f]
            try:
                verify_index(data, entry.index_bytes, entry.index_checksum, entry.index_name)
                index = FileIndex.parse(data, entry.index_name, file=f, rank=entry.rank, nbytes=entry.nbytes,
                                        block=block, tensors=meta, ref_files=ref_files, first_ref=len(self.files))
            except CorruptCheckpointError as exc:
                self._refused[f] = str(exc)  # asked for again (the rule budget counts every index): the same error
                raise
            entry.header_bytes, entry.header_checksum = index.header_bytes, index.header_checksum
            index.raw = data
            self._add_local_tensors(index)
            self._indexes[f] = index

    def has_index(self, file: int) -> bool:
        """True once file ``file``'s index is attached (always true before format 3)."""
        return not self.indexed or file in self._indexes

    @property
    def cuts_need_indexes(self) -> bool:
        """True when cutting a rule first needs every file index (the rule budget is then
        checked against the rows they list: see :class:`~shardsafe.format.rules.Backing`)."""
        backing = self.backing
        return backing is not None and backing.armed and not backing.done

    def listed_rows(self) -> int:
        """The chunk rows (and references) that all file indexes list (all attached)."""
        return sum(len(ix) + len(ix.ref_ordinals) for ix in map(self.index, range(len(self.files))))

    def check_rule_budget(self) -> None:
        """Once every index is attached: check that their rows back the rules (the rule
        budget; readers that look at the whole checkpoint)."""
        if self.backing is not None:
            self.backing.check()

    def index(self, file: int) -> FileIndex:
        """The attached index of data file ``file`` (CorruptCheckpointError when the reader
        did not fetch it: a manifest read alone, without its checkpoint)."""
        found = self._indexes.get(file)
        if found is None:
            if file in self._refused:
                raise CorruptCheckpointError(self._refused[file])
            raise CorruptCheckpointError(f"this manifest was read without the index of {self.files[file].name}: "
                                         "its file indexes cannot be read")
        return found

    def _tensor_meta(self) -> list[tuple[tuple[int, ...], int]]:
        from .dtypes import NAME_ITEMSIZE

        size = NAME_ITEMSIZE.get
        return [(e.shape, size(e.dtype) or 0) for e in list(self.tensors.values())[: len(self._keys)]]

    def _add_local_tensors(self, index: FileIndex) -> None:
        """The rank-local tensors an index lists become entries of ``tensors``."""
        base = len(self._keys)
        for i, (key, (dtype, shape)) in enumerate(index.local_tensors.items()):
            if key in self.tensors:
                raise CorruptCheckpointError(f"{self.files[index.file].index_name}: rank-local tensor '{key}' is "
                                             "listed twice")
            rows = index.rows_of(base + i)
            chunks = [index.chunk(r) for r in rows]
            self.tensors[key] = TensorEntry(dtype, shape, "rank_local", chunks)
            self._local_keys[(index.file, base + i)] = key

    def resolve_one(self, ordinal: int, offsets: tuple[int, ...], lengths: tuple[int, ...], f: int) -> Chunk:
        """``resolve(ordinal, [(offsets, lengths, f)])[0]``, for one box of a loaded index."""
        index = self._indexes.get(f)
        row = None if index is None else index.row(ordinal, offsets)
        if row is None:
            return self.resolve(ordinal, [(offsets, lengths, f)])[0]
        chunk = index.table.chunk(row)
        if chunk.lengths != lengths:
            return self.resolve(ordinal, [(offsets, lengths, f)])[0]  # (raises, naming the tensor)
        return chunk

    def resolve(self, ordinal: int, boxes: list[tuple[tuple[int, ...], tuple[int, ...], int]]) -> list[Chunk]:
        """The chunks of manifest tensor ``ordinal`` at the given (offsets, lengths, file),
        with byte ranges and checksums from the files' indexes."""
        index_of = self.index
        out = []
        for offsets, lengths, f in boxes:
            index = index_of(f)
            row = index.row(ordinal, offsets)
            if row is not None:
                chunk: Chunk | None = index.table.chunk(row)
            else:  # format 3.1: the bytes may be in a referenced file
                found = index.find(ordinal, tuple(offsets))
                chunk = None if found is None else found[0]
            if chunk is None or chunk.lengths != tuple(lengths):
                raise CorruptCheckpointError(
                    f"tensor '{self.key_of(ordinal)}': the chunk at {list(offsets)}+{list(lengths)} is not in the "
                    f"index of {self.files[f].name} (the index or the manifest is corrupt)")
            out.append(chunk)
        return out

    def key_in_file(self, file: int, ordinal: int) -> str:
        """Format 3: the key of tensor ``ordinal`` of file ``file``'s index (rank-local
        tensors are numbered after the manifest's, per file)."""
        return self._keys[ordinal] if ordinal < len(self._keys) else self._local_keys[(file, ordinal)]

    def chunks_in_file(self, index: int) -> list[tuple[str, Chunk]]:
        """(tensor key, chunk) of every chunk stored in file ``index``. For a parsed
        manifest the chunk table is searched with one vectorized test and only those
        chunks are built; for format 3, the file's index lists them."""
        if self.indexed:
            fi = self.index(index)
            return [(self._keys[t] if t < len(self._keys) else self._local_keys[(index, t)], fi.chunk(r))
                    for r, t in enumerate(fi.ordinals)]
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
        if self.indexed:
            return _seal(self._body_v3())
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
            "version": list(self.version if self.version[0] >= TABLE_VERSION[0] else TABLE_VERSION),
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
        return _seal(body)

    def _body_v3(self) -> dict[str, Any]:
        """The format-3 manifest: rules, explicit boxes, files as columns (docs/format.md)."""
        mesh_index = {m: i for i, m in enumerate(self.meshes)}
        keys = list(self.tensors)[: len(self._keys)]  # rank-local tensors live in the file indexes
        entries: dict[str, Any] = {}
        o: list[int] = []
        n: list[int] = []
        f: list[int] = []
        rows = 0
        for key in keys:
            t = self.tensors[key]
            d: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "kind": t.kind}
            if t.rule is not None:
                d["rule"] = t.rule.to_json(mesh_index[t.rule.mesh])
            else:
                if t.layout is not None:
                    d["layout"] = t.layout
                boxes = t.boxes()
                d["chunks"] = [rows, len(boxes)]
                rows += len(boxes)
                for bo, bn, bf in boxes:
                    o.extend(bo)
                    n.extend(bn)
                    f.append(bf)
            entries[key] = d
        files = self.files
        return {
            "format": FORMAT_NAME,
            "version": list(self.version),
            "checksum_algorithm": ALGORITHM,
            "created": self.created,
            "writer": self.writer,
            "world_size": self.world_size,
            "extra": self.extra,
            "meshes": [m.to_json() for m in self.meshes],
            "files": {"id": self.file_id, "rank": [e.rank for e in files], "bytes": [e.nbytes for e in files],
                      "index_bytes": [e.index_bytes for e in files],
                      "index_x": "".join(e.index_checksum for e in files)},
            "tensors": entries,
            "chunks": {"o": o, "n": n, "f": f},
            "rank_local": sorted(self.rank_local),
            **({"refs": refs_json(self.refs)} if self.refs else {}),
            "tree": self.tree,
        }

    @staticmethod
    def from_bytes(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and verify a manifest (format 1.x, 2.x or 3.x); errors name ``where``."""
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
            if version[0] >= 3:
                return _parse_v3(body, spans, head, (version[0], version[1]), where)
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


def _seal(body: dict[str, Any]) -> bytes:
    """The manifest's bytes: compact JSON whose last member is the integrity trailer."""
    text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
    head = text[:-1]  # drop the closing brace; the trailer closes the object
    return head + _TRAILER + checksum(head).encode("ascii") + b'"}\n'


# strict JSON parsing lives in strict_json.py

_NOT_IN_NAME = NOT_IN_NAME


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


_LIMIT = SIZE_LIMIT


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


# ----------------------------------------------------------------------------- format 3

_FILE_ID = re.compile(r"(\.[0-9a-z]{1,64})?")


def _parse_v3(body: dict[str, Any], spans: Any, head: bytes, version: tuple[int, int], where: str) -> Manifest:
    """A format-3 manifest (docs/format.md): validated before anything is sized by it."""
    world_size, extra, writer = body["world_size"], body.get("extra", {}), body.get("writer", {})
    problem = _header_problem(world_size, extra, writer, {}, [])
    if problem:
        raise CorruptCheckpointError(f"inconsistent manifest: {problem}")
    created = body.get("created", 0.0)
    if not (type(created) in (int, float) and 0 <= created < MAX_CREATED):
        raise CorruptCheckpointError(f"inconsistent manifest: created {_show(created)} is not a finite number of "
                                     "seconds in [0, 2^35)")
    meshes_json = body["meshes"]
    if type(meshes_json) is not list:
        raise CorruptCheckpointError("inconsistent manifest: meshes is not a list")
    meshes = []
    for i, m in enumerate(meshes_json):
        try:
            meshes.append(Mesh.from_json(m, world_size))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"inconsistent manifest: mesh {i}: {exc}") from None
    if world_size > MAX_WORLD:
        raise CorruptCheckpointError(f"inconsistent manifest: world_size {world_size} is above {MAX_WORLD}")
    files, file_id = _files_v3(body["files"], world_size)
    rank_local = body["rank_local"]
    if not (type(rank_local) is list and all(type(k) is str for k in rank_local)
            and len(set(rank_local)) == len(rank_local)):
        raise CorruptCheckpointError("inconsistent manifest: rank_local is not a list of distinct keys")
    tensors_json = body["tensors"]
    # The rule budget (docs/format.md, limits): the rules' bounds, summed over distinct
    # rules, within an allowance (2^16 + 512 per distinct rule) plus the rows the indexes
    # list. Refused here, before anything is cut, when even the stated index sizes could
    # not list them; rules beyond the work pool (2^16 + 16 per manifest byte) are cut only
    # once the real indexes (read and verified, each read bounded by its stated size) have
    # been counted, and every reader that reads all indexes counts them too.
    listable = sum(f.index_bytes for f in files) // INDEX_BYTES_PER_ROW
    tensors, members, rules = _tensors_v3(tensors_json, body["chunks"], meshes, len(files), world_size,
                                          FREE_BOXES + listable)
    if members != spans.counted.get("tensors"):
        duplicate = _duplicate(head, spans)
        if duplicate:
            raise CorruptCheckpointError(f"manifest is not valid JSON: {duplicate}")
    refs = parse_refs(body["refs"]) if "refs" in body else []
    own = {MANIFEST_NAME} | {f.name for f in files} | {f.index_name for f in files}
    if any(r.checkpoint == "" and r.name in own for r in refs):
        raise CorruptCheckpointError("inconsistent manifest: a referenced file of this checkpoint's own folder has the "
                                     "name of its manifest, a data file or an index")
    manifest = Manifest(tree=body["tree"], tensors=tensors, files=files, world_size=world_size,
                        rank_local=rank_local, created=created, writer=writer, extra=extra, version=version,
                        meshes=meshes, file_id=file_id, refs=refs)
    if rules:
        claimed = sum(r.count_bound() for r in rules)
        manifest.backing = Backing(claimed, allowance(len(rules)), manifest.listed_rows)
        if claimed > free_boxes(len(head)):
            manifest.backing.armed = True
            for r in rules:
                r.backing = manifest.backing
    return manifest


def _files_v3(d: Any, world: int) -> tuple[list[FileEntry], str]:
    """The files table: one data file (and its index) per listed saving rank."""
    if type(d) is not dict:
        raise CorruptCheckpointError("inconsistent manifest: files is not an object")
    file_id = d.get("id")
    if not (type(file_id) is str and _FILE_ID.fullmatch(file_id)):
        raise CorruptCheckpointError(f"inconsistent manifest: files id {_show(file_id)} is not \"\" or \".\" and up "
                                     "to 64 lowercase letters and digits")
    ranks, sizes, isizes, sums = d.get("rank"), d.get("bytes"), d.get("index_bytes"), d.get("index_x")
    count = len(ranks) if type(ranks) is list else -1
    for name, col in (("rank", ranks), ("bytes", sizes), ("index_bytes", isizes)):
        if not (type(col) is list and len(col) == count and all(type(v) is int and 0 <= v < _LIMIT for v in col)):
            raise CorruptCheckpointError(f"inconsistent manifest: files '{name}' is not a list of {max(count, 0)} "
                                         "sizes")
    if any(a >= b for a, b in zip(ranks, ranks[1:])) or (ranks and ranks[-1] >= world):
        raise CorruptCheckpointError(f"inconsistent manifest: file ranks are not increasing ranks below {world}")
    if any(n < 8 for n in sizes):
        raise CorruptCheckpointError("inconsistent manifest: a data file of fewer than 8 bytes")
    if not (type(sums) is str and len(sums) == HEX * count and _hex_lower(sums)):
        raise CorruptCheckpointError("inconsistent manifest: files 'index_x' is not one 16-hex digest per file")
    files = [FileEntry(data_name(r, file_id), n, r, 0, "", i, sums[HEX * k: HEX * (k + 1)])
             for k, (r, n, i) in enumerate(zip(ranks, sizes, isizes))]
    return files, file_id


def _hex_lower(s: str) -> bool:
    try:
        return 2 * len(bytes.fromhex(s)) == len(s) and s == s.lower()
    except ValueError:
        return False


def _tensors_v3(tensors_json: Any, chunks_json: Any, meshes: list[Mesh], nfiles: int, world: int,
                box_budget: int) -> tuple[dict[str, TensorEntry], int, list[Rule]]:
    """Tensor entries: by rule, or by explicit boxes (rows of the geometry table), the
    object members of ``tensors_json`` (fewer than its raw text holds: a duplicate key) and
    the distinct rules (their bounds summed at most ``box_budget`` plus RULE_SLACK per
    distinct rule, nothing cut).

    A first pass checks the boxes and dims of all tensors at once (numpy) and gives up at
    the first doubt; a second pass, one tensor at a time, then raises the error that
    names the first bad tensor (the same error for every manifest)."""
    try:
        found = _tensors_v3_pass(tensors_json, chunks_json, meshes, nfiles, world, box_budget, True)
    except Exception:  # noqa: BLE001 - the exact error comes from the careful pass below
        found = None
    if found is None:
        found = _tensors_v3_pass(tensors_json, chunks_json, meshes, nfiles, world, box_budget, False)
    return found


_INT = frozenset([int])


def _tensors_v3_pass(tensors_json: Any, chunks_json: Any, meshes: list[Mesh], nfiles: int, world: int,
                     box_budget: int, batched: bool) -> tuple[dict[str, TensorEntry], int, list[Rule]] | None:
    """:func:`_tensors_v3`, checking each box as it comes (``batched`` False), or all boxes
    and dims at once at the end (``batched``: None when any check fails, with no error)."""
    from .dtypes import name_itemsize

    if type(tensors_json) is not dict:
        raise CorruptCheckpointError("inconsistent manifest: tensors is not an object")
    if type(chunks_json) is not dict:
        raise CorruptCheckpointError("inconsistent manifest: chunks is not an object")
    o, n, f = chunks_json.get("o"), chunks_json.get("n"), chunks_json.get("f")
    if not (type(o) is list and type(n) is list and type(f) is list and len(o) == len(n)
            and all(set(map(type, col)) <= _INT for col in (o, n, f))):
        raise CorruptCheckpointError("inconsistent manifest: chunks 'o', 'n', 'f' are not lists of integers")
    out: dict[str, TensorEntry] = {}
    row = dim = 0
    known: set[tuple[Any, tuple[Any, ...]]] = set()  # (dtype, shape) validated
    rules: dict[tuple, Rule] = {}
    members = len(tensors_json)
    dims: list[Any] = []  # batched: every dim of every tensor, their types checked at the end
    bounds: list[int] = []  # batched: each box dim's bound (its tensor's dim)
    by_boxes = TensorEntry.by_boxes
    for key, t in tensors_json.items():
        if type(t) is not dict:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}' is not an object")
        members += len(t)
        dtype, shape, kind = t["dtype"], t["shape"], t.get("kind", "replicated")
        shape_t = tuple(shape) if type(shape) is list else ()
        if batched:
            try:
                seen = (dtype, shape_t) in known and type(shape) is list
            except TypeError:
                seen = False
            if seen:
                dims.extend(shape)
        else:
            try:
                seen = (dtype, shape_t) in known and set(map(type, shape)) <= _INT
            except TypeError:
                seen = False
        if not seen:
            _head_itemsize(key, dtype, shape, name_itemsize)
            known.add((dtype, shape_t))
        if kind not in ("replicated", "sharded"):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': kind {_show(kind)} (rank-local "
                                         "tensors are listed in the file indexes)")
        rule = t.get("rule")
        if rule is not None:
            if batched and not set(map(type, shape_t)) <= _INT:
                return None  # the careful pass names the bad dim before the rule uses it
            if not (type(rule) is dict and set(rule) == {"mesh", "placements", "salt"}):
                raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': rule is not mesh, placements "
                                             "and salt")
            members += len(rule)
            m, placements, salt = rule["mesh"], rule["placements"], rule["salt"]
            if not (type(m) is int and 0 <= m < len(meshes) and type(placements) is list and _count(salt)
                    and salt < _LIMIT):
                raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad rule mesh or salt")
            if not shape_t or 0 in shape_t:
                raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': a rule needs a shape of "
                                             "non-zero dims")
            try:
                parsed = tuple(parse_placement(p, len(shape_t), world) for p in placements)
                rule_key = (shape_t, m, parsed, salt)
                rule_obj = rules.get(rule_key)  # one Rule per geometry: its boxes are computed once
                if rule_obj is None:
                    rule_obj = rules[rule_key] = Rule(shape_t, meshes[m], parsed, salt)
                    box_budget += RULE_SLACK - rule_obj.count_bound()
                    if box_budget < 0:
                        raise CorruptCheckpointError("its rules claim more chunks than the manifest allows and the "
                                                     "file indexes can list")
                out[key] = TensorEntry.by_rule(dtype, shape_t, kind, rule_obj)
            except CorruptCheckpointError as exc:
                raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': {exc}") from None
            continue
        layout, span = t.get("layout"), t.get("chunks")
        if not (layout is None or type(layout) is dict):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad layout")
        if layout is not None:
            members += _object_members(layout)
        if not (type(span) is list and len(span) == 2 and type(span[0]) is int and span[0] == row
                and type(span[1]) is int and 1 <= span[1] <= len(f) - row):
            raise CorruptCheckpointError(
                f"inconsistent manifest: tensor '{key}': chunk range {_show(span)} is not [first, count] with first "
                f"{row} (where the previous tensor's chunks end), count >= 1, inside the table")
        nd = len(shape_t)
        count = span[1]
        if batched:  # the boxes are checked below, all at once
            if count == 1:
                boxes = [(tuple(o[dim: dim + nd]), tuple(n[dim: dim + nd]), f[row])]
            else:
                boxes = [(tuple(o[d: d + nd]), tuple(n[d: d + nd]), f[r])
                         for r, d in zip(range(row, row + count), range(dim, dim + count * nd, nd))]
            dim += count * nd
            bounds.extend(shape_t * count)
        else:
            boxes = []
            for r in range(row, row + count):
                bo, bn = tuple(o[dim: dim + nd]), tuple(n[dim: dim + nd])
                dim += nd
                if len(bn) != nd or not all(0 <= a and 0 <= b and a + b <= s for a, b, s in zip(bo, bn, shape_t)):
                    raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}', chunk {r - row}: box "
                                                 f"{list(bo)}+{list(bn)} is not inside shape {list(shape_t)}")
                if not 0 <= f[r] < nfiles:
                    raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}', chunk {r - row}: file "
                                                 f"index {f[r]} is out of range")
                boxes.append((bo, bn, f[r]))
        row += count
        out[key] = by_boxes(dtype, shape_t, kind, boxes, layout)
    if row != len(f) or dim != len(o):
        raise CorruptCheckpointError(f"inconsistent manifest: the tensors claim {row} chunks, the chunk table has "
                                     f"{len(f)}")
    if batched:
        if not set(map(type, dims)) <= _INT:
            return None
        if o:
            bo_, bn_, bound = (np.array(col, dtype=np.int64) for col in (o, n, bounds))  # OverflowError: None
            if not ((bo_ >= 0) & (bn_ >= 0) & (bo_ <= bound) & (bn_ <= bound - bo_)).all():
                return None
        if f:
            files = np.array(f, dtype=np.int64)
            if not ((files >= 0) & (files < nfiles)).all():
                return None
    return out, members, list(rules.values())


class RankLocalValues(Mapping):
    """Format 3: rank-local values by key; each saving rank's value is read from its
    file's index when first asked for (``manifest.rank_local[key][rank]``, None where
    that rank wrote no file)."""

    def __init__(self, manifest: Manifest, keys: list[str]) -> None:
        self._manifest = manifest
        self._keys = list(keys)
        self._set = set(keys)

    def __getitem__(self, key: str) -> _PerRank:
        if key not in self._set:
            raise KeyError(key)
        return _PerRank(self._manifest, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


class _PerRank:
    """One rank-local key's values, by saving rank (a read-only sequence)."""

    def __init__(self, manifest: Manifest, key: str) -> None:
        self._manifest = manifest
        self._key = key

    def __len__(self) -> int:
        return self._manifest.world_size

    def __getitem__(self, rank: int) -> Any:
        if not 0 <= rank < len(self):
            raise IndexError(rank)
        f = self._manifest.file_of_rank.get(rank)
        return None if f is None else self._manifest.index(f).rank_local.get(self._key)

    def __iter__(self) -> Iterator[Any]:
        return (self[r] for r in range(len(self)))


def rule_layout(rule: Rule) -> dict[str, Any]:
    """A readable description of a rule's mesh and placements (tools)."""
    names = {"R": lambda p: "R", "S": lambda p: f"S({p[1]})", "SS": lambda p: f"_S({p[1]}, {p[2]})"}
    return {"mesh_shape": list(rule.mesh.shape), "mesh_dim_names": None if rule.mesh.names is None else
            list(rule.mesh.names), "placements": [names[p[0]](p) for p in rule.placements]}


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
