"""save / load / load_full: wire the layers together, on one process or a process group.

Save protocol (every rank of the group calls ``save``):
  1. each rank flattens its state and describes what it holds (keys, dtypes, shapes,
     boxes); one ``all_gather_object`` shares the descriptions (and rank 0's choice of
     temporary directory, and any error), so every rank computes the same global plan;
  2. each rank writes its file into the temporary directory and fsyncs it; one
     ``gather_object`` brings the write results and rank-local values to rank 0, which
     writes the manifest last and commits atomically; a small tensor broadcast then tells
     every rank whether the commit happened, and if not, the error (the same on all ranks).
Load: every rank reads the manifest and plans its own reads; ranks agree on errors once
after validation and checksum verification (before any destination byte is written)
and once after reading.
"""

from __future__ import annotations

import os
import shutil
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .comm import Comm, describe, rebuild, resolve
from .engine.reader import ReadSession
from .engine.writer import write_data_file
from .errors import CheckpointError, MissingKeysError
from .format.checksum import checksum
from .format.dtypes import dtype_name
from .format.manifest import MANIFEST_NAME, Chunk, FileEntry, Manifest, TensorEntry
from .layout import Box
from .plan.load_plan import DEFAULT_MAX_BUFFER, plan_reads
from .plan.save_plan import (
    FilePlan,
    GlobalPlan,
    TensorLayout,
    WriteItem,
    data_file_name,
    layout_digest,
    plan_global,
)
from .state.match import Matcher
from .state.sharding import dtensor_pieces, is_dtensor, layout_of, local_of
from .state.tree import FlatState, flatten, join_key, saved_items, saved_sequence
from .storage import local

CHECKSUM_BLOCK = 1 << 20
PathLike = str | os.PathLike
_PLAN_CACHE: dict[str, GlobalPlan] = {}
_PLAN_CACHE_SIZE = 4


@dataclass
class SaveInfo:
    """What a save did (bytes and files are this rank's own)."""

    path: Path
    bytes_written: int
    files: int
    tensors: int
    seconds: float
    plan_cached: bool = False


@dataclass
class LoadInfo:
    """What a load did on this rank. ``bytes_read``: distinct bytes of data files touched
    (verified checksum blocks included); ``bytes_copied``: bytes landed in the destination."""

    path: Path
    bytes_read: int
    tensors: int
    seconds: float
    bytes_copied: int = 0


# ----------------------------------------------------------------------------- save


def _local_layout(flat: FlatState) -> tuple[list[TensorLayout], dict[tuple[str, Box], torch.Tensor], dict]:
    """This rank's tensor layouts, the local source of each box, and DTensor layouts."""
    layouts: list[TensorLayout] = []
    sources: dict[tuple[str, Box], torch.Tensor] = {}
    dlayouts: dict[str, Any] = {}
    for key, t in flat.tensors.items():
        name = dtype_name(t.dtype, key)
        if is_dtensor(t):
            local_t = local_of(t)
            pieces = dtensor_pieces(t)
            boxes = [p.box for p in pieces]
            for p in pieces:
                sources[(key, p.box)] = local_t[p.local_slices]
            kind = "sharded" if any(not _is_replicate(p) for p in t.placements) else "replicated"
            dlayouts[key] = layout_of(t)
        else:
            boxes = [Box.whole(t.shape)]
            sources[(key, boxes[0])] = t
            kind = "rank_local" if key in flat.rank_local_tensors else "replicated"
        layouts.append(TensorLayout(key, name, tuple(t.shape), t.element_size(), kind, boxes))
    return layouts, sources, dlayouts


def _is_replicate(p: Any) -> bool:
    from torch.distributed.tensor import Replicate

    return isinstance(p, Replicate)


def _source_for(sources: dict[tuple[str, Box], torch.Tensor], key: str, box: Box) -> torch.Tensor:
    """The local tensor holding ``box`` of ``key`` (a row range of a held box when split)."""
    exact = sources.get((key, box))
    if exact is not None:
        return exact
    for (k, held), t in sources.items():
        if k == key and held.contains(box):
            return t[box.relative_to(held).slices()]
    raise CheckpointError(f"tensor '{key}': this rank was asked to write {box} but does not hold it")


