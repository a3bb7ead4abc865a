"""The Checkpointer: one object that owns everything a job's saves and loads share.

It holds the storage backends, the per-rank host-memory budget (and the staging buffers
it keeps for reuse), the plan cache, the dedicated process groups of async saves and the
async save in flight, and wires the phases of ``saving`` and ``loading`` to the engine.
``close()`` waits for pending work and releases it all. The module-level functions
(``shardsafe.save``, ``load``, ``async_save``, ...) use a default Checkpointer; a
``CheckpointManager`` owns one of its own.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .comm import Comm, destroy_groups, resolve
from .engine.memory import HostMemory
from .engine.reader import OpenFiles, Reader
from .engine.writer import FileWriter
from .errors import CheckpointChangedError, CheckpointError
from .exit_settle import guard_destroy, settle_gloo_workers
from .format.manifest import Manifest
from .hints import as_keys
from .layout import Box
from .ops.incremental import VersionMemo
from .ops.load import (
    DEFAULT_MAX_BUFFER,
    CheckpointReader,
    LoadInfo,
    Opened,
    apply_phase,
    block_size,
    land_phase,
    open_files_phase,
    plan_phase,
    read_manifest_phase,
)
from .ops.save import (
    CHECKSUM_BLOCK,
    FileResult,
    PlanCache,
    PreparedSave,
    SaveInfo,
    file_result,
    finish,
    prepare,
    remember,
)
from .plan.share_plan import Shared, plan_sharing
from .state.context import active_group
from .state.match import Fill, Matcher
from .state.saved import check_tree, select
from .storage.base import Backend
from .storage.urls import OBJECT_SCHEMES, default_backends
from .storage.urls import resolve as resolve_location

PathLike = str | os.PathLike
SYNC_STAGING = 128 << 20  # a sync save stages (GPU / non-dense tensors) through at most this much
LOAD_RETRIES = 3  # a load that sees its checkpoint replaced mid-way starts again this often


class SaveFuture:
    """The handle of an async save: ``staged()`` and ``result()`` (durable and committed)."""

    def __init__(self, path: Path | str) -> None:
        self.path = path
        self._future: Future[SaveInfo] = Future()
        self._staged = threading.Event()
        self.stage_seconds = 0.0
        self._observed = False
        self._thread: threading.Thread | None = None  # the commit thread

    def _join(self) -> None:
        """Wait until the commit thread has ended (it ends right after the result is set)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def staged(self, timeout: float | None = None) -> bool:
        """True once the state has been copied out (always true after async_save returns)."""
        return self._staged.wait(timeout)

    def done(self) -> bool:
        """True once the save has committed or failed."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> SaveInfo:
        """Wait until the checkpoint is durable and committed; re-raises a background error."""
        self._observed = True
        return self._future.result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the save; its error, or None when it committed."""
        self._observed = True
        return self._future.exception(timeout)


def _check(check_replicas: bool | None) -> bool:
    """``check_replicas``, defaulting to the SHARDSAFE_CHECK_REPLICAS environment variable."""
    if check_replicas is not None:
        return check_replicas
    return os.environ.get("SHARDSAFE_CHECK_REPLICAS", "") not in ("", "0")


def _threads(n: int | None, default: int) -> int:
    return max(1, n if n is not None else default)


