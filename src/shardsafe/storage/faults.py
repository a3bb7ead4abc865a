"""A fault-injecting backend: wraps another backend and fails (or slows, or blocks) chosen
operations, so tests and the fault campaign exercise failure paths through the storage
seam instead of patching module attributes.

Operations, as named in :class:`Fault` and counted in ``FaultyBackend.calls``: ``create``,
``write``, ``finish`` (fsync + close), ``open_read``, ``read``, ``remove``,
``remove_tree``, ``rename``, ``exchange``, ``sync``, ``lock``, ``open_folder``.

It also throttles: ``throttle_write_bps`` / ``throttle_read_bps`` cap the bytes per second
that all the backend's writes (or reads) move together, whatever the number of threads:
a slow disk or a slow link in front of a fast one (see :class:`Throttle`).
"""

from __future__ import annotations

import errno as errno_mod
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .base import Backend, Entry, Folder, ReadHandle, StorageError, WriteHandle
from .commit import IN_PLACE, Commit, Lock, Renaming
from .local import LocalBackend, storage_error

if TYPE_CHECKING:
    from ..budget import HostMemory


class Throttle:
    """A token bucket of ``rate`` bytes/s holding at most ``burst`` bytes (default 0: strict
    pacing), shared by every thread that passes bytes through it. :meth:`reserve` books
    ``n`` bytes on the link (behind the bytes booked before) and returns when they are
    through; :meth:`pace` does the operation, then waits out what is left of its booking,
    so the operation's own time overlaps the wait: the throttle is a ceiling, never added
    latency. Over any run, ``bytes`` moved take at least ``(bytes - burst) / rate``
    seconds from the first booking."""

    def __init__(self, rate: float, burst: int = 0) -> None:
        if not rate > 0:
            raise ValueError(f"a throttle needs a rate above 0 bytes/s, not {rate!r}")
        self.rate = float(rate)
        self.burst = max(0, int(burst))
        self.bytes = 0  # bytes booked so far
        self.waited = 0.0  # seconds callers slept
        self._free_at = 0.0  # when the link has sent everything booked
        self._lock = threading.Lock()

    def book(self, n: int) -> float:
        """Book ``n`` bytes; the time (``time.monotonic``) at which they are through."""
        with self._lock:
            now = time.monotonic()
            start = max(self._free_at, now - self.burst / self.rate)
            self._free_at = start + n / self.rate
            self.bytes += n
            return self._free_at

    def wait_until(self, until: float) -> None:
        delay = until - time.monotonic()
        if delay > 0:
            time.sleep(delay)
            with self._lock:
                self.waited += delay

    def pace(self, n: int, op: Callable[[], None]) -> None:
        """Run ``op`` (moving ``n`` bytes) and return no sooner than the link allows."""
        until = self.book(n) if n > 0 else 0.0
        op()
        self.wait_until(until)


@dataclass
class Fault:
    """Fail operation ``op`` with ``errno`` (as an OSError turned into a StorageError by
    the same rule the local backend uses).

    ``name``: only entries whose name contains it; ``skip``: let that many matching calls
    pass first; ``times``: fail that many times (None: every time after ``skip``);
    ``after_bytes`` (``write`` only): fail once this many bytes were written in all."""

    op: str
    errno: int = errno_mod.EIO
    name: str | None = None
    skip: int = 0
    times: int | None = None
    after_bytes: int | None = None
    seen: int = 0
    fired: int = 0


