"""Distributed-specific helpers for the distributed and planning benchmarks: a pool of
spawned gloo worker processes, the durable raw-write baseline, per-process I/O counters,
load average, source state. The generic helpers (statistics, raw vectored I/O, RSS
sampling, machine description, tables, JSON, temporary directories) are in _common.

The worker pool follows tests/distributed.py: ``world`` spawned processes join one gloo
group (file:// rendezvous) and then run case functions, named "module:function", on
every rank until the pool is closed. Workers are daemonic and the pool kills them on
error or timeout, so no process outlives the benchmark.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from _common import REPO, pwritev_all

# --------------------------------------------------------------------------- worker pool


def _worker_main(rank: int, world: int, init_file: str, tasks: Any, results: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when workers stop
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
                results.put((rank, case_id, True, fn(rank, world, *args)))
            except BaseException:  # noqa: BLE001 - report everything to the parent
                results.put((rank, case_id, False, traceback.format_exc()))
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def _ref(fn: Callable) -> str:
    module = fn.__module__
    if module in ("__main__", "__mp_main__"):
        module = Path(sys.modules[module].__file__).stem  # type: ignore[arg-type]
    return f"{module}:{fn.__name__}"


class WorkerPool:
    """``world`` spawned processes in one gloo group, running case functions on demand."""

    def __init__(self, world: int, start_timeout: float = 180.0) -> None:
        self.world = world
        self.alive = False
        self._ctx = mp.get_context("spawn")
        self._dir = tempfile.mkdtemp(prefix="shardsafe-bench-pg-")
        self._tasks = [self._ctx.Queue() for _ in range(world)]
        self._results = self._ctx.Queue()
        init_file = os.path.join(self._dir, "init")
        self._procs = [
            self._ctx.Process(target=_worker_main, args=(r, world, init_file, self._tasks[r], self._results),
                              daemon=True)
            for r in range(world)
        ]
        self._next = 0
        self.alive = True
        try:
            for p in self._procs:
                p.start()
            self.run(_ping, timeout=start_timeout)
        except BaseException:
            self.close(force=True)
            raise

    def run(self, fn: Callable, *args: Any, timeout: float = 600.0) -> list[Any]:
        """``fn(rank, world, *args)`` on every rank; the per-rank return values."""
        if not self.alive:
            raise RuntimeError("worker pool is closed")
        ref = _ref(fn)
        case_id = self._next
        self._next += 1
        for q in self._tasks:
            q.put((case_id, ref, args))
        values: list[Any] = [None] * self.world
        failures: list[str] = []
        got = 0
        deadline = time.monotonic() + timeout
        while got < self.world:
            try:
                rank, cid, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close(force=True)
                    why = f"ranks {dead} died" if dead else f"timed out after {timeout:.0f}s"
                    raise RuntimeError(f"case {ref}: {why} ({got}/{self.world} ranks done)") from None
                continue
            if cid != case_id:
                continue
            got += 1
            if ok:
                values[rank] = value
            else:
                failures.append(f"--- rank {rank} ---\n{value}")
        if failures:
            self.close(force=True)
            raise RuntimeError(f"case {ref} failed:\n" + "\n".join(sorted(failures)))
        return values

    def close(self, force: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._tasks:
                with contextlib.suppress(Exception):
                    q.put(None)
            for p in self._procs:
                with contextlib.suppress(Exception):
                    p.join(timeout=30)
        for p in self._procs:
            if p.pid is not None and p.is_alive():
                p.kill()
            with contextlib.suppress(Exception):
                p.join(timeout=10)
        for q in [*self._tasks, self._results]:
            q.cancel_join_thread()
            q.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(force=exc[0] is not None)


def _ping(rank: int, world: int) -> int:
    return os.getpid()


# --------------------------------------------------------------------------- raw I/O


def write_durable(path: Path, views: Sequence[Any]) -> int:
    """Write the buffers back to back into a new file with ``pwritev`` and fsync it (the
    raw baseline: no header, no checksums, no directory fsync). Returns bytes written."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        n = pwritev_all(fd, views)
        os.fsync(fd)
    finally:
        os.close(fd)
    return n


def files_under(paths: Sequence[Path]) -> list[Path]:
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        out.extend(sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p])
    return out


# --------------------------------------------------------------------------- counters


def proc_io() -> dict[str, int]:
    """This process's /proc/self/io counters (rchar: bytes passed through read-type
    syscalls of all its threads, page-cache hits included; mmap'd reads are not counted)."""
    out: dict[str, int] = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            out[k.strip()] = int(v)
    return out


def malloc_trim() -> bool:
    """Return freed heap memory to the OS (glibc), so that an RSS baseline taken next is not
    hiding allocator-cached memory that a later allocation would silently reuse."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


def loadavg() -> float:
    """The 1-minute load average (other work on the machine skews timings)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


# --------------------------------------------------------------------------- output


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def source_state() -> dict[str, Any]:
    """The commit and the uncommitted changes under src/ that a run measured (read-only git)."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    dirty = git("status", "--porcelain", "src").splitlines()
    return {"commit": git("rev-parse", "--short", "HEAD"), "dirty_src": dirty}


def source_banner(src: dict[str, Any], *extra: str) -> str:
    """One line naming what a run measured: shardsafe's version and commit, uncommitted
    changes under src/, torch's version, then ``extra``."""
    import torch

    import shardsafe

    dirty = f" + uncommitted src changes: {', '.join(x.split()[-1] for x in src['dirty_src'])}" \
        if src["dirty_src"] else ""
    return "; ".join([f"shardsafe {shardsafe.__version__} at {src['commit']}{dirty}", f"torch {torch.__version__}",
                      *extra])
