"""Phase 5 of a save, commit: each rank's file index, then rank 0's manifest, written last.

Each rank writes its data file's index (byte ranges, block checksums, its rank-local
values), parsed first with the reader's own rules; ranks agree on errors; one fixed-size
tensor ``gather`` brings each rank's :class:`FileSummary` to rank 0, which builds the
manifest from the plan (O(tensors + files)), checks it parses, and publishes the
checkpoint; a small tensor broadcast tells every rank whether it committed.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import torch

from .. import __version__
from ..comm import describe as describe_error
from ..comm import rebuild
from ..engine.writer import WrittenFile
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.dtypes import name_itemsize
from ..format.file_index import ZIP_VERSION, FileIndex, IndexedChunk, build_index, data_name, index_name
from ..format.manifest import FORMAT_VERSION, FileEntry, Manifest, TensorEntry
from ..format.refs import RefFile
from ..format.rules import Mesh
from ..format.values import RANK_LOCAL_TAG
from ..layout import Box
from ..plan.save_plan import GlobalPlan
from .incremental import VersionMemo
from .prepare import CHECKSUM_BLOCK, PreparedSave, SaveInfo


class FileSummary(NamedTuple):
    """What rank 0 learns of each rank's file at the commit (int64s, one tensor gather)."""

    has_file: int  # 1 when the rank wrote a data file
    nbytes: int = 0  # the data file's size
    index_bytes: int = 0  # its index's size
    index_digest: int = 0  # the index's XXH3-64, as a signed int64
    referred: int = 0  # incremental: bytes of the rank's chunks left in the base's files
    compressed: int = 0  # 1 when the rank's index has compressed rows (format 3.2)


NO_FILE = FileSummary(0)


class FileResult(NamedTuple):
    """A rank's written data file and its index's bytes, for the commit."""

    entry: FileEntry
    index: bytes


def file_result(prep: PreparedSave, written: WrittenFile) -> FileResult:
    """A written file and its index (byte ranges, block checksums, this rank's rank-local
    values), as plain data for the commit."""
    assert prep.mine is not None
    order = prep.plan.ordinal()
    local = {tl.key: i for i, tl in enumerate(sorted(prep.described.local, key=lambda t: t.key))}
    base = len(order)
    ranges = written.ranges or [(c.start, c.end) for c in prep.mine.chunks]
    stored = written.stored or [()] * len(ranges)
    prep.zip_stats = (written.codec or "off", sum(c.end - c.start for c in prep.mine.chunks),
                      sum(hi - lo for lo, hi in ranges))
    chunks = [IndexedChunk(order[c.key] if c.key in order else base + local[c.key], c.box.offsets, c.box.lengths,
                           lo, hi, sums, digest, codec=written.codec if z else "", stored=z)
              for c, sums, digest, (lo, hi), z in zip(prep.mine.chunks, written.checksums, written.digests, ranges,
                                                      stored)]
    if prep.memo_states:  # version_skip: the digests the memo records once committed
        prep.digests = {(c.key, c.box): d for c, d in zip(prep.mine.chunks, written.digests)}
        keys = list(prep.plan.tensors)
        prep.digests.update({(keys[r.ordinal], Box(r.offsets, r.lengths)): r.digest for r in prep.ref_rows})
    chunks.extend(prep.ref_rows)
    local_tensors = {tl.key: (tl.dtype, tl.shape) for tl in sorted(prep.described.local, key=lambda t: t.key)}
    data = build_index(prep.comm.rank, written.entry.header_bytes, written.entry.header_checksum, chunks,
                       local_tensors, prep.described.flat.rank_local)
    return FileResult(written.entry, data)


def remember(prep: PreparedSave, memo: VersionMemo) -> None:
    """After a committed save: record each chunk's digest with its source's state, so the
    next save with ``version_skip`` need not hash what did not change."""
    entries = {}
    for kb, (state, storage) in prep.memo_states.items():
        digest = prep.digests.get(kb)
        if digest:
            entries[kb] = (state, storage, digest)
    memo.replace(entries, prep.memo_epoch)


def finish(prep: PreparedSave, results: list[FileResult], error: BaseException | None) -> SaveInfo:
    """Phase 5 (one gather + one small tensor broadcast): rank 0 writes the manifest and
    commits; every rank learns whether the commit happened and raises the same error
    when it did not. Releases the temp folder on every path."""
    try:
        return _finish(prep, results, error)
    finally:
        if prep.staging is not None and prep.target is None:
            prep.staging.close()
        if prep.target is not None:
            prep.target.release()
            prep.target.parent.close()


def _finish(prep: PreparedSave, results: list[FileResult], error: BaseException | None) -> SaveInfo:
    comm = prep.comm
    summary = NO_FILE
    if error is None and results:
        try:
            summary = _write_index(prep, results[0].entry, results[0].index)
        except BaseException as exc:  # noqa: BLE001 - agreed on below
            error = exc
    try:
        comm.agree(error)
    except BaseException:
        if prep.target is not None:
            prep.target.abort()
        raise
    gathered = comm.gather_ints(list(summary))
    status: tuple[str, str] | None = None
    if comm.rank == 0:
        assert gathered is not None
        status = _commit(prep, [FileSummary(*s) for s in gathered])
    status = comm.broadcast_status(status)
    if status is not None:
        raise rebuild(status) from error
    mine = sum(r.entry.nbytes for r in results)
    return SaveInfo(prep.location, mine, len(results), len(prep.described.flat.tensors),
                    time.perf_counter() - prep.t0, prep.plan_cached,
                    prep.backend.retries - prep.retries0 if prep.backend is not None else 0,
                    sum(r.end - r.start for r in prep.ref_rows), len(prep.ref_rows), prep.zip_stats[0],
                    prep.zip_stats[2], prep.zip_stats[1] / prep.zip_stats[2] if prep.zip_stats[2] else 1.0)