class FaultyBackend(Backend):
    """``inner`` (default: the local filesystem) with faults. ``exchange=False`` acts like a
    filesystem without atomic directory swaps; ``locks=False`` like one without flock;
    ``renames=False`` acts like an object store (no folder renames: commits publish the
    manifest in place); ``write_delay`` sleeps before each write; ``write_gate`` (an Event) blocks each write
    after the first ``gate_skip`` ones until it is set; ``hidden`` names are left out of
    folder listings (a stale listing, as NFS attribute caches give); ``on_op(op, name)``
    is called before every operation. ``throttle_write_bps`` / ``throttle_read_bps``: at
most that many bytes per second written (``write``, ``publish``) / read (``read``), all
threads and folders of this backend together (:class:`Throttle`; ``throttle_burst``
bytes may go unpaced after an idle spell); with ``throttle_cache`` a read pays only for
the bytes of its file not read through this backend before (a page cache in front of a
slow disk: a verified load reads each block twice, to hash it, then to land it;
:meth:`forget` empties it). ``written`` / ``bytes_read``: bytes that went through, for
accounting (a load's read amplification)."""

    def __init__(self, inner: Backend | None = None, faults: Iterable[Fault] = (), *, exchange: bool = True,
                 locks: bool = True, renames: bool = True, write_delay: float = 0.0,
                 write_gate: threading.Event | None = None, gate_skip: int = 0, hidden: Iterable[str] = (),
                 on_op: Callable[[str, str], None] | None = None, throttle_write_bps: float | None = None,
                 throttle_read_bps: float | None = None, throttle_burst: int = 0,
                 throttle_cache: bool = False) -> None:
        self.inner = inner if inner is not None else LocalBackend()
        self.faults = list(faults)
        self.exchange = exchange
        self.locks = locks
        self.renames = renames
        self.write_delay = write_delay
        self.write_gate = write_gate
        self.gate_skip = gate_skip
        self.hidden = set(hidden)
        self.on_op = on_op
        self.calls: Counter[str] = Counter()
        self.written = 0
        self.bytes_read = 0
        self.write_throttle = None if throttle_write_bps is None else Throttle(throttle_write_bps, throttle_burst)
        self.read_throttle = None if throttle_read_bps is None else Throttle(throttle_read_bps, throttle_burst)
        self.cache: dict[str, list[tuple[int, int]]] | None = {} if throttle_cache else None
        self._lock = threading.Lock()

    # -- the rule ---------------------------------------------------------------------
    def check(self, op: str, name: str, where: str, nbytes: int = 0) -> None:
        """Count the operation and raise when a fault says so."""
        if self.on_op is not None:
            self.on_op(op, name)
        with self._lock:
            self.calls[op] += 1
            before = self.written
            if op == "write":
                self.written += nbytes
            elif op == "read":
                self.bytes_read += nbytes
            for f in self.faults:
                if f.op != op or (f.name is not None and f.name not in name):
                    continue
                if f.after_bytes is not None and before + nbytes <= f.after_bytes:
                    continue
                f.seen += 1
                if f.seen <= f.skip or (f.times is not None and f.fired >= f.times):
                    continue
                f.fired += 1
                if op == "write":
                    self.written -= nbytes
                elif op == "read":
                    self.bytes_read -= nbytes
                exc = OSError(f.errno, os.strerror(f.errno), where)
                raise storage_error(exc, f"{op} (injected)", where) from exc

    def uncached(self, where: str, lo: int, hi: int) -> int:
        """Bytes of ``[lo, hi)`` of file ``where`` that the throttle must carry: all of them
        without ``throttle_cache``, else those not read before (now remembered)."""
        if self.cache is None:
            return hi - lo
        with self._lock:
            runs = self.cache.setdefault(where, [])
            new = hi - lo - sum(max(0, min(b, hi) - max(a, lo)) for a, b in runs)
            merged: list[tuple[int, int]] = []
            for a, b in sorted([*runs, (lo, hi)]):
                if merged and a <= merged[-1][1]:
                    merged[-1] = (merged[-1][0], max(merged[-1][1], b))
                else:
                    merged.append((a, b))
            self.cache[where] = merged
            return new

    def forget(self) -> None:
        """Empty the read cache of ``throttle_cache`` (a cold cache: a new job, or a reboot)."""
        with self._lock:
            if self.cache is not None:
                self.cache.clear()

    # -- Backend ----------------------------------------------------------------------
    def open(self, location: str, create: bool = False) -> Folder:
        return FaultyFolder(self, self.inner.open(location, create))

    def use_memory(self, memory: HostMemory) -> None:
        """The wrapped backend's buffers come from ``memory``."""
        self.inner.use_memory(memory)

    def split(self, location: str) -> tuple[str, str]:
        return self.inner.split(location)

    def exists(self, location: str) -> bool:
        return self.inner.exists(location)


def paced(throttle: Throttle | None, n: int, op: Callable[[], None]) -> None:
    """``op`` through ``throttle`` when there is one."""
    if throttle is None:
        op()
    else:
        throttle.pace(n, op)


