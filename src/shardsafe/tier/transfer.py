"""Files sent between ranks over the tier's own gloo group, in rounds, within the budget.

A round pairs each rank with at most one file to send and one to receive, so every rank
posts one send and one receive at a time and no schedule deadlocks. Pieces are leased
from the Checkpointer's host-memory budget; each received piece is written at its offset
as it arrives; what was received is verified against its checkpoint's checksums by the
caller (``ops.reader.verify_files``) before it counts.
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
    piece = max(1 << 20, min(piece, memory.fits(piece)))
    sbuf = memory.lease(piece)
    rbuf = memory.lease(piece)
    try:
        for rnd in rounds(transfers):
            send = next((t for t in rnd if t.src == rank), None)
            recv = next((t for t in rnd if t.dst == rank), None)
            if send is None and recv is None:
                continue
            try:
                _pair(send, recv, group, sbuf.tensor, rbuf.tensor, open_src, create_dst)
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


def _pair(send: Transfer | None, recv: Transfer | None, group: object, sbuf: torch.Tensor, rbuf: torch.Tensor,
          open_src: Callable[[str], ReadHandle], create_dst: Callable[[str], WriteHandle]) -> None:
    piece = sbuf.numel()
    ns = -(-send.nbytes // piece) if send else 0
    nr = -(-recv.nbytes // piece) if recv else 0
    src = open_src(send.name) if send else None
    dst = create_dst(recv.name) if recv else None
    sview = memoryview(sbuf.numpy())
    rview = memoryview(rbuf.numpy())
    try:
        for k in range(max(ns, nr)):
            reqs = []
            if k < ns:
                assert send is not None and src is not None
                n = min(piece, send.nbytes - k * piece)
                src.read_into([sview[:n]], k * piece)
                reqs.append(dist.isend(sbuf[:n], dst=dist.get_global_rank(group, send.dst), group=group))
            if k < nr:
                assert recv is not None
                m = min(piece, recv.nbytes - k * piece)
                reqs.append(dist.irecv(rbuf[:m], src=dist.get_global_rank(group, recv.src), group=group))
            for r in reqs:
                r.wait()
            if k < nr:
                assert dst is not None and recv is not None
                dst.write([rview[:m]], k * piece)
        if dst is not None:
            dst.finish(durable=False)
            dst = None
    finally:
        if src is not None:
            src.close()
        if dst is not None:
            dst.abort()


__all__ = ["PIECE", "Stats", "Transfer", "exchange", "rounds"]
