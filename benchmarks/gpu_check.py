"""GPU check: every CUDA path of shardsafe, end to end, on one CUDA device, in a few minutes.

    .venv/bin/python benchmarks/gpu_check.py [--quick] [--reps N] [--only a,b] [--dir DIR] [--out FILE]
    .venv/bin/python benchmarks/gpu_check.py --dist-world 2            # 2+ GPUs: the dist check over NCCL
    .venv/bin/python benchmarks/gpu_check.py --cpu-dry-run [--quick]   # the same logic on the CPU

Without CUDA (and without --cpu-dry-run) it prints "no CUDA device: gpu_check skipped" and
exits 0. Every check runs in its own try block: a failing check is reported FAIL with its
exception and the others still run; the exit status is 1 when any check failed. The end is
a markdown table of the figures; everything also goes to bench-out/gpu_check.json
(bench-out/gpu_check-cpu-dry-run.json for a dry run). Checkpoints go to /dev/shm when it
has room (tmpfs: the figures measure shardsafe and the PCIe link, not a disk), else --dir.

Checks (in benchmarks/gpu_cases.py, the dist check here; sizes without --quick, chosen for a
run under 5 minutes on one recent GPU; no GPU has run them yet: the CPU dry run has):
  save_load        CUDA tensors of every kind a save meets — fp32/bf16/fp16/fp64/int64/bool/
                   float8/complex64, a lazy conj view, transposed and strided views, rows
                   wider than a staging slot, 0-d, empty — saved (a) sync, (b) async with
                   pinned staging, (c) async through an 8 MiB budget (slots of 4 MiB, rows
                   split), (d) async on a side CUDA stream; after each async save returns the
                   sources' bytes are all changed on the GPU, then the checkpoint is loaded
                   into zeroed CUDA tensors of the same layouts and by load_full: bitwise equal
                   to the values at save time. The kept staging slots must be pinned.
  rng              TrainState's RNG streams (CUDA generator of every device, torch CPU, Python,
                   NumPy): save, draw (torch.cuda rand/randn, a CUDA dropout mask, ...),
                   reseed, load, draw again: bitwise the same draws.
  throughput       a 1 GiB state (16 x 64 MiB fp32 + 4097 floats) on the GPU, interleaved reps
                   (rotated order), medians: pinned ``copy_`` device-to-host (the floor), pageable
                   ``copy_``, shardsafe async stall (staging into pinned slots), sync save, load
                   into CUDA tensors (verified) and the pinned host-to-device ``copy_`` floor.
  train_async      a GPU MLP training loop (AdamW, ~1.2 GB of weights + moments, step ~40 ms,
                   synchronized): the async_save stall against a pinned copy_ of the same
                   tensors, and the median step time while the background write runs over the
                   undisturbed steps around it; the first trial's checkpoint is compared
                   bitwise with the weights at save time.
  dist             in a child process: init_process_group("nccl", world 1, MASTER_ADDR
                   127.0.0.1, a free port), DTensors on 1-D and 2-D meshes (Shard/Replicate),
                   an FSDP2 (fully_shard) MLP with AdamW state through TrainState beside a
                   replicated device tensor and a CPU tensor, saved sync and async, loaded into
                   a fresh FSDP2 model (broadcast_replicated on 2+ ranks): bitwise; the group
                   destroyed. On one rank shardsafe's own collectives are skipped (a 1-rank
                   group is not distributed to it); with 2+ GPUs --dist-world 2 runs them over
                   NCCL: the broadcast of device tensors, CPU tensors (AdamW's step counters,
                   the CPU tensor) read by every rank instead (da94971).
  non_current_device  (2+ GPUs) tensors on cuda:1 while cuda:0 is current: sync and async
                   saves and a load, bitwise (the copies waited for on the sources' device
                   streams, 59202c2). SKIP on one GPU.
  pinned_budget    async saves of the 1 GiB state through Checkpointer(memory_budget=256 MiB),
                   a sync save and a load: shardsafe's own accounting (HostMemory.peak, kept
                   bytes) against the budget, and torch's pinned host allocator statistics
                   (torch.cuda.host_memory_stats: active and allocated bytes, rounded up to
                   powers of two by the allocator); an unbounded save of a 96 MiB state
                   (48 MiB slots) shows the rounding. Runs last: it empties the host cache.

--cpu-dry-run runs every check with device "cpu" (no pinned memory, gloo instead of
NCCL): the logic of the script is exercised where no GPU is at hand; its figures say
nothing about GPUs. Timings are figures, never pass/fail criteria; results are.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import REPO, machine_info, md_table, write_json
from gpu_cases import (
    MLP,
    SKIP_MESSAGE,
    Ctx,
    MiB,
    Skip,
    assert_same,
    check_non_current_device,
    check_pinned_budget,
    check_rng,
    check_save_load,
    check_throughput,
    check_train_async,
    cpu_copy,
    fmt_s,
)
from torch import nn

# =============================================================================== the DTensor / FSDP2 check


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def work_base(requested: str | None, need: int) -> str | None:
    """/dev/shm when it has room for ``need`` bytes (and no folder was asked for), else the
    requested folder (None: the system's temporary folder)."""
    if requested is not None:
        return requested
    shm = "/dev/shm"
    try:
        if os.path.isdir(shm) and shutil.disk_usage(shm).free > need:
            return shm
    except OSError:
        pass
    return None



def check_dist(ctx: Ctx) -> tuple[str, dict]:
    """The DTensor / FSDP2 checks in child processes (one per rank) on a real process group."""
    world = ctx.dist_world
    port = free_port()
    argv = [sys.executable, str(Path(__file__).resolve()), "--child-dist", str(ctx.work), "--port", str(port),
            "--dist-world", str(world)] + (["--cpu-dry-run"] if not ctx.cuda else []) + (["--quick"] if ctx.quick
                                                                                          else [])
    procs = [subprocess.Popen(argv + ["--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              cwd=REPO) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=240))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    failed = [(r, p.returncode, e) for r, (p, (_, e)) in enumerate(zip(procs, outs)) if p.returncode != 0]
    if failed:
        r, rc, err = failed[0]
        raise RuntimeError(f"rank {r} of {world} exited {rc}:\n{err[-3000:]}")
    lines = [ln for ln in outs[0][0].splitlines() if ln.startswith("{")]
    if not lines:
        raise RuntimeError(f"rank 0 printed no figures:\n{outs[0][0][-2000:]}")
    figures = json.loads(lines[-1])
    summary = (f"{figures['backend']} world {world}: {figures['dtensors']} DTensors ({', '.join(figures['meshes'])}) "
               f"+ FSDP2 TrainState and replicated device/CPU tensors ({figures['fsdp_tensors']} tensors, sync and "
               f"async) bitwise, {sum(figures['bytes_received_by_rank']) / MiB:.1f} MiB broadcast; "
               f"save {fmt_s(figures['fsdp_save_s'])}, load {fmt_s(figures['fsdp_load_s'])}")
    return summary, figures


def dist_child(work: Path, rank: int, world: int, port: int, cuda: bool, quick: bool) -> dict:
    """One rank of the dist check (see the module docstring); rank 0 returns the figures."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    kwargs: dict[str, Any] = {}
    if cuda:
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world, **kwargs)
    try:
        probe = torch.ones(1, device=device)
        dist.all_reduce(probe)
        if int(probe.item()) != world:
            raise AssertionError(f"all_reduce gave {probe.item()}, not {world}")
        figures = {"backend": dist.get_backend(), "world": world}
        figures.update(_dist_dtensors(work, device, world))
        figures.update(_dist_fsdp(work, device, world, quick))
        dist.barrier()
        return figures
    finally:
        dist.destroy_process_group()


def _dist_dtensors(work: Path, device: torch.device, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import shardsafe

    mesh = init_device_mesh(device.type, (world,))
    mesh2 = init_device_mesh(device.type, (world, 1), mesh_dim_names=("dp", "tp"))
    g = torch.Generator(device=device).manual_seed(0)
    full = torch.randn(1027, 129, generator=g, device=device)
    full16 = torch.randn(515, 257, generator=g, device=device).to(torch.bfloat16)
    dts = {"row": distribute_tensor(full, mesh, [Shard(0)]), "col": distribute_tensor(full, mesh, [Shard(1)]),
           "rep": distribute_tensor(full, mesh, [Replicate()]),
           "mesh2d": distribute_tensor(full16, mesh2, [Shard(0), Shard(1)]),
           "mesh2d_rep": distribute_tensor(full16, mesh2, [Replicate(), Shard(0)])}
    want = cpu_copy(dts)
    path = work / "dist_dtensor"
    t0 = time.perf_counter()
    shardsafe.save(dts, path, overwrite=True)
    save_s = time.perf_counter() - t0
    dest = {k: distribute_tensor(torch.zeros_like(v.full_tensor()), v.device_mesh, v.placements)
            for k, v in dts.items()}
    shardsafe.load(dest, path)
    assert_same(cpu_copy(dest), want, "DTensors loaded")
    if any(v.to_local().device != device for v in dest.values()):
        raise AssertionError(f"loaded DTensors are not on {device}")
    assert_same(cpu_copy(shardsafe.load_full(path)), want, "DTensors by load_full")
    dist.barrier()
    return {"dtensors": len(dts), "meshes": [f"({world},)", f"({world}, 1)"], "dtensor_save_s": save_s}


def _dist_fsdp(work: Path, device: torch.device, world: int, quick: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import shardsafe

    mesh = init_device_mesh(device.type, (world,))
    dim = 256 if quick else 1024
    model, opt = _fsdp_model(mesh, device, dim, seed=0)
    x = torch.randn(64, dim, device=device)
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    ts = shardsafe.TrainState(model, opt)
    ts.step = 2
    want = _fsdp_state(model, opt)
    paths = {"sync": work / "dist_fsdp_sync", "async": work / "dist_fsdp_async"}
    t0 = time.perf_counter()
    # replicated plain tensors beside the FSDP2 state: broadcast_replicated sends the device one over the
    # group and has every rank read the CPU one (NCCL takes tensors on the current GPU only)
    g = torch.Generator(device=device).manual_seed(2)
    shared = {"device": torch.randn(256, 1024, generator=g, device=device), "cpu": torch.arange(4099.0)}
    want.update({f"shared.{k}": v for k, v in cpu_copy(shared).items()})
    shardsafe.save({"train": ts, "shared": shared}, paths["sync"], overwrite=True)
    save_s = time.perf_counter() - t0
    shardsafe.async_save({"train": ts, "shared": shared}, paths["async"], overwrite=True).result()
    load_s = 0.0
    received = 0
    for how, path in paths.items():
        model2, opt2 = _fsdp_model(mesh, device, dim, seed=1)
        ts2 = shardsafe.TrainState(model2, opt2)
        shared2 = {k: torch.zeros_like(v) for k, v in shared.items()}
        t0 = time.perf_counter()
        info = shardsafe.load({"train": ts2, "shared": shared2}, path, broadcast_replicated=world > 1)
        load_s = time.perf_counter() - t0
        received += info.bytes_received
        got = {**_fsdp_state(model2, opt2), **{f"shared.{k}": v for k, v in cpu_copy(shared2).items()}}
        assert_same(got, want, f"FSDP2 model and optimizer and the replicated tensors loaded from the {how} save")
        if [v.device for v in shared2.values()] != [v.device for v in shared.values()]:
            raise AssertionError(f"the replicated tensors moved: {[v.device for v in shared2.values()]}")
        if ts2.step != 2:
            raise AssertionError(f"counters not restored from the {how} save: step {ts2.step}")
        if any(p.to_local().device != device for p in model2.parameters()):
            raise AssertionError(f"FSDP2 parameters left {device}")
    received_by: list[Any] = [None] * world
    dist.all_gather_object(received_by, received)
    return {"fsdp_tensors": len(want), "fsdp_save_s": save_s, "fsdp_load_s": load_s,
            "bytes_received_by_rank": received_by}


def _fsdp_model(mesh: Any, device: torch.device, dim: int, seed: int) -> tuple[nn.Module, Any]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = MLP(dim, 3).to(device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _fsdp_state(model: nn.Module, opt: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    out = {f"model.{k}": v for k, v in cpu_copy(msd).items()}
    out.update({f"optim.{k}": v for k, v in cpu_copy(osd).items()})
    return out


CHECKS: dict[str, Callable[[Ctx], tuple[str, dict]]] = {
    "save_load": check_save_load,
    "rng": check_rng,
    "throughput": check_throughput,
    "train_async": check_train_async,
    "dist": check_dist,
    "non_current_device": check_non_current_device,
    "pinned_budget": check_pinned_budget,
}


# =============================================================================== driver


def run_check(name: str, fn: Callable[[Ctx], tuple[str, dict]], ctx: Ctx) -> dict:
    """Run one check; its result (PASS / FAIL / SKIP), seconds, summary, figures, error."""
    print(f"[{name}] ...", flush=True)
    t0 = time.perf_counter()
    try:
        if ctx.inject == name:
            raise RuntimeError(f"failure injected into {name} (--inject-failure)")
        summary, figures = fn(ctx)
        out = {"result": "PASS", "summary": summary, "figures": figures}
    except Skip as exc:
        out = {"result": "SKIP", "summary": str(exc), "figures": {}}
    except Exception as exc:  # noqa: BLE001 - reported, the other checks still run
        traceback.print_exc()
        out = {"result": "FAIL", "summary": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
               "figures": {}, "error": "".join(traceback.format_exception(exc))[-4000:]}
    finally:
        gc.collect()
        if ctx.cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    out["seconds"] = time.perf_counter() - t0
    print(f"[{name}] {out['result']} in {out['seconds']:.1f} s: {out['summary']}", flush=True)
    return out


def describe_device(ctx: Ctx) -> dict:
    if not ctx.cuda:
        return {"device": "cpu (dry run)"}
    p = torch.cuda.get_device_properties(0)
    return {"device": torch.cuda.get_device_name(0), "capability": f"{p.major}.{p.minor}",
            "memory_gib": round(p.total_memory / 2**30, 1), "devices": torch.cuda.device_count(),
            "cuda": torch.version.cuda}


def report(results: dict[str, dict], ctx: Ctx, total_s: float) -> None:
    rows = [[name, r["result"], f"{r['seconds']:.1f} s", r["summary"].replace("|", "/")] for name, r in results.items()]
    print()
    print(f"gpu_check on {describe_device(ctx)['device']} ({'quick' if ctx.quick else 'full'}; torch "
          f"{torch.__version__}; {total_s:.0f} s in all)")
    print(md_table(["check", "result", "time", "figures"], rows, align="llll"))
    if not ctx.cuda:
        print("(CPU dry run: no pinned memory, gloo; the logic is exercised, the figures say nothing about GPUs)")
    tp = results.get("throughput", {})
    if tp.get("result") == "PASS":
        f = tp["figures"]
        print()
        print(f"Throughput, {f['bytes'] / 2**30:.2f} GiB, median of {f['reps']} interleaved reps")
        print(md_table(["path", "median", "GB/s"],
                       [[k, fmt_s(v), f"{f['gb_per_s'][k]:.2f}"] for k, v in f["median_s"].items()]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one trial: a smoke run")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run every check on the CPU (gloo, no pinned memory)")
    ap.add_argument("--reps", type=int, default=None, help="throughput repetitions (default 5; 2 with --quick)")
    ap.add_argument("--only", default="", help=f"comma-separated checks to run (of {', '.join(CHECKS)})")
    ap.add_argument("--dist-world", type=int, default=1, help="ranks of the dist check (one GPU each; default 1)")
    ap.add_argument("--dir", default=None, help="parent of the scratch folder (default /dev/shm when it has room)")
    ap.add_argument("--out", default=None, help="JSON output (default bench-out/gpu_check.json)")
    ap.add_argument("--inject-failure", default="", help=argparse.SUPPRESS)  # tests of the FAIL path
    ap.add_argument("--child-dist", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    cuda = not args.cpu_dry_run
    if args.child_dist is not None:
        figures = dist_child(Path(args.child_dist), args.rank, args.dist_world, args.port, cuda, args.quick)
        print(json.dumps(figures, default=str))
        return 0
    if cuda and not torch.cuda.is_available():
        print(SKIP_MESSAGE)
        return 0
    only = [c for c in args.only.split(",") if c]
    unknown = [c for c in only if c not in CHECKS]
    if unknown:
        ap.error(f"unknown checks {unknown}; the checks are {', '.join(CHECKS)}")
    if cuda and args.dist_world > torch.cuda.device_count():
        ap.error(f"--dist-world {args.dist_world}: only {torch.cuda.device_count()} GPUs")
    out = Path(args.out) if args.out else REPO / "bench-out" / ("gpu_check.json" if cuda
                                                                else "gpu_check-cpu-dry-run.json")
    base = work_base(args.dir, (4 << 30) if cuda and not args.quick else 1 << 30)
    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="shardsafe-gpu-check-", dir=base))
    try:
        ctx = Ctx(torch.device("cuda", 0) if cuda else torch.device("cpu"), cuda, args.quick,
                  args.reps or (2 if args.quick else 5), work, args.dist_world, args.inject_failure)
        if cuda:
            torch.cuda.set_device(0)
        else:
            torch.set_num_threads(1)  # a dry run shares small CPU machines: no OpenMP spinning
        print(f"gpu_check: {describe_device(ctx)}; scratch {work}", flush=True)
        results = {name: run_check(name, fn, ctx) for name, fn in CHECKS.items() if not only or name in only}
        info = machine_info(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    total_s = time.perf_counter() - t_start
    report(results, ctx, total_s)
    write_json(out, {"benchmark": "gpu_check", "mode": "cuda" if cuda else "cpu-dry-run", "quick": args.quick,
                     "torch": torch.__version__, "gpu": describe_device(ctx), "machine": info, "total_s": total_s,
                     "checks": results})
    print(f"\nwrote {out}")
    if total_s > 300:
        print(f"note: the run took {total_s:.0f} s, over the 5-minute aim")
    failed = [n for n, r in results.items() if r["result"] == "FAIL"]
    if failed:
        print(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
