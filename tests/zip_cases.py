"""Per-rank cases of tests/test_compression.py (run on the ``pg_pool`` gloo workers)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardsafe
from bitwise import assert_bitwise
from dist_cases import build, data_rank, full_reference, train, train_state


def save_compressed(rank: int, world: int, layout: str, path: str, ref_path: str, codec: str) -> dict:
    """Train ``layout`` a few steps and save it compressed; rank 0 writes a full reference."""
    model, opt = build(layout, world)
    train(model, opt, 3, data_rank(layout, rank))
    state = train_state(model, opt)
    info = shardsafe.save(state, path, compression=codec)
    ref = full_reference(state)  # (a collective: every rank)
    if rank == 0:
        torch.save(ref, ref_path)
    dist.barrier()
    return {"compression": info.compression, "stored": info.bytes_stored, "ratio": info.compression_ratio}


def load_compressed(rank: int, world: int, layout: str, path: str, ref_path: str) -> dict:
    """Load into a fresh ``layout`` (verify=False: each stored block is read once), compare bitwise."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = build(layout, world)
    state = train_state(model, opt)
    info = shardsafe.load(state, path, verify=False)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_bitwise(torch.load(ref_path, weights_only=True), full_reference(train_state(model, opt)))
    checked = shardsafe.load(train_state(*build(layout, world)), path)  # verify=True loads too
    return {"stored_read": info.bytes_stored_read, "tensors": checked.tensors}


ROWS, COLS = 8192, 256  # fp32: 1 KiB a row, 1024 rows a checksum block


def _weights() -> torch.Tensor:
    return torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(0)) * 0.02


def save_rows(rank: int, world: int, path: str) -> dict:
    """A Shard(0) DTensor of realistic weights, saved compressed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    info = shardsafe.save({"w": distribute_tensor(_weights(), mesh, [Shard(0)])}, path, compression="zstd")
    return {"ratio": info.compression_ratio}


def load_rows(rank: int, world: int, path: str) -> dict:
    """Load the rows this rank holds at ``world`` ranks (verify=False: each block read once);
    returns the stored bytes read and the rows."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dest = distribute_tensor(torch.zeros(ROWS, COLS), mesh, [Shard(0)])
    info = shardsafe.load({"w": dest}, path, verify=False)
    per = -(-ROWS // world)
    lo, hi = min(ROWS, rank * per), min(ROWS, (rank + 1) * per)
    assert torch.equal(dest.to_local(), _weights()[lo:hi])
    return {"stored_read": info.bytes_stored_read, "rows": (lo, hi)}
