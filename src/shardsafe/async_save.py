"""async_save: stage the state into a bounded, reused host buffer pool, return, and
write + commit in the background.

- The caller returns once every byte this rank writes has been copied into the pool
  (with a pool smaller than the state, it waits while the writer drains it). From then
  on the training loop may change its tensors.
- A background thread writes, fsyncs, gathers the results on a dedicated gloo group
  (so training collectives are never interleaved with ours) and rank 0 commits.
- At most one save is in flight per process: a new save first waits for the previous
  one. A failed background save never commits; its error is raised by ``result()`` and,
  if nobody called ``result()``, by the next save call. Interpreter exit waits for a
  pending save to commit.
"""

from __future__ import annotations

import atexit
import threading
import time
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .api import CHECKSUM_BLOCK, PathLike, PreparedSave, SaveInfo, finish_save, prepare_save
from .comm import Comm, resolve
from .engine.staging import StagedWriter, StagingPool, StreamedFile
from .plan.save_plan import data_file_name


class SaveFuture:
    """The handle of an async save: ``staged()`` and ``result()`` (durable and committed)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._future: Future[SaveInfo] = Future()
        self._staged = threading.Event()
        self.stage_seconds = 0.0
        self._observed = False

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


class AsyncSaver:
    """Async saves of one job: the staging pool, the dedicated group and the save in flight."""

    def __init__(self, pin_memory: bool = True) -> None:
        self.pin_memory = pin_memory  # pinned staging when CUDA tensors are saved
        self.pool = StagingPool()
        self.pending: SaveFuture | None = None
        self._groups: dict[Any, Any] = {}
        self._lock = threading.Lock()


    def _comm(self, process_group: Any) -> Comm:
        base = resolve(process_group)
        if not base.distributed:
            return base
        key = id(base.group)
        group = self._groups.get(key)
        if group is None:
            ranks = dist.get_process_group_ranks(base.group)
            group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
            self._groups[key] = group
        return Comm(group, base.rank, base.world)

    def wait(self) -> SaveInfo | None:
        """Wait for the save in flight; raises its error if it failed."""
        pending, self.pending = self.pending, None
        if pending is None:
            return None
        if pending._observed and pending.done() and pending._future.exception() is not None:
            return None  # its error was already raised to the caller once
        return pending.result()

    def save(
        self,
        state_dict: dict[str, Any],
        path: PathLike,
        *,
        overwrite: bool = False,
        process_group: Any = None,
        max_staging_bytes: int | None = None,
    ) -> SaveFuture:
        """Stage ``state_dict`` and write it in the background; see the module docstring."""
        self.wait()
        comm = self._comm(process_group)
        prep = prepare_save(state_dict, path, overwrite, comm)
        future = SaveFuture(prep.path)
        t0 = time.perf_counter()
        writer: StagedWriter | None = None
        try:
            if prep.items:
                spec = StreamedFile(prep.tmp, data_file_name(comm.rank), comm.rank, prep.items, CHECKSUM_BLOCK)
                writer = StagedWriter(spec, self.pool, max_staging_bytes, self.pin_memory)
                writer.stage()
        except BaseException as exc:  # noqa: BLE001 - the commit step reports it to every rank
            stage_error: BaseException | None = exc
        else:
            stage_error = None
        future.stage_seconds = time.perf_counter() - t0
        future._staged.set()
        thread = threading.Thread(target=_finish, args=(prep, writer, stage_error, future), name="shardsafe-commit",
                                  daemon=True)
        with _PENDING_LOCK:
            _PENDING.add(future)
        thread.start()
        self.pending = future
        if stage_error is not None and not comm.distributed:
            self.wait()
        return future


def _finish(prep: PreparedSave, writer: StagedWriter | None, error: BaseException | None, future: SaveFuture) -> None:
    results = []
    try:
        if writer is not None:
            try:
                entry, chunks = writer.finish()
                if error is None:
                    results = [(entry, [(it.key, it.box, s, e, sums) for it, s, e, sums in chunks])]
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        future._future.set_result(finish_save(prep, results, error))
    except BaseException as exc:  # noqa: BLE001
        future._future.set_exception(exc)
    finally:
        with _PENDING_LOCK:
            _PENDING.discard(future)


_PENDING: set[SaveFuture] = set()  # saves in flight, whoever started them (kept alive until done)
_PENDING_LOCK = threading.Lock()
_DEFAULT = AsyncSaver()


def async_save(
    state_dict: dict[str, Any],
    path: PathLike,
    *,
    overwrite: bool = False,
    process_group: Any = None,
    max_staging_bytes: int | None = None,
) -> SaveFuture:
    """Save like :func:`shardsafe.save`, but return once the state is staged in host
    memory; the write and commit run in the background. All ranks call it.

    ``max_staging_bytes`` bounds the host buffer pool (default: this rank's share of
    the state); a larger state streams through the pool and the call waits longer.
    The pool is reused by later saves. Raises the error of a previous async save that
    failed and was never observed."""
    return _DEFAULT.save(state_dict, path, overwrite=overwrite, process_group=process_group,
                         max_staging_bytes=max_staging_bytes)


def wait_for_pending() -> SaveInfo | None:
    """Block until the default saver's save in flight has committed (raises its error)."""
    return _DEFAULT.wait()


@atexit.register
def _drain_at_exit() -> None:
    """Interpreter exit waits for every pending save (managers own savers too)."""
    with _PENDING_LOCK:
        pendings = list(_PENDING)
    for pending in pendings:
        try:
            pending.result()
        except BaseException as exc:  # noqa: BLE001 - at exit, report instead of raising
            warnings.warn(f"shardsafe: the pending async save to {pending.path} failed: {exc}", stacklevel=1)
    for thread in threading.enumerate():  # no thread of ours may outlive the interpreter's teardown
        if thread.name in ("shardsafe-commit", "shardsafe-writer") and thread is not threading.current_thread():
            thread.join()