def _plan(layouts_wire: list[list[tuple] | None], signatures: list[str]) -> tuple[GlobalPlan, bool]:
    """The global plan (cached by the ranks' layout signatures). Ranks whose layout equals
    an earlier rank's send None instead of their layout."""
    digest = layout_digest([signatures])
    cached = _PLAN_CACHE.get(digest)
    if cached is not None:
        return cached, True
    first: dict[str, list[TensorLayout]] = {}
    layouts: list[list[TensorLayout]] = []
    for sig, ws in zip(signatures, layouts_wire):
        if ws is not None and sig not in first:
            first[sig] = [TensorLayout.from_wire(w) for w in ws]
        layouts.append(first[sig])
    plan = plan_global(layouts, signatures)
    if len(_PLAN_CACHE) >= _PLAN_CACHE_SIZE:
        _PLAN_CACHE.pop(next(iter(_PLAN_CACHE)))
    _PLAN_CACHE[digest] = plan
    return plan, False


@dataclass
class PreparedSave:
    """A save after step 1: every rank agreed on the plan and the temporary directory."""

    comm: Comm
    path: Path
    tmp: Path
    plan: GlobalPlan
    plan_cached: bool
    items: list[WriteItem]
    flat: FlatState
    dlayouts: dict[str, Any]
    send_tree: bool
    t0: float
    lock_fd: int = -1  # rank 0 holds the temp directory's lock until the save ends
    overwrite: bool = False


def prepare_save(state_dict: dict[str, Any], path: PathLike, overwrite: bool, comm: Comm) -> PreparedSave:
    """Step 1 of a save (one all_gather): flatten, describe, agree on errors and plan."""
    t0 = time.perf_counter()
    path = Path(os.path.abspath(path))  # "a/b/.." must not put the temp sibling inside "a"
    error: BaseException | None = None
    wire: list[tuple] = []
    signature = ""
    tree_digest = ""
    tmp_name = ""
    flat = FlatState(tree=None)
    sources: dict[tuple[str, Box], torch.Tensor] = {}
    dlayouts: dict[str, Any] = {}
    lock_fd = -1
    try:
        flat = flatten(state_dict, comm.rank)
        layouts, sources, dlayouts = _local_layout(flat)
        wire = [tl.to_wire() for tl in layouts]
        signature = checksum(repr(wire).encode())
        tree_digest = checksum(repr(flat.tree).encode())
        if comm.rank == 0:
            local.check_target(path, overwrite)
            for old in local.stale_siblings(path):
                if local.TMP_MARK in old.name and not local.in_use(old):
                    shutil.rmtree(old, ignore_errors=True)
            tmp_dir = local.temp_sibling(path)
            lock_fd = local.lock_dir(tmp_dir)
            tmp_name = str(tmp_dir)
    except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
        error = exc
    gathered = comm.all_gather(
        (None if error is None else describe(error, comm.rank), wire, tree_digest, tmp_name, signature)
    )
    tmp = Path(gathered[0][3]) if gathered[0][3] else None
    try:
        failures = [g[0] for g in gathered if g[0] is not None]
        if failures:
            if comm.world == 1 and error is not None:
                raise error
            raise rebuild(failures[0]) from error
        assert tmp is not None
        plan, cached = _plan([g[1] for g in gathered], [g[4] for g in gathered])
        items = [WriteItem(a.key, a.box, a.whole, _source_for(sources, a.key, a.box)) for a in plan.by_rank[comm.rank]]
    except BaseException:
        if comm.rank == 0 and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if lock_fd >= 0:
            os.close(lock_fd)
        raise
    send_tree = comm.rank != 0 and gathered[comm.rank][2] != gathered[0][2]
    return PreparedSave(comm, path, tmp, plan, cached, items, flat, dlayouts, send_tree, t0, lock_fd, overwrite)


FileResult = tuple[FileEntry, list[tuple[str, Box, int, int, list[str]]]]


def write_prepared(prep: PreparedSave) -> list[FileResult]:
    """Step 2 of a synchronous save: write this rank's data file straight from the tensors."""
    if not prep.items:
        return []
    rank = prep.comm.rank
    entry, written = write_data_file(prep.tmp, FilePlan(data_file_name(rank), rank, prep.items), CHECKSUM_BLOCK,
                                     threads=min(2, os.cpu_count() or 1))
    return [(entry, [(w.item.key, w.item.box, w.start, w.end, w.checksums) for w in written])]


def finish_save(prep: PreparedSave, results: list[FileResult], error: BaseException | None) -> SaveInfo:
    """Step 3 (one gather + one small tensor broadcast): rank 0 writes the manifest and
    commits; every rank learns whether the commit happened. Raises the same error on
    every rank when it did not."""
    try:
        return _finish_save(prep, results, error)
    finally:
        if prep.lock_fd >= 0:
            os.close(prep.lock_fd)
            prep.lock_fd = -1


