"""Incremental saves: chunks whose bytes equal the base checkpoint's are referred to, not written.

A save with a base reads the base's manifest (every rank) and the indexes of the base files
that hold the boxes this rank writes. A chunk is *referred to* when the base has a chunk of
the same tensor (same dtype and shape) at the same box whose chunk digest (XXH3-128 over its
blocks' XXH3-128 digests, format/refs.py) equals the digest of the bytes being saved. The
reference copies the base chunk's location: the file that physically holds the bytes (the
base's own file, or the file the base itself referred to), so references never chain.

Cost when nothing can be skipped (dense training): the first checksum block of each chunk is
hashed with XXH3-64 and compared with the base's first block checksum; only when they agree
is the whole chunk hashed (XXH3-128) before the write. An opt-in memo (``version_skip``)
skips even that for tensors whose storage and ``_version`` counter did not change since the
last save in this process (see :class:`VersionMemo` for when that is unsafe).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..comm import Comm
from ..engine.buffers import flat_bytes, resolved
from ..errors import BaseCheckpointError, CheckpointError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.chunk_table import Chunk
from ..format.file_index import IndexedChunk
from ..format.manifest import Manifest
from ..format.refs import RefFile, block_digest, chunk_digest
from ..format.zindex import ZRow
from ..knobs import HASH_PIECE
from ..layout import Box
from ..plan.load_plan import Dest
from ..plan.save_plan import Assignment, GlobalPlan
from ..storage.base import Backend
from .describe import Described
from .metadata import Opened, fetch_cut_indexes, fetch_indexes, read_manifest_phase


@dataclass
class Base:
    """A save's base checkpoint: its name (a sibling of the new checkpoint), manifest, and
    the files a reference may point at: its own files, then the files it refers to."""

    name: str
    manifest: Manifest
    candidates: list[RefFile]
    own_keys: dict[str, int] = field(default_factory=dict)  # tensor key -> ordinal

    @staticmethod
    def of(name: str, manifest: Manifest) -> Base:
        """The base named ``name`` whose parsed manifest (indexes read on demand) is ``manifest``
        (a format 1 or 2 base has no chunk digests: nothing can be referred to)."""
        if not manifest.indexed:
            return Base(name, manifest, [])
        cands = [RefFile(name, f.name, f.nbytes) for f in manifest.files]
        cands += [RefFile(r.checkpoint or name, r.name, r.nbytes) for r in manifest.refs]
        return Base(name, manifest, cands, {k: i for i, k in enumerate(manifest.own_tensors())})


@dataclass
class Match:
    """An assigned chunk found unchanged in the base: where its bytes are (``chunk.file``
    numbers a base candidate) and its digest."""

    chunk: Chunk
    digest: str
    z: ZRow | None = None  # format 3.2: the chunk is stored compressed (its stored layout)


_MEMOS: weakref.WeakSet[VersionMemo] = weakref.WeakSet()
_MEMOS_LOCK = threading.Lock()
_EPOCH = [0]  # bumped by every load into live tensors: a save prepared before it records nothing


class VersionMemo:
    """Chunk digests of a Checkpointer's last save, keyed by (tensor key, box), valid while
    the source tensor's storage, strides and ``_version`` counter are unchanged.

    Each entry holds a reference to the source's storage, so that memory cannot be freed
    and reused by another tensor while the entry lives (a fresh tensor at a reused address
    with the same counter would pass for unchanged); entries are replaced at every save.
    Every shardsafe load into live tensors empties every memo (a load writes without bumping
    ``_version``).

    ``_version`` counts in-place changes made through torch operations (optimizer steps, ``copy_``,
    ``add_``). Changes it does not see: writes through ``tensor.data`` (a fresh counter), through
    numpy or DLPack views, by C++ extensions or collectives writing into the memory directly. A
    memo entry is used only with ``version_skip=True``, which asserts that none of those happen."""

    def __init__(self) -> None:
        self.entries: dict[tuple[str, Box], tuple[tuple, Any, str]] = {}
        with _MEMOS_LOCK:
            _MEMOS.add(self)

    @staticmethod
    def epoch() -> int:
        """The number of loads so far (a save records its memo only if none came between)."""
        return _EPOCH[0]

    @staticmethod
    def state(t: torch.Tensor) -> tuple[tuple, Any] | None:
        """What must be unchanged for a memo entry to hold, and the storage to keep alive;
        None for a tensor without a version counter (made under ``torch.inference_mode``)."""
        try:
            version = t._version
        except RuntimeError:
            return None
        return (t.device, t.dtype, t.data_ptr(), tuple(t.shape), tuple(t.stride()), version), t.untyped_storage()

    def get(self, key: str, box: Box, t: torch.Tensor) -> str | None:
        """The digest recorded for (key, box) when ``t`` is unchanged since, else None."""
        found = self.entries.get((key, box))
        now = self.state(t) if found is not None else None
        if found is None or now is None:
            return None
        state, storage, digest = found
        return digest if state == now[0] and storage.data_ptr() == now[1].data_ptr() else None

    def replace(self, entries: dict[tuple[str, Box], tuple[tuple, Any, str]], epoch: int | None = None) -> None:
        """Make ``entries`` (a committed save's) the memo's only entries; nothing when a load
        came after ``epoch`` (the save's sources may have been overwritten since)."""
        with _MEMOS_LOCK:
            self.entries = entries if epoch is None or epoch == _EPOCH[0] else {}

    @staticmethod
    def forget_all() -> None:
        """Empty every memo of the process (before a load writes into live tensors)."""
        with _MEMOS_LOCK:
            _EPOCH[0] += 1
            for memo in list(_MEMOS):
                memo.entries = {}


def first_block(src: torch.Tensor, block: int) -> memoryview:
    """The first ``block`` bytes (or all of them) of ``src`` in row-major order, on the host."""
    src = resolved(src)
    flat = src.reshape(-1)
    n = max(1, block // max(1, src.element_size()))
    part = flat[:n]
    if part.device.type != "cpu":
        part = part.cpu()
    return memoryview(flat_bytes(part.contiguous()).numpy())


def full_digest(src: torch.Tensor, block: int) -> str:
    """The chunk digest of ``src``'s bytes (row-major), hashing each block once; accelerator
    tensors are copied to host ``HASH_PIECE`` bytes at a time."""
    src = resolved(src)
    flat = src.reshape(-1)
    if flat.numel() == 0:
        return chunk_digest([block_digest(b"")])
    per = max(1, block // flat.element_size())
    piece = max(per, (HASH_PIECE // block) * per)
    digests: list[bytes] = []
    for lo in range(0, flat.numel(), piece):
        part = flat[lo: lo + piece]
        if part.device.type != "cpu":
            part = part.cpu()
        view = memoryview(flat_bytes(part.contiguous()).numpy())
        for b in range(0, len(view), block):
            digests.append(block_digest(view[b: b + block]))
    return chunk_digest(digests)


def match(base: Base, assigned: list[Assignment], source: Any, meta: dict[str, tuple[str, tuple[int, ...]]],
          block: int, memo: VersionMemo | None, fetch: Callable[[set[int]], None]) -> dict[int, Match]:
    """The assigned chunks (by position) whose bytes equal the base's; ``meta`` holds the
    (dtype, global shape) of every tensor that may be referred to (not rank-local ones).
    With a ``memo``, a chunk whose source is unchanged since the memo's save is not hashed
    again. ``fetch`` attaches the base's indexes of the given files (the reader's
    fetch-indexes phase: at once, several requests in flight on object stores)."""
    manifest = base.manifest
    if manifest.extra.get("checksum_block") != block or not base.candidates:
        return {}
    wanted: list[tuple[int, Assignment, int, tuple[int, ...]]] = []
    for i, a in enumerate(assigned):
        ordinal = base.own_keys.get(a.key)
        if ordinal is None or a.key not in meta:
            continue
        entry = manifest.tensors[a.key]
        if (entry.dtype, tuple(entry.shape)) != meta[a.key] or entry.kind == "rank_local":
            continue
        boxes = [b for b in entry.boxes_meeting(a.box.offsets, a.box.lengths)
                 if tuple(b[0]) == a.box.offsets and tuple(b[1]) == a.box.lengths]
        if len(boxes) != 1:
            continue
        wanted.append((i, a, ordinal, boxes[0][2]))
    fetch({f for *_, f in wanted})
    found: dict[int, Match] = {}
    for i, a, ordinal, f in wanted:
        hit = manifest.index(f).find(ordinal, a.box.offsets)
        if hit is None or not hit[1]:
            continue  # not in the index (refused on load), or a format-3.0 chunk without a digest
        chunk, digest = hit
        src = source(a)
        known = memo.get(a.key, a.box, src) if memo is not None else None
        if known is None:
            if chunk.checksum and checksum(first_block(src, block)) != chunk.checksum[0]:
                continue  # changed: written (and hashed) as usual
            known = full_digest(src, block)
        if known == digest:
            found[i] = Match(chunk, digest, manifest.zrow(chunk) if manifest.version >= (3, 2) else None)
    return found


def chain_depth(manifest: Manifest) -> int:
    """How many incremental saves lead to this checkpoint from a full one (0: it refers to
    nothing), as its manifest's ``extra.incremental.depth`` says."""
    if not getattr(manifest, "refs", None):
        return 0
    inc = manifest.extra.get("incremental")
    depth = inc.get("depth") if isinstance(inc, dict) else None
    return depth if type(depth) is int and depth >= 0 else 1 << 30  # unknown: start a new chain


def reference_rows(found: dict[int, Match], assigned: list[Assignment], ordinal: dict[str, int],
                   numbering: dict[int, int]) -> list[IndexedChunk]:
    """The index rows of the referred chunks: the new checkpoint's ordinals, the base's byte
    ranges and checksums, ``numbering`` mapping a base candidate to the new ``refs`` number."""
    rows = []
    for i, m in found.items():
        a = assigned[i]
        if m.z is not None:  # a compressed chunk: its stored range and blocks (a ``zrefs`` row)
            rows.append(IndexedChunk(ordinal[a.key], a.box.offsets, a.box.lengths, m.z.start, m.z.end,
                                     list(m.chunk.checksum), m.digest, numbering[m.chunk.file], m.z.codec, m.z.lengths))
            continue
        rows.append(IndexedChunk(ordinal[a.key], a.box.offsets, a.box.lengths, m.chunk.start, m.chunk.end,
                                 list(m.chunk.checksum), m.digest, numbering[m.chunk.file]))
    return rows


__all__ = ["Base", "Match", "VersionMemo", "chain_depth", "full_digest", "match", "reference_rows"]


# ----------------------------------------------------------------------------- the save's incremental phase


def open_base(backend: Backend, location: str, base: str) -> Opened:
    """The base checkpoint of a save to ``location``: it must be another checkpoint of the
    same parent folder (references name it by its folder name)."""
    parent, name = backend.split(location)
    base_parent, base_name = backend.split(base)
    if base_parent != parent:
        raise CheckpointError(f"base checkpoint {base} must be in the same folder as the new checkpoint {location} "
                              "(references name their checkpoint by its name in that folder)")
    if base_name == name:
        raise CheckpointError(f"a checkpoint cannot be its own base: {location}")
    try:
        return read_manifest_phase(backend, base)
    except CheckpointError as exc:
        raise BaseCheckpointError(f"base checkpoint {base} cannot be used: {exc}") from exc


def refer(comm: Comm, described: Described, plan: GlobalPlan, assigned: list, opened: Opened, base_name: str,
          target_name: str, memo: VersionMemo | None, block: int) -> tuple[list[RefFile], list[IndexedChunk], list]:
    """Find this rank's chunks that the base holds unchanged; agree with every rank on the
    referenced files (one all-reduce). Returns the manifest's ``refs``, this rank's
    reference rows and the assignments still to write."""
    error: BaseException | None = None
    found: dict = {}
    base: Base | None = None
    mine: set[int] = set()
    try:
        base = Base.of(base_name, opened.manifest)
        for c in base.candidates:
            if c.checkpoint == target_name:
                raise CheckpointError(f"base checkpoint '{base_name}' refers to data in '{target_name}', which this "
                                      "save would replace")
        meta = {tl.key: (tl.dtype, tuple(tl.shape)) for tl in described.held}
        try:
            fetch_cut_indexes(opened, [Dest(a.key, a.box, False) for a in assigned])
            found = match(base, assigned, described.source, meta, block, memo,
                          lambda files: fetch_indexes(opened, files))
            mine = {m.chunk.file for m in found.values()}
            _check_referenced(opened, base, mine)
        except CheckpointError as exc:
            raise BaseCheckpointError(f"base checkpoint '{base_name}' cannot be used: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    comm.agree(error, opened.digest, " as the base")  # every rank matched against the same manifest
    assert base is not None
    used = comm.all_max([1 if j in mine else 0 for j in range(len(base.candidates))])
    numbering: dict[int, int] = {}
    refs: list[RefFile] = []
    for j, u in enumerate(used):
        if u:
            numbering[j] = len(refs)
            refs.append(base.candidates[j])
    rows = reference_rows(found, assigned, plan.ordinal(), numbering)
    return refs, rows, [a for i, a in enumerate(assigned) if i not in found]


def _check_referenced(opened: Opened, base: Base, files: set[int]) -> None:
    """The files this rank would refer to exist with the size the base recorded (a base
    damaged since its save is noticed now, not by the new checkpoint's loads)."""
    for j in sorted(files):
        ref = base.candidates[j]
        if ref.checkpoint == base.name:
            folder, close = opened.folder, False
        else:
            assert opened.siblings is not None
            try:
                folder, close = opened.siblings(ref.checkpoint), True
            except CheckpointError as exc:
                raise CorruptCheckpointError(f"it refers to checkpoint '{ref.checkpoint}', which is missing "
                                             f"({exc})") from None
        try:
            size = folder.size(ref.name) if folder.kind(ref.name) == "file" else None
        finally:
            if close:
                folder.close()
        if size != ref.nbytes:
            raise CorruptCheckpointError(
                f"data file {folder.where(ref.name)} is {'missing' if size is None else f'{size} bytes'}, "
                f"{ref.nbytes} recorded")
