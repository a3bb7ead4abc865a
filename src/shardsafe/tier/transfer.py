"""Files sent between ranks over the tier's own gloo group, in rounds, within the budget.

A round pairs each rank with at most one file to send and one to receive, so every rank
posts one send and one receive at a time and no schedule deadlocks. Pieces are leased
from the Checkpointer's host-memory budget (two each way: while one is on the wire the
next is read from its file and the last one received is written at its offset); what
was received is verified against its checkpoint's checksums by the caller
(``ops.reader.verify_files``) before it counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..engine.memory import HostMemory
from ..errors import CheckpointError
from ..storage.base import ReadHandle, WriteHandle

PIECE = 8 << 20


class Transfer(NamedTuple):
    """File ``name`` (``nbytes`` long) sent by rank ``src`` to rank ``dst``."""

    src: int
    dst: int
    name: str
    nbytes: int


def rounds(transfers: list[Transfer]) -> list[list[Transfer]]:
    """The transfers in rounds where no rank sends or receives twice (greedy, in sorted
    order: the same rounds on every rank)."""
    left = sorted(transfers)
    out: list[list[Transfer]] = []
    while left:
        senders: set[int] = set()
        receivers: set[int] = set()
        now: list[Transfer] = []
        rest: list[Transfer] = []
        for t in left:
            if t.src in senders or t.dst in receivers:
                rest.append(t)
            else:
                senders.add(t.src)
                receivers.add(t.dst)
                now.append(t)
        out.append(now)
        left = rest
    return out


class Stats(NamedTuple):
    sent: int
    received: int
    seconds: float


def exchange(transfers: list[Transfer], rank: int, group: object, memory: HostMemory,
             open_src: Callable[[str], ReadHandle], create_dst: Callable[[str], WriteHandle],
             piece: int = PIECE) -> Stats:
    """Run this rank's part of ``transfers`` (every rank calls it with the same list):
    send what it is ``src`` of, receive and write what it is ``dst`` of. A peer that
    fails mid-way raises CheckpointError naming it."""
    t0 = time.perf_counter()
    sent = received = 0
    piece = max(1 << 20, min(piece, memory.fits(4 * piece) // 4))
    sbuf = memory.lease(2 * piece)  # two pieces each way: one in flight, one read or written meanwhile
    rbuf = memory.lease(2 * piece)
    try:
        bufs = _Buffers(sbuf.tensor, rbuf.tensor, piece)
        for rnd in rounds(transfers):
            send = next((t for t in rnd if t.src == rank), None)
            recv = next((t for t in rnd if t.dst == rank), None)
            if send is None and recv is None:
                continue
            try:
                _pair(send, recv, group, bufs, open_src, create_dst)
            except CheckpointError:
                raise
            except Exception as exc:  # noqa: BLE001 - a peer gone mid-transfer
                who = [f"sending {send.name} to rank {send.dst}"] if send else []
                who += [f"receiving {recv.name} from rank {recv.src}"] if recv else []
                raise CheckpointError(f"rank {rank}: transfer failed while {' and '.join(who)}: {exc}") from exc
            sent += send.nbytes if send else 0
            received += recv.nbytes if recv else 0
    finally:
        sbuf.release()
        rbuf.release()
    return Stats(sent, received, time.perf_counter() - t0)


class _Buffers:
    """Two send and two receive pieces (tensors and byte views of the same memory)."""

    def __init__(self, send: torch.Tensor, recv: torch.Tensor, piece: int) -> None:
        self.piece = piece
        self.send = [send[i * piece:(i + 1) * piece] for i in (0, 1)]
        self.recv = [recv[i * piece:(i + 1) * piece] for i in (0, 1)]
        self.sview = [memoryview(t.numpy()) for t in self.send]
        self.rview = [memoryview(t.numpy()) for t in self.recv]


def _pair(send: Transfer | None, recv: Transfer | None, group: object, bufs: _Buffers,
          open_src: Callable[[str], ReadHandle], create_dst: Callable[[str], WriteHandle]) -> None:
    """Send one file and receive another, piece by piece: while piece k is on the wire,
    piece k+1 is read from the source file and piece k-1 written to the destination."""
    piece = bufs.piece
    ns = -(-send.nbytes // piece) if send else 0
    nr = -(-recv.nbytes // piece) if recv else 0
    src = open_src(send.name) if send else None
    dst = create_dst(recv.name) if recv else None

    def size(t: Transfer, k: int) -> int:
        return min(piece, t.nbytes - k * piece)

    def read(k: int) -> None:
        assert send is not None and src is not None
        src.read_into([bufs.sview[k % 2][:size(send, k)]], k * piece)

    written: tuple[int, int] | None = None  # (piece index, bytes) received, not yet written
    try:
        if ns:
            read(0)
        for k in range(max(ns, nr)):
            reqs = []
            if k < ns:
                assert send is not None
                reqs.append(dist.isend(bufs.send[k % 2][:size(send, k)],
                                       dst=dist.get_global_rank(group, send.dst), group=group))
            if k < nr:
                assert recv is not None
                reqs.append(dist.irecv(bufs.recv[k % 2][:size(recv, k)],
                                       src=dist.get_global_rank(group, recv.src), group=group))
            if k + 1 < ns:
                read(k + 1)
            if written is not None:
                assert dst is not None
                dst.write([bufs.rview[written[0] % 2][:written[1]]], written[0] * piece)
                written = None
            for r in reqs:
                r.wait()
            if k < nr:
                assert recv is not None
                written = (k, size(recv, k))
        if written is not None:
            assert dst is not None
            dst.write([bufs.rview[written[0] % 2][:written[1]]], written[0] * piece)
        if dst is not None:
            dst.finish(durable=False)
            dst = None
    finally:
        if src is not None:
            src.close()
        if dst is not None:
            dst.abort()


__all__ = ["PIECE", "Stats", "Transfer", "exchange", "rounds"]
