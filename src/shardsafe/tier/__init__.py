"""The node-local recovery tier: local saves, replication to peers, restore from the
fastest complete copy (see :class:`~shardsafe.tier.local.LocalTier`)."""

from .local import LocalTier, TierStep
from .topology import Topology

__all__ = ["LocalTier", "TierStep", "Topology"]
