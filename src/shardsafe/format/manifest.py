"""The manifest model: one JSON file per checkpoint describes everything in it.

It is written last; a directory without a valid manifest is not a checkpoint. Format 3
(what saves write) keeps it O(tensors + files): rule tensors' chunks are computed
(rules.py) and byte ranges, checksums and rank-local values are looked up in the indexes
of the files a reader needs (file_index.py), fetched by the reader and attached here after
they verify against the digests the manifest lists. This module does no I/O and holds no
codec: bytes <-> Manifest is manifest_codec.py (the 3.x codec in manifest_v3.py, the
1.x/2.x readers in manifest_legacy.py).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .chunk_table import Chunk, ChunkTable
from .file_index import FileIndex, data_name, index_name, verify_index
from .manifest_checks import MAX_CHECKSUM_BLOCK, MAX_FILE_NAME_BYTES  # noqa: F401 (re-exported)
from .refs import RefFile
from .rules import Backing, Mesh, Rule
from .zindex import LOGICAL_BASE, ZRow, zrows

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardsafe"
FORMAT_VERSION = (3, 1)
"""What saves write: layouts as rules, byte ranges and checksums in per-file indexes, chunk
digests, and (incremental saves) references to other checkpoints' data files."""
TABLE_VERSION = (2, 0)
"""The layout of a Manifest built from explicit chunk lists (every chunk in one table)."""
READABLE_MAJORS = (1, 2, 3)

KINDS = ("replicated", "sharded", "rank_local")

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
    requires: list[str] = field(default_factory=list)  # format 3.2: features a reader must know ("compression")

    def __post_init__(self) -> None:
        self._indexes: dict[int, FileIndex] = {}  # attached by a reader's fetch-indexes phase
        self._refused: dict[int, str] = {}  # file -> why its index bytes were refused
        self.backing: Backing | None = None  # format 3: rules beyond the free allowance, backed by index rows
        self.file_of_rank: dict[int, int] = {f.rank: i for i, f in enumerate(self.files)}
        self._keys = list(self.tensors)
        self._local_keys: dict[tuple[int, int], str] = {}  # (file, ordinal) -> rank-local tensor key
        self._zrows: dict[int, tuple[int, list[ZRow], list[int]]] = {}  # file -> (indexes seen, its compressed chunks)
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
                        self.extra, self.version, self.meshes, file_id, list(self.refs), list(self.requires))

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

    @property
    def cuts_need_indexes(self) -> bool:
        """True when cutting a rule first needs every file index (the rule budget is then
        checked against the rows they list: see :class:`~shardsafe.format.rules.Backing`)."""
        backing = self.backing
        return backing is not None and backing.armed and not backing.done

    def listed_rows(self) -> int:
        """The chunk rows (and references) that all file indexes list (all attached)."""
        return sum(len(ix) + len(ix.ref_ordinals) + ix.zrow_count() for ix in map(self.index, range(len(self.files))))

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

    def zrows(self, file: int) -> list[ZRow]:
        """Format 3.2: the compressed chunks stored in file ``file`` (own or referenced) that
        the attached indexes list, sorted by stored start (engine/zread.py reads them)."""
        return self._zlookup(file)[0]

    def _zlookup(self, file: int) -> tuple[list[ZRow], list[int]]:
        found = self._zrows.get(file)
        if found is not None and found[0] == len(self._indexes):
            return found[1], found[2]
        sizes = [z for _, z in self._tensor_meta()]
        rows: dict[tuple[int, int], ZRow] = {}
        for f, ix in sorted(self._indexes.items()):
            if ix.zchunks is not None and f == file:
                rows.update(((r.start, r.end), r) for r in zrows(ix.zchunks, self._keys, sizes, None, f))
            if ix.zrefs is not None and file >= len(self.files):
                files = ix.zrefs.table.file.tolist()
                if file in files:
                    rows.update(((r.start, r.end), r) for r in zrows(ix.zrefs, self._keys, sizes, files, f)
                                if r.file == file)
        out = [rows[k] for k in sorted(rows)]
        self._zrows[file] = (len(self._indexes), out, [r.logical for r in out])
        return out, self._zrows[file][2]

    def zrow(self, chunk: Chunk) -> ZRow | None:
        """Format 3.2: the stored layout of ``chunk`` when it is compressed, else None."""
        if chunk.start < LOGICAL_BASE:
            return None
        rows, logicals = self._zlookup(chunk.file)
        i = bisect.bisect_left(logicals, chunk.start)
        while i < len(rows) and logicals[i] == chunk.start:
            if rows[i].raw == chunk.end - chunk.start:
                return rows[i]
            i += 1
        return None

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
            out = [(self._keys[t] if t < len(self._keys) else self._local_keys[(index, t)], fi.chunk(r))
                   for r, t in enumerate(fi.ordinals)]
            if fi.zchunks is not None:  # format 3.2: compressed chunks (logical byte ranges)
                out += [(self._keys[t], c) for t, c in zip(fi.zchunks.ordinals, fi.zchunks.table.chunks(
                    0, len(fi.zchunks.ordinals)))]
            return out
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
        ``from_bytes`` is its inverse (both: :mod:`~shardsafe.format.manifest_codec`)."""
        from .manifest_codec import encode_manifest

        return encode_manifest(self)

    @staticmethod
    def from_bytes(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and verify a manifest (format 1.x, 2.x or 3.x); errors name ``where``."""
        from .manifest_codec import decode_manifest

        return decode_manifest(data, where)


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
