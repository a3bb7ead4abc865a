"""Persistent worker processes that run campaign probes, with timeouts.

A :class:`Pool` spawns ``world`` processes once (a gloo process group joins them when
``group`` is set) and runs functions by reference (``"module:function"``) on every rank,
reused across trials. A call that does not finish within its timeout, or a worker that
dies, kills the whole pool (the next call starts a fresh one) and is reported as a hang
or a crash instead of stopping the campaign.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any


def _worker_main(rank: int, world: int, group: bool, init_file: str, tasks: Any, results: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import datetime
    import importlib

    import torch

    torch.set_num_threads(1)
    if group:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=300))
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            ticket, ref, args = task
            module_name, func_name = ref.split(":")
            try:
                fn = getattr(importlib.import_module(module_name), func_name)
                results.put((rank, ticket, True, fn(rank, world, *args)))
            except BaseException:  # noqa: BLE001 - report everything to the parent
                results.put((rank, ticket, False, traceback.format_exc()))
    finally:
        os._exit(0)  # no process-group teardown: peers may already be gone


@dataclass
class Failure:
    """A call that did not return on every rank: ``kind`` is "hang", "crash" or "error"."""

    kind: str
    detail: str


class Pool:
    """``world`` worker processes (see the module docstring); ``name`` labels messages."""

    def __init__(self, world: int, *, group: bool, name: str = "pool") -> None:
        self.world = world
        self.group = group
        self.name = name
        self.starts = 0
        self._procs: list[Any] = []
        self._dir: str | None = None
        self._next = 0

    @property
    def alive(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        """Start the workers (a no-op when they run)."""
        if self._procs:
            return
        ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="shardsafe-faults-pg-")
        self._tasks = [ctx.Queue() for _ in range(self.world)]
        self._results = ctx.Queue()
        init_file = os.path.join(self._dir, "init")
        self._procs = [ctx.Process(target=_worker_main, daemon=True, name=f"{self.name}-{r}",
                                   args=(r, self.world, self.group, init_file, self._tasks[r], self._results))
                       for r in range(self.world)]
        for p in self._procs:
            p.start()
        self.starts += 1

    def submit(self, ref: str, *args: Any) -> int:
        """Queue ``ref(rank, world, *args)`` on every rank; returns a ticket for :meth:`collect`."""
        self.start()
        ticket = self._next
        self._next += 1
        for q in self._tasks:
            q.put((ticket, ref, args))
        return ticket

    def collect(self, ticket: int, timeout: float) -> list[Any] | Failure:
        """The per-rank return values of call ``ticket``, or a :class:`Failure` (the pool
        is then killed when the call hung or a worker died)."""
        values: list[Any] = [None] * self.world
        errors: list[str] = []
        got = 0
        deadline = time.monotonic() + timeout
        while got < self.world:
            try:
                rank, tid, ok, value = self._results.get(timeout=0.2)
            except queue.Empty:
                dead = [p for p in self._procs if not p.is_alive()]
                if dead:
                    codes = ", ".join(f"{p.name} exit {p.exitcode}" for p in dead)
                    self.close(force=True)
                    return Failure("crash", f"{self.name}: worker died ({codes})")
                if time.monotonic() > deadline:
                    self.close(force=True)
                    return Failure("hang", f"{self.name}: no answer from {self.world - got} of {self.world} ranks "
                                           f"after {timeout:.0f} s")
                continue
            if tid != ticket:
                continue
            got += 1
            if ok:
                values[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            return Failure("error", "\n".join(sorted(errors)))
        return values

    def run(self, ref: str, *args: Any, timeout: float = 120.0) -> list[Any] | Failure:
        """:meth:`submit` then :meth:`collect`."""
        return self.collect(self.submit(ref, *args), timeout)

    def close(self, force: bool = False) -> None:
        """Stop the workers (``force``: kill them at once) and remove the rendezvous folder."""
        if not self._procs:
            return
        procs, self._procs = self._procs, []
        if not force:
            for q in self._tasks:
                q.put(None)
            deadline = time.monotonic() + 10.0
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        for q in [*self._tasks, self._results]:
            q.close()
            q.join_thread()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
