"""Run test cases on real gloo process groups, reusing the processes across cases.

A :class:`WorkerPool` starts ``world`` spawned processes once, each joins one gloo
process group, then runs case functions by reference ("module:function") on every rank
until closed. A case that fails on any rank raises AssertionError with every failing
rank's traceback; a case that hangs past its timeout kills the pool (the next use
starts a fresh one).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import traceback
from typing import Any


def _worker_main(rank: int, world: int, init_file: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import importlib

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            case_id, ref, args = task
            module_name, func_name = ref.split(":")
            try:
                fn = getattr(importlib.import_module(module_name), func_name)
                value = fn(rank, world, *args)
                results.put((rank, case_id, True, value))
            except BaseException:  # noqa: BLE001 - report everything to the parent
                results.put((rank, case_id, False, traceback.format_exc()))
    finally:
        # No destroy_process_group(): its gloo teardown can wait on peers that already left;
        # the process exits right after and the OS reclaims everything.
        os._exit(0)


class WorkerPool:
    """``world`` processes in one gloo group, running cases on demand."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="shardsafe-pg-")
        self._tasks = [self._ctx.Queue() for _ in range(world)]
        self._results = self._ctx.Queue()
        init_file = os.path.join(self._dir, "init")
        self._procs = [
            self._ctx.Process(target=_worker_main, args=(r, world, init_file, self._tasks[r], self._results),
                              daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self._next = 0
        self.alive = True

    def run(self, fn: Any, *args: Any, timeout: float = 180.0) -> list[Any]:
        """Run ``fn(rank, world, *args)`` on every rank; returns the per-rank return values."""
        ref = f"{fn.__module__}:{fn.__name__}"
        case_id = self._next
        self._next += 1
        for q in self._tasks:
            q.put((case_id, ref, args))
        values: list[Any] = [None] * self.world
        failures: list[str] = []
        got = 0
        while got < self.world:
            try:
                rank, cid, ok, value = self._results.get(timeout=timeout)
            except queue.Empty:
                self.close(force=True)
                raise AssertionError(f"case {ref} timed out after {timeout}s ({got}/{self.world} ranks done)") from None
            if cid != case_id:
                continue
            got += 1
            if ok:
                values[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            raise AssertionError(f"case {ref} failed:\n" + "\n".join(sorted(failures)))
        return values

    def close(self, force: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not force:
            import time

            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 5.0  # one shared grace period, not one per worker
            for p in self._procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        for q in [*self._tasks, self._results]:
            q.close()
            q.join_thread()
        shutil.rmtree(self._dir, ignore_errors=True)
