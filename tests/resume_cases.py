"""Exact-resume runs shared by tests/test_resume.py.

One small training recipe (an MLP with dropout on a synthetic classification set, AdamW,
a warmup + cosine LR schedule, optionally a GradScaler, an ElasticSampler feeding a
DataLoader) runs on one process (``single``, ``compiled``), under DDP or under FSDP2.
The case functions take ``(rank, world, *args)`` and run on every rank of a WorkerPool
(see distributed.py); :func:`single_main` is the entry point of the fresh processes the
single-process tests start.

Rules the recipe follows so that a resumed run is bitwise the uninterrupted one:

* the DataLoader gets its own ``generator``: without one, every ``iter(loader)`` draws its
  base seed from the global torch RNG, and a resumed run creates an iterator mid-epoch
  where the uninterrupted run did not, which shifts every later dropout mask;
* the sampler is told what the loop took (``sampler.advance()`` after each optimizer
  step), never what the DataLoader prefetched;
* every RNG draw happens in the training step (dropout), after the TrainState restored
  the streams.
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shardsafe
from bitwise import assert_bitwise
from dist_cases import full_reference
from shardsafe.data import ElasticSampler, keep_global_batch, per_rank_batch
from shardsafe.state.rng import derive_seed

DIM, HIDDEN, CLASSES = 16, 32, 5

DEFAULTS: dict[str, Any] = {
    "dataset_len": 96,  # 12 global batches of 8: a 20-step run crosses an epoch boundary
    "global_batch": 8,
    "micro_batch": None,  # None: per_rank_batch(global_batch, world) (no accumulation)
    "dropout": 0.1,
    "workers": 0,
    "scaler": False,
    "lr": 3e-3,
    "warmup": 4,
    "total": 20,
    "save_at": 10,
    "data_seed": 5,
    "rng_base_seed": 1234,
    "backend": "eager",  # torch.compile backend of the "compiled" layout
}


def config(**overrides: Any) -> dict[str, Any]:
    unknown = set(overrides) - set(DEFAULTS)
    if unknown:
        raise ValueError(f"unknown settings {sorted(unknown)}")
    return {**DEFAULTS, **overrides}


# ----------------------------------------------------------------------------- the recipe


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(self.norm(x))))


class Net(nn.Module):
    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.inp = nn.Linear(DIM, HIDDEN)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(HIDDEN, dropout) for _ in range(2))
        self.out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(F.gelu(self.inp(x)))
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def dataset(n: int) -> TensorDataset:
    """(features, label, sample id) triples, the same in every process."""
    g = torch.Generator().manual_seed(42)
    x = torch.randn(n, DIM, generator=g)
    y = torch.randint(0, CLASSES, (n,), generator=g)
    return TensorDataset(x, y, torch.arange(n))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class Run:
    model: nn.Module
    opt: torch.optim.Optimizer
    sched: Any
    scaler: Any
    sampler: ElasticSampler
    loader: DataLoader
    state: shardsafe.TrainState
    accum: int
    rank: int
    world: int
    cfg: dict[str, Any]

    @property
    def distributed(self) -> bool:
        return self.world > 1


def build_run(cfg: dict[str, Any], layout: str, rank: int, world: int, *, init_seed: int, rng_seed: int) -> Run:
    """Fresh model / optimizer / scheduler / scaler / sampler / loader / TrainState.

    ``init_seed`` seeds the weights (every rank alike); afterwards every RNG stream is
    seeded with ``rng_seed + rank``, so ranks draw different dropout masks."""
    torch.manual_seed(init_seed)
    net = Net(cfg["dropout"])
    if layout == "ddp":
        model: nn.Module = nn.parallel.DistributedDataParallel(net)
    elif layout == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for b in net.blocks:
            fully_shard(b, mesh=mesh)
        model = fully_shard(net, mesh=mesh)
    elif layout == "compiled":
        model = torch.compile(net, backend=cfg["backend"])
    elif layout == "single":
        model = net
    else:
        raise ValueError(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=cfg["warmup"])
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg["total"], eta_min=cfg["lr"] / 10)
    sched = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[cfg["warmup"]])
    scaler = torch.amp.GradScaler("cpu", growth_interval=3) if cfg["scaler"] else None
    g = cfg["global_batch"]
    micro = cfg["micro_batch"] or per_rank_batch(g, world)
    accum = keep_global_batch(g, world, micro)
    ds = dataset(cfg["dataset_len"])
    sampler = ElasticSampler(len(ds), g, rank=rank, world_size=world, seed=cfg["data_seed"])
    loader = DataLoader(ds, batch_size=micro, sampler=sampler, num_workers=cfg["workers"],
                        generator=torch.Generator().manual_seed(0))
    state = shardsafe.TrainState(model, opt, sched, scaler, sampler, extra={"recipe": "resume_cases"},
                                 rng_base_seed=cfg["rng_base_seed"])
    seed_everything(rng_seed + rank)
    return Run(model, opt, sched, scaler, sampler, loader, state, accum, rank, world, cfg)


def _step(run: Run, it: Any) -> dict[str, Any]:
    """One optimizer step over ``run.accum`` micro-batches; the step's record."""
    lr = float(run.opt.param_groups[0]["lr"])
    total = torch.zeros(())
    ids: list[int] = []
    for _ in range(run.accum):
        x, y, i = next(it)
        loss = F.cross_entropy(run.model(x), y) / run.accum
        (run.scaler.scale(loss) if run.scaler is not None else loss).backward()
        total += loss.detach()
        ids += i.tolist()
    if run.scaler is not None:
        run.scaler.step(run.opt)
        run.scaler.update()
    else:
        run.opt.step()
    run.opt.zero_grad(set_to_none=True)
    run.sched.step()
    run.sampler.advance()
    run.state.step += 1
    run.state.tokens_seen += run.cfg["global_batch"]
    local = float(total)
    if run.distributed:
        dist.all_reduce(total)
        parts: list[Any] = [None] * run.world
        dist.all_gather_object(parts, ids)
        ids = [i for p in parts for i in p]
        total /= run.world
    return {"step": run.state.step, "lr": lr, "loss": float(total), "local_loss": local, "ids": ids}