def _write_index(prep: PreparedSave, entry: FileEntry, index: bytes) -> FileSummary:
    """Check this rank's file index with the reader's rules and write it beside its data file."""
    if prep.staging is None:
        raise CheckpointError("the save's folder could not be opened on this rank")
    check_index(prep, entry, index)
    prep.staging.write_bytes(index_name(entry.name), index)
    digest = int(checksum(index), 16)
    return FileSummary(1, entry.nbytes, len(index), digest - (1 << 64) if digest >= 1 << 63 else digest,
                       sum(r.end - r.start for r in prep.ref_rows), int(index_is_compressed(index)))


def _commit(prep: PreparedSave, summaries: list[FileSummary]) -> tuple[str, str] | None:
    """Rank 0: build, check and publish the manifest. Returns the error to broadcast (None:
    committed); alone (no process group) it raises the error itself."""
    assert prep.target is not None
    try:
        manifest = build_manifest(prep.plan, summaries, prep.tree, prep.comm.world, prep.suffix, prep.refs)
        if prep.chain is not None:
            manifest.extra["incremental"] = {**prep.chain, "referred_bytes": sum(s.referred for s in summaries)}
        prep.target.commit(checked_manifest(manifest), prep.overwrite)
    except BaseException as exc:
        prep.target.abort()
        if not prep.comm.distributed:
            raise
        return describe_error(exc, prep.comm.rank)
    return None


def index_is_compressed(index: bytes) -> bool:
    """True for an index with compressed rows (it says format 3.2)."""
    return index.startswith(b'{"format":"shardsafe-index","version":[3,2]')


def check_index(prep: PreparedSave, entry: FileEntry, index: bytes) -> None:
    """Parse this rank's index with the reader's own rules before it is written: a save
    never commits an index its reader refuses (CheckpointError naming the rank)."""
    meta = [(shape, name_itemsize(dtype) or 0) for dtype, shape, _ in prep.plan.tensors.values()]
    try:
        FileIndex.parse(index, index_name(entry.name), file=0, rank=prep.comm.rank, nbytes=entry.nbytes,
                        block=CHECKSUM_BLOCK, tensors=meta, ref_files=[(r.name, r.nbytes) for r in prep.refs],
                        first_ref=1)
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"save refused: rank {prep.comm.rank}'s file index would not load: {exc}") from None


def checked_manifest(manifest: Manifest) -> bytes:
    """The manifest's bytes, parsed back with the reader's own rules and bounds first: a
    save never commits a manifest its reader refuses (CheckpointError naming the cause)."""
    data = manifest.to_bytes()
    try:
        Manifest.from_bytes(data, "the manifest to commit")
    except CorruptCheckpointError as exc:
        raise CheckpointError(f"save refused: the checkpoint would not load: {exc}") from None
    return data


def build_manifest(plan: GlobalPlan, summaries: list[FileSummary] | list[list[int]], tree: Any, world: int,
                   file_id: str, refs: list[RefFile] | None = None) -> Manifest:
    """The format-3 manifest of a save, from the plan and each rank's :class:`FileSummary`
    (or its ints): O(tensors + files), no chunk of a rule tensor listed."""
    files: list[FileEntry] = []
    file_of_rank: dict[int, int] = {}
    zipped = any(FileSummary(*s).compressed for s in summaries)
    for rank, s in enumerate(FileSummary(*s) for s in summaries):
        if s.has_file:
            file_of_rank[rank] = len(files)
            files.append(FileEntry(data_name(rank, file_id), s.nbytes, rank, 0, "", s.index_bytes,
                                   format(s.index_digest & ((1 << 64) - 1), "016x")))
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...], int]]] = {}
    for rank, assigned in enumerate(plan.by_rank):
        for a in assigned:
            boxes.setdefault(a.key, []).append((a.box.offsets, a.box.lengths, file_of_rank[rank]))
    meshes: dict[Mesh, None] = {}
    tensors: dict[str, TensorEntry] = {}
    for key, (dtype, shape, kind) in plan.tensors.items():
        rule = plan.rules.get(key)
        if rule is not None:
            meshes.setdefault(rule.mesh)
            tensors[key] = TensorEntry.by_rule(dtype, shape, kind, rule)
        else:
            tensors[key] = TensorEntry.by_boxes(dtype, shape, kind, boxes[key], plan.specs.get(key))
    return Manifest(
        tree=tree,
        tensors=tensors,
        files=files,
        world_size=world,
        rank_local=_rank_local_keys(tree),
        writer={"shardsafe": __version__, "torch": torch.__version__},
        extra={"checksum_block": CHECKSUM_BLOCK},
        version=ZIP_VERSION if zipped else FORMAT_VERSION,
        meshes=list(meshes),
        file_id=file_id,
        refs=list(refs or []),
        requires=["compression"] if zipped else [],
    )


def _rank_local_keys(tree: Any) -> list[str]:
    """The keys of the rank-local placeholders in a saved value tree."""
    out: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if len(node) == 1 and isinstance(node.get(RANK_LOCAL_TAG), str):
                out.append(node[RANK_LOCAL_TAG])
            else:
                stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return sorted(set(out))
