"""The share phase of a broadcast load: each piece that several ranks need goes from the
rank that read it to the others (``broadcast_replicated``, :mod:`shardsafe.plan.share_plan`).

A collective per piece costs a round trip, and a training state has many small replicated
tensors (an optimizer's step counters, norms, biases): pieces smaller than ``SHARE_PACK``
bytes with the same owner and members go packed, back to back in one byte buffer, up to
``SHARE_PACK`` bytes per message. Every member of a group sees the same pieces in the same
order (the plan's), and a group's messages are sent where its first piece stands in that
order, so the ranks' sequences of collectives stay consistent (no deadlock); whether a
piece is packed depends on its size only, the same on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from ..knobs import SHARE_PACK
from ..plan.share_plan import Shared

ALIGN = 16  # pieces start at multiples of this in a packed buffer (any dtype can view it)


def share_phase(comm: Comm, shared: list[Shared], piece: Any, pack: int = SHARE_PACK) -> int:
    """Send every shared piece from its owner to its other members (``piece(s)``: the
    tensor of ``s`` on this rank); returns the bytes this rank received."""
    events: list[tuple[int, Any]] = []  # (position in the plan, a piece or a group key)
    groups: dict[tuple, list[torch.Tensor]] = {}
    for i, s in enumerate(shared):
        t = piece(s)
        if t.numel() * t.element_size() >= pack:
            events.append((i, t))
            continue
        key = (s.owner, s.members)
        if key not in groups:
            groups[key] = []
            events.append((i, key))
        groups[key].append(t)
    received = 0
    for i, item in events:
        if isinstance(item, torch.Tensor):
            received += comm.share_tensor(item, shared[i].owner, shared[i].members)
            continue
        for batch in _batches(groups[item], pack):
            received += _send_packed(comm, batch, *item)
    return received


def _batches(tensors: list[torch.Tensor], pack: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``pack`` bytes (aligned) each."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        n = _aligned(t)
        if not out or size + n > pack:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out


def _aligned(t: torch.Tensor) -> int:
    n = t.numel() * t.element_size()
    return -(-n // ALIGN) * ALIGN


def _send_packed(comm: Comm, tensors: list[torch.Tensor], owner: int, members: tuple[int, ...]) -> int:
    """One message of ``tensors`` back to back; returns the bytes received (0 on the owner)."""
    buf = torch.empty(sum(_aligned(t) for t in tensors), dtype=torch.uint8, device=tensors[0].device)
    mine = comm.rank == owner
    at = 0
    if mine:
        for t in tensors:
            n = t.numel() * t.element_size()
            if n:
                buf[at: at + n].copy_(t.contiguous().reshape(-1).view(torch.uint8))
            at += _aligned(t)
    comm.share_tensor(buf, owner, members)
    if mine:
        return 0
    at = 0
    received = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if n:
            with torch.no_grad():
                t.copy_(buf[at: at + n].view(t.dtype).view(t.shape))
        at += _aligned(t)
        received += n
    return received
