"""``shardsafe inspect``: the key tree of a checkpoint with each tensor's kind, dtype,
global shape, bytes and chunks, and plain values shown briefly. Reads only the manifest,
and checks that every data file it lists is there with its recorded size (a missing or
truncated file is reported, and the command exits 1 as ``verify`` does)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointError
from ..format.dtypes import name_itemsize
from ..format.manifest import Manifest, TensorEntry
from ..format.values import RANK_LOCAL_TAG
from .common import PathLike, human_bytes, locate
from .entries import Leaf, brief, leaves

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer


def tensor_bytes(entry: TensorEntry) -> int:
    """Bytes of the whole tensor (from its dtype and global shape)."""
    n = 1
    for s in entry.shape:
        n *= s
    return n * (name_itemsize(entry.dtype) or 0)


@dataclass
class Row:
    """One line of the key tree: a tensor, a plain value or a rank-local marker."""

    kind: str  # "sharded" | "replicated" | "rank_local" (tensors) | "value" | "rank-local value"
    parts: tuple[str, ...]
    key: str
    dtype: str | None = None
    shape: list[int] | None = None
    nbytes: int | None = None
    chunks: int | None = None
    ranks: list[int] | None = None  # saving ranks that wrote its chunks
    value: str | None = None  # brief description of a plain value
    held_in: dict[str, int] | None = None  # incremental: checkpoint ("." = this one) -> bytes of it held there
    stored: int | None = None  # format 3.2: bytes its chunks take in the data files (compressed or raw)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (without empty members)."""
        d = {"key": self.key, "kind": self.kind, "dtype": self.dtype, "shape": self.shape, "bytes": self.nbytes,
             "chunks": self.chunks, "ranks": self.ranks, "value": self.value, "held_in": self.held_in,
             "stored": self.stored,
             "ratio": round(self.nbytes / self.stored, 3) if self.stored and self.nbytes is not None else None}
        return {k: v for k, v in d.items() if v is not None}


@dataclass
class Inspection:
    """What ``shardsafe inspect`` shows about one checkpoint."""

    path: str
    world_size: int
    created: float
    writer: dict[str, str]
    files: list[dict[str, Any]]
    rows: list[Row] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # data files missing or resized (sizes only)

    @property
    def ok(self) -> bool:
        """True when every data file the manifest lists is there with its recorded size."""
        return not self.problems

    @property
    def tensor_rows(self) -> list[Row]:
        return [r for r in self.rows if r.dtype is not None]

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {
            "path": self.path, "world_size": self.world_size, "created": self.created, "writer": self.writer,
            "files": self.files, "tensors": len(self.tensor_rows),
            "tensor_bytes": sum(r.nbytes or 0 for r in self.tensor_rows),
            "entries": [r.to_json() for r in self.rows], "problems": self.problems,
        }

    def to_text(self) -> str:
        """The indented key tree."""
        total = sum(r.nbytes or 0 for r in self.tensor_rows)
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.created))
        head = (f"{self.path}: world size {self.world_size}, saved {created}, {len(self.tensor_rows)} tensors "
                f"({human_bytes(total)}) in {len(self.files)} data files")
        lines: list[tuple[str, str]] = []
        shown: tuple[str, ...] = ()
        for row in self.rows:
            parent = row.parts[:-1]
            common = 0
            while common < min(len(parent), len(shown)) and parent[common] == shown[common]:
                common += 1
            for depth in range(common, len(parent)):
                lines.append(("  " * depth + parent[depth], ""))
            shown = parent
            name = "  " * len(parent) + (row.parts[-1] if row.parts else "<root>")
            lines.append((name, _describe(row)))
            if row.kind == "rank-local value":
                shown = row.parts  # its per-rank copies are listed below this line
        width = min(max((len(n) for n, _ in lines), default=0), 60)
        body = [f"{n:<{width}}  {d}".rstrip() for n, d in lines]
        return "\n".join([head, *body, *problem_lines(self.problems)])


def _describe(row: Row) -> str:
    if row.dtype is not None:
        shape = "[" + ", ".join(str(s) for s in row.shape or []) + "]"
        chunks = f"{row.chunks} chunk" + ("s" if row.chunks != 1 else "")
        held = ""
        if row.held_in and set(row.held_in) != {"."}:
            held = "  in " + ", ".join(f"{'this checkpoint' if k == '.' else k} ({human_bytes(v)})"
                                       for k, v in sorted(row.held_in.items()))
        ratio = f"  stored {human_bytes(row.stored)} ({(row.nbytes or 0) / row.stored:.2f}x)" \
            if row.stored is not None and row.stored > 0 else ""
        return f"{row.kind:<10}  {row.dtype:<9} {shape:<16} {human_bytes(row.nbytes or 0):>10}  {chunks}{held}{ratio}"
    return f"{row.kind:<10}  {row.value}"


