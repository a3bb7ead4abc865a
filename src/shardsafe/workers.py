"""The one place shardsafe creates threads: worker pools and long-lived worker threads.

Every pool and thread is named ``shardsafe-<job>`` (so a leftover is easy to spot, and
the exit handlers can tell ours from the user's), is a daemon where it outlives a call,
and has its size bounded by the caller from :mod:`shardsafe.knobs`. Pools are context
managers: leaving the ``with`` joins their threads.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PREFIX = "shardsafe-"


def pool(threads: int, job: str) -> ThreadPoolExecutor:
    """A pool of at most ``threads`` (at least 1) threads named ``shardsafe-<job>_<n>``."""
    return ThreadPoolExecutor(max(1, threads), thread_name_prefix=PREFIX + job)


def new_thread(target: Callable[..., Any], job: str, *args: Any) -> threading.Thread:
    """A daemon thread named ``shardsafe-<job>`` that will run ``target(*args)``, not yet
    started (for a caller that must record it before it runs); the caller joins it (a
    daemon only so that a crash elsewhere cannot hang the exit)."""
    return threading.Thread(target=target, args=args, name=PREFIX + job, daemon=True)


def start_thread(target: Callable[..., Any], job: str, *args: Any) -> threading.Thread:
    """:func:`new_thread`, started."""
    thread = new_thread(target, job, *args)
    thread.start()
    return thread
