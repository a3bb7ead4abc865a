"""Pause the cyclic garbage collector while building many small objects.

Parsing a manifest with 100k chunks or planning 100k tensors allocates millions of
tuples and dataclasses, none of them cyclic garbage; each automatic GC pass would walk
all of them again, making the work grow faster than linearly."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """Disable automatic GC inside the block (restored afterwards, even on errors)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
