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

from ..errors import CorruptCheckpointError, FormatVersionError
from ..gcpause import gc_paused
from .checksum import ALGORITHM, checksum

MANIFEST_NAME = "manifest.json"
FORMAT_NAME = "shardsafe"
FORMAT_VERSION = (1, 0)
_TRAILER = b', "manifest_xxh3_64": "'

KINDS = ("replicated", "sharded", "rank_local")


@dataclass
class Chunk:
    """One saved box of a tensor, stored contiguously (row-major) in one data file."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: int  # index into Manifest.files
    start: int  # absolute byte range in the file
    end: int
    checksum: list[str]  # XXH3-64 of each checksum block of the byte range
    rank: int  # the saving rank that wrote it

    def to_json(self) -> dict[str, Any]:
        return {
            "o": list(self.offsets),
            "n": list(self.lengths),
            "f": self.file,
            "b": [self.start, self.end],
            "x": self.checksum,
            "r": self.rank,
        }

    @staticmethod
    def from_json(d: dict[str, Any]) -> Chunk:
        return Chunk(tuple(d["o"]), tuple(d["n"]), d["f"], d["b"][0], d["b"][1], d["x"], d["r"])


@dataclass
class TensorEntry:
    """A logical tensor: dtype, global shape, kind, and the chunks that cover it."""

    dtype: str
    shape: tuple[int, ...]
    kind: str = "replicated"
    chunks: list[Chunk] = field(default_factory=list)
    layout: dict[str, Any] | None = None  # the saving layout (mesh, placements), when sharded

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"dtype": self.dtype, "shape": list(self.shape), "kind": self.kind}
        if self.layout is not None:
            d["layout"] = self.layout
        d["chunks"] = [c.to_json() for c in self.chunks]
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> TensorEntry:
        return TensorEntry(
            d["dtype"], tuple(d["shape"]), d.get("kind", "replicated"),
            [Chunk.from_json(c) for c in d["chunks"]], d.get("layout"),
        )


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
        """Serialize with the integrity trailer; ``from_bytes`` is its inverse."""
        with gc_paused():
            return self._to_bytes()

    def _to_bytes(self) -> bytes:
        body = {
            "format": FORMAT_NAME,
            "version": list(self.version),
            "checksum_algorithm": ALGORITHM,
            "created": self.created,
            "writer": self.writer,
            "world_size": self.world_size,
            "extra": self.extra,
            "files": [f.to_json() for f in self.files],
            "tensors": {k: t.to_json() for k, t in self.tensors.items()},
            "rank_local": self.rank_local,
            "tree": self.tree,
        }
        text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
        head = text[:-1]  # drop the closing brace; the trailer closes the object
        return head + _TRAILER + checksum(head).encode("ascii") + b'"}\n'

    @staticmethod
    def from_bytes(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
        """Parse and verify a manifest; errors name ``where``."""
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
        if not (isinstance(version, list) and len(version) == 2 and all(isinstance(v, int) for v in version)):
            raise CorruptCheckpointError(f"{where}: bad format version {version!r}")
        if version[0] != FORMAT_VERSION[0]:
            raise FormatVersionError(
                f"{where}: format version {version[0]}.{version[1]} is not readable by this shardsafe "
                f"(reads {FORMAT_VERSION[0]}.x); upgrade shardsafe to load it"
            )
        if body.get("checksum_algorithm") != ALGORITHM:
            raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {body.get('checksum_algorithm')!r}")
        try:
            manifest = Manifest(
                tree=body["tree"],
                tensors={k: TensorEntry.from_json(v) for k, v in body["tensors"].items()},
                files=[FileEntry.from_json(f) for f in body["files"]],
                world_size=body["world_size"],
                rank_local=body.get("rank_local", {}),
                created=body.get("created", 0.0),
                writer=body.get("writer", {}),
                extra=body.get("extra", {}),
                version=(version[0], version[1]),
            )
        except (KeyError, TypeError, IndexError, AttributeError) as exc:
            raise CorruptCheckpointError(f"{where}: a manifest field is missing or mistyped: {exc!r}") from None
        problem = _structure_problem(manifest)
        if problem:
            raise CorruptCheckpointError(f"{where}: inconsistent manifest: {problem}")
        return manifest


def _count(v: Any) -> bool:
    """A non-negative JSON integer (not a bool)."""
    return type(v) is int and v >= 0


def _chunk_ok(c: Chunk, shape: tuple[int, ...], ndim: int, nfiles: int, files: list[FileEntry],
              size: int | None) -> bool:
    """The fast check of one chunk (the slow path in _structure_problem explains failures)."""
    offsets, lengths = c.offsets, c.lengths
    if len(offsets) != ndim or len(lengths) != ndim:
        return False
    numel = 1
    for o, n, s in zip(offsets, lengths, shape):
        if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > s:
            return False
        numel *= n
    f = c.file
    if type(f) is not int or not 0 <= f < nfiles:
        return False
    start, end = c.start, c.end
    fe = files[f]
    if type(start) is not int or type(end) is not int or not fe.header_bytes <= start <= end <= fe.nbytes:
        return False
    if size is not None and end - start != numel * size:
        return False
    sums = c.checksum
    if type(sums) is not list or not sums or not all(type(x) is str for x in sums):
        return False
    return type(c.rank) is int and c.rank >= 0


def _structure_problem(m: Manifest) -> str | None:
    """What makes a parsed manifest unusable, or None. Checks types and that every chunk
    lies inside its tensor and, byte for byte, inside the data area of an existing file of
    the checkpoint directory, so that no reader reads elsewhere or allocates on trust."""
    from .dtypes import itemsize, torch_dtype

    if not (_count(m.world_size) and m.world_size >= 1):
        return f"world_size {m.world_size!r}"
    for name, part in (("extra", m.extra), ("writer", m.writer), ("rank_local", m.rank_local)):
        if not isinstance(part, dict):
            return f"{name} is not an object"
    for i, f in enumerate(m.files):
        if not (isinstance(f.name, str) and f.name not in ("", ".", "..") and not any(c in f.name for c in "/\\\0")):
            return f"file {i}: name {f.name!r} is not a plain file name"
        if not (_count(f.nbytes) and _count(f.rank) and _count(f.header_bytes) and 8 <= f.header_bytes <= f.nbytes):
            return f"file {f.name!r}: bad sizes (bytes {f.nbytes!r}, header_bytes {f.header_bytes!r})"
        if not isinstance(f.header_checksum, str):
            return f"file {f.name!r}: bad header checksum"
    for key, t in m.tensors.items():
        if not (isinstance(t.dtype, str) and isinstance(t.shape, tuple) and all(_count(s) for s in t.shape)):
            return f"tensor '{key}': bad dtype {t.dtype!r} or shape {list(t.shape)!r}"
        if t.kind not in KINDS or not isinstance(t.chunks, list) or not isinstance(t.layout, (dict, type(None))):
            return f"tensor '{key}': bad kind, chunks or layout"
        dtype = torch_dtype(t.dtype)
        size = itemsize(dtype) if dtype is not None else None
        ndim = len(t.shape)
        nfiles = len(m.files)
        for c in t.chunks:
            if _chunk_ok(c, t.shape, ndim, nfiles, m.files, size):
                continue
            where = f"tensor '{key}', chunk at {list(c.offsets)!r}"
            if not (
                len(c.offsets) == len(c.lengths) == len(t.shape)
                and all(_count(v) for v in c.offsets + c.lengths)
                and all(o + n <= s for o, n, s in zip(c.offsets, c.lengths, t.shape))
            ):
                return f"{where}: box {list(c.offsets)}+{list(c.lengths)} is not inside shape {list(t.shape)}"
            if not (type(c.file) is int and 0 <= c.file < len(m.files)):
                return f"{where}: file index {c.file!r} is out of range"
            f = m.files[c.file]
            if not (_count(c.start) and _count(c.end) and f.header_bytes <= c.start <= c.end <= f.nbytes):
                return f"{where}: byte range {c.start!r}-{c.end!r} is outside the data of {f.name}"
            if size is not None and c.end - c.start != prod(c.lengths) * size:
                return f"{where}: byte range {c.start}-{c.end} does not hold {prod(c.lengths)} {t.dtype} elements"
            if not (isinstance(c.checksum, list) and c.checksum and all(isinstance(x, str) for x in c.checksum)):
                return f"{where}: bad block checksums"
            if not _count(c.rank):
                return f"{where}: bad rank {c.rank!r}"
    return None
