"""Distributed cases for incremental checkpoints (run on every rank of a WorkerPool)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

import shardsafe
from bitwise import assert_bitwise
from dist_cases import build, full_reference, train_state


def _change(model: torch.nn.Module, opt: torch.optim.Optimizer, rng: random.Random) -> list[str]:
    """Change a random subset of parameters (and their optimizer state), the same on every
    rank: each chosen parameter gets +1 on its local shard."""
    names = sorted(n for n, _ in model.named_parameters())
    chosen = rng.sample(names, rng.randint(1, max(1, len(names) // 3)))
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n in chosen:
            p = params[n]
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(1.0)
            st = opt.state.get(p)
            if st and "exp_avg" in st:
                ea = st["exp_avg"]
                (ea.to_local() if hasattr(ea, "to_local") else ea).add_(0.5)
    return chosen


def _warm(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    """One real step so the optimizer has state for every parameter."""
    torch.manual_seed(1)
    loss = model(torch.randint(0, 31, (2, 5))).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def _load_and_compare(world: int, path: str, ref: dict) -> None:
    """Load ``path`` into a fresh FSDP2 model and optimizer; compare with ``ref`` bitwise."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = build("fsdp", world)
    _warm(model, opt)
    state = train_state(model, opt)
    shardsafe.load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert_bitwise(ref, full_reference(train_state(model, opt)))


def chain_of_saves(rank: int, world: int, folder: str, saves: int, refs_path: str) -> dict:
    """FSDP2: ``saves`` checkpoints, each incremental on the previous one, with a random
    subset of parameters changed in between; each checkpoint reloaded into a fresh model
    and compared bitwise with the state at its save. Rank 0 writes the full references."""
    model, opt = build("fsdp", world)
    _warm(model, opt)
    rng = random.Random(7)
    refs = {}
    referred = []
    written = []
    previous = None
    for i in range(saves):
        if i:
            _change(model, opt, rng)
        state = train_state(model, opt)
        state["step"] = i
        path = f"{folder}/step-{i:08d}"
        info = shardsafe.save(state, path, base=previous)
        referred.append(info.bytes_referred)
        written.append(info.bytes_written)
        refs[i] = full_reference({"model": state["model"], "optim": state["optim"]})
        previous = path
    for i in range(saves):
        fresh, fresh_opt = build("fsdp", world)
        _warm(fresh, fresh_opt)
        with torch.no_grad():
            for p in fresh.parameters():
                (p.to_local() if hasattr(p, "to_local") else p).zero_()
        state = train_state(fresh, fresh_opt)
        state["step"] = -1
        shardsafe.load(state, f"{folder}/step-{i:08d}")
        assert state["step"] == i
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        got = full_reference(train_state(fresh, fresh_opt))
        assert_bitwise(refs[i], got)
    if rank == 0:
        torch.save(refs, refs_path)
    dist.barrier()
    return {"referred": referred, "written": written}


def load_chain_resharded(rank: int, world: int, folder: str, saves: int, refs_path: str) -> int:
    """Load every checkpoint of :func:`chain_of_saves` on another world size and compare."""

    refs = torch.load(refs_path, weights_only=True)
    for i in range(saves):
        _load_and_compare(world, f"{folder}/step-{i:08d}", refs[i])
    return saves


def manager_chain(rank: int, world: int, folder: str, steps: int) -> list[int]:
    """A CheckpointManager with incremental saves and keep_last=2 over ``steps`` saves of
    an FSDP2 model; every kept checkpoint compared with its state at save time."""
    model, opt = build("fsdp", world)
    _warm(model, opt)
    rng = random.Random(3)
    refs = {}
    with shardsafe.CheckpointManager(folder, interval=1, keep_last=2, incremental=True, full_every=4) as mgr:
        for step in range(1, steps + 1):
            _change(model, opt, rng)
            state = train_state(model, opt)
            mgr.save(step, state)
            refs[step] = full_reference(state)
        kept = mgr.agreed_steps()
        for step in kept:
            from torch.distributed.checkpoint.state_dict import set_state_dict

            fresh, fresh_opt = build("fsdp", world)
            _warm(fresh, fresh_opt)
            state = train_state(fresh, fresh_opt)
            mgr.load(state, step=step)
            set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            assert_bitwise(refs[step], full_reference(train_state(fresh, fresh_opt)))
    return kept


def async_chain(rank: int, world: int, folder: str) -> list[int]:
    """async_save with a base on a process group: three saves, each loaded back bitwise."""

    model, opt = build("fsdp", world)
    _warm(model, opt)
    rng = random.Random(11)
    refs = {}
    referred = []
    previous = None
    for i in range(3):
        if i:
            _change(model, opt, rng)
        state = train_state(model, opt)
        fut = shardsafe.async_save(state, f"{folder}/a{i}", base=previous)
        fut.staged()
        refs[i] = full_reference(state)
        referred.append(fut.result().bytes_referred)
        previous = f"{folder}/a{i}"
    for i in range(3):
        _load_and_compare(world, f"{folder}/a{i}", refs[i])
    return referred
