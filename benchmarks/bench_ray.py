"""Ray Train checkpointing: Ray's directory checkpoints vs shardsafe through
``shardsafe.integrations.ray``, in the same Ray run, on a local Ray cluster (CPU, gloo).

    .venv/bin/python benchmarks/bench_ray.py [--size small|quick|full] [--reps N] [--workers 2] [--resume-workers 4]

State: the FSDP2 GPT of bench_distributed.py (``fully_shard`` per block and at the root)
with AdamW after one training step; ``--size small`` (default) is a 4-layer, dim-256,
8192-token model, ``full`` bench_distributed's 58.1M-parameter one.

Run 1 (``--workers`` workers, one TorchTrainer run) saves ``--reps`` times with each
contender, in a rotated order (one untimed warm-up round first):
  * ray-dcp: every worker ``dcp.save`` s its shards into its own temporary folder, then
    ``ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))`` (the default
    SYNC upload: Ray copies every worker's folder into the run's checkpoint folder); the
    temporary folder is deleted after the report (not timed). Ray's documented pattern for
    FSDP; DCP can reshard it on load.
  * ray-torch: the same with ``torch.save`` of each worker's sharded state dict (DTensors)
    to ``rank<r>.pt``; it cannot be resumed on another worker count, so save figures only.
  * shardsafe: ``ss_ray.report(state, metrics, step=...)``, sync: every worker writes its
    shards once into the run's storage, then Ray is handed a pointer (NO_UPLOAD).
  * shardsafe-async: the same with ``async_save=True``: report returns once the state is
    staged; the commit is waited for after the timed region (its time reported apart).
Save time = from a barrier to the return of the report call, the slowest worker. Bytes
written = the files written into temporary folders (sum over workers) + the files of the
checkpoint in the run's storage.

Run 2 (``--resume-workers`` workers, a new TorchTrainer run) restores the last ray-dcp and
shardsafe checkpoints of run 1 into a freshly built model and optimizer, ``--reps`` times
each in a rotated order: ray-dcp ``Checkpoint.as_directory()`` + ``dcp.load`` +
``set_state_dict``; shardsafe ``ss_ray.restore(state, checkpoint=...)`` (checksums
verified). Resume time = barrier to loaded, slowest worker. The two restored states are
compared bitwise (every rank's shards).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import REPO, machine_info, md_table, median, mib, rotated, write_json  # noqa: E402
from _dist_common import loadavg, source_banner, source_state  # noqa: E402
from bench_distributed import FULL, GPT, QUICK, param_count  # noqa: E402

SMALL = {"vocab": 8192, "dim": 256, "layers": 4, "heads": 4, "ctx": 128, "batch": 2, "seq": 32}
SIZES = {"quick": QUICK, "small": SMALL, "full": FULL}
SAVERS = ["ray-dcp", "ray-torch", "shardsafe", "shardsafe-async"]
LOADERS = ["ray-dcp", "shardsafe"]


# ============================================================================ worker side


def _build(cfg: dict[str, Any], seed: int, train: bool) -> dict[str, Any]:
    """FSDP2 GPT + AdamW (one training step when ``train``) and its shardsafe TrainState."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardsafe

    torch.manual_seed(seed)
    model = GPT(**cfg)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), generator=g)
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    if train:
        opt.step()
    else:  # same state layout (AdamW's step and moments exist), other values: a load must overwrite them
        opt.step()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    opt.zero_grad(set_to_none=True)
    return {"model": model, "opt": opt, "state": shardsafe.TrainState(model, opt, rng_base_seed=seed)}


def _dcp_state(parts: dict[str, Any]) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(parts["model"], parts["opt"])
    return {"model": msd, "optim": osd}


