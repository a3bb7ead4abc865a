"""Reading compressed chunks (format 3.2) through their logical byte ranges.

A file index gives each compressed chunk a logical byte range beyond the file's real
bytes (format/zindex.py). :class:`ZHandle` wraps a data file's handle: reads below
``LOGICAL_BASE`` go to the file unchanged; a read of logical bytes reads the stored
blocks that hold them (each block once: a small per-thread cache keeps the last blocks
decompressed, so the rows of a box that share a block cost one read), decompresses each
with its declared length as the bound, and checks it against its block checksum before
any byte of it is handed out. A block that does not decompress to its declared length,
or whose checksum differs, is a CorruptCheckpointError naming the file and tensor.

A load reads each block twice (the verify pass, then landing): :class:`BlockCache`, one
per load shared by its files' handles, keeps verified blocks (up to ``knobs.ZIP_CACHE``
bytes, and only while the memory budget has room) so landing does not decompress them
again. It fills in reading order and never evicts (a sequential pass over more than it
holds would evict every block before its second use under LRU); what does not fit is
decompressed again.

Reading and decompressing overlap: :meth:`ZHandle.fetch` reads the stored blocks of a
logical range into one leased buffer (a :class:`Fetched`) on one thread while another
thread decompresses the blocks fetched before (``with handle.using(fetched):``
``read_into`` then takes their stored bytes from it instead of reading them). The
reader's verify pass fetches each window while the previous one is decompressed.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager

from .. import knobs
from ..errors import CorruptCheckpointError
from ..format.checksum import checksum
from ..format.codecs import CodecError, decompress_into
from ..format.zindex import LOGICAL_BASE, ZRow, stored_key
from ..storage.base import ReadHandle
from ..storage.memcopy import copy_bytes
from ..workers import pool
from .memory import HostMemory, Lease

CACHED_BLOCKS = 2  # decompressed blocks each reading thread keeps

_Key = tuple[int, int, int]  # (the handle's id, its row's logical start, block)


class BlockCache:
    """Verified decompressed blocks of one load, shared by its files (see the module doc)."""

    def __init__(self, memory: Callable[[], HostMemory | None], capacity: int | None = None) -> None:
        self.capacity = knobs.ZIP_CACHE if capacity is None else capacity
        self._memory = memory
        self._lock = threading.Lock()
        self._blocks: dict[_Key, tuple[memoryview, Lease | None]] = {}
        self.held = 0
        self.hits = 0

    def get(self, key: _Key) -> memoryview | None:
        """The block under ``key`` when it is kept."""
        with self._lock:
            got = self._blocks.get(key)
            if got is None:
                return None
            self.hits += 1
            return got[0]

    def reserve(self, n: int) -> tuple[memoryview, Lease | None] | None:
        """Room for a block of ``n`` bytes to be decompressed straight into, counted as kept
        (``put`` it once verified, else ``unreserve`` it); None when the capacity or the
        budget has no room."""
        memory = self._memory()
        with self._lock:
            if self.held + n > self.capacity:
                return None
            if memory is not None and memory.limit is not None and memory.in_use + n > memory.limit:
                return None
            self.held += n
        if memory is None:
            return memoryview(bytearray(n)), None
        lease = memory.lease(n, wait=False)
        return memoryview(lease.tensor.numpy())[:n], lease

    def put(self, key: _Key, view: memoryview, lease: Lease | None) -> memoryview:
        """Keep a reserved, verified block; returns the kept view (another thread's, when it
        kept the same block first: then this one is given back)."""
        with self._lock:
            got = self._blocks.get(key)
            if got is None:
                self._blocks[key] = (view, lease)
                return view
        self.unreserve(view, lease)
        return got[0]

    def unreserve(self, view: memoryview, lease: Lease | None) -> None:
        """Give back a reservation that was not kept."""
        with self._lock:
            self.held -= len(view)
        if lease is not None:
            lease.release()

    def close(self) -> None:
        """Release every kept block."""
        with self._lock:
            blocks, self._blocks, self.held = list(self._blocks.values()), {}, 0
        for _, lease in blocks:
            if lease is not None:
                lease.release()


class Fetched:
    """The stored bytes of some blocks of one file, read ahead in one leased buffer:
    ``blocks`` maps (row's logical start, block) to its stored bytes."""

    def __init__(self, blocks: dict[tuple[int, int], memoryview], lease: Lease | None,
                 release: Callable[[Lease | None], None]) -> None:
        self.blocks = blocks
        self._lease = lease
        self._release = release

    def release(self) -> None:
        """Give the buffer back (its blocks may no longer be used)."""
        lease, self._lease, self.blocks = self._lease, None, {}
        self._release(lease)


class ZHandle(ReadHandle):
    """A data file's handle that also answers reads of its compressed chunks' logical
    ranges. ``rows()`` returns the file's compressed chunks (sorted by stored start);
    ``where`` names the file in errors; ``block``: the checksum block size."""

    def __init__(self, inner: ReadHandle, rows: Callable[[], list[ZRow]], block: int, where: str,
                 memory: Callable[[], HostMemory | None] = lambda: None, shared: BlockCache | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.size = inner.size
        self._rows_of = rows
        self._rows: list[ZRow] = []
        self._starts: list[int] = []
        self.block = block
        self.where = where
        self._local = threading.local()
        self._lock = threading.Lock()
        self.stored_read = 0  # stored bytes read for logical reads (tests, tools)
        self._memory = memory  # the budget the block buffers are leased from (None: plain buffers)
        self._leases: set[Lease] = set()  # every lease the threads' caches hold (released by close)
        self._shared = shared  # the load's verified blocks, kept across its passes

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        if offset < LOGICAL_BASE:
            self.inner.read_into(buffers, offset)
            return
        pos = offset
        for buf in buffers:
            done, n = 0, len(buf)
            while done < n:
                row = self._row(pos)
                b = row.block_at(pos, self.block)
                data = self._block(row, b)
                within = pos - (row.logical + b * self.block)
                take = min(len(data) - within, n - done)
                copy_bytes(buf[done: done + take], data[within: within + take])
                done += take
                pos += take

    def fetch(self, ranges: list[tuple[int, int]]) -> Fetched:
        """Read the stored bytes of every block that the logical byte ranges touch into one
        buffer leased from the budget (one read per run of back-to-back stored bytes);
        nothing is decompressed yet. Raises what the file's reads raise."""
        spans = []  # (row, first block, last block + 1)
        for lo, hi in ranges:
            pos = lo
            while pos < hi:
                row = self._row(pos)
                end = min(hi, row.logical + row.raw)
                spans.append((row, row.block_at(pos, self.block), row.block_at(end - 1, self.block) + 1))
                pos = end
        total = sum(row.offset(b1) - row.offset(b0) for row, b0, b1 in spans)
        buf, lease = self._buffer(total)
        blocks: dict[tuple[int, int], memoryview] = {}
        try:
            at = 0
            runs: list[tuple[int, int, int]] = []  # (file offset, buffer offset, bytes)
            for row, b0, b1 in spans:
                first, n = row.offset(b0), row.offset(b1) - row.offset(b0)
                if runs and runs[-1][0] + runs[-1][2] == row.start + first:
                    runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + n)
                elif n:
                    runs.append((row.start + first, at, n))
                for b in range(b0, b1):
                    blocks[(row.logical, b)] = buf[at + row.offset(b) - first: at + row.offset(b + 1) - first]
                at += n
            for offset, into, n in runs:
                self.inner.read_into([buf[into: into + n]], offset)
            with self._lock:
                self.stored_read += total
        except BaseException:
            self._drop(lease)
            raise
        return Fetched(blocks, lease, self._drop)

    @contextmanager
    def using(self, fetched: Fetched | None) -> Iterator[None]:
        """Within: this thread's reads of the blocks ``fetched`` holds take their stored bytes
        from it (checked and decompressed as any read's)."""
        self._local.fetched = fetched
        try:
            yield
        finally:
            self._local.fetched = None

    def _row(self, logical: int) -> ZRow:
        for attempt in range(2):
            i = bisect.bisect_right(self._starts, stored_key(logical)) - 1
            if i >= 0:
                row = self._rows[i]
                if row.logical <= logical < row.logical + row.raw:
                    return row
            if attempt == 0:
                with self._lock:
                    self._rows = self._rows_of()
                    self._starts = [r.start for r in self._rows]
        raise CorruptCheckpointError(f"{self.where}: logical byte {logical} is in no compressed chunk the index lists")

    def _block(self, row: ZRow, b: int) -> memoryview:
        """Block ``b`` of ``row``, decompressed and verified (from this thread's cache)."""
        cache: list[tuple[tuple[int, int], memoryview, Lease | None]] = getattr(self._local, "cache", None) or []
        self._local.cache = cache
        key = (row.logical, b)
        for k, view, _ in cache:
            if k == key:
                return view
        if self._shared is not None:
            kept = self._shared.get((id(self), *key))
            if kept is not None:
                return kept
        lo = row.start + row.offset(b)
        n = row.lengths[b]
        raw = min(self.block, row.raw - b * self.block)
        fetched = getattr(self._local, "fetched", None)
        ahead = None if fetched is None else fetched.blocks.get(key)
        stored, stored_lease = (ahead, None) if ahead is not None else self._buffer(n)
        try:
            if ahead is None:
                if n:
                    self.inner.read_into([stored], lo)
                with self._lock:
                    self.stored_read += n
            slot = self._shared.reserve(raw) if self._shared is not None else None
            out, lease = slot if slot is not None else self._buffer(raw)  # kept blocks: no copy later
            what = f"{self.where}, tensor '{row.key}', stored block at bytes {lo}-{lo + n}"
            try:
                decompress_into(row.codec, stored, row.itemsize, out)
                if checksum(out) != row.sums[b]:
                    raise CorruptCheckpointError(f"checksum mismatch in {what} (decompressed): the data is corrupt")
            except BaseException as exc:
                if slot is not None and self._shared is not None:
                    self._shared.unreserve(out, lease)
                else:
                    self._drop(lease)
                if isinstance(exc, CodecError):
                    raise CorruptCheckpointError(f"{what}: {exc}: the data is corrupt") from None
                raise
        finally:
            self._drop(stored_lease)
        if slot is not None and self._shared is not None:
            out, lease = self._shared.put((id(self), *key), out, lease), None  # the cache owns it now
        cache.append((key, out, lease))
        if len(cache) > CACHED_BLOCKS:
            self._drop(cache.pop(0)[2])
        return out

    def room(self, n: int) -> bool:
        """Whether ``n`` more bytes fit the memory budget now (always without a limit)."""
        memory = self._memory()
        return memory is None or memory.limit is None or memory.in_use + n <= memory.limit

    def _buffer(self, n: int) -> tuple[memoryview, Lease | None]:
        """``n`` bytes leased from the budget (counted at once: a reading thread holds at
        most a few blocks), or plain memory without a budget."""
        memory = self._memory()
        if memory is None:
            return memoryview(bytearray(n)), None
        lease = memory.lease(n, keep=True, wait=False)
        with self._lock:
            self._leases.add(lease)
        return memoryview(lease.tensor.numpy())[:n], lease

    def _drop(self, lease: Lease | None) -> None:
        if lease is not None:
            with self._lock:
                self._leases.discard(lease)
            lease.release()

    def stored_ranges(self, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """The stored byte ranges that logical/real ``ranges`` read (remote prefetch)."""
        out = []
        for lo, hi in ranges:
            if lo < LOGICAL_BASE:
                out.append((lo, hi))
                continue
            pos = lo
            while pos < hi:
                row = self._row(pos)
                b0 = row.block_at(pos, self.block)
                end = min(hi, row.logical + row.raw)
                b1 = row.block_at(end - 1, self.block)
                out.append((row.start + row.offset(b0), row.start + row.offset(b1 + 1)))
                pos = end
        return out

    def close(self) -> None:
        with self._lock:
            leases, self._leases = list(self._leases), set()
        for lease in leases:
            lease.release()
        self.inner.close()


class ReadAhead:
    """Reads windows ``(file, lo, hi)`` in order (:meth:`read_into` window ``i``, then
    ``i + 1``...), overlapping the reads of compressed windows' stored blocks with the
    decompression of the windows before them: a helper thread reads the next windows, one
    after another, up to ``ahead`` bytes (``knobs.ZIP_AHEAD``) and only while the memory
    budget has room (their buffers are leased from it), so the storage is kept busy while
    this thread decompresses. ``units``: how many consecutive windows are fetched in one
    read (their stored bytes are back to back: small chunks); default one each. Windows of
    real bytes are read as they come. ``handle``: a file's handle."""

    def __init__(self, handle: Callable[[int], ReadHandle], windows: list[tuple[int, int, int]],
                 ahead: int | None = None, units: list[int] | None = None) -> None:
        self.handle = handle
        self.windows = windows
        self.ahead = knobs.ZIP_AHEAD if ahead is None else ahead
        self.units: list[tuple[int, int]] = []  # window ranges [a, b) fetched together
        for n in units if units is not None else [1] * len(windows):
            start = self.units[-1][1] if self.units else 0
            self.units.append((start, start + n))
        self.unit_of = [u for u, (a, b) in enumerate(self.units) for _ in range(a, b)]
        zipped = sum(lo >= LOGICAL_BASE and hi > lo for _, lo, hi in windows)
        self.helper = pool(1, "read-ahead") if zipped > 1 and self.ahead > 0 else None
        self.pending: dict[int, Future[Fetched]] = {}
        self.current: tuple[int, Fetched] | None = None  # the unit being decompressed
        self.started = 0  # units [0, started) were considered for fetching
        self.held = 0  # raw bytes of the pending units

    def _size(self, u: int) -> int:
        a, b = self.units[u]
        return sum(hi - lo for _, lo, hi in self.windows[a:b])

    def _start(self, u: int) -> None:
        """Start fetching units from ``u`` on (the compressed ones), up to ``ahead`` bytes
        beyond unit ``u``, the budget permitting."""
        if self.helper is None:
            return
        self.started = max(self.started, u)
        while self.started < len(self.units):
            a, b = self.units[self.started]
            f, lo, hi = self.windows[a]
            n = self._size(self.started)
            if self.started > u and self.held + n > self.ahead:
                return
            handle = self.handle(f)
            if lo >= LOGICAL_BASE and hi > lo and isinstance(handle, ZHandle):
                if self.started > u and not handle.room(n):
                    return
                ranges = [(w_lo, w_hi) for _, w_lo, w_hi in self.windows[a:b]]
                self.pending[self.started] = self.helper.submit(handle.fetch, ranges)
                self.held += n
            self.started += 1

    def _fetched(self, u: int) -> Fetched | None:
        """Unit ``u``'s stored bytes when they are read ahead (waits for them), else None."""
        if self.current is not None and self.current[0] == u:
            return self.current[1]
        if u not in self.pending:
            self._start(u)
        future = self.pending.pop(u, None)
        if future is None:
            return None
        self.held -= self._size(u)
        fetched = future.result()  # (a failed read raises here)
        self.current = (u, fetched)
        self._start(u + 1)  # the next units are read while this one is decompressed
        return fetched

    def read_into(self, i: int, view: memoryview) -> None:
        """Window ``i``'s bytes into ``view`` (its length), decompressed and block-checked
        when compressed; raises what a read of them would."""
        f, lo, _ = self.windows[i]
        handle = self.handle(f)
        u = self.unit_of[i]
        try:
            fetched = self._fetched(u)
            if fetched is None:
                handle.read_into([view], lo)
                return
            assert isinstance(handle, ZHandle)
            with handle.using(fetched):
                handle.read_into([view], lo)
        finally:
            if self.current is not None and (self.current[0] != u or i == self.units[u][1] - 1):
                self.current[1].release()  # the unit's last window (or a unit left by an error)
                self.current = None

    def close(self) -> None:
        """Wait for the reads still running and give their buffers back."""
        if self.current is not None:
            self.current[1].release()
            self.current = None
        if self.helper is None:
            return
        for future in self.pending.values():
            if future.exception() is None:
                future.result().release()
        self.pending.clear()
        self.helper.shutdown(wait=True)


__all__ = ["BlockCache", "Fetched", "ReadAhead", "ZHandle"]
