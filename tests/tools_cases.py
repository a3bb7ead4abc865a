"""Case functions for tests/test_tools.py, run on every rank of a WorkerPool (tests/distributed.py).

Each takes (rank, world, *args)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import shardsafe
from dist_cases import build, data_rank, full_reference, train, train_state


def save_fsdp_both(rank: int, world: int, dcp_dir: str, ours_dir: str, ref_path: str) -> dict:
    """Build the FSDP2 Tiny model on ``world`` ranks, train one step, save the state with
    DCP (``dcp_dir``) and with shardsafe (``ours_dir``); rank 0 writes a full reference
    of the state with torch.save (``ref_path``)."""
    model, opt = build("fsdp", world)
    train(model, opt, 1, rank)
    state = train_state(model, opt)
    dcp.save(state, checkpoint_id=dcp_dir)
    shardsafe.save(state, ours_dir)
    ref = full_reference(state)
    if rank == 0:
        torch.save(ref, ref_path)
    dist.barrier()
    return {"rank": rank}


def save_tp(rank: int, world: int, ours_dir: str) -> dict:
    """FSDP2 + tensor parallel (2-D mesh; RowwiseParallel shards weights by columns): train
    one step and save with shardsafe."""
    model, opt = build("fsdp_tp", world)
    train(model, opt, 1, data_rank("fsdp_tp", rank))  # TP peers see one batch (replicated biases stay equal)
    shardsafe.save(train_state(model, opt), ours_dir)
    dist.barrier()
    return {"rank": rank}
