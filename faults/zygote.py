"""A child process that imports torch and shardsafe once, then forks short-lived workers
on request (``python -m faults.zygote``), so that each kill or rlimit trial runs in a
real, separate process without paying for a torch import.

Protocol: one JSON object per line on stdin; ``{"cmd": "start", "target": NAME, "args":
{...}}`` forks a worker running ``TARGETS[NAME](**args)`` and answers its pid;
``{"cmd": "wait", "pid": N}`` reaps it and answers its raw wait status.

Targets save in a loop and append each committed sequence number or step to a marker
file (one line each), so the parent knows what was durable before it sent SIGKILL.
``kill_at`` (a fraction of the storage operations of one save; negative: of its
operations other than writes) makes a worker SIGKILL itself right before that operation
of a later save, through the fault backend's ``on_op`` hook; the operation's name is
written to ``<marker>.op`` first.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import traceback
from typing import Any

import torch

import shardsafe
from shardsafe.storage.faults import FaultyBackend

from .common import seq_state


def _mark(marker: str, value: int) -> None:
    fd = os.open(marker, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{value}\n".encode())
    finally:
        os.close(fd)


class Killer:
    """Counts storage operations; once armed with a target, SIGKILLs this process right
    before operation number ``target`` (counted from arming)."""

    def __init__(self, fraction: float | None, marker: str) -> None:
        # a negative fraction counts only operations other than writes (commit, cleanup, deletion)
        self.meta = fraction is not None and fraction < 0
        self.fraction = abs(fraction) if fraction is not None else None
        self.marker = marker
        self.count = 0
        self.target: int | None = None
        self.lock = threading.Lock()

    def arm(self) -> None:
        """Called after the first committed save: its operation count sets the target."""
        if self.fraction is not None and self.target is None:
            self.target = int(self.fraction * self.count)
            self.count = 0

    def __call__(self, op: str, name: str) -> None:
        if self.meta and op in ("write", "read"):
            return
        with self.lock:
            self.count += 1
            if self.target is not None and self.count > self.target:
                fd = os.open(self.marker + ".op", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.write(fd, f"{op} {name}".encode())
                os.close(fd)
                os.kill(os.getpid(), signal.SIGKILL)


def _checkpointer(killer: Killer) -> shardsafe.Checkpointer:
    return shardsafe.Checkpointer(storage=FaultyBackend(on_op=killer))


def save_loop(path: str, marker: str, start: int, kill_at: float | None = None) -> None:
    """``shardsafe.save(seq_state(n), path, overwrite=True)`` for n = start, start+1, ..."""
    killer = Killer(kill_at, marker)
    cp = _checkpointer(killer)
    n = start
    while True:
        cp.save(seq_state(n), path, overwrite=True)
        _mark(marker, n)
        killer.arm()
        n += 1


def manager_loop(folder: str, marker: str, start: int, async_mode: str, keep_last: int,
                 kill_at: float | None = None) -> None:
    """A CheckpointManager saving steps start, start+1, ... (``seq_state(step)``); the
    marker gets each step known to be committed (async: a step is committed once the next
    save has returned, since a save first waits for the one in flight)."""
    killer = Killer(kill_at, marker)
    mgr = shardsafe.CheckpointManager(folder, interval=1, keep_last=keep_last, async_mode=async_mode,
                                      checkpointer=_checkpointer(killer))
    step = start
    while True:
        state = seq_state(step)
        mgr.save(step, state)
        if async_mode == "disabled":
            _mark(marker, step)
            killer.arm()
        elif step > start:
            _mark(marker, step - 1)
            killer.arm()
        step += 1


def dist_save_loop(path: str, marker: str, start: int, rank: int, world: int, init_file: str,
                   kill_at: float | None = None) -> None:
    """Rank ``rank`` of a ``world``-rank gloo job saving ``dist_state(n)`` over ``path`` for
    n = start, start+1, ...; rank 0 marks each committed n."""
    import datetime

    import torch.distributed as dist

    from .common import dist_state

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    killer = Killer(kill_at, marker)
    cp = _checkpointer(killer)
    n = start
    while True:
        cp.save(dist_state(n, rank), path, overwrite=True)
        if rank == 0:
            _mark(marker, n)
        killer.arm()
        n += 1


def rlimit_save(path: str, result: str, limit: int, seq: int, how: str) -> None:
    """Save ``seq_state(seq)`` over ``path`` under RLIMIT_FSIZE = ``limit`` bytes (writes
    past it fail with EFBIG: Python ignores SIGXFSZ); write what happened to ``result``
    as JSON: the error's class and errno, and the threads and descriptors left over."""
    import resource

    from .common import LeakCheck, temp_siblings

    leak = LeakCheck()
    out: dict[str, Any] = {}
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        if how == "async":
            cp = shardsafe.Checkpointer()
            try:
                cp.async_save(seq_state(seq), path, overwrite=True).result(timeout=60)
            finally:
                try:
                    cp.close()
                except Exception:  # noqa: BLE001 - the error was seen on result()
                    pass
        else:
            shardsafe.save(seq_state(seq), path, overwrite=True)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - reported
        out.update(error=type(exc).__name__, errno=getattr(exc, "errno", None), message=str(exc)[:300],
                   checkpoint_error=isinstance(exc, shardsafe.CheckpointError))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    out["leaks"] = leak.leaks()
    out["temp"] = temp_siblings(path)
    with open(result, "w") as f:
        json.dump(out, f)


def concurrent_loop(role: str, path: str, result: str, seconds: float, seed: int) -> None:
    """For the concurrency section: ``role`` "saver" overwrites ``path`` with seq states
    (seed, seed+2, ...) for ``seconds``; "loader" / "full" loads it in place / with
    load_full as often as it can and records each outcome (see faults.concurrency)."""
    from .concurrency import worker_loop

    worker_loop(role, path, result, seconds, seed)


TARGETS = {"save_loop": save_loop, "manager_loop": manager_loop, "dist_save_loop": dist_save_loop,
           "rlimit_save": rlimit_save, "concurrent_loop": concurrent_loop}


def main() -> None:
    torch.set_num_threads(1)
    print("up", flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "wait":
            _, status = os.waitpid(cmd["pid"], 0)
            print(status, flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                TARGETS[cmd["target"]](**cmd["args"])
            except BaseException:  # noqa: BLE001 - the parent reads stderr
                traceback.print_exc()
                code = 3
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