class FaultyRead(ReadHandle):
    def __init__(self, backend: FaultyBackend, inner: ReadHandle, where: str) -> None:
        self.backend, self.inner, self.where = backend, inner, where
        self.name, self.size = inner.name, inner.size

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        b = self.backend
        n = sum(memoryview(x).nbytes for x in buffers)
        b.check("read", self.name, self.where, n)
        paid = b.uncached(self.where, offset, offset + n) if b.read_throttle is not None else n
        paced(b.read_throttle, paid, lambda: self.inner.read_into(buffers, offset))

    def close(self) -> None:
        self.inner.close()


class FaultyWrite(WriteHandle):
    def __init__(self, backend: FaultyBackend, inner: WriteHandle, where: str) -> None:
        self.backend, self.inner, self.where = backend, inner, where
        self.name = inner.name

    def write(self, buffers: Sequence[memoryview], offset: int) -> None:
        b = self.backend
        if b.write_gate is not None and b.calls["write"] >= b.gate_skip:
            b.write_gate.wait()
        if b.write_delay:
            time.sleep(b.write_delay)
        n = sum(memoryview(x).nbytes for x in buffers)
        b.check("write", self.name, self.where, n)
        paced(b.write_throttle, n, lambda: self.inner.write(buffers, offset))

    def finish(self, durable: bool = True) -> None:
        try:
            self.backend.check("finish", self.name, self.where)
        except BaseException:
            self.inner.abort()
            raise
        self.inner.finish(durable)

    def abort(self) -> None:
        self.inner.abort()


class _FaultyLock(Lock):
    def __init__(self, inner: Lock) -> None:
        self.inner = inner

    def release(self) -> None:
        self.inner.release()


class FaultyFolder(Renaming):
    def __init__(self, backend: FaultyBackend, inner: Folder) -> None:
        self.backend = backend
        self.inner = inner
        self.location = inner.location

    def _check(self, op: str, name: str) -> None:
        self.backend.check(op, name, self.where(name))

    @property
    def commit(self) -> Commit:  # type: ignore[override]
        """The inner backend's strategy; in place (an object store's) with ``renames=False``."""
        return self.inner.commit if self.backend.renames else IN_PLACE

    def stat(self, name: str) -> Entry | None:
        return self.inner.stat(name)

    def names(self) -> list[str]:
        return [n for n in self.inner.names() if n not in self.backend.hidden]

    def size(self, name: str) -> int:
        return self.inner.size(name)

    def mtime(self, name: str) -> float:
        return self.inner.mtime(name)

    def open_read(self, name: str) -> ReadHandle:
        self._check("open_read", name)
        return FaultyRead(self.backend, self.inner.open_read(name), self.where(name))

    def create(self, name: str) -> WriteHandle:
        self._check("create", name)
        return FaultyWrite(self.backend, self.inner.create(name), self.where(name))

    def remove(self, name: str) -> None:
        self._check("remove", name)
        self.inner.remove(name)

    def open_folder(self, name: str, create: bool = False) -> Folder:
        self._check("open_folder", name)
        return FaultyFolder(self.backend, self.inner.open_folder(name, create))

    def remove_tree(self, name: str) -> None:
        self._check("remove_tree", name)
        self.inner.remove_tree(name)

    def rename(self, src: str, dst: str) -> None:
        if not self.backend.renames:
            raise StorageError(f"cannot rename {self.where(src)}: this storage has no renames", errno_mod.ENOTSUP,
                               self.where(src))
        self._check("rename", f"{src}->{dst}")
        assert isinstance(self.inner, Renaming)
        self.inner.rename(src, dst)

    def publish_bytes(self, name: str, data: bytes, replace: bool) -> None:
        self._check("publish", name)
        paced(self.backend.write_throttle, len(data), lambda: self.inner.publish_bytes(name, data, replace))

    def exchange(self, a: str, b: str) -> bool:
        if not self.backend.exchange or not self.backend.renames:
            return False
        self._check("exchange", f"{a}<->{b}")
        assert isinstance(self.inner, Renaming)
        return self.inner.exchange(a, b)

    def sync(self) -> None:
        self._check("sync", "")
        self.inner.sync()

    def lock(self, name: str) -> Lock | None:
        self._check("lock", name)
        if not self.backend.locks or not self.backend.renames:
            return None
        assert isinstance(self.inner, Renaming)
        inner = self.inner.lock(name)
        return None if inner is None else _FaultyLock(inner)

    def locked(self, name: str) -> bool | None:
        if not self.backend.locks or not self.backend.renames:
            return None
        assert isinstance(self.inner, Renaming)
        return self.inner.locked(name)

    def close(self) -> None:
        self.inner.close()
