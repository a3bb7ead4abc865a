"""Data position: a sampler whose position is global, and keeping the global batch.

See :mod:`shardsafe.data.elastic_sampler` for the semantics of resuming on a different
world size.
"""

from .batching import keep_global_batch, per_rank_batch
from .elastic_sampler import ElasticSampler

__all__ = ["ElasticSampler", "keep_global_batch", "per_rank_batch"]
