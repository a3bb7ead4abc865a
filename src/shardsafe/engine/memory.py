"""The per-rank host-memory budget, re-exported where the engine always found it: it lives
in :mod:`shardsafe.budget` (the bottom layer), so that storage backends lease their
buffers (S3 parts) from the same budget as the engine's staging and read buffers."""

from __future__ import annotations

from ..budget import HostMemory, Lease

__all__ = ["HostMemory", "Lease"]
