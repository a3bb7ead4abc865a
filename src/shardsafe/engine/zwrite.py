"""Writing a compressed data file (format 3.2): compression runs ahead of the writes.

The writer threads of :class:`~shardsafe.engine.writer.FileWriter` take stretches (in
file order, each numbered by ``seq``), hash and compress their blocks and hand them, a
*packet* of about one checksum block at a time, to the write threads of this module, which
write the packets in file order, back to back after the reserved header, as soon as each is
ready: while it writes a packet, the writer threads compress the next ones. The packets'
bytes (compressed, or raw where compression does not pay) are copied into buffers leased
from the memory budget, so a stretch's staging slot is free as soon as it is compressed;
the packets compressed but not yet written hold at most ``knobs.ZIP_AHEAD`` bytes per
writer thread (the packet of the stretch the write thread waits for always goes in, so the
bound never stalls the file).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import knobs
from ..plan.save_plan import FileWrite
from ..storage.base import WriteHandle
from .memory import Lease

IOV_MAX = 1024


class _Zip:
    """A compressed file being written: which chunks are compressed, the reserved header,
    each block's stored place (filled in as its packet is written)."""

    def __init__(self, plan: FileWrite, codec: str, raw_keys: frozenset[str], block: int) -> None:
        from ..format.datafile import ChunkEntry, _itemsizes, build_header, chunk_name

        self.codec = codec
        self.packs = [c.key not in raw_keys for c in plan.chunks]
        self.itemsizes = [_itemsizes()[c.code] for c in plan.chunks]
        self.names = [chunk_name(c.key, c.box.offsets, c.whole) for c in plan.chunks]
        # Stored sizes never exceed raw ones, so this header (raw sizes) is the longest the
        # final one can be: its size is reserved, the final header padded to it.
        raw = [c.end - c.start for c in plan.chunks]
        self.entries = lambda sizes: [ChunkEntry(n, "U8" if p else c.code, (m,) if p else c.box.lengths, m)
                                      for n, p, c, m in zip(self.names, self.packs, plan.chunks, sizes)]
        self.reserve = len(build_header(self.entries(raw))[0])
        self.build_header = build_header
        self.stored: list[list[tuple[int, int] | None]] = [[None] * max(1, -(-n // block)) for n in raw]
        self.submitted = 0
        self.cursor = self.reserve

    def header(self, plan: FileWrite) -> tuple[bytes, list[tuple[int, int]], list[tuple[int, ...]]]:
        """The final header (padded to the reserved size), each chunk's stored range, and
        each compressed chunk's stored block lengths (() for a raw chunk)."""
        ranges = []
        stored = []
        for blocks, pack in zip(self.stored, self.packs):
            assert all(b is not None for b in blocks)
            lo = blocks[0][0]  # type: ignore[index]
            hi = blocks[-1][0] + blocks[-1][1]  # type: ignore[index]
            ranges.append((lo, hi))
            stored.append(tuple(b[1] for b in blocks) if pack else ())  # type: ignore[index]
        header, _ = self.build_header(self.entries([hi - lo for lo, hi in ranges]))
        text = header[8:] + b" " * (self.reserve - len(header))
        return struct.pack("<Q", len(text)) + text, ranges, stored


@dataclass
class Packet:
    """Stored blocks ``(chunk, block, bytes)`` of stretch ``seq``, the ``sub``-th packet of
    it (``last``: its final one), their bytes in ``lease``."""

    seq: int
    sub: int
    last: bool
    blocks: list[tuple[int, int, memoryview]] = field(default_factory=list)
    lease: Lease | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(b) for _, _, b in self.blocks)

    def release(self) -> None:
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()


class OrderedWrites:
    """The write thread of a compressed file: writes packets in (seq, sub) order at the
    file's next bytes, records each block's stored place in ``zip.stored``. ``error()``:
    the file's first error (the thread stops writing once there is one); ``fail(exc)``
    records one."""

    def __init__(self, zip_: _Zip, handle: WriteHandle, ahead: int, error: Callable[[], BaseException | None],
                 fail: Callable[[BaseException], None]) -> None:
        self.zip = zip_
        self.handle = handle
        self.ahead = ahead  # bytes of packets waiting to be written beyond which packers wait
        self.error = error
        self.fail = fail
        self.cond = threading.Condition()
        self.ready: dict[tuple[int, int], Packet] = {}
        self.waiting = 0  # bytes of the packets in ``ready``
        self.next = (0, 0)  # the packet to write next
        self.total: int | None = None  # stretches in the file, once staging is done

    def put(self, packet: Packet) -> None:
        """Hand over a packet (waits while ``ahead`` bytes wait to be written, unless the
        write thread waits for this stretch); raises the file's error, if any."""
        n = packet.nbytes
        with self.cond:
            while (self.waiting + n > self.ahead and packet.seq != self.next[0] and self.waiting
                   and self.error() is None):
                self.cond.wait(0.5)
            failed = self.error()
            if failed is None:
                self.ready[(packet.seq, packet.sub)] = packet
                self.waiting += n
                self.cond.notify_all()
        if failed is not None:
            packet.release()
            raise failed

    def close(self, total: int) -> None:
        """Every one of the file's ``total`` stretches has been handed over (or the file failed)."""
        with self.cond:
            self.total = total
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    def _take(self) -> list[Packet] | None:
        """The next packets in order that are ready (waits for the first); None at the end."""
        with self.cond:
            while True:
                if self.error() is not None or (self.total is not None and self.next[0] >= self.total):
                    return None
                if self.next in self.ready:
                    break
                self.cond.wait(0.5)
            out: list[Packet] = []
            count = 0
            while self.next in self.ready and count < IOV_MAX:
                p = self.ready.pop(self.next)
                out.append(p)
                count += len(p.blocks)
                self.next = (p.seq + 1, 0) if p.last else (p.seq, p.sub + 1)
            z = self.zip
            for p in out:  # their place in the file: the next bytes, in order
                for ci, bi, buf in p.blocks:
                    z.stored[ci][bi] = (z.cursor, len(buf))
                    z.cursor += len(buf)
            return out

    def run(self) -> None:
        """A write thread: takes the next packets (and their place) in order until the last
        stretch's last one, and writes them; two such threads write back-to-back ranges at
        once, so the storage has the next write while one thread waits to be scheduled."""
        while True:
            packets = self._take()
            if packets is None:
                return
            try:
                self._write(packets)
            except BaseException as exc:  # noqa: BLE001 - reported by the FileWriter's finish()
                self.fail(exc)
            finally:
                with self.cond:
                    self.waiting -= sum(p.nbytes for p in packets)
                    self.cond.notify_all()
                for p in packets:
                    p.release()

    def _write(self, packets: list[Packet]) -> None:
        ci, bi, _ = packets[0].blocks[0]
        offset = self.zip.stored[ci][bi][0]  # type: ignore[index]
        bufs = [buf for p in packets for _, _, buf in p.blocks if len(buf)]
        if bufs:
            self.handle.write(bufs, offset)

    def drop(self) -> None:
        """Release the packets never written (after a failure)."""
        with self.cond:
            packets, self.ready, self.waiting = list(self.ready.values()), {}, 0
        for p in packets:
            p.release()


def ahead_bytes(threads: int) -> int:
    """Bytes of packets that may wait to be written: ``ZIP_AHEAD`` per writer thread."""
    return knobs.ZIP_AHEAD * max(1, threads)


WRITE_THREADS = 2  # threads writing a compressed file's packets

__all__ = ["IOV_MAX", "WRITE_THREADS", "OrderedWrites", "Packet", "ahead_bytes"]