def _size(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _total(n: int) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def save_loop(config: dict[str, Any]) -> None:
    """Run 1: every contender saves ``reps`` times (after one warm-up round)."""
    import ray.train
    import torch.distributed.checkpoint as dcp

    from shardsafe.integrations import ray as ss_ray

    rank = dist.get_rank()
    parts = _build(config["model"], seed=0, train=True)
    sessions = {"shardsafe": ss_ray.RayCheckpointing(), "shardsafe-async": ss_ray.RayCheckpointing(async_save=True)}
    storage = ray.train.get_context().get_storage()
    scratch = config["scratch"]
    results: list[dict[str, Any]] = []
    step = 0
    for rep in range(config["reps"] + 1):
        for who in rotated(SAVERS, rep):
            step += 1
            metrics = {"step": step, "who": who}
            tmp = os.path.join(scratch, f"{who}-{step}-rank{rank}")
            dist.barrier()
            t0 = time.perf_counter()
            if who.startswith("ray-"):
                os.makedirs(tmp)
                if who == "ray-dcp":
                    dcp.save(_dcp_state(parts), checkpoint_id=tmp)
                else:
                    torch.save(_dcp_state(parts), os.path.join(tmp, f"rank{rank}.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                                 checkpoint_dir_name=f"{who}-{step:04d}")
            else:
                sessions[who].report(parts["state"], metrics, step=step)
            seconds = time.perf_counter() - t0
            commit = 0.0
            if who == "shardsafe-async":
                t1 = time.perf_counter()
                sessions[who].manager.wait()
                commit = time.perf_counter() - t1
            seconds, commit = _slowest(seconds), _slowest(commit)
            temp_bytes = _total(_size(tmp) if os.path.isdir(tmp) else 0)
            shutil.rmtree(tmp, ignore_errors=True)
            dist.barrier()
            if who.startswith("ray-"):
                stored = _size(storage.build_checkpoint_path_from_name(f"{who}-{step:04d}")) if rank == 0 else 0
            else:
                location = sessions[who].manager.path(step)
                pointer = os.path.join(storage.build_checkpoint_path_from_name(ss_ray.ray_checkpoint_name(step)),
                                       ss_ray.POINTER_NAME)
                stored = _size(str(location)) + os.path.getsize(pointer) if rank == 0 else 0
            if rep > 0:
                results.append({"who": who, "step": step, "seconds": seconds, "commit_seconds": commit,
                                "temp_bytes": temp_bytes, "stored_bytes": stored})
    for s in sessions.values():
        s.close()
    local = sum(t.to_local().nbytes if hasattr(t, "to_local") else t.nbytes
                for sd in _dcp_state(parts).values() for t in _tensors(sd))
    payload = _total(local)
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"saves": results, "payload_bytes": payload}, f)


def _tensors(tree: Any) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


def resume_loop(config: dict[str, Any]) -> None:
    """Run 2: restore the last ray-dcp and shardsafe checkpoints ``reps`` times each."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from bitwise import first_difference
    from shardsafe.integrations import ray as ss_ray

    rank = dist.get_rank()
    results: list[dict[str, Any]] = []
    restored: dict[str, Any] = {}
    for rep in range(config["reps"] + 1):
        for who in rotated(LOADERS, rep):
            parts = _build(config["model"], seed=1, train=False)
            ckpt = config["checkpoints"][who]
            dist.barrier()
            t0 = time.perf_counter()
            if who == "ray-dcp":
                with ckpt.as_directory() as d:
                    sd = _dcp_state(parts)
                    dcp.load(sd, checkpoint_id=d)
                    set_state_dict(parts["model"], parts["opt"], model_state_dict=sd["model"],
                                   optim_state_dict=sd["optim"])
            else:
                session = ss_ray.RayCheckpointing()
                session.restore(parts["state"], checkpoint=ckpt)
                session.close()
            seconds = _slowest(time.perf_counter() - t0)
            if rep > 0:
                results.append({"who": who, "seconds": seconds})
            restored[who] = {k: v for k, v in _dcp_state(parts).items()}
    diff = first_difference(restored["ray-dcp"], restored["shardsafe"])
    diffs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(diffs, diff)
    if rank == 0:
        with open(config["out"], "w") as f:
            json.dump({"loads": results, "differences": [d for d in diffs if d is not None]}, f)


# ============================================================================ driver


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="small")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per contender (after one warm-up)")
    ap.add_argument("--workers", type=int, default=2, help="workers of the saving run")
    ap.add_argument("--resume-workers", type=int, default=4, help="workers of the resuming run")
    ap.add_argument("--dir", default=None, help="where the run's storage and temporary folders go")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    args = ap.parse_args()

    import ray
    from ray.train import CheckpointConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    import shardsafe
    from shardsafe.integrations import ray as ss_ray

    cfg = SIZES[args.size]
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "benchmarks"), str(REPO / "tests"), str(REPO / "src"), os.environ.get("PYTHONPATH", "")])
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    work = Path(tempfile.mkdtemp(prefix="bench-ray-", dir=args.dir))
    ray_tmp = tempfile.mkdtemp(prefix="bray")
    src = source_state()
    try:
        ray.init(num_cpus=max(args.workers, args.resume_workers), include_dashboard=False, _temp_dir=ray_tmp,
                 log_to_driver=False, logging_level="ERROR")
        storage, scratch = work / "storage", work / "scratch"
        scratch.mkdir(parents=True)
        load1 = loadavg()
        saved = TorchTrainer(
            save_loop, train_loop_config={"model": cfg, "reps": args.reps, "scratch": str(scratch),
                                          "out": str(work / "saves.json")},
            scaling_config=ScalingConfig(num_workers=args.workers),
            run_config=RunConfig(name="bench", storage_path=str(storage), checkpoint_config=CheckpointConfig())).fit()
        if saved.error is not None:
            raise saved.error
        last: dict[str, Any] = {}
        for ckpt, metrics in saved.best_checkpoints:  # report order: the last of each wins
            if metrics["who"] in ("ray-dcp", "shardsafe"):
                last[metrics["who"]] = ckpt
        resumed = TorchTrainer(
            resume_loop, train_loop_config={"model": cfg, "reps": args.reps, "checkpoints": last,
                                            "out": str(work / "loads.json")},
            scaling_config=ScalingConfig(num_workers=args.resume_workers),
            run_config=RunConfig(name="bench-resume", storage_path=str(storage))).fit()
        if resumed.error is not None:
            raise resumed.error
        load2 = loadavg()
        saves = json.loads((work / "saves.json").read_text())
        loads = json.loads((work / "loads.json").read_text())
        location, _ = ss_ray.checkpoint_location(last["shardsafe"])
        verified = shardsafe.tools.verify_checkpoint(location).ok
    finally:
        ray.shutdown()
        shutil.rmtree(ray_tmp, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)

    payload = saves["payload_bytes"]
    rows, res = [], {"size": args.size, "params": param_count(cfg), "payload_bytes": payload,
                     "workers": args.workers, "resume_workers": args.resume_workers, "reps": args.reps,
                     "machine": machine_info(Path(tempfile.gettempdir())), "loadavg": [load1, load2],
                     "source": src, "contenders": {}}
    for who in SAVERS:
        mine = [r for r in saves["saves"] if r["who"] == who]
        resume_cell = "as shardsafe (same checkpoint)" if who == "shardsafe-async" else "n/a (no resharding)"
        entry = {"save_seconds": median([r["seconds"] for r in mine]),
                 "commit_seconds": median([r["commit_seconds"] for r in mine]),
                 "bytes_written": median([r["temp_bytes"] + r["stored_bytes"] for r in mine]),
                 "stored_bytes": median([r["stored_bytes"] for r in mine]),
                 "resume_seconds": median([r["seconds"] for r in loads["loads"] if r["who"] == who])
                 if who in LOADERS else None}
        res["contenders"][who] = entry
        rows.append([who, f"{entry['save_seconds']:.3f}"
                     + (f" (+{entry['commit_seconds']:.3f} commit)" if who == "shardsafe-async" else ""),
                     mib(entry["bytes_written"]), f"{entry['bytes_written'] / payload:.2f}",
                     resume_cell if entry["resume_seconds"] is None else f"{entry['resume_seconds']:.3f}"])
    res["restored_differences"] = loads["differences"]
    res["shardsafe_verified"] = verified
    print(source_banner(src, f"ray {ray.__version__}", f"load average {load1:.1f} -> {load2:.1f}"))
    print(f"state: GPT {args.size} ({param_count(cfg) / 1e6:.1f}M params) + AdamW = {mib(payload)}; save on "
          f"{args.workers} workers, resume on {args.resume_workers}; medians of {args.reps} reps")
    print(md_table(["contender", "save s (until report returns)", "bytes written", "x state",
                    f"resume s on {args.resume_workers} workers"], rows))
    print(f"restored states bitwise equal (ray-dcp vs shardsafe, every rank): {not loads['differences']}; "
          f"shardsafe checkpoint verifies: {verified}")
    if args.out:
        write_json(args.out, res)


if __name__ == "__main__":
    main()
