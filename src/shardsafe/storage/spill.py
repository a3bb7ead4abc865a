"""Read each remote byte once: a spill of the byte ranges a load needs, in memory or on disk.

A verified load reads the blocks it checks before any byte lands, then reads them again to
land them (a failed load must leave the destination untouched). On a local disk the second
read is served by the page cache; on an object store it would fetch every byte twice. A
:class:`SpilledHandle` wraps the handle of a remote file: :func:`prefetch` fetches the
ranges a load needs (merged when close, several requests at once) and every later read of
a range it holds is served locally. Each request goes either into host memory leased
from the load's budget (``memory_room`` bytes of it at most: verify and land then read
memory, and a fetched range can be handed to ``on_fetched`` on the fetch thread) or, when
the room is spent, into an anonymous local temporary file (a few MiB of memory per
request). The temporary file is unlinked from the start, so nothing is left behind, even
by a killed process; the leases go back to the budget on :meth:`SpilledHandle.forget` and
:meth:`SpilledHandle.close`.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Callable, Sequence

from .. import workers
from ..budget import HostMemory, Lease
from ..errors import StorageError
from ..knobs import SPILL_MERGE_GAP as MERGE_GAP
from ..knobs import SPILL_PIECE as PIECE
from ..knobs import SPILL_REQUEST_BYTES as REQUEST_BYTES
from .base import ReadHandle
from .hugepages import huge_buffer
from .memcopy import copy_bytes


def merge_ranges(ranges: Sequence[tuple[int, int]], gap: int = MERGE_GAP,
                 limit: int = REQUEST_BYTES) -> list[tuple[int, int]]:
    """Sorted, merged ``[lo, hi)`` ranges (neighbours closer than ``gap`` joined), then cut
    into requests of at most ``limit`` bytes."""
    merged: list[list[int]] = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if merged and lo <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    out: list[tuple[int, int]] = []
    for lo, hi in merged:
        while hi - lo > limit:
            out.append((lo, lo + limit))
            lo += limit
        out.append((lo, hi))
    return out


def _locate(views: list[memoryview], at: int) -> tuple[int, int]:
    """The buffer holding byte ``at`` of ``views`` laid end to end, and the offset in it."""
    for i, v in enumerate(views):
        if at < len(v):
            return i, at
        at -= len(v)
    raise IndexError(at)


Fetched = Callable[[int, int, memoryview], None]  # (lo, hi, the bytes) of a range fetched into memory


class SpilledHandle(ReadHandle):
    """A remote file whose prefetched ranges are read from host memory or a local temporary file."""

    def __init__(self, remote: ReadHandle, spill_dir: str | None = None) -> None:
        self.remote = remote
        self.name = remote.name
        self.size = remote.size
        self._spill_dir = spill_dir
        self._file: object | None = None  # the temporary file, made on the first range spilled to disk
        self._fd = -1
        self._held: list[tuple[int, int]] = []  # sorted, disjoint ranges spilled to disk
        self._mem: list[tuple[int, int, memoryview]] = []  # ranges held in memory: [lo, hi) and their bytes
        self._leases: list[Lease] = []
        self._lock = threading.Lock()
        self.fetched = 0  # bytes fetched from the remote file
        self.in_memory = 0  # of which into memory

    def _disk(self) -> int:
        """The spill file's descriptor (the file is made, unlinked, on first use)."""
        with self._lock:
            if self._file is None:
                self._file = tempfile.TemporaryFile(prefix="shardsafe-spill-", dir=self._spill_dir)
                self._fd = self._file.fileno()  # type: ignore[attr-defined]
            return self._fd

    def _holds(self, lo: int, hi: int) -> bool:
        with self._lock:
            return any(a <= lo and hi <= b for a, b in self._held)

    def view(self, lo: int, hi: int) -> memoryview | None:
        """The bytes ``[lo, hi)`` when a range held in memory covers them (no copy), else None."""
        for a, b, buf in self._mem:
            if a <= lo and hi <= b:
                return buf[lo - a: hi - a]
        return None

    def hold(self, lo: int, hi: int, lease: Lease) -> None:
        """Keep ``[lo, hi)`` in ``lease`` (at least ``hi - lo`` bytes) when it is fetched;
        the lease is released with the spill."""
        with self._lock:
            self._leases.append(lease)
            self._mem.append((lo, hi, memoryview(lease.tensor.numpy())[: hi - lo]))

    def _add(self, lo: int, hi: int) -> None:
        with self._lock:
            ranges = sorted([*self._held, (lo, hi)])
            out: list[tuple[int, int]] = []
            for a, b in ranges:
                if out and a <= out[-1][1]:
                    out[-1] = (out[-1][0], max(out[-1][1], b))
                else:
                    out.append((a, b))
            self._held = out

    def fetch(self, lo: int, hi: int, on_fetched: Fetched | None = None) -> None:
        """Fetch bytes ``[lo, hi)`` of the remote file: into the memory that :meth:`hold`
        set aside for them (then ``on_fetched(lo, hi, bytes)``, on this thread), else into
        the spill file."""
        mem = self.view(lo, hi)
        if mem is not None:
            self.remote.read_into([mem], lo)
            with self._lock:
                self.fetched += hi - lo
                self.in_memory += hi - lo
            if on_fetched is not None:
                on_fetched(lo, hi, mem)
            return

        def sink(piece: memoryview, offset: int) -> None:
            view = piece.cast("B") if piece.format != "B" else piece
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)

        try:
            fd = self._disk()
            self.remote.stream_to(lo, hi, sink, PIECE)
        except StorageError:
            raise  # the remote read failed: its own error names the object and the cause
        except OSError as exc:  # writing the spill failed
            raise StorageError(f"cannot spill {self.name} to local disk: {exc.strerror or exc}", exc.errno or 0,
                               self.name) from exc
        with self._lock:
            self.fetched += hi - lo
        self._add(lo, hi)

    def _pieces(self, lo: int, hi: int) -> list[tuple[memoryview | None, int, int]] | None:
        """``[lo, hi)`` as consecutive pieces held here: (its bytes in memory, or None for
        the spill file, start, end); None when some byte is not held."""
        with self._lock:
            mem, held = list(self._mem), list(self._held)
        out: list[tuple[memoryview | None, int, int]] = []
        pos = lo
        while pos < hi:
            found = next(((buf[pos - a: min(b, hi) - a], min(b, hi)) for a, b, buf in mem if a <= pos < b), None)
            if found is None:
                found = next(((None, min(b, hi)) for a, b in held if a <= pos < b), None)
            if found is None:
                return None
            out.append((found[0], pos, found[1]))
            pos = found[1]
        return out

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Served from memory and the spill file when they hold the whole range, else from the remote file."""
        total = sum(len(b) for b in buffers)
        if not total:
            return
        pieces = self._pieces(offset, offset + total)
        if pieces is None:
            self.remote.read_into(buffers, offset)
            with self._lock:
                self.fetched += total
            return
        views = [b.cast("B") if (b.format != "B" or b.ndim != 1) else b for b in buffers]
        at = 0  # bytes of the range placed so far
        for mem, lo, hi in pieces:
            pos = lo
            while pos < hi:
                i, skip = _locate(views, pos - offset)
                view = views[i][skip: skip + hi - pos]
                if mem is not None:
                    copy_bytes(view, mem[pos - lo: pos - lo + len(view)])
                else:
                    n = os.preadv(self._fd, [view], pos)
                    if n <= 0:
                        raise StorageError(f"cannot read back the spill of {self.name}", 0, self.name)
                    view = view[:n]
                pos += len(view)
                at += len(view)
        assert at == total

    def forget(self) -> None:
        """Drop the spilled ranges: their disk space is freed, their memory given back to the budget."""
        with self._lock:
            self._held = []
            self._mem = []
            leases, self._leases = self._leases, []
            if self._file is not None:
                os.ftruncate(self._fd, 0)
        for lease in leases:
            lease.release()

    def close(self) -> None:
        try:
            self.forget()
        finally:
            self.remote.close()
            if self._file is not None:
                self._file.close()  # type: ignore[attr-defined]


def prefetch(handles: dict[int, SpilledHandle], ranges: dict[int, list[tuple[int, int]]], threads: int,
             memory: HostMemory | None = None, memory_room: int = 0, headroom: int = 0,
             on_fetched: Callable[[int], Fetched | None] | None = None) -> int:
    """Fetch ``ranges`` (per file index) into the handles' spills on ``threads`` threads
    (merged, then cut into requests), into memory leased from ``memory`` as far as
    ``memory_room`` bytes go (:func:`_place`), the rest to disk. ``on_fetched(file)``: the
    callback of each request fetched into memory. Returns the bytes fetched."""
    jobs = [(f, lo, hi) for f, rs in ranges.items() for lo, hi in merge_ranges(rs)]
    jobs.sort(key=lambda j: -(j[2] - j[1]))
    if not jobs:
        return 0
    if memory is not None:
        jobs = _place(handles, jobs, memory, memory_room, headroom)
    calls = {f: (on_fetched(f) if on_fetched is not None else None) for f in ranges}
    if threads <= 1 or len(jobs) == 1:
        for f, lo, hi in jobs:
            handles[f].fetch(lo, hi, calls[f])
    else:
        with workers.pool(min(threads, len(jobs)), "fetch") as pool:
            for fut in [pool.submit(handles[f].fetch, lo, hi, calls[f]) for f, lo, hi in jobs]:
                fut.result()
    return sum(hi - lo for _, lo, hi in jobs)


def _place(handles: dict[int, SpilledHandle], jobs: list[tuple[int, int, int]], memory: HostMemory, room: int,
           headroom: int) -> list[tuple[int, int, int]]:
    """Set memory aside for requests (largest first): all of them when they fit ``room``
    bytes, else ``room - headroom`` bytes' worth (``headroom``: for the reader's buffers of
    what is read from disk), the request that crosses the limit split in two. Returns the
    requests to make (memory leases are counted at once: they never block a reader).
    Buffers the budget keeps for reuse (a save's parts) count against ``room``; they are
    freed when the requests would not fit beside them."""
    total = sum(hi - lo for _, lo, hi in jobs)
    if memory.limit is not None and memory.kept_bytes:
        if total > room - memory.kept_bytes:
            memory.trim()
        else:
            room -= memory.kept_bytes
    if total > room:
        room -= headroom
    out: list[tuple[int, int, int]] = []
    for f, lo, hi in jobs:
        take = min(hi - lo, max(room, 0))
        if take > 0:
            handles[f].hold(lo, lo + take, memory.lease(take, wait=False, alloc=huge_buffer))
            room -= take
            out.append((f, lo, lo + take))
        if lo + take < hi:
            out.append((f, lo + take, hi))
    return out
