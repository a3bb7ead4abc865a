"""Staging for async saves: a host buffer pool reused across saves, filled by the caller
and drained by a background writer, so memory stays bounded and the training loop only
waits for memory copies.

The pool is one allocation (pinned when CUDA tensors are staged) cut into equal slots.
The caller copies the bytes of this rank's data file, in file order, into free slots;
a writer thread takes full slots in order and, piece by piece of one checksum block,
hashes the bytes into each chunk's checksums and writes them at their file offset while
they are still cached, then frees the slot. A state larger
than the pool streams through it: the caller waits for free slots.
"""

from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..format.checksum import StreamingChecksum, checksum
from ..format.datafile import ChunkEntry, build_header, chunk_name
from ..format.dtypes import safetensors_code
from ..format.manifest import FileEntry
from ..plan.save_plan import WriteItem
from ..storage.local import write_all
from .buffers import byte_view, resolved
from .parallel import run_shares

DEFAULT_SLOT = 64 << 20
COPY_THREADS = 4  # at most this many threads copy a slot (the caller included)
PARALLEL_MIN = 8 << 20  # smaller states are staged by the caller alone
MIN_POOL = 1 << 20  # smaller bounds are raised to this: slots of a few bytes only cost time


def _split_copies(pairs: list[tuple[torch.Tensor, torch.Tensor]], parts: int) -> list[list[tuple]]:
    """Cut (dst, src) byte-view pairs into ``parts`` lists of about equal byte counts."""
    total = sum(d.numel() for d, _ in pairs)
    share = max(1, -(-total // parts))
    out: list[list[tuple]] = [[] for _ in range(parts)]
    i, room = 0, share
    for dst, src in pairs:
        off, n = 0, dst.numel()
        while off < n:
            take = n - off if i == parts - 1 else min(n - off, room)
            out[i].append((dst[off: off + take], src[off: off + take]))
            off += take
            room -= take
            if room == 0 and i < parts - 1:
                i, room = i + 1, share
    return out


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


class StagingPool:
    """A reusable host buffer cut into slots; grows only when a save needs more."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.pinned = False
        self.allocations = 0

    def slots(self, capacity: int, pin: bool) -> list[torch.Tensor]:
        """Slots covering exactly ``capacity`` bytes (at least two when it allows; the last
        may be shorter), views of one buffer that is reused while it is large enough."""
        capacity = max(capacity, 2)
        if self.buffer is None or self.buffer.numel() < capacity or (pin and not self.pinned):
            self.buffer = None
            self.buffer = torch.empty(capacity, dtype=torch.uint8, pin_memory=pin)
            self.pinned = pin
            self.allocations += 1
        size = min(DEFAULT_SLOT, -(-capacity // 2))
        return [self.buffer[i: min(i + size, capacity)] for i in range(0, capacity, size)]


class BlockHasher:
    """Per-block checksums of one chunk fed in file order, in arbitrary pieces (the
    pieces may be reused memory: nothing is kept after ``feed`` returns)."""

    def __init__(self, start: int, end: int, block: int) -> None:
        self.start, self.end, self.block = start, end, block
        self.sums: list[str] = []
        self.current = StreamingChecksum()
        self.current_len = 0
        if end == start:
            self.sums.append(checksum(b""))

    def feed(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), self.block - self.current_len)
            if take == self.block:
                self.sums.append(checksum(view[:take]))
            else:
                self.current.update(view[:take])
                self.current_len += take
                if self.current_len == self.block:
                    self._flush()
            view = view[take:]

    def _flush(self) -> None:
        self.sums.append(self.current.hexdigest())
        self.current = StreamingChecksum()
        self.current_len = 0

    def finish(self) -> list[str]:
        if self.current_len:
            self._flush()
        return self.sums


@dataclass
class _Slot:
    index: int
    file_offset: int
    length: int
    event: object = None


@dataclass
class StreamedFile:
    """One data file being written through the staging pool."""

    path: Path
    name: str
    rank: int
    items: list[WriteItem]
    block: int
    header: bytes = b""
    ranges: list[tuple[int, int]] = field(default_factory=list)


class StagedWriter:
    """Stage a rank's chunks into pool slots (caller thread) and write them (background thread)."""

    def __init__(self, spec: StreamedFile, pool: StagingPool, capacity: int | None, pin: bool = True) -> None:
        self.spec = spec
        sources = [it.source for it in spec.items]
        entries = [
            ChunkEntry(chunk_name(it.key, it.box.offsets, it.whole), safetensors_code(s.dtype), it.box.lengths,
                       it.box.numel * s.element_size())
            for it, s in zip(spec.items, sources)
        ]
        spec.header, spec.ranges = build_header(entries)
        total = sum(e.nbytes for e in entries)
        self.cuda = any(s.device.type == "cuda" for s in sources)
        pin = pin and self.cuda and torch.cuda.is_available()
        want = total if capacity is None else max(min(total, MIN_POOL), min(total, capacity))
        self.slot_views = pool.slots(want, pin)
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(len(self.slot_views)):
            self.free.put(i)
        self.full: queue.Queue[_Slot | None] = queue.Queue()
        self.hashers = [BlockHasher(s, e, spec.block) for s, e in spec.ranges]
        self.error: BaseException | None = None
        self.go = threading.Event()  # the writer may start
        if sum(v.numel() for v in self.slot_views) < total:
            self.go.set()  # the state streams through the pool: write while staging
        self.fd = os.open(spec.path / spec.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.thread = threading.Thread(target=self._drain, name="shardsafe-writer", daemon=True)
        self.thread.start()

    # -- caller side ------------------------------------------------------------------
    def stage(self) -> None:
        """Copy every chunk's bytes into slots in file order; returns when all are staged.

        Host-to-host copies of one slot are split over the machine's cores (the caller is
        blocked anyway, so the cores would idle). When the pool holds the whole file, the
        writer starts only after staging, so the two do not compete for memory bandwidth
        and cores while the caller waits."""
        slot_i: int | None = None
        pos = 0
        file_pos = self.spec.ranges[0][0] if self.spec.ranges else len(self.spec.header)
        slot_start = file_pos
        total = self.spec.ranges[-1][1] - file_pos if self.spec.ranges else 0
        threads = 1 if self.cuda or total < PARALLEL_MIN else min(COPY_THREADS, os.cpu_count() or 1)
        copier = ThreadPoolExecutor(threads - 1, thread_name_prefix="shardsafe-stage") if threads > 1 else None
        pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # copies into the current slot
        try:
            for item, (start, _end) in zip(self.spec.items, self.spec.ranges):
                assert start == file_pos
                for piece in self._pieces(item, min(len(v) for v in self.slot_views)):
                    done = 0
                    n = piece.numel()
                    while done < n:
                        if slot_i is None:
                            slot_i, pos, slot_start = self._take(), 0, file_pos
                        slot = self.slot_views[slot_i]
                        take = min(n - done, slot.numel() - pos)
                        pending.append((slot[pos: pos + take], piece[done: done + take]))
                        pos += take
                        done += take
                        file_pos += take
                        if pos == slot.numel():
                            self._copy(pending, copier, threads)
                            self._submit(slot_i, slot_start, pos)
                            slot_i = None
            if slot_i is not None:
                if pos:
                    self._copy(pending, copier, threads)
                    self._submit(slot_i, slot_start, pos)
                else:
                    self.free.put(slot_i)
            if self.cuda:
                torch.cuda.current_stream().synchronize()
        finally:
            if copier is not None:
                copier.shutdown(wait=True)
            self.full.put(None)
            self.go.set()

    def _copy(self, pending: list[tuple[torch.Tensor, torch.Tensor]], copier: ThreadPoolExecutor | None,
              threads: int) -> None:
        """Run (and clear) the byte copies into one slot, split into ``threads`` parts of
        equal size: the caller copies the first, the copier's threads the others."""
        if copier is None:
            for dst, src in pending:
                dst.copy_(src, non_blocking=self.cuda)
            pending.clear()
            return
        parts = _split_copies(pending, threads)
        pending.clear()
        run_shares(copier, _copy_all, parts)

    def _pieces(self, item: WriteItem, limit: int):
        """Contiguous uint8 views of an item's bytes in row-major order, each of at most
        ``limit`` bytes when a copy is needed (a contiguous CPU source is viewed whole)."""
        src = resolved(item.source)
        if src.device.type == "cpu" and src.is_contiguous():
            yield torch.from_numpy(byte_view(src)) if src.numel() else torch.empty(0, dtype=torch.uint8)
            return
        if src.dim() == 0 or src.numel() * src.element_size() <= limit:
            yield src.contiguous().reshape(-1).view(torch.uint8)
            return
        row = src[0].numel() * src.element_size()
        step = max(1, limit // max(row, 1))
        for r in range(0, src.shape[0], step):
            yield src[r: r + step].contiguous().reshape(-1).view(torch.uint8)

    def _take(self) -> int:
        while True:
            if self.error is not None:
                raise self.error
            try:
                return self.free.get(timeout=0.5)
            except queue.Empty:
                if self.error is not None:
                    raise self.error from None

    def _submit(self, index: int, file_offset: int, length: int) -> None:
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self.full.put(_Slot(index, file_offset, length, event))

    # -- writer side ------------------------------------------------------------------
    def _drain(self) -> None:
        try:
            self.go.wait()
            write_all(self.fd, memoryview(self.spec.header), 0)
            chunk = 0
            while True:
                slot = self.full.get()
                if slot is None:
                    break
                if slot.event is not None:
                    slot.event.synchronize()
                data: np.ndarray = self.slot_views[slot.index][: slot.length].numpy()
                view = memoryview(data)
                lo, hi = slot.file_offset, slot.file_offset + slot.length
                ranges = self.spec.ranges
                # Block by block: hash, then write while the bytes are still cached (one
                # pass over the slot instead of a hash pass and a write pass).
                for a in range(lo, hi, self.spec.block):
                    b = min(hi, a + self.spec.block)
                    while chunk < len(ranges) and ranges[chunk][1] <= a:
                        chunk += 1  # chunks wholly before this piece (empty chunks are pre-hashed)
                    c = chunk
                    while c < len(ranges) and ranges[c][0] < b:
                        x, y = max(ranges[c][0], a), min(ranges[c][1], b)
                        if y > x:
                            self.hashers[c].feed(view[x - lo: y - lo])
                        c += 1
                    write_all(self.fd, view[a - lo: b - lo], a)
                self.free.put(slot.index)
            os.fsync(self.fd)
        except BaseException as exc:  # noqa: BLE001 - surfaced by finish()
            self.error = exc
            while True:  # keep the caller from waiting forever on slots
                try:
                    if self.full.get_nowait() is None:
                        break
                except queue.Empty:
                    break
            for i in range(len(self.slot_views)):
                self.free.put(i)
        finally:
            os.close(self.fd)

    def finish(self) -> tuple[FileEntry, list[tuple[WriteItem, int, int, list[str]]]]:
        """Wait for the writer; the file entry and each chunk's range and checksums."""
        self.thread.join()
        if self.error is not None:
            raise self.error
        header = self.spec.header
        total = self.spec.ranges[-1][1] if self.spec.ranges else len(header)
        entry = FileEntry(self.spec.name, total, self.spec.rank, len(header), checksum(header))
        chunks = [(it, s, e, h.finish()) for it, (s, e), h in zip(self.spec.items, self.spec.ranges, self.hashers)]
        return entry, chunks
