"""The one write-and-hash routine: every data file a save writes (sync or async, CPU or
GPU tensors) goes through :class:`FileWriter`.

A file's bytes after its header are cut into *stretches*: runs of whole checksum blocks
(of one chunk or of several small consecutive chunks), so every block is hashed in one
call, whichever thread takes its stretch. A stretch's bytes come from one of two places:

- **borrowed**: views of the source tensors' own memory, when the source is a dense CPU
  tensor and the caller waits until the write is done (a sync save): nothing is copied;
- **staged**: a slot leased from the per-rank :class:`~shardsafe.engine.memory.HostMemory`
  budget, filled by copies (GPU tensors, non-dense views, and every tensor of an async
  save, whose caller may change its tensors once staging returns).

:meth:`FileWriter.stage` (on the caller's thread) produces stretches; writer threads take
them, hash each block and write it while it is still in the core's cache (one pass over
memory), then release the slot. A state larger than the budget streams through it: the
caller waits for slots.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from ..format.checksum import checksum
from ..format.codecs import compress
from ..format.manifest import FileEntry
from ..format.refs import block_digest, chunk_digest
from ..knobs import BORROW_STRETCH, COPY_THREADS, PARALLEL_MIN
from ..knobs import DENSE_PIECE as PART
from ..knobs import SLOT_BYTES as SLOT
from ..plan.save_plan import ChunkWrite, FileWrite
from ..storage.base import Folder, WriteHandle
from ..workers import pool, start_thread
from .buffers import dense, flat_bytes, readable_bytes, resolved
from .memory import HostMemory, Lease
from .parallel import run_shares
from .zwrite import WRITE_THREADS, OrderedWrites, Packet, _Zip, ahead_bytes

IOV_MAX = 1024

Source = Callable[[ChunkWrite], torch.Tensor]


@dataclass
class Stretch:
    """Bytes [offset, offset + size) of the file: ``pieces`` back to back, each piece one
    checksum block (or a whole small chunk) ``(chunk index, block index, bytes)``."""

    offset: int
    pieces: list[tuple[int, int, memoryview]]
    lease: Lease | None = None
    events: tuple = ()  # CUDA events recorded after the copies into the slot (one per source device)
    seq: int = 0  # order of submission (compressed files are written in it)


@dataclass
class WrittenFile:
    """A finished data file: its manifest entry, each chunk's block checksums and chunk
    digest (format/refs.py)."""

    entry: FileEntry
    checksums: list[list[str]]
    digests: list[str]
    ranges: list[tuple[int, int]] | None = None  # compressed file: each chunk's stored byte range
    stored: list[tuple[int, ...]] | None = None  # compressed file: each compressed chunk's block lengths (() raw)
    codec: str = ""  # the codec of the compressed chunks ("": none)


def _copy_parts(pairs: list[tuple[torch.Tensor, torch.Tensor]], parts: int) -> list[list[tuple]]:
    """Cut (dst, src) byte-tensor pairs into ``parts`` lists of about equal byte counts."""
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


def _recorded(device: int) -> torch.cuda.Event:
    """A CUDA event recorded on ``device``'s current stream (of this thread)."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


