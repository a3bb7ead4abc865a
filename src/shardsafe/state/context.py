"""The process group of the save or load in progress, for Statefuls that need it.

A save or load sets it (on the calling thread) while it asks Statefuls for their
``state_dict()`` and calls their ``load_state_dict``; :class:`~shardsafe.TrainState` reads
it, so it saves and restores the RNG streams of the group the checkpoint is taken on,
not of the default group.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch.distributed as dist

_ACTIVE: ContextVar[tuple[Any, int, int] | None] = ContextVar("shardsafe_active_group", default=None)


@contextmanager
def active_group(group: Any, rank: int, world: int) -> Iterator[None]:
    """Make (group, rank, world) the active one inside the block."""
    token = _ACTIVE.set((group, rank, world))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def current_rank_world() -> tuple[int, int]:
    """(rank, world size) of the active save or load's group; outside one, of the default
    process group (0, 1 without one)."""
    active = _ACTIVE.get()
    if active is not None:
        return active[1], active[2]
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1
