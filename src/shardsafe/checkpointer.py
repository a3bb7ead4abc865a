"""The Checkpointer: one object that owns everything a job's saves and loads share.

It holds the storage backends, the per-rank host-memory budget (and the staging buffers
it keeps for reuse), the plan cache, the dedicated process groups of async saves and the
async save in flight. A save delegates to ``ops.save`` (a sync save is the same run as an
async one, awaited by its caller); a load wires the phases of ``ops.load`` to the engine.
``close()`` waits for pending work and releases it all. The module-level functions
(``shardsafe.save``, ``load``, ``async_save``, ...) use a default Checkpointer; a
``CheckpointManager`` owns one of its own.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import warnings
import weakref
from collections.abc import Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .comm import Comm, destroy_groups, resolve
from .engine.memory import HostMemory
from .errors import CheckpointError
from .exit_settle import guard_destroy, settle_gloo_workers
from .format.manifest import Manifest
from .hints import as_keys
from .ops.compression import check_choice
from .ops.incremental import VersionMemo
from .ops.load import DEFAULT_MAX_BUFFER, LoadInfo, LoadOptions, ReadResources, load_full_tree, load_in_place
from .ops.metadata import fetch_all_indexes, read_manifest_phase
from .ops.reader import CheckpointReader
from .ops.save import PlanCache, SaveInfo, SaveRequest, StagedSave, StagePolicy, complete, stage_policy, start
from .storage.base import Backend
from .storage.urls import OBJECT_SCHEMES, default_backends
from .storage.urls import resolve as resolve_location
from .workers import new_thread

PathLike = str | os.PathLike


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
        self._bandwidth: dict[int, float] = {}  # id(backend) -> write bandwidth of its last raw save (bytes/s)
        self._rates: dict[int, dict[str, float]] = {}  # id(backend) -> codec -> chunk bytes/s of its last save
        self.pending: SaveFuture | None = None
        self._groups: dict[int, tuple[Any, Any]] = {}  # id(group) -> (group, its dedicated gloo group)
        self._closed = False
        _LIVE.add(self)

    # -- locations ----------------------------------------------------------------------
    def locate(self, path: PathLike, storage_options: dict[str, Any] | None = None) -> tuple[Backend, str]:
        """The backend for ``path`` and the location there (unsupported URLs raise).
        ``storage_options`` (for object-store URLs) override this Checkpointer's for this
        call; a backend is built once per distinct set of options and kept. A backend that
        leases host buffers of its own (``use_memory``: S3 parts, Azure blocks) gets this Checkpointer's
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
        backend.use_memory(self.memory)
        return backend, location

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointError("this Checkpointer is closed")

    # -- saving -------------------------------------------------------------------------
    def save(self, state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False,
             process_group: Any = None, check_replicas: bool | None = None,
             storage_options: dict[str, Any] | None = None, base: PathLike | None = None,
             version_skip: bool = False, compression: str = "off") -> SaveInfo:
        """Save ``state_dict`` at ``path`` crash-safely; see :func:`shardsafe.save`. The
        save in the background of :meth:`async_save`, awaited by the caller."""
        self._check_open()
        check_choice(compression)
        comm = resolve(process_group)
        staged = self._start(state_dict, path, comm, comm.group, stage_policy(True, self.write_threads),
                             overwrite, check_replicas, storage_options, base, version_skip, compression)
        info = complete(staged)
        self._learn(staged, info)
        return info

    def _learn(self, staged: StagedSave, info: SaveInfo) -> None:
        """Remember a raw save's write bandwidth per backend (what ``compression="auto"``
        compares against), and the rate each codec reached (ops/compression.py)."""
        if info.write_bandwidth <= 0 or staged.prep.backend is None:
            return
        backend = id(staged.prep.backend)
        if info.compression == "off":
            self._bandwidth[backend] = info.write_bandwidth
        else:
            self._rates.setdefault(backend, {})[info.compression] = info.write_bandwidth

    def async_save(self, state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False,
                   process_group: Any = None, max_staging_bytes: int | None = None,
                   check_replicas: bool | None = None, storage_options: dict[str, Any] | None = None,
                   base: PathLike | None = None, version_skip: bool = False, compression: str = "off") -> SaveFuture:
        """Stage ``state_dict`` and write it in the background; see :func:`shardsafe.async_save`."""
        self._check_open()
        check_choice(compression)
        self.wait()
        comm = self._async_comm(process_group)
        staged = self._start(state_dict, path, comm, resolve(process_group).group,
                             stage_policy(False, self.write_threads, max_staging_bytes), overwrite, check_replicas,
                             storage_options, base, version_skip, compression)
        future = SaveFuture(staged.prep.location)
        future.stage_seconds = staged.seconds
        future._staged.set()
        future._thread = new_thread(_complete_into, "commit", staged, future)
        self.pending = future
        future._thread.start()
        if staged.error is not None and not comm.distributed:
            self.wait()
        return future

    def _start(self, state_dict: dict[str, Any], path: PathLike, comm: Comm, group: Any, policy: StagePolicy,
               overwrite: bool, check_replicas: bool | None, storage_options: dict[str, Any] | None,
               base: PathLike | None, version_skip: bool, compression: str = "off") -> StagedSave:
        """Phases 1-3 of a save (:func:`~shardsafe.ops.save.start`) with this Checkpointer's
        backends, plan cache, memory budget and version memo."""
        backend, location = self.locate(path, storage_options)
        base_location = self._base(backend, base, storage_options)
        memo = self.memo if version_skip else None
        if memo is None:
            self.memo.replace({})  # the memo answers for the last save only (and holds its storages)
        request = SaveRequest(state_dict, backend, location, overwrite, _check(check_replicas), base_location, memo,
                              compression, self._bandwidth.get(id(backend)), self._rates.get(id(backend)))
        return start(request, comm, group, self.plans, self.memory, policy, self.pin_memory)

    def _base(self, backend: Backend, base: PathLike | None, storage_options: dict[str, Any] | None) -> str | None:
        """The location of an incremental save's base (on the same backend as the save)."""
        if base is None:
            return None
        base_backend, location = self.locate(base, storage_options)
        if base_backend is not backend:
            raise CheckpointError(f"base checkpoint {base} is on another storage than the new checkpoint")
        return location

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
    def _resources(self) -> ReadResources:
        """What a load borrows from this Checkpointer (ops/load.py runs the protocol)."""
        return ReadResources(self.memory, self.read_threads, self.fetch_threads)

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
                fetch_all_indexes(opened)
        finally:
            opened.close()
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
        opts = LoadOptions(strict, verify, max_buffer, exclude, cast_dtype, bcast and comm.distributed)
        return load_in_place(state_dict, backend, location, comm, self._resources(), opts)

    def load_full(self, path: PathLike, keys: str | Iterable[str] | None = None, *, verify: bool = True,
                  rank: int = 0, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
        """A fresh tree of full CPU tensors; see :func:`shardsafe.load_full`."""
        self._check_open()
        keys = as_keys(keys, "keys")
        backend, location = self.locate(path, storage_options)
        return load_full_tree(backend, location, keys, self._resources(), verify=verify, rank=rank)

    def delete(self, path: PathLike, storage_options: dict[str, Any] | None = None) -> bool:
        """Delete the checkpoint at ``path`` so that no reader ever sees it half deleted
        (out of sight first, then its files). Returns False when there was none; a folder
        that is not a shardsafe checkpoint, or one that incremental checkpoints beside it
        refer to, is refused (CheckpointError naming them), never deleted. A retired
        checkpoint (docs/incremental.md) that nothing refers to any more is deleted."""
        from .checkpoint_folder import delete_checkpoint, is_committed, prune_retired, refuse_referred, retired_files

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
            refuse_referred(parent, name, "delete", retired=retired)
            if retired:  # kept for the data files incremental checkpoints referred to
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


def _complete_into(staged: StagedSave, future: SaveFuture) -> None:
    """The commit thread of an async save: phases 4 and 5, their outcome into ``future``."""
    try:
        future._future.set_result(complete(staged))
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
