"""ops/share.py: small shared pieces go packed, one collective per owner and group of
members; every member of a group makes the same calls in the same order (no deadlock),
and the pieces arrive bitwise (a recording comm on threads stands in for the process group)."""

from __future__ import annotations

import threading

import torch

from shardsafe.layout import Box
from shardsafe.ops.share import share_phase
from shardsafe.plan.share_plan import Shared


class Wire:
    """Messages per (owner, members), in the order the owner sent them."""

    def __init__(self) -> None:
        self.sent: dict[tuple, list[torch.Tensor]] = {}
        self.cond = threading.Condition()

    def send(self, key: tuple, t: torch.Tensor) -> None:
        with self.cond:
            self.sent.setdefault(key, []).append(t.clone())
            self.cond.notify_all()

    def take(self, key: tuple, i: int) -> torch.Tensor:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.sent.get(key, [])) > i, timeout=30), ("never sent", key, i)
            return self.sent[key][i]


class RecordingComm:
    distributed = True

    def __init__(self, rank: int, world: int, wire: Wire) -> None:
        self.rank, self.world, self.wire = rank, world, wire
        self.calls: list[tuple] = []
        self.taken: dict[tuple, int] = {}

    def share_tensor(self, t: torch.Tensor, owner: int, members: tuple[int, ...]) -> int:
        self.calls.append((owner, members, t.numel() * t.element_size()))
        key = (owner, members)
        if self.rank == owner:
            self.wire.send(key, t)
            return 0
        i = self.taken.get(key, 0)
        self.taken[key] = i + 1
        t.copy_(self.wire.take(key, i))
        return t.numel() * t.element_size()


def test_small_pieces_are_packed_and_arrive_bitwise():
    world = 3
    torch.manual_seed(0)
    # the global plan: small, large (alone), scalar, strided, bool and bfloat16 pieces
    values = [torch.randn(5), torch.randn(3 << 20), torch.tensor(7, dtype=torch.int64), torch.randn(6, 4).t(),
              torch.rand(9) > 0.5, torch.randn(2, 3).to(torch.bfloat16), torch.randn(1000)]
    plan = [(0, (0, 1, 2)), (1, (0, 1, 2)), (0, (0, 1, 2)), (2, (0, 2)), (0, (0, 1)), (0, (0, 1, 2)), (2, (0, 2))]
    wire = Wire()
    comms = [RecordingComm(r, world, wire) for r in range(world)]
    results: dict[int, tuple[int, list]] = {}

    def run(r: int) -> None:
        mine = [(i, o) for i, (o, m) in enumerate(plan) if r in m]
        dests = [values[i].clone() if r == o else torch.zeros_like(values[i]) for i, o in mine]
        shared = [Shared(k, Box((0,), (1,)), o, plan[i][1]) for k, (i, o) in enumerate(mine)]
        results[r] = (share_phase(comms[r], shared, lambda s: dests[s.index], pack=1 << 20), dests)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(world))
    for r in range(world):
        received, dests = results[r]
        mine = [(i, o) for i, (o, m) in enumerate(plan) if r in m]
        assert received == sum(values[i].numel() * values[i].element_size() for i, o in mine if o != r)
        for (i, _), d in zip(mine, dests):
            assert d.dtype == values[i].dtype and torch.equal(d, values[i])
    for a in range(world):  # every pair of ranks made the same calls in the same order where both take part
        for b in range(a + 1, world):
            assert [c for c in comms[a].calls if b in c[1]] == [c for c in comms[b].calls if a in c[1]]
    # rank 0's three small pieces for all ranks: one packed message; rank 1's 12 MiB piece: alone
    assert [c[:2] for c in comms[0].calls].count((0, (0, 1, 2))) == 1
    assert [c for c in comms[0].calls if c[0] == 1] == [(1, (0, 1, 2), 12 << 20)]
    assert len(comms[0].calls) == 4  # (0, all), (1, all), (2, (0, 2)) packed, (0, (0, 1))
