"""Train the small GPT-like model of the other examples with FSDP2 under Ray Train's
TorchTrainer, checkpointing with shardsafe (shardsafe.integrations.ray): every worker
writes its own shards once, straight into the run's storage; run it again with the same
--name and --storage and it resumes from the run's latest checkpoint, on any number of
workers (parameters and optimizer state resharded, the global sample order and batch kept).

    python examples/train_ray.py --workers 2 --steps 40 --storage /tmp/ray-runs --stop-at 20
    python examples/train_ray.py --workers 4 --steps 40 --storage /tmp/ray-runs
    shardsafe ls /tmp/ray-runs/gpt/shardsafe

Starts a local Ray cluster (or joins --address). The two calls that matter are in
``train_loop``: ``ss_ray.restore(state)`` before the loop and ``ss_ray.report(state,
metrics, step=...)`` instead of ``ray.train.report(metrics, checkpoint=...)``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import _common
import ray
import ray.train
import torch
import torch.distributed as dist
from _common import SEQ, WarmupCosine, _step, build_model, synthetic_dataset
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch.utils.data import DataLoader

import shardsafe
from shardsafe.data import ElasticSampler, keep_global_batch, per_rank_batch
from shardsafe.integrations import ray as ss_ray


def train_loop(cfg: dict[str, Any]) -> None:
    """What every Ray worker runs: build, restore, train, report, close."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    say = (lambda msg: print(msg, flush=True)) if rank == 0 else (lambda msg: None)
    model = build_model(seed=0, dropout=cfg["dropout"])  # identical on every worker before sharding
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    g = cfg["global_batch"]
    micro = cfg["micro_batch"] or per_rank_batch(g, world)
    accum = keep_global_batch(g, world, micro)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(max(1, min(20, cfg["steps"] // 10)), cfg["steps"]))
    data = synthetic_dataset()
    sampler = ElasticSampler(len(data), g, seed=cfg["seed"])
    loader = DataLoader(data, batch_size=micro, sampler=sampler, generator=torch.Generator().manual_seed(cfg["seed"]))
    state = shardsafe.TrainState(model, opt, sched, data=sampler, rng_base_seed=cfg["seed"])
    torch.manual_seed(cfg["seed"] + rank)  # dropout streams per worker; restored on resume
    options = {"async_save": cfg["async_save"], "incremental": cfg["incremental"]}

    t0 = time.perf_counter()
    restored = ss_ray.restore(state, storage_options=cfg["storage_options"])  # <- call 1
    if restored is None:
        say(f"no checkpoint in this run: step 0 on {world} worker(s), global batch {g} = {micro} x {world} x {accum}")
    else:
        say(f"resumed step {restored} on {world} worker(s) in {time.perf_counter() - t0:.2f}s: sample "
            f"{sampler.consumed} of epoch {sampler.epoch}, RNG {state.rng_restored}, global batch {g} = {micro} x "
            f"{world} x {accum}")

    model.train()
    while state.step < cfg["steps"]:
        if sampler.global_batches_left == 0:
            sampler.set_epoch(sampler.epoch + 1)
            state.epoch = sampler.epoch
        it = iter(loader)
        for _ in range(min(sampler.global_batches_left, cfg["steps"] - state.step)):
            loss = _step(model, opt, it, accum)
            sched.step()
            sampler.advance()
            state.step += 1
            state.tokens_seen += g * SEQ
            dist.all_reduce(loss)
            loss /= world
            say(f"step {state.step:5d}  loss {loss.item():.4f}")
            if state.step % cfg["interval"] == 0 or state.step == cfg["steps"]:
                t = time.perf_counter()
                ss_ray.report(state, {"loss": loss.item(), "step": state.step}, step=state.step,  # <- call 2
                              storage_options=cfg["storage_options"], **options)
                say(f"reported checkpoint of step {state.step} ({time.perf_counter() - t:.3f}s)")
            if cfg["stop_at"] is not None and state.step == cfg["stop_at"]:
                say(f"stopping after step {state.step} (--stop-at: simulated preemption)")
                ss_ray.close()
                return
        del it
    ss_ray.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2, help="Ray Train workers (one CPU each)")
    p.add_argument("--storage", default=os.path.abspath("ray-runs"),
                   help="RunConfig(storage_path): a shared folder or an s3:// URL")
    p.add_argument("--name", default="gpt", help="the run's name; the same name resumes it")
    p.add_argument("--steps", type=int, default=40, help="train until this many steps in total")
    p.add_argument("--interval", type=int, default=10, help="report a checkpoint every this many steps")
    p.add_argument("--keep", type=int, default=3, help="CheckpointConfig(num_to_keep)")
    p.add_argument("--async-save", action="store_true", help="report returns once the state is staged")
    p.add_argument("--incremental", action="store_true", help="refer to unchanged chunks of the previous step")
    p.add_argument("--max-failures", type=int, default=1, help="FailureConfig(max_failures)")
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=None)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--stop-at", type=int, default=None, help="end the run after this step (then run again)")
    p.add_argument("--address", default=None, help="an existing Ray cluster (default: start a local one)")
    args = p.parse_args()

    storage = args.storage if "://" in args.storage else os.path.abspath(args.storage)
    ray.init(address=args.address, num_cpus=None if args.address else max(args.workers, 1),
             include_dashboard=False)
    ray.cloudpickle.register_pickle_by_value(_common)  # the workers get _common with the loop
    try:
        cfg = {k: getattr(args, k) for k in ("steps", "interval", "async_save", "incremental", "global_batch",
                                             "micro_batch", "lr", "dropout", "seed", "stop_at")}
        cfg["storage_options"] = None  # s3://: endpoint / credentials, else the AWS environment variables
        trainer = TorchTrainer(
            train_loop, train_loop_config=cfg, scaling_config=ScalingConfig(num_workers=args.workers),
            run_config=RunConfig(name=args.name, storage_path=storage,
                                 checkpoint_config=CheckpointConfig(num_to_keep=args.keep),
                                 failure_config=FailureConfig(max_failures=args.max_failures)))
        result = trainer.fit()
        if result.checkpoint is not None:
            location, step = ss_ray.checkpoint_location(result.checkpoint)
            print(f"done: latest checkpoint step {step} at {location}; Ray keeps "
                  f"{sorted(ss_ray.checkpoint_location(c)[1] for c, _ in result.best_checkpoints)}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
