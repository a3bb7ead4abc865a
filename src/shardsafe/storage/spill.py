"""Read each remote byte once: a local spill of the byte ranges a load needs.

A verified load reads the blocks it checks before any byte lands, then reads them again to
land them (a failed load must leave the destination untouched). On a local disk the second
read is served by the page cache; on an object store it would fetch every byte twice. A
:class:`SpilledHandle` wraps the handle of a remote file: :meth:`SpilledHandle.prefetch`
streams the ranges a load needs into an anonymous local temporary file (merged when close,
several requests at once, a few MiB of memory per request), and every later read of a
range it holds is served from there. The temporary file is unlinked from the start, so
nothing is left behind, even by a killed process.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections.abc import Sequence

from .. import workers
from ..errors import StorageError
from ..knobs import SPILL_MERGE_GAP as MERGE_GAP
from ..knobs import SPILL_PIECE as PIECE
from ..knobs import SPILL_REQUEST_BYTES as REQUEST_BYTES
from .base import ReadHandle


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


class SpilledHandle(ReadHandle):
    """A remote file whose prefetched ranges are read from a local temporary file."""

    def __init__(self, remote: ReadHandle, spill_dir: str | None = None) -> None:
        self.remote = remote
        self.name = remote.name
        self.size = remote.size
        self._file = tempfile.TemporaryFile(prefix="shardsafe-spill-", dir=spill_dir)  # unlinked already
        self._fd = self._file.fileno()
        self._held: list[tuple[int, int]] = []  # sorted, disjoint ranges spilled
        self._lock = threading.Lock()
        self.fetched = 0  # bytes fetched from the remote file

    def _holds(self, lo: int, hi: int) -> bool:
        with self._lock:
            return any(a <= lo and hi <= b for a, b in self._held)

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

    def fetch(self, lo: int, hi: int) -> None:
        """Stream bytes ``[lo, hi)`` of the remote file into the spill."""
        def sink(piece: memoryview, offset: int) -> None:
            view = piece.cast("B") if piece.format != "B" else piece
            done = 0
            while done < len(view):
                done += os.pwrite(self._fd, view[done:], offset + done)

        try:
            self.remote.stream_to(lo, hi, sink, PIECE)
        except StorageError:
            raise  # the remote read failed: its own error names the object and the cause
        except OSError as exc:  # writing the spill failed
            raise StorageError(f"cannot spill {self.name} to local disk: {exc.strerror or exc}", exc.errno or 0,
                               self.name) from exc
        with self._lock:
            self.fetched += hi - lo
        self._add(lo, hi)

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Served from the spill when it holds the whole range, else from the remote file."""
        total = sum(len(b) for b in buffers)
        if not total:
            return
        if not self._holds(offset, offset + total):
            self.remote.read_into(buffers, offset)
            with self._lock:
                self.fetched += total
            return
        pos = offset
        for buf in buffers:
            view = buf.cast("B") if (buf.format != "B" or buf.ndim != 1) else buf
            done = 0
            while done < len(view):
                n = os.preadv(self._fd, [view[done:]], pos + done)
                if n <= 0:
                    raise StorageError(f"cannot read back the spill of {self.name}", 0, self.name)
                done += n
            pos += len(view)

    def forget(self) -> None:
        """Drop the spilled ranges and free their disk space."""
        with self._lock:
            self._held = []
            os.ftruncate(self._fd, 0)

    def close(self) -> None:
        self.remote.close()
        self._file.close()


def prefetch(handles: dict[int, SpilledHandle], ranges: dict[int, list[tuple[int, int]]], threads: int) -> int:
    """Fetch ``ranges`` (per file index) into the handles' spills on ``threads`` threads
    (merged and cut into requests first). Returns the bytes fetched."""
    jobs = [(f, lo, hi) for f, rs in ranges.items() for lo, hi in merge_ranges(rs)]
    jobs.sort(key=lambda j: -(j[2] - j[1]))
    if not jobs:
        return 0
    if threads <= 1 or len(jobs) == 1:
        for f, lo, hi in jobs:
            handles[f].fetch(lo, hi)
    else:
        with workers.pool(min(threads, len(jobs)), "fetch") as pool:
            for fut in [pool.submit(handles[f].fetch, lo, hi) for f, lo, hi in jobs]:
                fut.result()
    return sum(hi - lo for _, lo, hi in jobs)