class FileWriter:
    """Writes one data file of a save: :meth:`start` the writer threads, :meth:`stage` on
    the caller's thread, then :meth:`finish` (on any thread) waits for the writes, makes
    the file durable and returns what was written. :meth:`abort` stops everything.

    ``borrow``: dense CPU sources are written from their own memory (the caller must not
    change them before ``finish`` returns). ``threads``: background writer threads.
    ``staging_bytes``: at most this many bytes of slots at once (default: what the file
    stages, so the caller never waits for writes); slots come from ``memory``."""

    def __init__(self, folder: Folder, plan: FileWrite, source: Source, memory: HostMemory, *, block: int,
                 borrow: bool, threads: int = 1, pin: bool = False, staging_bytes: int | None = None,
                 write_while_staging: bool = True, durable: bool = True, codec: str = "",
                 raw_keys: frozenset[str] = frozenset()) -> None:
        self.plan = plan
        # Compressed (format 3.2): every chunk but ``raw_keys``' is stored block by block,
        # compressed with ``codec`` or raw; blocks are written back to back in file order
        # after a header reserved up front and written last, by one thread while the
        # writer threads compress the next blocks (engine/zwrite.py).
        self.zip = _Zip(plan, codec, raw_keys, block) if codec else None
        self.writes: OrderedWrites | None = None
        self.write_threads: list[threading.Thread] = []
        self.memory = memory
        self.block = block
        self.borrow = borrow
        self.durable = durable
        self.sources = [resolved(source(c)) for c in plan.chunks]
        self.cuda = any(s.device.type == "cuda" for s in self.sources)
        # A device-to-host copy runs on the current stream of its *source's* device, which
        # need not be the current device: wait on each source device's stream.
        self.devices = sorted({s.device.index or 0 for s in self.sources if s.device.type == "cuda"})
        self.pin = pin and self.cuda and torch.cuda.is_available()
        self.borrowable = [self._borrowable(s) for s in self.sources]
        self.staged_bytes = sum(c.end - c.start for c, b in zip(plan.chunks, self.borrowable) if not b)
        cap = self.staged_bytes if staging_bytes is None else min(staging_bytes, self.staged_bytes)
        cap = memory.fits(max(cap, min(block, self.staged_bytes), 1))
        # Slots: at least two when the cap allows (one fills while the other is written),
        # never smaller than a checksum block (a block is hashed within one slot).
        self.slot = max(min(SLOT, -(-cap // 2)), min(block, self.staged_bytes), 1)
        # Without a cap every staged byte may be held at once (slots are not filled to the
        # last byte: a block never straddles two), the budget permitting.
        self.slots = threading.BoundedSemaphore(max(1, cap // self.slot) if staging_bytes is not None else 1 << 30)
        self.sums: list[list[str | None]] = [[None] * max(1, -(-(c.end - c.start) // block)) for c in plan.chunks]
        self.wide: list[list[bytes | None]] = [[None] * len(s) for s in self.sums]  # XXH3-128 of each block
        self.full: queue.Queue[Stretch | None] = queue.Queue()
        self.error: BaseException | None = None
        self.go = threading.Event()
        if write_while_staging or self.staged_bytes > cap:
            self.go.set()  # (a state larger than the slots streams through them: write while staging)
        self.threads: list[threading.Thread] = []
        # Staged bytes need a writer while the caller stages (slots must drain): at least one thread.
        self.n_threads = max(threads, 1 if self.staged_bytes else 0)
        self.handle: WriteHandle = folder.create(plan.name)
        try:
            if self.zip is None:
                self.handle.write([memoryview(plan.header)], 0)
            else:
                self.writes = OrderedWrites(self.zip, self.handle, ahead_bytes(self.n_threads + 1),
                                            lambda: self.error, self._fail)
        except BaseException:
            self.handle.abort()
            raise

    def _borrowable(self, src: torch.Tensor) -> bool:
        return self.borrow and src.device.type == "cpu" and dense(src)

    def start(self) -> None:
        """Start the background writer threads (and a compressed file's write thread)."""
        if self.writes is not None and not self.write_threads:
            self.write_threads = [start_thread(self.writes.run, f"zip-write-{i}") for i in range(WRITE_THREADS)]
        for i in range(self.n_threads):
            self.threads.append(start_thread(self._drain, f"writer-{i}"))

    # -- the caller's side: stretches -------------------------------------------------------
    def stage(self) -> None:
        """Produce every stretch in file order (copying into leased slots where needed);
        returns once all bytes are borrowed or copied. Raises a writer thread's error."""
        copier = None
        try:
            slot: _SlotFill | None = None
            copy_threads = 1 if self.cuda or self.staged_bytes < PARALLEL_MIN else min(COPY_THREADS,
                                                                                    os.cpu_count() or 1)
            if copy_threads > 1:
                copier = pool(copy_threads - 1, "stage")
            borrowed: list[tuple[int, int, memoryview]] = []
            at = size = 0
            for ci, (chunk, src, borrowable) in enumerate(zip(self.plan.chunks, self.sources, self.borrowable)):
                self._check()
                if not borrowable:
                    if borrowed:
                        self._submit(Stretch(at, borrowed))
                        borrowed = []
                    slot = self._stage_chunk(ci, chunk, src, slot, copier, copy_threads)
                    continue
                if slot is not None:
                    self._submit(slot.close(copier, copy_threads, self.cuda))
                    slot = None
                view = readable_bytes(src)  # (``self.sources`` keeps ``src`` alive until the file is written)
                for bi, piece in self._blocks(view):
                    start = chunk.start + bi * self.block
                    if borrowed and (at + size != start or size + len(piece) > BORROW_STRETCH
                                     or len(borrowed) >= IOV_MAX):
                        self._submit(Stretch(at, borrowed))
                        borrowed = []
                    if not borrowed:
                        at, size = start, 0
                    borrowed.append((ci, bi, piece))
                    size += len(piece)
            if borrowed:
                self._submit(Stretch(at, borrowed))
            if slot is not None:
                self._submit(slot.close(copier, copy_threads, self.cuda))
            for d in self.devices:
                torch.cuda.current_stream(d).synchronize()
        except BaseException as exc:
            self._fail(exc)
            raise
        finally:
            if copier is not None:
                copier.shutdown(wait=True)
            self.full.put(None)
            self.go.set()

    def _blocks(self, view: memoryview) -> Iterator[tuple[int, memoryview]]:
        """The checksum blocks of a chunk's bytes ``view`` (one empty block if empty)."""
        n = len(view)
        if n == 0:
            yield 0, view
            return
        for bi in range(-(-n // self.block)):
            yield bi, view[bi * self.block: (bi + 1) * self.block]

    def _stage_chunk(self, ci: int, chunk: ChunkWrite, src: torch.Tensor, slot: _SlotFill | None,
                     copier: ThreadPoolExecutor | None, copy_threads: int) -> _SlotFill | None:
        """Queue copies of chunk ``ci`` into slots, each checksum block wholly in one slot."""
        n = chunk.end - chunk.start
        if n == 0:
            if slot is None:
                slot = _SlotFill(self._lease(), chunk.start)
            slot.add_piece(ci, 0, 0)
            return slot
        temporary = not (src.device.type == "cpu" and dense(src))  # parts are copies made for us
        for part_lo, part in self._source_parts(src, self.slot if self.cuda else PART):
            done = 0
            m = part.numel()
            while done < m:
                lo = part_lo + done  # chunk-relative byte
                bi = lo // self.block
                block_lo, block_hi = bi * self.block, min(n, (bi + 1) * self.block)
                if slot is not None and lo == block_lo and slot.room() < block_hi - block_lo:
                    self._submit(slot.close(copier, copy_threads, self.cuda))
                    slot = None
                if slot is None:
                    self._check()
                    slot = _SlotFill(self._lease(), chunk.start + lo)
                take = min(m - done, block_hi - lo)
                slot.add_copy(ci, bi, lo == block_lo, part[done: done + take], now=temporary, cuda=self.cuda)
                done += take
        return slot

    @staticmethod
    def _source_parts(src: torch.Tensor, limit: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(chunk-relative byte offset, uint8 bytes) of ``src`` in row-major order. A dense
        CPU source is viewed whole; otherwise parts of at most about ``limit`` bytes are made
        dense one at a time (sub-rows of rows larger than that), so the temporary copies stay
        small: freed and reused, they never add up (glibc keeps large freed blocks)."""
        if src.device.type == "cpu" and dense(src):
            yield 0, flat_bytes(src)
            return
        nbytes = src.numel() * src.element_size()
        if src.dim() == 0 or nbytes <= limit:
            yield 0, flat_bytes(src.contiguous())
            return
        row = nbytes // src.shape[0] if src.shape[0] else 0
        if row > limit:
            for r in range(src.shape[0]):
                for lo, part in FileWriter._source_parts(src[r], limit):
                    yield r * row + lo, part
            return
        step = max(1, limit // max(row, 1))
        for r in range(0, src.shape[0], step):
            yield r * row, flat_bytes(src[r: r + step].contiguous())

    def _lease(self) -> Lease:
        """A slot: one of this file's slots, then its memory from the budget. When none is
        free the writers start (if they were held back), so the slots drain."""
        if not self.slots.acquire(blocking=False):
            self.go.set()
            while not self.slots.acquire(timeout=0.5):
                self._check()
        try:
            return self.memory.lease(self.slot, keep=True, pin=self.pin)
        except BaseException:
            self.slots.release()
            raise

    def _release(self, lease: Lease) -> None:
        lease.release()
        self.slots.release()

    def _submit(self, stretch: Stretch) -> None:
        if self.zip is not None:
            stretch.seq = self.zip.submitted
            self.zip.submitted += 1
        if self.cuda and stretch.lease is not None:
            stretch.events = tuple(_recorded(d) for d in self.devices)
        self.full.put(stretch)

    def _check(self) -> None:
        if self.error is not None:
            raise self.error

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        if self.writes is not None:
            self.writes.wake()

    # -- the writers' side ------------------------------------------------------------------
    def _drain(self) -> None:
        """Take stretches until the end marker, hashing and writing each (after an error:
        only releasing their slots)."""
        self.go.wait()
        while True:
            stretch = self.full.get()
            if stretch is None:
                self.full.put(None)  # the other writers stop too
                return
            try:
                if self.error is None:
                    self._write(stretch)
            except BaseException as exc:  # noqa: BLE001 - reported by finish()
                self._fail(exc)
            finally:
                if stretch.lease is not None:
                    self._release(stretch.lease)

    def _write(self, stretch: Stretch) -> None:
        """Hash each block and write it while it is still in the core's cache (small
        pieces are written together, up to one block per call)."""
        for event in stretch.events:
            event.synchronize()  # the slot's copies from that device are done
        if self.zip is not None:
            self._write_zipped(stretch)
            return
        group: list[memoryview] = []
        size = 0
        offset = stretch.offset
        for ci, bi, piece in stretch.pieces:
            self.sums[ci][bi] = checksum(piece)
            self.wide[ci][bi] = block_digest(piece)  # the block is in cache: a second hash costs little
            n = len(piece)
            if not n:
                continue
            group.append(piece)
            size += n
            if size >= self.block:
                self.handle.write(group, offset)
                offset += size
                group, size = [], 0
        if group:
            self.handle.write(group, offset)

    def _write_zipped(self, stretch: Stretch) -> None:
        """Hash and compress the stretch's blocks (or keep them raw), about one checksum
        block per packet, each packet's bytes copied into a buffer leased for it, and hand
        each packet to the write thread as soon as it is done (engine/zwrite.py)."""
        z, writes = self.zip, self.writes
        assert z is not None and writes is not None
        pieces = stretch.pieces
        sub = start = 0
        while start < len(pieces):
            end, size = start, 0
            while end < len(pieces) and (end == start or size + len(pieces[end][2]) <= self.block):
                size += len(pieces[end][2])
                end += 1
            packet = Packet(stretch.seq, sub, end == len(pieces))
            packet.lease = self.memory.lease(size, keep=True, wait=False) if size else None
            try:
                room = memoryview(packet.lease.tensor.numpy()) if packet.lease is not None else memoryview(b"")
                used = 0
                for ci, bi, piece in pieces[start:end]:
                    self.sums[ci][bi] = checksum(piece)
                    self.wide[ci][bi] = block_digest(piece)
                    packed = compress(z.codec, piece, z.itemsizes[ci]) if z.packs[ci] else None
                    data = piece if packed is None else packed  # (never longer than the piece: it fits)
                    room[used: used + len(data)] = data
                    packet.blocks.append((ci, bi, room[used: used + len(data)]))
                    used += len(data)
            except BaseException:
                packet.release()
                raise
            writes.put(packet)
            sub, start = sub + 1, end

    def finish(self, help_write: bool = True) -> WrittenFile:
        """Wait for every stretch to be written (this thread helps with ``help_write``),
        make the file durable and return its entry; on any error the file is removed and
        the error raised."""
        try:
            if help_write or not self.threads:
                self._drain()
            for t in self.threads:
                t.join()
            self._check()
            if self.zip is not None:
                self._join_writes()
                self._check()
                return self._finish_zipped()
            self.handle.finish(self.durable)
        except BaseException as exc:
            if self.zip is not None:
                self._fail(exc)
                self._join_writes()
            self.handle.abort()
            raise
        header = self.plan.header
        entry = FileEntry(self.plan.name, self.plan.size, self.plan.rank, len(header), checksum(header))
        return WrittenFile(entry, self.sums, [chunk_digest(w) for w in self.wide])  # type: ignore[arg-type]

    def _join_writes(self) -> None:
        """Let a compressed file's write thread write what is handed over, then end it (it
        ends at once after an error); release the packets it never wrote."""
        writes = self.writes
        if writes is None:
            return
        assert self.zip is not None
        writes.close(self.zip.submitted)
        if not self.write_threads:  # (never started: write here)
            writes.run()
        for t in self.write_threads:
            t.join()
        writes.drop()

    def _finish_zipped(self) -> WrittenFile:
        """The header (now that stored sizes are known) in its reserved space, then durable."""
        z = self.zip
        assert z is not None
        header, ranges, stored = z.header(self.plan)
        self.handle.write([memoryview(header)], 0)
        self.handle.finish(self.durable)
        entry = FileEntry(self.plan.name, z.cursor, self.plan.rank, len(header), checksum(header))
        digests = [chunk_digest(w) for w in self.wide]  # type: ignore[arg-type]
        return WrittenFile(entry, self.sums, digests, ranges, stored, z.codec)  # type: ignore[arg-type]

    def abort(self, error: BaseException | None = None) -> None:
        """Stop after a failure elsewhere: writers only release their slots, the file is removed."""
        self._fail(error or RuntimeError("save aborted"))
        self.go.set()
        self.full.put(None)
        for t in self.threads:
            t.join()
        while True:
            try:
                s = self.full.get_nowait()
            except queue.Empty:
                break
            if s is not None and s.lease is not None:
                self._release(s.lease)
        self._join_writes()
        self.handle.abort()


class _SlotFill:
    """A staging slot being filled: the copies into it and the block pieces it holds."""

    def __init__(self, lease: Lease, offset: int) -> None:
        self.lease = lease
        self.offset = offset  # file offset of the slot's first byte
        self.pos = 0
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.pieces: list[tuple[int, int, int, int]] = []  # chunk, block, lo, hi in the slot

    def room(self) -> int:
        return self.lease.nbytes - self.pos

    def add_piece(self, ci: int, bi: int, n: int) -> None:
        self.pieces.append((ci, bi, self.pos, self.pos + n))
        self.pos += n

    def add_copy(self, ci: int, bi: int, new_block: bool, src: torch.Tensor, now: bool = False,
                 cuda: bool = False) -> None:
        """Place ``src``'s bytes next in the slot: copied at once when ``now`` (a temporary
        part, freed right after), else when the slot closes (split over threads)."""
        n = src.numel()
        dst = self.lease.tensor[self.pos: self.pos + n]
        if now:
            dst.copy_(src, non_blocking=cuda)
        else:
            self.copies.append((dst, src))
        if not new_block and self.pieces and self.pieces[-1][:2] == (ci, bi):
            c, b, lo, hi = self.pieces[-1]
            self.pieces[-1] = (c, b, lo, hi + n)  # a block whose source came in two parts
            self.pos += n
        else:
            self.add_piece(ci, bi, n)

    def close(self, copier: ThreadPoolExecutor | None, threads: int, cuda: bool) -> Stretch:
        """Run the copies (split over the copier's threads) and turn the slot into a stretch."""
        if cuda or copier is None:
            for dst, src in self.copies:
                dst.copy_(src, non_blocking=cuda)
        else:
            run_shares(copier, _copy_all, _copy_parts(self.copies, threads))
        self.copies.clear()
        raw = memoryview(self.lease.tensor.numpy())
        return Stretch(self.offset, [(c, b, raw[lo:hi]) for c, b, lo, hi in self.pieces], self.lease)
