"""The training loop the Ray Train tests run in their workers (tests/test_ray.py).

A small FSDP2 model (a frozen embedding, two trained linear layers: ``fully_shard`` per
layer and at the root) trained with AdamW, a StepLR schedule and an ElasticSampler, all in
one ``shardsafe.TrainState``, checkpointed with ``shardsafe.integrations.ray``. Rank 0
appends one JSON line per event to ``config["log"]``: the start of each attempt (world
size, step restored, how a plain ``shardsafe.load`` of the same checkpoint compares) and
each step (the global loss as a float hex string and the sorted sample ids of the global
batch). With ``config["dumps"]``, rank 0 also ``torch.save``s the full (gathered) state
right after each report and after a restore, for the test to compare bitwise.

``config["kill_at"]``: on the first attempt, rank 1 SIGKILLs itself while the state of that
step is being saved (inside ``state_dict`` of the ``probe`` entry).
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, HIDDEN, SEQ = 64, 32, 64, 8
SAMPLES = 512


class Net(nn.Module):
    """Token classifier: mean of frozen embeddings -> Linear -> tanh -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.emb.weight.requires_grad_(False)  # unchanged between saves: incremental saves refer to it
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(self.emb(x).mean(1))))


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1) % VOCAB, torch.arange(SAMPLES))


class Probe:
    """A Stateful in the checkpointed tree; kills rank 1 while step ``kill_at`` is saved."""

    def __init__(self, state: Any, config: dict[str, Any]) -> None:
        self.state, self.config = state, config

    def state_dict(self) -> dict[str, Any]:
        cfg = self.config
        if (cfg.get("kill_at") == self.state.step and dist.get_rank() == 1
                and not os.path.exists(cfg["kill_marker"])):
            open(cfg["kill_marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return {"saved_at": self.state.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


def build(config: dict[str, Any], init_seed: int) -> dict[str, Any]:
    """Model (FSDP2 over every worker), optimizer, scheduler, sampler and their TrainState."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardsafe
    from shardsafe.data import ElasticSampler

    torch.manual_seed(init_seed)
    model = Net()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.02)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.7)
    sampler = ElasticSampler(SAMPLES, config["global_batch"], seed=11)
    state = shardsafe.TrainState(model, opt, sched, data=sampler, rng_base_seed=5)
    return {"model": model, "opt": opt, "sched": sched, "sampler": sampler, "state": state,
            "tree": {"train": state, "probe": Probe(state, config)}}


def full_state(parts: dict[str, Any]) -> dict[str, Any]:
    """Everything checkpointed, gathered to full tensors (every rank calls; a collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_sd, optim_sd = get_state_dict(parts["model"], parts["opt"],
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    st = parts["state"]
    return {"model": model_sd, "optim": optim_sd, "sched": parts["sched"].state_dict(),
            "data": parts["sampler"].state_dict(), "counters": [st.step, st.epoch, st.tokens_seen]}


def local_state(parts: dict[str, Any]) -> dict[str, Any]:
    """This rank's view of the state (DTensor shards, no collective)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(parts["model"], parts["opt"])
    st = parts["state"]
    return {"model": model_sd, "optim": optim_sd, "sched": parts["sched"].state_dict(),
            "data": parts["sampler"].state_dict(), "counters": [st.step, st.epoch, st.tokens_seen]}


def train_loop(config: dict[str, Any]) -> None:
    """The loop every Ray worker runs (``TorchTrainer(train_loop, train_loop_config=config)``)."""
    import shardsafe
    from bitwise import first_difference
    from shardsafe.integrations import ray as ss_ray

    rank, world = dist.get_rank(), dist.get_world_size()
    so = config.get("storage_options")
    save_opts = {"async_save": config.get("async_save", False), "incremental": config.get("incremental", False),
                 "compression": config.get("compression", "off"), "storage_options": so}

    def log(entry: dict[str, Any]) -> None:
        if rank == 0:
            with open(config["log"], "a") as f:
                f.write(json.dumps({"run": config["name"], "pid": os.getpid(), "t": time.time(), **entry}) + "\n")

    def dump(kind: str, step: int) -> None:
        full = full_state(parts)
        if rank == 0 and config.get("dumps"):
            torch.save(full, os.path.join(config["dumps"], f"{config['name']}-{kind}-{step}.pt"))

    parts = build(config, init_seed=1)
    restored = ss_ray.restore(parts["tree"], checkpoint=config.get("resume_from"), storage_options=so)
    entry: dict[str, Any] = {"event": "start", "world": world, "restored": restored}
    if restored is not None:
        # the same checkpoint through a plain shardsafe.load into fresh objects: must be bitwise the same
        location, step = ss_ray.checkpoint_location(ray_checkpoint() or config["resume_from"])
        fresh = build(config, init_seed=2)
        shardsafe.load(fresh["tree"], location, storage_options=so)
        diff = first_difference(local_state(parts), local_state(fresh))
        diffs = [None] * world
        dist.all_gather_object(diffs, diff)
        entry.update(location=location, plain_load_difference=[d for d in diffs if d is not None],
                     step_of_pointer=step)
        del fresh
        dump("restored", restored)
    log(entry)

    state, sampler = parts["state"], parts["sampler"]
    loader = torch.utils.data.DataLoader(dataset(), batch_size=config["global_batch"] // world, sampler=sampler)
    it = iter(loader)
    while state.step < config["steps"]:
        x, y, ids = next(it)
        loss = F.cross_entropy(parts["model"](x), y)
        loss.backward()
        parts["opt"].step()
        parts["opt"].zero_grad(set_to_none=True)
        parts["sched"].step()
        sampler.advance()
        state.step += 1
        total = loss.detach().clone()
        dist.all_reduce(total)
        everyone = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(everyone, ids.contiguous())
        log({"step": state.step, "loss": (total / world).item().hex(), "ids": sorted(torch.cat(everyone).tolist())})
        if state.step % config["interval"] == 0:
            metrics = {"step": state.step, "loss": (total / world).item()}
            if config.get("scores"):
                metrics["score"] = config["scores"][str(state.step)]
            ss_ray.report(parts["tree"], metrics, step=state.step, **save_opts)
            dump("saved", state.step)
    ss_ray.close()
    log({"event": "end", "step": state.step})


def ray_checkpoint() -> Any:
    import ray.train

    return ray.train.get_checkpoint()


def read_log(path: str, run: str) -> list[dict[str, Any]]:
    """The log lines of run ``run``."""
    with open(path) as f:
        return [e for e in map(json.loads, f) if e["run"] == run]


def losses(entries: list[dict[str, Any]]) -> dict[int, tuple[str, list[int]]]:
    """step -> (loss hex, sample ids) of the last attempt that logged the step."""
    return {e["step"]: (e["loss"], e["ids"]) for e in entries if "step" in e and "loss" in e}


def pointer_disagreement(rank: int, world: int, root: str) -> str:
    """Run on a gloo pool: rank 1's Ray checkpoint has no pointer; every rank must raise a
    CheckpointError naming rank 1 (not wait in the load). Returns the message."""
    import pyarrow.fs
    import ray.train

    from shardsafe import CheckpointError
    from shardsafe.integrations.ray import _agreed_location

    folder = os.path.join(root, "run", "checkpoint_00000003" if rank == 1 else "checkpoint_00000002")
    ckpt = ray.train.Checkpoint(path=folder, filesystem=pyarrow.fs.LocalFileSystem())
    try:
        _agreed_location(ckpt)
    except CheckpointError as exc:
        return str(exc)
    return "no error"
