"""The end of a job in an order torch tolerates: at interpreter exit, let torch's gloo
worker threads finish before finalization; before the user's ``destroy_process_group()``,
let the async saves in flight finish their commits.

A ``ProcessGroupGloo`` worker thread (``pt_gloo_runloop``) destroys each collective's
work object after the collective completes, on its own thread, and that can drop the
last reference to a tensor whose Python object must then be freed under the GIL. When the
main thread reaches interpreter finalization first, the worker's GIL request ends the
thread inside a C++ destructor and the process aborts ("terminate called without an
active exception", SIGABRT; at times SIGSEGV or SIGBUS in faulthandler). FSDP2's
full-state-dict gather followed by ``destroy_process_group()`` and exit shows it without
any shardsafe object (faults/exit_stress.py, variant ``torch-only-gather``); it is
pytorch/pytorch#190489 (the atexit fix of pytorch/pytorch#179291 was abandoned).

:func:`settle_gloo_workers` runs from shardsafe's atexit handler, while the interpreter is
whole: it releases the GIL in short sleeps until every gloo worker thread is parked on its
work queue for two checks in a row (a worker waiting for the GIL, or on a peer inside a
collective, is not parked: it is given the time to finish), bounded by a deadline. Linux
only (thread syscalls from ``/proc``; elsewhere it returns at once).
"""

from __future__ import annotations

import functools
import os
import platform
import time
from collections.abc import Callable
from typing import Any

GLOO_WORKER = "pt_gloo_runloop"
TASKS = "/proc/self/task"
FUTEX = {"x86_64": "202", "aarch64": "98"}.get(platform.machine())  # futex(2)
NO_TIMEOUT = "0x0"


def _worker_idle() -> list[bool]:
    """For each gloo worker thread of this process: is it parked on its work queue?

    Parked is an untimed futex wait (``workProduceCV_.wait``: syscall 202 with no timeout),
    read from ``/proc/self/task/<tid>/syscall``. A worker running, waiting for the GIL (a
    timed futex wait) or waiting on a peer inside a collective (timed) is not parked. Where
    the syscall file cannot be read (or the machine's futex number is not known), a sleeping
    thread ("S") counts as parked."""
    idle = []
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return idle
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/comm") as f:
                if f.read().strip() != GLOO_WORKER:
                    continue
            idle.append(_parked(tid))
        except (OSError, IndexError):
            continue  # the thread ended meanwhile
    return idle


def _parked(tid: str) -> bool:
    """One worker's test (see :func:`_worker_idle`)."""
    if FUTEX is not None:
        try:
            with open(f"{TASKS}/{tid}/syscall") as f:
                call = f.read().split()
            return len(call) > 4 and call[0] == FUTEX and call[4] == NO_TIMEOUT
        except PermissionError:
            pass
    with open(f"{TASKS}/{tid}/stat") as f:
        return f.read().rpartition(")")[2].split()[0] == "S"


def settle_gloo_workers(timeout: float = 2.0, pause: float = 0.005) -> bool:
    """Sleep (GIL released) until every gloo worker thread has been parked on its work queue
    for two checks ``pause`` apart, or ``timeout`` passes. True when settled or when there
    is no gloo worker; False at the deadline."""
    if not _worker_idle():
        return True
    deadline = time.monotonic() + timeout
    calm = 0
    while time.monotonic() < deadline:
        time.sleep(pause)
        if all(_worker_idle()):
            calm += 1
            if calm >= 2:
                return True
        else:
            calm = 0
    return False


_GUARDED: dict[str, Any] = {}


def guard_destroy(drain: Callable[[], None]) -> None:
    """Make ``torch.distributed.destroy_process_group()`` of every group (no argument, or
    the default group) call ``drain()`` first, then do what it always does. shardsafe's
    async saves commit with collectives on dedicated gloo groups that this call destroys,
    so a save still in flight when the user tears the groups down would fail half-way, on
    some ranks and not others; ``drain`` waits for those commits. Installed once (the
    first time an async save makes a dedicated group), on the module attribute, so code
    that bound the function before then (``from torch.distributed import
    destroy_process_group`` at import) calls torch's own. Calls naming another group pass
    straight through."""
    if "original" in _GUARDED:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    original = c10d.destroy_process_group

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        if group is None or group is c10d.GroupMember.WORLD:
            drain()
        return original(group)

    _GUARDED["original"] = original
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
