"""Case functions for the async-save and CheckpointManager tests.

Multi-rank cases take ``(rank, world, *args)`` and run on every rank of a WorkerPool
(see distributed.py). ``kill_target`` is the body of the child process that the kill -9
test starts and kills mid-save; ``step_state`` / ``expected_step_state`` give the
deterministic, per-step distinct content it saves.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import dist_cases
import shardsafe
from shardsafe.storage.faults import FaultyBackend

MiB = 1 << 20


# ----------------------------------------------------------------------------- kill -9 child

KILL_TENSORS = 5
KILL_NUMEL = 2 * MiB  # 5 x 8 MiB float32 = 40 MiB


def _base(i: int) -> torch.Tensor:
    return torch.arange(KILL_NUMEL, dtype=torch.float32).mul_(1e-3).add_(1000.0 * i)


def step_state() -> dict:
    """A ~40 MiB state (step 0): five float32 tensors, an int64 tensor and the step."""
    state: dict = {f"w{i}": _base(i) for i in range(KILL_TENSORS)}
    state["tag"] = torch.zeros(16, dtype=torch.int64)
    state["step"] = 0
    return state


def set_step(state: dict, bases: list[torch.Tensor], step: int) -> None:
    """Overwrite ``state`` in place with the content of ``step`` (distinct for every step)."""
    for i, b in enumerate(bases):
        state[f"w{i}"].copy_(b).add_(float(step))
    state["tag"].fill_(step)
    state["step"] = step


def expected_step_state(step: int) -> dict:
    state = step_state()
    set_step(state, [_base(i) for i in range(KILL_TENSORS)], step)
    return state


def kill_target(folder: str, steps: int, keep_last: int) -> None:
    """Child body: save steps 1..steps with an async CheckpointManager, mutating the state
    in place right after each save returns (killed with SIGKILL by the parent)."""
    torch.set_num_threads(1)  # started by fork: never enter the parent's OpenMP pool
    mgr = shardsafe.CheckpointManager(folder, interval=1, async_mode="async", keep_last=keep_last)
    state = step_state()
    bases = [_base(i) for i in range(KILL_TENSORS)]
    for step in range(1, steps + 1):
        set_step(state, bases, step)
        mgr.save(step, state)
    mgr.close()
    os._exit(0)


# ----------------------------------------------------------------------------- multi-rank cases


def _mutate_(state) -> None:
    """Add 1 in place to every tensor (DTensor: its local shard) of a state tree."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(state, DTensor):
            state.to_local().add_(1)
        elif isinstance(state, torch.Tensor):
            if state.is_floating_point() or state.dtype in (torch.int32, torch.int64):
                state.add_(1)
        elif isinstance(state, dict):
            for v in state.values():
                _mutate_(v)
        elif isinstance(state, (list, tuple)):
            for v in state:
                _mutate_(v)


def fsdp_async_vs_sync(rank: int, world: int, sync_path: str, async_path: str, ref_path: str) -> dict:
    """Train FSDP2 a few steps; save it synchronously and asynchronously; mutate the state
    right after async_save returns; rank 0 writes the full reference of the saved state."""
    model, opt = dist_cases.build("fsdp", world)
    dist_cases.train(model, opt, 3, rank)
    state = dist_cases.train_state(model, opt)
    ref = dist_cases.full_reference(state)
    shardsafe.save(state, sync_path)
    fut = shardsafe.async_save(state, async_path)
    staged_now = fut.staged(0)
    _mutate_(state)  # must not leak into the async checkpoint
    info = fut.result(timeout=120)
    if rank == 0:
        torch.save(ref, ref_path)
    dist.barrier()
    return {"staged": staged_now, "done": fut.done(), "bytes": info.bytes_written}


def manager_async_retention(rank: int, world: int, folder: str, steps: int, keep_last: int,
                            keep_every: int) -> dict:
    """An async CheckpointManager with retention on every rank: replicated and rank-local
    tensors, distinct per step, mutated right after each save; then resume the latest
    into a fresh state. Reports the steps, the load and the step folders this rank deleted."""
    deleted: list[str] = []

    def record(op: str, name: str) -> None:
        # Retention takes a step folder out of sight by renaming it to a -del- name first.
        src, _, dst = name.partition("->")
        if op == "rename" and src.startswith("step-") and ".shardsafe-del-" in dst:
            deleted.append(src)

    # Record the retention deletes of this rank through the storage seam.
    cp = shardsafe.Checkpointer(storage=FaultyBackend(on_op=record))
    mgr = shardsafe.CheckpointManager(folder, interval=1, keep_last=keep_last, keep_every=keep_every,
                                      async_mode="async", checkpointer=cp)
    state = {
        "w": torch.zeros(64, 33),
        "big": torch.zeros(300_000),
        "mine": shardsafe.rank_local({"t": torch.zeros(5, dtype=torch.int64)}),
        "step": 0,
    }
    seen = _manager_loop(mgr, state, rank, steps)
    result = _manager_check(mgr, folder, rank) | {"deleted": deleted, "seen": seen}
    cp.close()
    return result


def _manager_loop(mgr, state: dict, rank: int, steps: int) -> list[list[int]]:
    seen_during: list[list[int]] = []
    for step in range(1, steps + 1):
        state["w"].fill_(float(step))
        state["big"].fill_(step * 0.5)
        state["mine"].value["t"].fill_(step * 100 + rank)
        state["step"] = step
        mgr.maybe_save(step, state)
        _mutate_(state)  # in place, right after the save returns
        seen_during.append(mgr.steps())
    mgr.wait()
    dist.barrier()
    return seen_during


def _manager_check(mgr, folder: str, rank: int) -> dict:
    after = mgr.steps()
    leftovers = sorted(p.name for p in Path(folder).iterdir() if not p.name.startswith("step-"))
    fresh = {
        "w": torch.full((64, 33), -1.0),
        "big": torch.full((300_000,), -1.0),
        "mine": shardsafe.rank_local({"t": torch.full((5,), -1, dtype=torch.int64)}),
        "step": -1,
    }
    loaded = mgr.load(fresh)
    ok = (
        torch.equal(fresh["w"], torch.full((64, 33), float(loaded)))
        and torch.equal(fresh["big"], torch.full((300_000,), loaded * 0.5))
        and torch.equal(fresh["mine"].value["t"], torch.full((5,), loaded * 100 + rank, dtype=torch.int64))
        and fresh["step"] == loaded
    )
    mgr.close()
    dist.barrier()
    return {"steps": after, "loaded": loaded, "ok": ok, "leftovers": leftovers}