class Checkpointer:
    """Saves and loads of one job (see the module docstring).

    ``storage``: the backend for local paths (e.g. a fault-injecting one in tests), or a
    dict scheme -> backend. ``storage_options``: settings of the object-store backend built
    on first use of an ``s3://`` URL (endpoint, region, credentials; default: the usual
    AWS environment variables and config). ``memory_budget``: the most host memory (bytes) this rank's
    staging and bounce buffers may hold at once; None: async saves stage a rank's whole
    share (the caller then never waits for the disk), sync saves at most 128 MiB, loads at
    most ``max_buffer``. ``write_threads`` / ``read_threads``: I/O concurrency of sync
    saves and of loads (async saves write on one background thread)."""

    def __init__(self, *, storage: Backend | dict[str, Backend] | None = None, memory_budget: int | None = None,
                 write_threads: int | None = None, read_threads: int | None = None, pin_memory: bool = True,
                 plan_cache_size: int = 4, storage_options: dict[str, Any] | None = None) -> None:
        if isinstance(storage, dict):
            self.backends = {**default_backends(), **storage}
        elif storage is not None:
            self.backends = {**default_backends(), "file": storage}
        else:
            self.backends = default_backends()
        self.storage_options = dict(storage_options or {})
        self._option_backends: dict[str, dict[str, Backend]] = {}  # per set of call-time storage_options
        cpus = os.cpu_count() or 1
        self.memory = HostMemory(memory_budget)
        self.write_threads = _threads(write_threads, min(2, cpus))
        self.read_threads = _threads(read_threads, max(2, min(8, cpus)))
        self.fetch_threads = max(self.read_threads, 8)  # requests at once on remote backends (I/O bound)
        self.pin_memory = pin_memory
        self.plans = PlanCache(plan_cache_size)
        self.memo = VersionMemo()  # chunk digests of the last saves (used with version_skip=True)
        self.pending: SaveFuture | None = None
        self._groups: dict[int, tuple[Any, Any]] = {}  # id(group) -> (group, its dedicated gloo group)
        self._closed = False
        _LIVE.add(self)

    # -- locations ----------------------------------------------------------------------
    def locate(self, path: PathLike, storage_options: dict[str, Any] | None = None) -> tuple[Backend, str]:
        """The backend for ``path`` and the location there (unsupported URLs raise).
        ``storage_options`` (for object-store URLs) override this Checkpointer's for this
        call; a backend is built once per distinct set of options and kept. A backend that
        leases host buffers of its own (``use_memory``: S3 parts) gets this Checkpointer's
        budget, the one every staging and read buffer comes from."""
        if not storage_options:
            backend, location = resolve_location(path, self.backends, self.storage_options)
        else:
            key = json.dumps({**self.storage_options, **storage_options}, sort_keys=True, default=str)
            backends = self._option_backends.setdefault(key, dict(self.backends))
            for scheme in OBJECT_SCHEMES:
                if backends.get(scheme) is self.backends.get(scheme):
                    backends.pop(scheme, None)  # built anew with these options
            backend, location = resolve_location(path, backends, {**self.storage_options, **storage_options})
        use_memory = getattr(backend, "use_memory", None)
        if use_memory is not None:
            use_memory(self.memory)
        return backend, location

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")

    # -- saving -------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False,
             process_group: Any = None, check_replicas: bool | None = None,
             storage_options: dict[str, Any] | None = None, base: PathLike | None = None,
             version_skip: bool = False) -> SaveInfo:
        """Save ``state_dict`` at ``path`` crash-safely; see :func:`shardsafe.save`."""
        self._check_open()
        comm = resolve(process_group)
        backend, location = self.locate(path, storage_options)
        base_location = self._base(backend, base, storage_options)
        memo = self.memo if version_skip else None
        if memo is None:
            self.memo.replace({})  # the memo answers for the last save only (and holds its storages)
        with active_group(comm.group, comm.rank, comm.world):
            prep = prepare(state_dict, backend, location, overwrite, comm, self.plans, _check(check_replicas),
                           base_location, memo)
        results: list[FileResult] = []
        error: BaseException | None = None
        try:
            if prep.error is not None:
                raise prep.error
            if prep.mine is not None:
                assert prep.staging is not None
                writer = FileWriter(prep.staging, prep.mine, prep.described.source, self.memory, block=CHECKSUM_BLOCK,
                                    borrow=True, threads=self.write_threads - 1, pin=self.pin_memory,
                                    staging_bytes=SYNC_STAGING)
                writer.start()
                try:
                    writer.stage()
                except BaseException as exc:
                    writer.abort(exc)
                    raise
                results = [file_result(prep, writer.finish(help_write=True))]
        except Exception as exc:  # noqa: BLE001 - reported to every rank by finish()
            error = exc
        info = finish(prep, results, error)
        if memo is not None:
            remember(prep, memo)
        return info

    def _base(self, backend: Backend, base: PathLike | None, storage_options: dict[str, Any] | None) -> str | None:
        """The location of an incremental save's base (on the same backend as the save)."""
        if base is None:
            return None
        base_backend, location = self.locate(base, storage_options)
        if base_backend is not backend:
            raise CheckpointError(f"base checkpoint {base} is on another storage than the new checkpoint")
        return location

    def async_save(self, state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False,
                   process_group: Any = None, max_staging_bytes: int | None = None,
                   check_replicas: bool | None = None, storage_options: dict[str, Any] | None = None,
                   base: PathLike | None = None, version_skip: bool = False) -> SaveFuture:
        """Stage ``state_dict`` and write it in the background; see :func:`shardsafe.async_save`."""
        self._check_open()
        self.wait()
        comm = self._async_comm(process_group)
        backend, location = self.locate(path, storage_options)
        base_location = self._base(backend, base, storage_options)
        memo = self.memo if version_skip else None
        if memo is None:
            self.memo.replace({})
        with active_group(resolve(process_group).group, comm.rank, comm.world):
            prep = prepare(state_dict, backend, location, overwrite, comm, self.plans, _check(check_replicas),
                           base_location, memo)
        future = SaveFuture(location)
        t0 = time.perf_counter()
        writer: FileWriter | None = None
        stage_error: BaseException | None = None
        try:
            if prep.error is not None:
                raise prep.error
            if prep.mine is not None:
                assert prep.staging is not None
                writer = FileWriter(prep.staging, prep.mine, prep.described.source, self.memory, block=CHECKSUM_BLOCK,
                                    borrow=False, threads=1, pin=self.pin_memory, staging_bytes=max_staging_bytes,
                                    write_while_staging=False)
                writer.start()
                writer.stage()
        except BaseException as exc:  # noqa: BLE001 - the commit step reports it to every rank
            stage_error = exc
            if writer is not None:
                writer.abort(exc)
                writer = None
        future.stage_seconds = time.perf_counter() - t0
        future._staged.set()
        thread = threading.Thread(target=_finish_async, args=(prep, writer, stage_error, future, memo),
                                  name="shardsafe-commit", daemon=True)
        future._thread = thread
        self.pending = future
        thread.start()
        if stage_error is not None and not comm.distributed:
            self.wait()
        return future

    def wait(self) -> SaveInfo | None:
        """Wait for the async save in flight; raises its error if it failed (once)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        try:
            if pending._observed and pending.done() and pending._future.exception() is not None:
                return None  # its error was already raised to the caller once
            return pending.result()
        finally:
            pending._join()

    def _async_comm(self, process_group: Any) -> Comm:
        """A dedicated gloo group over the same ranks (so background collectives never
        interleave with training's), created once per group."""
        base = resolve(process_group)
        if not base.distributed:
            return base
        cached = self._groups.get(id(base.group))
        if cached is None or cached[0] is not base.group:
            ranks = dist.get_process_group_ranks(base.group)
            group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            guard_destroy(_drain_pending)  # the user's destroy_process_group() waits for our commits
            cached = (base.group, group)
            self._groups[id(base.group)] = cached  # holding the group keeps its id from being reused
        return Comm(cached[1], base.rank, base.world)

    # -- loading ------------------------------------------------------------------------
    def read_manifest(self, path: PathLike, storage_options: dict[str, Any] | None = None, *,
                      indexes: bool = True) -> Manifest:
        """Parse and verify the manifest of the committed checkpoint at ``path``; with
        ``indexes`` (the default) also every file's index (format 3), so that the returned
        manifest answers every question once the checkpoint is closed. ``indexes=False``
        reads the manifest alone (its tree, tensors, files; O(tensors + files)): what every
        rank of a big job can afford."""
        backend, location = self.locate(path, storage_options)
        opened = read_manifest_phase(backend, location)
        try:
            if indexes:
                opened.manifest.load_all_indexes()
        finally:
            opened.close()
        if not indexes:
            opened.manifest.index_source = None
        return opened.manifest

    def load(self, state_dict: dict[str, Any], path: PathLike, *, strict: bool = True, verify: bool = True,
             process_group: Any = None, max_buffer: int = DEFAULT_MAX_BUFFER,
             exclude: str | Iterable[str] = (), cast_dtype: bool = False,
             broadcast_replicated: bool | None = None, storage_options: dict[str, Any] | None = None) -> LoadInfo:
        """Load the checkpoint at ``path`` into ``state_dict`` in place; see :func:`shardsafe.load`."""
        self._check_open()
        exclude = as_keys(exclude, "exclude") or ()
        VersionMemo.forget_all()  # the load writes into tensors without bumping their _version
        comm = resolve(process_group)
        backend, location = self.locate(path, storage_options)
        bcast = backend.remote if broadcast_replicated is None else broadcast_replicated
        for attempt in range(LOAD_RETRIES):
            try:
                with active_group(comm.group, comm.rank, comm.world):
                    return self._load_once(state_dict, backend, location, comm, strict, verify, max_buffer, exclude,
                                           cast_dtype, bcast and comm.distributed)
            except CheckpointChangedError:
                if attempt == LOAD_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _load_once(self, state_dict: dict[str, Any], backend: Backend, location: str, comm: Comm, strict: bool,
                   verify: bool, max_buffer: int, exclude: Any, cast_dtype: bool = False,
                   broadcast: bool = False) -> LoadInfo:
        t0 = time.perf_counter()
        retries0 = backend.retries
        max_buffer = self.memory.fits(max_buffer)
        error: BaseException | None = None
        opened: Opened | None = None
        files: OpenFiles | None = None
        fetched = 0
        reader: Reader | None = None
        result = plan = None
        verified = 0
        try:
            opened = read_manifest_phase(backend, location)
            manifest = opened.manifest
            check_tree(manifest)
            matcher = Matcher(manifest, rank=comm.rank, strict=strict, exclude=exclude, world=comm.world,
                              cast_dtype=cast_dtype)
            matcher.match(state_dict, manifest.tree, [], top=True)
            matcher.check_exclude(manifest.tree)
            result = matcher.result
            result.raise_errors()
        except Exception as exc:  # noqa: BLE001 - agreed on by every rank below
            error = exc
        # Replicated tensors every rank needs whole: one rank reads each, then sends it.
        shared = broadcast_plan(comm, result.fills if error is None and result else None,
                                opened.manifest if opened else None) if broadcast else []
        mine = [] if result is None else reading_fills(result.fills, shared, comm.rank)
        try:
            if error is None:
                assert opened is not None
                plan = plan_phase(opened.manifest, mine, verify=verify, verify_fresh_first=True,
                                  max_buffer=max_buffer)
                files = OpenFiles(opened.folder, opened.manifest, digest=opened.digest, spill=backend.remote,
                                  siblings=opened.siblings)
                open_files_phase(files, plan, self.fetch_threads)
                reader = Reader(files, self.memory, self.read_threads)
                verified = plan.verify_with(reader)
        except Exception as exc:  # noqa: BLE001
            error = exc
        try:
            comm.agree(error, opened.digest if opened is not None else None, f" at {location}")
            copied = 0
            try:
                assert reader is not None and plan is not None and result is not None and opened is not None
                copied = land_phase(reader, plan, mine, max_buffer, block_size(opened.manifest))
            except Exception as exc:  # noqa: BLE001
                error = exc
            comm.agree(error)
        finally:
            if files is not None:
                fetched = files.fetched
                files.close()
            if opened is not None:
                opened.close()
        assert result is not None
        received = 0
        for s in shared:  # the same order on every rank
            received += comm.share_tensor(piece_of(result.fills[s.index], s.piece), s.owner, s.members)
        error = None
        try:
            apply_phase(result)
        except Exception as exc:  # noqa: BLE001 - every rank raises the same error
            error = exc
        comm.agree(error)
        return LoadInfo(location, verified if verify else copied, len({f.key for f in result.fills}),
                        time.perf_counter() - t0, copied, bytes_received=received,
                        retries=backend.retries - retries0, bytes_fetched=fetched)

    def load_full(self, path: PathLike, keys: str | Iterable[str] | None = None, *, verify: bool = True,
                  rank: int = 0, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """A fresh tree of full CPU tensors; see :func:`shardsafe.load_full`."""
        self._check_open()
        keys = as_keys(keys, "keys")
        backend, location = self.locate(path, storage_options)
        for attempt in range(LOAD_RETRIES):
            try:
                return self._load_full_once(backend, location, keys, verify, rank)
            except CheckpointChangedError:
                if attempt == LOAD_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _load_full_once(self, backend: Backend, location: str, keys: Any, verify: bool, rank: int) -> Any:
        opened = read_manifest_phase(backend, location)
        try:
            manifest = opened.manifest
            check_tree(manifest)
            tree = manifest.tree
            if keys is not None:
                tree = select(tree, list(keys))
            matcher = Matcher(manifest, rank=rank)
            value = matcher.materialize(tree)
            matcher.result.raise_errors()
            fills = matcher.result.fills
            max_buffer = self.memory.fits(DEFAULT_MAX_BUFFER)
            plan = plan_phase(manifest, fills, verify=verify, verify_fresh_first=False, max_buffer=max_buffer)
            with OpenFiles(opened.folder, manifest, digest=opened.digest, spill=backend.remote,
                           siblings=opened.siblings) as files:
                open_files_phase(files, plan, self.fetch_threads)
                reader = Reader(files, self.memory, self.read_threads)
                plan.verify_with(reader)
                land_phase(reader, plan, fills, max_buffer, block_size(manifest))
            return value
        finally:
            opened.close()

    def delete(self, path: PathLike, storage_options: dict[str, Any] | None = None) -> bool:
        """Delete the checkpoint at ``path`` so that no reader ever sees it half deleted
        (out of sight first, then its files). Returns False when there was none; a folder
        that is not a shardsafe checkpoint, or one that incremental checkpoints beside it
        refer to, is refused (CheckpointError naming them), never deleted. A retired
        checkpoint (docs/incremental.md) that nothing refers to any more is deleted."""
        from .checkpoint_folder import delete_checkpoint, is_committed, prune_retired, referrers, retired_files

        backend, location = self.locate(path, storage_options)
        parent_location, name = backend.split(location)
        try:
            parent = backend.open(parent_location)
        except CheckpointError:
            return False
        with parent:
            kind = parent.kind(name)
            if kind is None:
                return False
            retired = not is_committed(parent, name) and retired_files(parent, name) is not None
            if not is_committed(parent, name) and not retired:
                raise CheckpointError(f"{location} is not a shardsafe checkpoint; refusing to delete it")
            others = referrers(parent, name)
            if others:
                raise CheckpointError(
                    f"{location}: incremental checkpoints refer to its data ({', '.join(others[:5])}"
                    f"{', ...' if len(others) > 5 else ''}); delete them first, or make them self-contained with "
                    "'shardsafe copy' (a CheckpointManager's retention keeps what they need by itself)")
            if retired:  # a retired checkpoint nothing refers to any more
                prune_retired(parent, name, set())
            else:
                delete_checkpoint(parent, name)
            return True

    def open_reader(self, path: PathLike, *, verify: bool = True, progress: Any = None,
                    storage_options: dict[str, Any] | None = None) -> CheckpointReader:
        """A :class:`~shardsafe.loading.CheckpointReader` on the checkpoint at ``path``."""
        backend, location = self.locate(path, storage_options)
        return CheckpointReader(backend, location, verify=verify, memory=self.memory, threads=self.read_threads,
                                progress=progress)

    # -- lifecycle ----------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the async save in flight (raising its error), then release the kept
        staging buffers and the dedicated groups. The Checkpointer cannot be used after."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self.memory.trim()
            self.memo.replace({})
            self.plans.clear()
            groups = [g for _, g in self._groups.values()]
            self._groups.clear()
            _LIVE.discard(self)
            destroy_groups(groups)

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def broadcast_plan(comm: Comm, fills: list | None, manifest: Any) -> list[Shared]:
    """The pieces of boxes this rank shares with others (an identical key and box needed
    whole by several ranks), planned by :func:`plan_sharing` from one all-gather of every
    rank's (key, box, bytes) list, as JSON (no pickle); ``Shared.index`` is a fill index.
    Empty when a rank has no fills (its error is agreed on later)."""
    mine: dict[tuple, int] = {}
    requests: list[list] = []
    device = comm._device() if comm.distributed else None  # where this group's collectives take tensors
    if fills is not None and manifest is not None:
        for i, f in enumerate(fills):
            entry = manifest.tensors.get(f.key)
            if entry is None or entry.kind == "rank_local" or f.fresh or f.cast:
                continue
            if device is not None and str(f.tensor.device) != device:
                continue  # gloo sends CPU tensors only, NCCL tensors on the current GPU only
            if tuple(f.tensor.shape) != tuple(f.box.lengths):
                continue  # not a plain view of its box: read by every rank
            box = (f.key, tuple(f.box.offsets), tuple(f.box.lengths))
            if box not in mine:
                mine[box] = i
                requests.append([f.key, list(f.box.offsets), list(f.box.lengths),
                                 f.tensor.numel() * f.tensor.element_size()])
    wire = b"-" if fills is None else json.dumps(requests).encode()
    everyone = comm.all_gather_bytes(wire)
    if any(w == b"-" for w in everyone):
        return []
    gathered = [[(k, tuple(o), tuple(n), b) for k, o, n, b in json.loads(w)] for w in everyone]
    fill_of = list(mine.values())
    return [s._replace(index=fill_of[s.index]) for s in plan_sharing(manifest, gathered, comm.rank)]


def piece_of(fill: Fill, piece: Box) -> Any:
    """The view of ``fill.tensor`` that holds ``piece`` (global coordinates)."""
    t = fill.tensor
    for d, (o, n, fo) in enumerate(zip(piece.offsets, piece.lengths, fill.box.offsets)):
        if o != fo or n != t.shape[d]:
            t = t.narrow(d, o - fo, n)
    return t


def reading_fills(fills: list[Fill], shared: list[Shared], rank: int) -> list[Fill]:
    """The fills this rank reads: those it shares with nobody, and the pieces it owns of
    those it shares (a view of the fill's tensor each)."""
    split = {s.index for s in shared}
    out = [f for i, f in enumerate(fills) if i not in split]
    for s in shared:
        if s.owner == rank:
            f = fills[s.index]
            out.append(f if s.piece == f.box else Fill(f.key, piece_of(f, s.piece), s.piece, fresh=False))
    return out


def _finish_async(prep: PreparedSave, writer: FileWriter | None, error: BaseException | None,
                  future: SaveFuture, memo: VersionMemo | None = None) -> None:
    results: list[FileResult] = []
    try:
        if writer is not None:
            try:
                written = writer.finish(help_write=False)
                if error is None:
                    results = [file_result(prep, written)]
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        info = finish(prep, results, error)
        if memo is not None:
            remember(prep, memo)
        future._future.set_result(info)
    except BaseException as exc:  # noqa: BLE001
        future._future.set_exception(exc)


_LIVE: weakref.WeakSet[Checkpointer] = weakref.WeakSet()  # for the exit drain below


def _drain_pending() -> None:
    """Wait until the async save in flight of every open Checkpointer has committed or
    failed (its error stays for ``wait()`` / ``close()`` to raise)."""
    for cp in list(_LIVE):
        pending = cp.pending
        if pending is not None:
            pending._future.exception()  # blocks until done; raises nothing
            pending._join()


@atexit.register
def _close_at_exit() -> None:
    """Interpreter exit closes every Checkpointer not closed yet: waits for its pending
    async save (a failure is a warning), joins its threads and destroys its dedicated
    groups while the interpreter is whole (see :func:`destroy_groups`); then lets torch's
    gloo worker threads finish freeing their last collectives' tensors before finalization
    (:func:`~shardsafe.exit_settle.settle_gloo_workers`)."""
    for cp in list(_LIVE):
        pending = cp.pending
        try:
            cp.close()
        except BaseException as exc:  # noqa: BLE001 - at exit, report instead of raising
            where = pending.path if pending is not None else "?"
            warnings.warn(f"shardsafe: the pending async save to {where} failed: {exc}", stacklevel=1)
    for thread in threading.enumerate():  # no thread of ours may outlive the interpreter's teardown
        if thread.name.startswith(("shardsafe-commit", "shardsafe-writer")) and \
                thread is not threading.current_thread():
            thread.join()
    settle_gloo_workers()  # torch's own gloo workers: pytorch/pytorch#190489 (exit_settle.py)
