"""Which ranks share a node, and which peers hold copies of a rank's local files.

A rank's node comes from an explicit ``node=`` argument, else the launcher (torchrun's
``GROUP_RANK``), never from the hostname alone, so nodes simulated on one machine are
distinct. Rank ``r``'s files are copied to ranks ``r + J*i`` (i = 1 .. F-1, modulo the
world), ``J`` the stride (default: ranks per node, ``LOCAL_WORLD_SIZE``), so copies land on
other nodes; a layout where two copies would share a node is refused at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..comm import Comm
from ..errors import CheckpointError


def node_id(node: int | None = None) -> int:
    """This process's node: ``node`` when given, else torchrun's ``GROUP_RANK``, else 0."""
    if node is not None:
        if isinstance(node, bool) or not isinstance(node, int) or node < 0:
            raise ValueError(f"node must be a non-negative int, not {node!r}")
        return node
    env = os.environ.get("GROUP_RANK")
    return int(env) if env and env.isdigit() else 0


@dataclass(frozen=True)
class Topology:
    """The node of every rank (``nodes[r]``), the copies kept of each rank's files
    (``replicas``, the rank's own included) and the peer stride."""

    nodes: tuple[int, ...]
    replicas: int = 1
    stride: int = 1

    @property
    def world(self) -> int:
        return len(self.nodes)

    def peers(self, rank: int) -> list[int]:
        """The ranks that receive a copy of ``rank``'s files."""
        return [(rank + self.stride * i) % self.world for i in range(1, self.replicas)]

    def holders(self, rank: int) -> list[int]:
        """``rank`` and its peers: the ranks whose nodes hold ``rank``'s files."""
        return [rank, *self.peers(rank)]

    def leader(self, rank: int) -> int:
        """The lowest rank on ``rank``'s node (it renames and prunes the node's folder)."""
        return min(r for r, n in enumerate(self.nodes) if n == self.nodes[rank])

    def ranks_on(self, node: int) -> list[int]:
        """The ranks on ``node``."""
        return [r for r, n in enumerate(self.nodes) if n == node]

    def check(self) -> None:
        """Refuse a layout where copies of one rank's files would share a node
        (CheckpointError naming the rank, its peers and their nodes)."""
        if self.replicas < 1:
            raise CheckpointError(f"replicas must be at least 1, not {self.replicas}")
        nodes = len(set(self.nodes))
        if self.replicas > nodes:
            raise CheckpointError(f"replicas={self.replicas} needs {self.replicas} nodes; this job has {nodes} "
                                  "(pass node= per process, or run under torchrun, which sets GROUP_RANK)")
        for r in range(self.world):
            held = [self.nodes[h] for h in self.holders(r)]
            if len(set(held)) != len(held):
                raise CheckpointError(
                    f"replica_stride={self.stride} puts copies of rank {r}'s files on one node: ranks "
                    f"{self.holders(r)} are on nodes {held}; use the number of ranks per node as the stride")


def discover(comm: Comm, node: int, replicas: int, stride: int | None) -> Topology:
    """Every rank's node (one small all-gather) and the checked :class:`Topology`."""
    nodes = tuple(int(b) for b in comm.all_gather_bytes(str(node).encode()))
    if stride is None:
        env = os.environ.get("LOCAL_WORLD_SIZE")
        stride = int(env) if env and env.isdigit() and node == int(os.environ.get("GROUP_RANK", node)) \
            else sum(1 for n in nodes if n == nodes[comm.rank])
    if stride < 1:
        raise CheckpointError(f"replica_stride must be at least 1, not {stride}")
    topo = Topology(nodes, replicas, stride)
    topo.check()
    return topo


__all__ = ["Topology", "discover", "node_id"]
