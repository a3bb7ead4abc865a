"""Case functions for the distributed S3 tests (test_s3_distributed.py), run on every rank
of a WorkerPool (see distributed.py). Each takes (rank, world, *args).

The S3 server (and any fault proxy in front of it) lives in the pytest process; the ranks
reach it over HTTP through the ``storage_options`` they are given (``opts``: one mapping for
every rank, or a list with one per rank). Models and helpers come from dist_cases."""

from __future__ import annotations

import torch
import torch.distributed as dist

import shardsafe
from bitwise import assert_bitwise
from dist_cases import big_replicated, build, data_rank, full_reference, train, train_state


def _opts(opts, rank: int) -> dict:
    return opts[rank] if isinstance(opts, list) else opts


def _state(layout: str, world: int, rank: int, extra: list | None, seed: int):
    """A trained ``layout`` model, its optimizer and their state (plus ``extra``
    replicated tensors from big_replicated when given)."""
    model, opt = build(layout, world)
    train(model, opt, 3, data_rank(layout, rank), seed)
    state = train_state(model, opt)
    if extra:
        state["extra"] = _place(layout, world, big_replicated([tuple(s) for s in extra], seed))
    return model, opt, state


def _place(layout: str, world: int, tensors: dict) -> dict:
    """Under HSDP, ``tensors`` as DTensors replicated over the 2 replica groups and
    sharded (dim 0) inside each (the layout of HSDP parameters); else as they are."""
    if layout != "hsdp":
        return tensors
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    return {k: distribute_tensor(v, mesh, [Replicate(), Shard(0)]) for k, v in tensors.items()}


def save_trained(rank: int, world: int, layout: str, url: str, opts, ref_path: str | None,
                 extra: list | None = None, seed: int = 1, overwrite: bool = False,
                 use_async: bool = False) -> dict:
    """Train ``layout``, save it at ``url`` (sync or async); rank 0 writes the full state
    to ``ref_path`` (a local torch.save file) as the reference loads are compared with.
    Returns the SaveInfo figures, or the error raised as (type name, message)."""
    _, _, state = _state(layout, world, rank, extra, seed)
    ref = full_reference(state)  # collective for DTensors: every rank calls it
    if rank == 0 and ref_path is not None:
        torch.save(ref, ref_path)
    dist.barrier()
    try:
        if use_async:
            future = shardsafe.async_save(state, url, overwrite=overwrite, storage_options=_opts(opts, rank))
            info = future.result(timeout=120)
        else:
            info = shardsafe.save(state, url, overwrite=overwrite, storage_options=_opts(opts, rank))
    except shardsafe.CheckpointError as exc:
        return {"error": (type(exc).__name__, str(exc))}
    # The group is still in step after the save (a collective that would hang otherwise).
    dist.barrier()
    return {"error": None, "retries": info.retries, "bytes_written": info.bytes_written, "files": info.files}


def load_checked(rank: int, world: int, layout: str, url: str, opts, ref_path: str, extra: list | None = None,
                 broadcast: bool | None = None) -> dict:
    """Build ``layout`` fresh (untrained: every value differs from the saved one), load
    ``url`` into it, and compare the full state bitwise with the reference at ``ref_path``.
    Returns the LoadInfo figures."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = build(layout, world)
    state = train_state(model, opt)
    if extra:
        zeros = {k: torch.zeros_like(v) for k, v in big_replicated([tuple(s) for s in extra]).items()}
        state["extra"] = _place(layout, world, zeros)
    info = shardsafe.load(state, url, broadcast_replicated=broadcast, storage_options=_opts(opts, rank))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_reference(train_state(model, opt))
    if extra:
        got["extra"] = full_reference(state["extra"])
    assert_bitwise(torch.load(ref_path, weights_only=True), got)
    return {"bytes_read": info.bytes_read, "bytes_copied": info.bytes_copied, "bytes_received": info.bytes_received,
            "retries": info.retries, "tensors": info.tensors}