def train(run: Run, stop: int, on_step: Any = None) -> list[dict[str, Any]]:
    """Train until ``run.state.step == stop``; one iterator per epoch (or per resume)."""
    records = []
    while run.state.step < stop:
        if run.sampler.global_batches_left == 0:
            run.sampler.set_epoch(run.sampler.epoch + 1)
            run.state.epoch = run.sampler.epoch
        it = iter(run.loader)  # starts at the sampler's position
        for _ in range(min(run.sampler.global_batches_left, stop - run.state.step)):
            records.append(_step(run, it))
            if on_step is not None:
                on_step(run)
        del it
    return records


def snapshot(run: Run) -> dict[str, Any]:
    """Full copies of everything a resume must reproduce (collective for DTensors)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(run.model, run.opt)
    return {
        "model": full_reference(msd),
        "optim": full_reference(osd),
        "sched": run.sched.state_dict(),
        "scaler": run.scaler.state_dict() if run.scaler is not None else None,
        "sampler": run.sampler.state_dict(),
        "counters": {"step": run.state.step, "epoch": run.state.epoch, "tokens_seen": run.state.tokens_seen},
        "rank_local_rng": torch.get_rng_state(),
    }


def schedule_view(run: Run) -> dict[str, Any]:
    """What the scheduler and optimizer say about the LR right now."""
    return {
        "param_group_lr": [float(g["lr"]) for g in run.opt.param_groups],
        "last_lr": [float(x) for x in run.sched.get_last_lr()],
        "last_epoch": run.sched.last_epoch,
    }


def assert_records_equal(a: list[dict], b: list[dict], what: str) -> None:
    assert len(a) == len(b), f"{what}: {len(a)} vs {len(b)} steps"
    for ra, rb in zip(a, b):
        assert ra == rb, f"{what}: step {ra['step']} differs:\n  uninterrupted {ra}\n  resumed       {rb}"


# ----------------------------------------------------------------------------- one process


def single_first(cfg: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """The uninterrupted run, then a run that saves through a CheckpointManager (every
    ``save_at // 2`` steps, keeping the last one) and stops at ``save_at``."""
    straight = build_run(cfg, "single", 0, 1, init_seed=0, rng_seed=100)
    rec_straight = train(straight, cfg["total"])
    final_straight = snapshot(straight)
    del straight

    first = build_run(cfg, "single", 0, 1, init_seed=0, rng_seed=100)
    mgr = shardsafe.CheckpointManager(ckpt_dir, interval=cfg["save_at"] // 2, keep_last=1)
    rec_first = train(first, cfg["save_at"], lambda r: mgr.maybe_save(r.state.step, {"train": r.state}))
    mgr.close()
    saved = {
        **schedule_view(first),
        "scaler": first.scaler.state_dict() if first.scaler is not None else None,
        "sampler": first.sampler.state_dict(),
        "steps_on_disk": mgr.steps(),
    }
    return {"straight": rec_straight, "final": final_straight, "first": rec_first, "saved": saved}


def single_resume(cfg: dict[str, Any], ckpt_dir: str) -> dict[str, Any]:
    """Fresh objects (other weights, other RNG seeds), resume from the latest checkpoint, finish."""
    fresh = build_run(cfg, "single", 0, 1, init_seed=7, rng_seed=999)
    before = schedule_view(fresh)
    mgr = shardsafe.CheckpointManager(ckpt_dir, interval=cfg["save_at"] // 2, keep_last=1)
    loaded = mgr.load({"train": fresh.state})
    after = {
        **schedule_view(fresh),
        "scaler": fresh.scaler.state_dict() if fresh.scaler is not None else None,
        "sampler": fresh.sampler.state_dict(),
        "rng_restored": fresh.state.rng_restored,
        "counters": [fresh.state.step, fresh.state.epoch, fresh.state.tokens_seen],
        "extra": fresh.state.extra,
    }
    rec = train(fresh, cfg["total"])
    return {"loaded_step": loaded, "before": before, "after_load": after, "resumed": rec, "final": snapshot(fresh)}


def single_main(argv: list[str]) -> None:
    """``first|resume CFG_JSON CKPT_DIR OUT``: :func:`single_first` or :func:`single_resume`
    with one intra-op thread; the result goes to OUT with torch.save."""
    mode, cfg_json, ckpt_dir, out = argv
    cfg = json.loads(cfg_json)
    torch.set_num_threads(1)
    fn = {"first": single_first, "resume": single_resume}[mode]
    torch.save(fn(cfg, ckpt_dir), out)


# ----------------------------------------------------------------------------- multi-rank cases


def exact_resume(rank: int, world: int, layout: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Uninterrupted run vs (run to save_at, save) + (fresh objects, RNG reseeded, load,
    finish) on the same world size: records and final state must be bitwise equal."""
    total, save_at = cfg["total"], cfg["save_at"]
    straight = build_run(cfg, layout, rank, world, init_seed=0, rng_seed=100)
    rec_straight = train(straight, total)
    final_straight = snapshot(straight)
    del straight

    first = build_run(cfg, layout, rank, world, init_seed=0, rng_seed=100)
    rec_first = train(first, save_at)
    saved_view = schedule_view(first)
    saved_rng = torch.get_rng_state()
    shardsafe.save({"train": first.state}, path)
    assert torch.equal(saved_rng, torch.get_rng_state()), "saving consumed random numbers"
    del first

    fresh = build_run(cfg, layout, rank, world, init_seed=7, rng_seed=999)
    assert not torch.equal(torch.get_rng_state(), saved_rng)
    shardsafe.load({"train": fresh.state}, path)
    assert fresh.state.rng_restored == "exact", fresh.state.rng_restored
    assert torch.equal(torch.get_rng_state(), saved_rng), "this rank's torch RNG stream was not restored"
    after_view = schedule_view(fresh)
    for k in ("param_group_lr", "last_epoch"):  # get_last_lr(): see test_resume.py (SequentialLR bug)
        assert after_view[k] == saved_view[k], f"{k} after load {after_view[k]} != saved {saved_view[k]}"
    assert (fresh.state.step, fresh.state.tokens_seen) == (save_at, save_at * cfg["global_batch"])
    rec_resumed = train(fresh, total)
    final_resumed = snapshot(fresh)

    assert_records_equal(rec_straight, rec_first + rec_resumed, f"{layout} rank {rank}")
    assert_bitwise(final_straight, final_resumed, f"{layout}.final")
    return {"straight": rec_straight, "resumed": rec_first + rec_resumed, "saved_lr": saved_view,
            "after_lr": after_view, "rng_digest": hashlib.sha1(saved_rng.numpy().tobytes()).hexdigest()}


def elastic_save(rank: int, world: int, layout: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """The uninterrupted run on this world size, saving at ``save_at`` on the way."""
    run = build_run(cfg, layout, rank, world, init_seed=0, rng_seed=100)
    saved: dict[str, Any] = {}

    def on_step(r: Run) -> None:
        if r.state.step == cfg["save_at"]:
            shardsafe.save({"train": r.state}, path)
            saved.update(schedule_view(r))

    records = train(run, cfg["total"], on_step)
    return {"records": records, "saved_view": saved}


def elastic_resume(rank: int, world: int, layout: str, cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Fresh objects on this (different) world size: load, check the RNG was re-derived
    with one warning, finish the run."""
    run = build_run(cfg, layout, rank, world, init_seed=7, rng_seed=999)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shardsafe.load({"train": run.state}, path)
        first_load = [str(w.message) for w in caught if "re-derived" in str(w.message)]
        shardsafe.load({"train": run.state}, path)  # a second load on the other world size stays quiet
        both_loads = [str(w.message) for w in caught if "re-derived" in str(w.message)]
    view = schedule_view(run)
    derived = derive_seed(cfg["rng_base_seed"], run.state.step, rank)
    info = {
        "rng_restored": run.state.rng_restored,
        "warnings_first_load": first_load,
        "warnings_both_loads": both_loads,
        "initial_seed_is_derived": torch.initial_seed() == derived,
        "view": view,
        "counters": [run.state.step, run.state.epoch, run.state.tokens_seen],
        "sampler": run.sampler.state_dict(),
        "accum": run.accum,
        "micro_batch": run.loader.batch_size,
    }
    info["records"] = train(run, cfg["total"])
    return info


def save_trained_state(rank: int, world: int, layout: str, cfg: dict[str, Any], steps: int, path: str,
                       ref_path: str) -> list[str]:
    """Train ``layout`` a few steps and save its TrainState; rank 0 writes full copies of the
    model / optimizer / scheduler state to ``ref_path``. Returns the live model's own keys."""
    run = build_run(cfg, layout, rank, world, init_seed=0, rng_seed=100)
    train(run, steps)
    shardsafe.save({"train": run.state}, path)
    snap = snapshot(run)
    if rank == 0:
        torch.save({k: snap[k] for k in ("model", "optim", "sched", "sampler", "counters")}, ref_path)
    if run.distributed:
        dist.barrier()
    return list(run.model.state_dict())


def load_trained_state(rank: int, world: int, layout: str, cfg: dict[str, Any], path: str,
                       ref_path: str) -> dict[str, Any]:
    """Load a TrainState saved under another layout into fresh ``layout`` objects and compare
    with the reference; train one more step to show the loaded state is usable."""
    run = build_run(cfg, layout, rank, world, init_seed=7, rng_seed=999)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RNG re-derivation when the world size differs
        shardsafe.load({"train": run.state}, path)
    ref = torch.load(ref_path, weights_only=True)
    snap = snapshot(run)
    for k in ("model", "optim", "sched", "sampler", "counters"):
        assert_bitwise(ref[k], snap[k], f"{layout}.{k}")
    records = train(run, run.state.step + 1)
    return {"keys": list(run.model.state_dict()), "rng_restored": run.state.rng_restored,
            "next_loss": records[-1]["loss"]}


if __name__ == "__main__":
    single_main(sys.argv[1:])
