"""One per-rank host-memory budget, and the buffers it hands out.

Every byte a save or load keeps in host memory on its way (staging slots of a save,
bounce buffers of checksum verification, staging buffers of scattered reads, the part
buffers of object-store uploads) is leased from one :class:`HostMemory`. Leases block while
the budget is spent, so a save of a state larger than the budget streams through it instead
of growing. A buffer that a holder of other leases needs in order to make progress (an
upload's part, filled by a writer that holds a staging slot) is leased with ``wait=False``:
it is counted at once, even beyond the limit, and the other leases wait until it is back,
except that a waiting lease is always granted while no other waiting lease is out (a part
still being filled needs the bytes of a staging slot: it must never starve the slot).
Buffers leased with ``keep=True`` (the slots of async saves, object-store parts) are kept
after release and handed out again, so repeated saves allocate nothing new; the others are
freed on release. This module is the bottom layer (torch and errors only), so storage
backends lease from the same budget as the engine. Buffers are
pinned (page-locked) when asked and CUDA is present, which makes device-to-host copies
asynchronous.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from .errors import CheckpointError


class Lease:
    """``nbytes`` of host memory as a uint8 tensor (``tensor``), until :meth:`release`."""

    __slots__ = ("owner", "tensor", "nbytes", "keep", "waited", "_released")

    def __init__(self, owner: HostMemory, tensor: torch.Tensor, nbytes: int, keep: bool,
                 waited: bool = True) -> None:
        self.owner = owner
        self.tensor = tensor[:nbytes]
        self.nbytes = nbytes
        self.keep = keep
        self.waited = waited  # leased with wait=True (counted in HostMemory.waiting_in_use)
        self._released = False

    def release(self) -> None:
        """Return the memory to the budget (idempotent)."""
        if not self._released:
            self._released = True
            self.owner._give_back(self)


class HostMemory:
    """A budget of ``limit`` bytes (None: unbounded) of host buffers, shared by threads."""

    def __init__(self, limit: int | None = None) -> None:
        if limit is not None and limit <= 0:
            raise CheckpointError(f"memory budget must be positive, not {limit}")
        self.limit = limit
        self.in_use = 0
        self.waiting_in_use = 0  # bytes of the leases taken with wait=True
        self.peak = 0
        self.allocations = 0
        self._kept: list[torch.Tensor] = []  # released keep=True buffers, ready for reuse
        self._cond = threading.Condition()

    @property
    def kept_bytes(self) -> int:
        """Bytes of released buffers held for reuse."""
        return sum(t.numel() for t in self._kept)

    def fits(self, nbytes: int) -> int:
        """``nbytes`` capped to what one lease may take (the whole budget)."""
        return nbytes if self.limit is None else max(1, min(nbytes, self.limit))

    def lease(self, nbytes: int, *, keep: bool = False, pin: bool = False, timeout: float | None = None,
              wait: bool = True, alloc: Callable[[int], torch.Tensor | None] | None = None) -> Lease:
        """A buffer of ``nbytes`` (at most the budget), waiting while the budget is spent;
        with ``wait=False`` never waits: counted at once, even beyond the limit (for a buffer
        the caller needs to release the leases it already holds). ``alloc(nbytes)``: makes the
        buffer when neither kept nor pinned (a uint8 tensor, or None for the default), e.g. on huge pages
        (storage/hugepages.py)."""
        nbytes = max(1, nbytes)
        if self.limit is not None and nbytes > self.limit and wait:
            raise CheckpointError(f"a {nbytes}-byte buffer does not fit the {self.limit}-byte memory budget")
        with self._cond:
            if wait and not self._cond.wait_for(lambda: self._grants(nbytes), timeout):
                raise CheckpointError(f"timed out waiting for {nbytes} bytes of the memory budget")
            self.in_use += nbytes
            self.waiting_in_use += nbytes if wait else 0
            self.peak = max(self.peak, self.in_use)
            buf = self._take_kept(nbytes, pin) if keep else None
        try:
            if buf is None and alloc is not None and not keep and not pin:
                buf = alloc(nbytes)
            if buf is None:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin and torch.cuda.is_available())
                with self._cond:
                    self.allocations += 1
        except BaseException:
            with self._cond:
                self.in_use -= nbytes
                self.waiting_in_use -= nbytes if wait else 0
                self._cond.notify_all()
            raise
        return Lease(self, buf, nbytes, keep, wait)

    def _grants(self, nbytes: int) -> bool:
        """Whether a waiting lease of ``nbytes`` may go now: it fits, or only leases taken
        without waiting are out (they may need this one to be released)."""
        return self.limit is None or self.in_use + nbytes <= self.limit or self.waiting_in_use == 0

    def _take_kept(self, nbytes: int, pin: bool) -> torch.Tensor | None:
        """A kept buffer of at least ``nbytes`` (the smallest); drops kept buffers that
        would push kept + in-use memory over the budget."""
        fitting = [t for t in self._kept if t.numel() >= nbytes and (t.is_pinned() or not pin)]
        if fitting:
            best = min(fitting, key=lambda t: t.numel())
            self._kept = [t for t in self._kept if t is not best]
            return best
        if self.limit is not None:
            while self._kept and self.in_use + sum(t.numel() for t in self._kept) > self.limit:
                self._kept.pop(0)
        return None

    def _give_back(self, lease: Lease) -> None:
        with self._cond:
            self.in_use -= lease.nbytes
            self.waiting_in_use -= lease.nbytes if lease.waited else 0
            if lease.keep:
                base = lease.tensor._base if lease.tensor._base is not None else lease.tensor
                self._kept.append(base)
            self._cond.notify_all()
        lease.tensor = None  # type: ignore[assignment]

    def trim(self) -> None:
        """Free every kept buffer."""
        with self._cond:
            self._kept.clear()
