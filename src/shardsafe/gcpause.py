"""Pause the cyclic garbage collector while building many small objects.

Parsing a manifest with 100k chunks or planning 100k tensors allocates millions of
tuples and dataclasses, none of them cyclic garbage; each automatic GC pass would walk
all of them again, making the work grow faster than linearly."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic GC inside the block (restored afterwards, even on errors).

    Only on the main thread: the switch is process-wide, and a background thread (an
    async save's commit) must not turn off collection for the training loop."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