def _finish_save(prep: PreparedSave, results: list[FileResult], error: BaseException | None) -> SaveInfo:
    comm = prep.comm
    collected = comm.gather((None if error is None else describe(error, comm.rank), results,
                             prep.flat.rank_local, prep.flat.tree if prep.send_tree else None))
    if error is not None and not comm.distributed:
        shutil.rmtree(prep.tmp, ignore_errors=True)
        raise error
    status: tuple[str, str] | None = None
    if comm.rank == 0:
        assert collected is not None
        try:
            bad = [c[0] for c in collected if c[0] is not None]
            if bad:
                status = bad[0]
            else:
                manifest = _build_manifest(prep.plan, collected, prep.flat.tree, prep.dlayouts, comm.world)
                local.write_small_file(prep.tmp / MANIFEST_NAME, manifest.to_bytes())
                local.commit(prep.tmp, prep.path, prep.overwrite)
        except BaseException as exc:
            if not comm.distributed:
                shutil.rmtree(prep.tmp, ignore_errors=True)
                raise
            status = describe(exc, comm.rank)
        if status is not None:
            shutil.rmtree(prep.tmp, ignore_errors=True)
    status = comm.broadcast_status(status)
    if status is not None:
        raise rebuild(status) from error
    mine = sum(e.nbytes for e, _ in results)
    return SaveInfo(prep.path, mine, len(results), len(prep.flat.tensors), time.perf_counter() - prep.t0,
                    prep.plan_cached)


def save(
    state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False, process_group: Any = None
) -> SaveInfo:
    """Save ``state_dict`` as a checkpoint directory at ``path``, crash-safely.

    With a process group (default: the world group when initialized) every rank calls
    ``save``; each writes only what it owns and replicated values are written once.
    The checkpoint becomes visible only once complete; an existing checkpoint at
    ``path`` is replaced only with ``overwrite=True`` and stays intact until the new one
    is committed. Values that cannot be saved without pickle raise
    UnsupportedValueError naming their key on every rank, before anything is written."""
    prep = prepare_save(state_dict, path, overwrite, resolve(process_group))
    results: list[FileResult] = []
    error: BaseException | None = None
    try:
        results = write_prepared(prep)
    except Exception as exc:  # noqa: BLE001 - reported to every rank in finish_save
        error = exc
    return finish_save(prep, results, error)


def _build_manifest(plan: GlobalPlan, collected: list, tree: Any, dlayouts: dict, world: int) -> Manifest:
    tensors = {key: TensorEntry(dt, shape, kind, [], dlayouts.get(key)) for key, (dt, shape, kind) in
               plan.tensors.items()}
    files: list[FileEntry] = []
    rank_local: dict[str, list[Any]] = {}
    merged_tree = tree
    for rank, (_, results, rl, other_tree) in enumerate(collected):
        for entry, chunks in results:
            index = len(files)
            files.append(entry)
            for key, box, start, end, sums in chunks:
                tensors[key].chunks.append(Chunk(box.offsets, box.lengths, index, start, end, sums, rank))
        for key, value in rl.items():
            rank_local.setdefault(key, [None] * world)[rank] = value
        if other_tree is not None:
            merged_tree = _merge_trees(merged_tree, other_tree, [], rank)
    for entry in tensors.values():
        entry.chunks.sort(key=lambda c: c.offsets)
    return Manifest(
        tree=merged_tree,
        tensors=tensors,
        files=files,
        world_size=world,
        rank_local=rank_local,
        writer={"shardsafe": __version__, "torch": torch.__version__},
        extra={"checksum_block": CHECKSUM_BLOCK},
    )


def _merge_trees(base: Any, other: Any, parts: list[str], rank: int) -> Any:
    """Add to rank 0's tree the dict entries only another rank has; warn on conflicts."""
    if isinstance(base, dict) and isinstance(other, dict) and not any(k.startswith("$") for k in base):
        out = dict(base)
        for k, v in other.items():
            out[k] = _merge_trees(base[k], v, parts + [k], rank) if k in base else v
        return out
    if base != other:
        warnings.warn(
            f"value at '{join_key(parts) or '<root>'}' differs between rank 0 and rank {rank}; rank 0's is "
            "saved (mark per-rank values with shardsafe.rank_local)",
            stacklevel=4,
        )
    return base


# ----------------------------------------------------------------------------- load


def read_manifest(path: PathLike) -> Manifest:
    """Parse and verify the manifest of the committed checkpoint at ``path``."""
    path = Path(path)
    mpath = local.require_checkpoint(path)
    return Manifest.from_bytes(mpath.read_bytes(), str(mpath))


def _block(manifest: Manifest) -> int:
    block = manifest.extra.get("checksum_block")
    if not isinstance(block, int) or block <= 0:
        raise CheckpointError("manifest: missing or bad extra.checksum_block")
    return block


