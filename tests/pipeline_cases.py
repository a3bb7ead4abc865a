"""Distributed cases for test_pipeline.py (run on every rank of a gloo pool)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardsafe
from shardsafe.storage.faults import FaultyBackend


def save_kind_conflict(rank: int, world: int, path: str) -> str | None:
    state = {"x": 1 if rank == 0 else torch.ones(3), "w": torch.zeros(2)}
    try:
        shardsafe.save(state, path)
    except shardsafe.CheckpointError as exc:
        return str(exc)
    return None


def manager_stale_listing(rank: int, world: int, folder: str) -> dict:
    with shardsafe.CheckpointManager(folder, interval=1) as mgr:
        for step in (1, 2, 3):
            mgr.save(step, {"w": torch.full((4,), float(step))})
    # Rank 1 sees a stale listing without step 3.
    hidden = ["step-00000003"] if rank == 1 else []
    cp = shardsafe.Checkpointer(storage=FaultyBackend(hidden=hidden))
    dest = {"w": torch.zeros(4)}
    with shardsafe.CheckpointManager(folder, interval=1, checkpointer=cp) as mgr:
        loaded = mgr.load(dest)
    cp.close()
    # Ranks loading different checkpoints (different paths here) must refuse together.
    other = f"{folder}/step-0000000{1 + rank}"
    try:
        shardsafe.load({"w": torch.zeros(4)}, other)
        mismatch = ""
    except shardsafe.CheckpointError as exc:
        mismatch = str(exc)
    dist.barrier()
    return {"loaded": loaded, "value": float(dest["w"][0]), "mismatch": mismatch}


def load_into_stateless_optimizer(rank: int, world: int, path: str) -> str:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from dist_cases import build, train

    model, opt = build("fsdp", world)
    train(model, opt, 1, rank)
    _, osd = get_state_dict(model, opt)
    shardsafe.save({"optim": osd}, path)
    fresh_model, fresh_opt = build("fsdp", world)
    try:
        shardsafe.load({"optim": fresh_opt.state_dict()}, path)  # no state: nothing to fill in place
    except shardsafe.CheckpointError as exc:
        return str(exc)
    return "loaded"


def train_state_on_subgroups(rank: int, world: int, folder: str) -> None:
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    g = rank // 2
    torch.manual_seed(0)  # replicated weights: the same on every rank
    model = torch.nn.Linear(3, 2)
    state = shardsafe.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    shardsafe.save({"train": state}, f"{folder}/g{g}", process_group=groups[g])
    dist.barrier()
    for group in groups:
        dist.destroy_process_group(group)


def optimizer_before_fully_shard(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dist_cases import Tiny

    model = Tiny()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # too early
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    try:
        shardsafe.save({"train": shardsafe.TrainState(model, opt)}, path)
    except shardsafe.CheckpointError as exc:
        return str(exc)
    return "saved"


def save_differing_replica(rank: int, world: int, path: str) -> dict:
    state = {"same": torch.ones(3), "w": torch.full((4,), float(rank == 1))}
    try:
        shardsafe.save(state, path, check_replicas=True)
        refused = ""
    except shardsafe.CheckpointError as exc:
        refused = str(exc)
    info = shardsafe.save(state, path + "-unchecked", check_replicas=False)
    return {"refused": refused, "bytes": info.bytes_written}


def _bcast_state() -> dict:
    torch.manual_seed(0)
    return {"big": torch.randn(1 << 16), "w": torch.randn(300, 7), "t": torch.arange(10), "step": 3}


def save_for_broadcast(rank: int, world: int, path: str) -> None:
    shardsafe.save(_bcast_state(), path)


def load_broadcast(rank: int, world: int, path: str, broadcast: bool) -> dict:
    state = _bcast_state()
    dest = {"big": torch.zeros(1 << 16), "w": torch.zeros(7, 300).t(), "t": torch.zeros(10, dtype=torch.int64),
            "step": 0}
    info = shardsafe.load(dest, path, broadcast_replicated=broadcast)
    ok = all(torch.equal(dest[k], state[k]) for k in ("big", "w", "t")) and dest["step"] == 3
    return {"ok": ok, "read": info.bytes_copied, "received": info.bytes_received}