def _row(leaf: Leaf, manifest: Manifest) -> Row:
    if leaf.kind == "tensor":
        entry = manifest.tensors.get(leaf.key)
        if entry is None:
            return Row("missing", leaf.parts, leaf.key, value="tensor not described in the manifest")
        ranks = sorted({manifest.files[f].rank for _, _, f in entry.boxes()})  # no file index needed
        return Row(entry.kind, leaf.parts, leaf.key, entry.dtype, list(entry.shape), tensor_bytes(entry),
                   entry.chunk_count, ranks, held_in=_holders(manifest, entry) if manifest.refs else None,
                   stored=_stored(manifest, entry) if manifest.version >= (3, 2) else None)
    if leaf.kind == "rank_local":
        per_rank = manifest.rank_local.get(leaf.node[RANK_LOCAL_TAG]) or []
        n = sum(1 for v in per_rank if v is not None)
        return Row("rank-local value", leaf.parts, leaf.key,
                   value=f"one copy per saving rank ({n} rank{'s' if n != 1 else ''})")
    try:
        text = brief(leaf.decoded())
    except Exception as exc:  # noqa: BLE001 - a bad value is shown, not fatal
        text = f"<undecodable: {exc}>"
    return Row("value", leaf.parts, leaf.key, value=text)


def _stored(manifest: Manifest, entry: TensorEntry) -> int:
    """Format 3.2: the bytes a tensor's chunks take as stored (reads the file indexes)."""
    total = 0
    for c in entry.chunks:
        z = manifest.zrow(c)
        total += c.end - c.start if z is None else z.end - z.start
    return total


def _holders(manifest: Manifest, entry: TensorEntry) -> dict[str, int]:
    """Incremental checkpoints: which checkpoint holds how many bytes of the tensor (reads
    the file indexes)."""
    out: dict[str, int] = {}
    for c in entry.chunks:
        ref = manifest.ref_file(c.file)
        name = "." if ref is None else (ref.checkpoint or ".")
        out[name] = out.get(name, 0) + c.end - c.start
    return out


def problem_lines(problems: list[str]) -> list[str]:
    """The closing lines of ``inspect`` for damaged files (none when all is well)."""
    if not problems:
        return []
    return [*(f"PROBLEM  {p}" for p in problems),
            f"{len(problems)} problem(s): loads that need these files fail (`shardsafe verify` checks every byte)"]


def checkpoint_file_problems(path: PathLike, manifest: Manifest, checkpointer: Checkpointer | None = None) -> list[str]:
    """The data files (and file indexes, and files referred to in other checkpoints) of
    the checkpoint at ``path`` that are missing or not of the size ``manifest`` records:
    a cheap check of sizes, no data read (``shardsafe verify`` hashes every byte)."""
    from .listing import file_problems

    backend, location = locate(path, checkpointer)
    parent_location, _ = backend.split(location)
    with backend.open(location) as folder:
        try:
            parent: Any = backend.open(parent_location)
        except CheckpointError:
            parent = None
        try:
            return file_problems(folder, manifest, parent)
        finally:
            if parent is not None:
                parent.close()


def inspect_checkpoint(path: PathLike, manifest: Manifest | None = None,
                       checkpointer: Checkpointer | None = None) -> Inspection:
    """The key tree of the checkpoint at ``path`` (reads and verifies only its manifest),
    and in ``problems`` each data file that is missing or not of its recorded size (sizes
    only: ``verify_checkpoint`` checks the bytes)."""
    root = str(path)
    if manifest is None:
        from ..api import read_manifest

        manifest = read_manifest(path)
    rows = [_row(leaf, manifest) for leaf in leaves(manifest, "all", inline=60)]
    files = [{"name": f.name, "bytes": f.nbytes, "rank": f.rank} for f in manifest.files]
    files += [{"name": r.name, "bytes": r.nbytes, "checkpoint": r.checkpoint or "."} for r in manifest.refs]
    return Inspection(str(root), manifest.world_size, manifest.created, dict(manifest.writer), files, rows,
                      checkpoint_file_problems(path, manifest, checkpointer))