def load(
    state_dict: dict[str, Any],
    path: PathLike,
    *,
    strict: bool = True,
    verify: bool = True,
    process_group: Any = None,
    max_buffer: int = DEFAULT_MAX_BUFFER,
    exclude: list[str] | tuple[str, ...] = (),
) -> LoadInfo:
    """Load the checkpoint at ``path`` into ``state_dict`` in place, on one process or on
    every rank of a process group, whatever world size or layout saved it.

    Tensors (plain or DTensor) are filled in place with only the bytes they need,
    Statefuls get ``load_state_dict`` with their filled tree, other values are replaced.
    Keys, shapes and dtypes are validated — and with ``verify`` the checksum of every
    needed block — before any destination byte is written, so a failed load leaves the
    destination untouched; every rank raises the same error. Dotted keys or prefixes in
    ``exclude`` are left as they are in the destination."""
    t0 = time.perf_counter()
    path = Path(path)
    comm = resolve(process_group)
    error: BaseException | None = None
    session: ReadSession | None = None
    result = None
    try:
        manifest = read_manifest(path)
        matcher = Matcher(manifest, rank=comm.rank, strict=strict, exclude=exclude)
        matcher.match(state_dict, manifest.tree, [], top=True)
        result = matcher.result
        result.raise_errors()
        ops = plan_reads(manifest, result.fills, max_buffer)
        session = ReadSession(path, manifest, ops, verify=verify, block=_block(manifest))
        session.verify()
    except Exception as exc:  # noqa: BLE001
        error = exc
    try:
        _agree(comm, error)
        nbytes = 0
        try:
            assert session is not None and result is not None
            nbytes = session.read()
        except Exception as exc:  # noqa: BLE001
            error = exc
        _agree(comm, error)
    finally:
        if session is not None:
            session.close()
    for assign in result.assigns:
        assign()
    for obj, get in result.statefuls:
        obj.load_state_dict(get())
    return LoadInfo(path, nbytes, len({f.key for f in result.fills}), time.perf_counter() - t0,
                    session.copied_bytes if session is not None else 0)


def _agree(comm: Comm, error: BaseException | None) -> None:
    if not comm.distributed:
        if error is not None:
            raise error
        return
    comm.agree(error)


def load_full(
    path: PathLike, keys: list[str] | str | None = None, *, verify: bool = True, rank: int = 0
) -> dict[str, Any]:
    """A fresh tree of full CPU tensors and values from the checkpoint at ``path``
    (rank-local values: those of saving rank ``rank``). Needs no process group.

    ``keys`` restricts the result to the given dotted keys or key prefixes (for example
    ``"model"`` or ``"model.layers.0.weight"``); a key that matches nothing raises
    MissingKeysError."""
    path = Path(path)
    manifest = read_manifest(path)
    tree = manifest.tree
    if keys is not None:
        tree = _prune(tree, [keys] if isinstance(keys, str) else list(keys))
    matcher = Matcher(manifest, rank=rank)
    value = matcher.materialize(tree)
    matcher.result.raise_errors()
    ops = plan_reads(manifest, matcher.result.fills)
    with ReadSession(path, manifest, ops, verify=verify, block=_block(manifest), verify_all_first=False) as session:
        session.verify()
        session.read()
    return value


def _prune(tree: Any, wanted: list[str]) -> Any:
    """Keep only the parts of a saved tree under the wanted dotted prefixes (a partly
    selected list or tuple becomes a dict keyed by index)."""
    found = {w: False for w in wanted}

    def walk(node: Any, parts: list[str]) -> Any:
        key = join_key(parts)
        hits = [w for w in wanted if key == w or key.startswith(w + ".")]
        if hits:
            for w in hits:
                found[w] = True
            return node
        if parts and not any(w.startswith(key + ".") for w in wanted):
            return _DROP
        items = saved_items(node)
        sequence = saved_sequence(node, list) or saved_sequence(node, tuple)
        if items is None and sequence is not None:
            items = list(enumerate(sequence))
        if items is None:
            return _DROP
        kept = {}
        for k, v in items:
            sub = walk(v, parts + [str(k)])
            if sub is not _DROP:
                kept[k] = sub
        if not kept:
            return _DROP
        if sequence is not None and len(kept) == len(sequence):
            return node
        if sequence is not None or (isinstance(node, dict) and "$dict" in node):
            # A partly selected list or tuple comes back as a dict keyed by index.
            from .format.values import encode_dict_key

            return {"$dict": [[encode_dict_key(k, key), v] for k, v in kept.items()]}
        return kept

    out = walk(tree, [])
    missing = [w for w, ok in found.items() if not ok]
    if missing:
        raise MissingKeysError(f"no key or key prefix {missing[0]!r} in the checkpoint")
    return {} if out is _DROP else out


_DROP = object()
