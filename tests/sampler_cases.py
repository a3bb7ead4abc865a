"""Case functions for tests/test_elastic_sampler.py, run on every rank of a real gloo
WorkerPool (see distributed.py); each takes (rank, world, *args)."""

from __future__ import annotations

import torch.distributed as dist

from shardsafe.data import ElasticSampler


def defaults_from_the_process_group(rank: int, world: int, dataset_len: int, global_batch: int) -> dict:
    """What ElasticSampler picks up from the initialized default group, what explicit
    ``rank=`` / ``world_size=`` give instead, and the samples each yields."""
    assert dist.is_initialized()
    found = ElasticSampler(dataset_len, global_batch, seed=3)
    explicit = ElasticSampler(dataset_len, global_batch, rank=0, world_size=1, seed=3)
    mixed = ElasticSampler(dataset_len, global_batch, rank=world - 1 - rank, seed=3)
    return {"found": (found.rank, found.world_size), "found_samples": list(found),
            "explicit": (explicit.rank, explicit.world_size),
            "mixed": (mixed.rank, mixed.world_size)}
