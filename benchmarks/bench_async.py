"""Async-save benchmark: how long the training loop is blocked per save, how much a
background write slows training steps, and whether memory stays flat across saves.

    .venv/bin/python benchmarks/bench_async.py [--reps N] [--quick] [--dir DIR] [--out FILE]

Method (one process, single-threaded torch: torch.set_num_threads(1))
  * State: 64 x 16 MiB float32 tensors + one of 4097 elements (1 GiB + 16 KiB; --quick:
    16 x 4 MiB + the small one). The small tensor makes the total, like any real model's,
    not a multiple of shardsafe's 64 MiB staging slot.
  * Stall = wall time until the save call returns (the training loop is blocked that
    long). Contenders, run back to back in a rotated order in every repetition:
      - copy_      : ``dst.copy_(src)`` of every tensor into preallocated buffers (the
                     floor for any save that snapshots host memory);
      - ss async   : ``shardsafe.Checkpointer().async_save`` (one Checkpointer for the whole run, so its
                     staging pool is reused; its first, pool-allocating save is a warm-up).
                     Its default pool holds the whole state, so the writer starts after
                     staging, and each slot's copies are split over the cores (the loop is
                     blocked anyway), while copy_ runs on one thread: the stall can be
                     below the copy_ floor;
      - ss sync    : ``shardsafe.save``;
      - dcp async  : ``torch.distributed.checkpoint.async_save(..., no_dist=True)`` — on
                     torch 2.13 it needs no process group when no_dist=True (thread
                     executor, default stager: a fresh CPU deep copy per call);
      - dcp sync   : ``torch.distributed.checkpoint.save(..., no_dist=True)``.
    For the async contenders the time until the checkpoint is durable is reported too.
    After every contender (untimed): wait until durable, ``os.sync()``, delete the files,
    so dirty pages of one contender do not slow the next. Ratios are computed per
    repetition (paired) and the median over repetitions is reported.
  * Training-step slowdown: an MLP step (Linear-ReLU-Linear, forward+backward+SGD, batch
    calibrated to ~75 ms) timed undisturbed and while a 1 GiB background write runs:
      - thread : a shardsafe async save (background thread hashes + writes + fsyncs);
      - process: a long-lived forked child hashes (xxh3, 1 MiB blocks) and writes (64 MiB
                 pwrites) + fsyncs the same bytes from a shared-memory buffer the parent
                 staged them into (the same work, in another process).
    Reported: per trial, median step time while the write is in flight / median step
    time of the undisturbed windows just before and just after it; the median over
    trials (pooled medians too).
  * RSS: psutil RSS after async save 1 and after save 20 (each waited for) of the same
    state through the run's Checkpointer; growth in percent of the RSS after save 1. Those
    checkpoints go to /dev/shm by default (--rss-dir): 20 fsync'd 1 GiB saves to a slow
    disk would take minutes, and tmpfs pages are not counted in the process's RSS.
Targets: ss async stall <= 1.3 x copy_ and <= 0.5 x dcp async stall; step slowdown
(thread) <= 1.25; RSS growth <= 1 %.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing as mp
import os
import shutil
import sys
import time
import warnings
from multiprocessing import shared_memory
from pathlib import Path
from typing import Any

from _common import REPO, CpuMonitor, bench_dir, machine_info, md_table, median, write_json

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import shardsafe  # noqa: E402

MiB = 1 << 20
SLOT = 64 * MiB
BLOCK = MiB


def ms(x: float) -> str:
    return f"{x * 1e3:.0f} ms" if x == x else "n/a"


def make_state(n: int, numel: int) -> dict[str, torch.Tensor]:
    """``n`` float32 tensors of ``numel`` elements plus a 4097-element one, so that the total
    is not a multiple of the 64 MiB staging slot (as for any real model)."""
    g = torch.Generator().manual_seed(0)
    state = {f"t{i:02d}": torch.rand(numel, generator=g) for i in range(n)}
    state["bias"] = torch.rand(4097, generator=g)
    return state


def settle(*paths: Path) -> None:
    """Flush dirty pages, then delete (outside any timed region)."""
    os.sync()
    for p in paths:
        shutil.rmtree(p, ignore_errors=True)


# --------------------------------------------------------------------------- subprocess writer


def _proc_writer_main(shm: shared_memory.SharedMemory, nbytes: int, conn: Any) -> None:
    """Forked child: for every path received, hash + write + fsync the shared buffer."""
    import xxhash

    view = shm.buf
    try:
        while (path := conn.recv()) is not None:
            t0 = time.perf_counter()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                sums = 0
                for off in range(0, nbytes, SLOT):
                    piece = view[off: min(off + SLOT, nbytes)]
                    for b in range(0, len(piece), BLOCK):
                        sums ^= xxhash.xxh3_64_intdigest(piece[b: b + BLOCK])
                    done = 0
                    while done < len(piece):
                        done += os.pwrite(fd, piece[done:], off + done)
                os.fsync(fd)
            finally:
                os.close(fd)
            conn.send((time.perf_counter() - t0, sums))
    finally:
        del view


class ProcessWriter:
    """A long-lived forked child that writes a shared-memory staging buffer."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)
        self.buf = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        ctx = mp.get_context("fork")  # before any shardsafe thread exists; the child uses no torch
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_proc_writer_main, args=(self.shm, nbytes, child), daemon=True)
        self.proc.start()

    def stage(self, tensors: list[torch.Tensor]) -> None:
        pos = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.buf[pos: pos + n].copy_(t.reshape(-1).view(torch.uint8))
            pos += n

    def start(self, path: Path) -> None:
        self.conn.send(str(path))

    def done(self) -> bool:
        return self.conn.poll()

    def result(self) -> float:
        return self.conn.recv()[0]

    def close(self) -> None:
        try:
            self.conn.send(None)
            self.proc.join(30)
        finally:
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)
            del self.buf
            gc.collect()
            self.shm.close()
            self.shm.unlink()


# --------------------------------------------------------------------------- training step


class Trainer:
    """A single-threaded MLP training step of about ``target`` seconds."""

    def __init__(self, target: float = 0.075, dim: int = 1024, hidden: int = 4096) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, dim))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-4)
        self.dim = dim
        batch = 64
        for _ in range(3):  # calibrate the batch to the target step time
            self.x = torch.randn(batch, dim)
            t = median([self.step() for _ in range(5)])
            batch = max(8, min(2048, round(batch * target / t)))
        self.x = torch.randn(batch, dim)
        self.batch = batch

    def step(self) -> float:
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss = self.model(self.x).square().mean()
        loss.backward()
        self.opt.step()
        return time.perf_counter() - t0

    def steps(self, n: int) -> list[float]:
        return [self.step() for _ in range(n)]

    def steps_while(self, busy) -> list[float]:
        out = []
        while busy():
            out.append(self.step())
        return out


# --------------------------------------------------------------------------- parts


def bench_stalls(work: Path, state: dict, reps: int, saver: shardsafe.Checkpointer) -> dict:
    tensors = list(state.values())
    bufs = [torch.empty_like(t) for t in tensors]
    for b in bufs:
        b.fill_(0)  # fault the pages in: the floor is a warm copy

    def copy_floor() -> tuple[float, float]:
        t0 = time.perf_counter()
        for d, s in zip(bufs, tensors):
            d.copy_(s)
        return time.perf_counter() - t0, float("nan")

    def ss_async() -> tuple[float, float]:
        p = work / "ss_async"
        t0 = time.perf_counter()
        fut = saver.async_save(state, p)
        stall = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        settle(p)
        return stall, total

    def ss_sync() -> tuple[float, float]:
        p = work / "ss_sync"
        t0 = time.perf_counter()
        shardsafe.save(state, p)
        t = time.perf_counter() - t0
        settle(p)
        return t, t

    def dcp_async() -> tuple[float, float]:
        p = work / "dcp_async"
        t0 = time.perf_counter()
        fut = dcp.async_save(state, checkpoint_id=str(p), no_dist=True)
        stall = time.perf_counter() - t0
        fut.result()
        total = time.perf_counter() - t0
        settle(p)
        return stall, total

    def dcp_sync() -> tuple[float, float]:
        p = work / "dcp_sync"
        t0 = time.perf_counter()
        dcp.save(state, checkpoint_id=str(p), no_dist=True)
        t = time.perf_counter() - t0
        settle(p)
        return t, t

    contenders = {"copy_": copy_floor, "ss async": ss_async, "ss sync": ss_sync, "dcp async": dcp_async,
                  "dcp sync": dcp_sync}
    # Warm-up (untimed in the medians): the pool allocation of the first async save,
    # DCP's first-call setup, page faults of the copy buffers.
    cold = {name: contenders[name]() for name in ("copy_", "ss async", "dcp async")}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in contenders}
    names = list(contenders)
    for r in range(reps):
        order = names[r % len(names):] + names[: r % len(names)]
        for name in order:
            gc.collect()
            runs[name].append(contenders[name]())
        print(f"  stalls rep {r + 1}/{reps}: " + ", ".join(f"{k} {ms(runs[k][-1][0])}" for k in names), flush=True)
    per_rep_copy = [runs["ss async"][i][0] / runs["copy_"][i][0] for i in range(reps)]
    per_rep_dcp = [runs["ss async"][i][0] / runs["dcp async"][i][0] for i in range(reps)]
    return {
        "cold_first_save": {k: {"stall_s": v[0], "durable_s": v[1]} for k, v in cold.items()},
        "runs": {k: [{"stall_s": s, "durable_s": d} for s, d in v] for k, v in runs.items()},
        "median_stall_s": {k: median([s for s, _ in v]) for k, v in runs.items()},
        "median_durable_s": {k: median([d for _, d in v]) for k, v in runs.items()},
        "ratio_ss_async_to_copy": median(per_rep_copy),
        "ratio_ss_async_to_dcp_async": median(per_rep_dcp),
        "ratio_ss_async_to_copy_per_rep": per_rep_copy,
        "ratio_ss_async_to_dcp_async_per_rep": per_rep_dcp,
    }


def bench_training(work: Path, state: dict, trials: int, saver: shardsafe.Checkpointer,
                   writer: ProcessWriter) -> dict:
    trainer = Trainer()
    trainer.steps(3)
    tensors = list(state.values())
    base: list[float] = []
    thread_steps: list[float] = []
    proc_steps: list[float] = []
    thread_write: list[float] = []
    proc_write: list[float] = []
    base_per: list[float] = []
    thread_per: list[float] = []
    proc_per: list[float] = []
    for t in range(trials):
        # undisturbed, thread write, undisturbed, process write, undisturbed: each write's
        # baseline is the median of the undisturbed windows on both sides of it
        b0 = trainer.steps(20)

        p = work / "train_thread"
        fut = saver.async_save(state, p)
        t0 = time.perf_counter()
        s_thread = trainer.steps_while(lambda: not fut.done())  # noqa: B023 - called within this iteration
        fut.result()
        thread_write.append(time.perf_counter() - t0)
        settle(p)

        b1 = trainer.steps(20)

        f = work / "train_proc.bin"
        writer.stage(tensors)
        t0 = time.perf_counter()
        writer.start(f)
        s_proc = trainer.steps_while(lambda: not writer.done())
        writer.result()
        proc_write.append(time.perf_counter() - t0)
        settle()
        f.unlink(missing_ok=True)

        b2 = trainer.steps(20)
        base += b0 + b1 + b2
        thread_steps += s_thread
        proc_steps += s_proc
        base_per.append(median(b0 + b1 + b2))
        thread_per.append(median(s_thread) / median(b0 + b1))
        proc_per.append(median(s_proc) / median(b1 + b2))
        print(f"  training trial {t + 1}/{trials}: undisturbed {ms(median(b0))}/{ms(median(b1))}/{ms(median(b2))}, "
              f"thread x{thread_per[-1]:.2f} ({len(s_thread)} steps), process x{proc_per[-1]:.2f} "
              f"({len(s_proc)} steps)", flush=True)
    mb = median(base)
    return {
        "batch": trainer.batch,
        "median_step_s": {"undisturbed": mb, "thread": median(thread_steps), "process": median(proc_steps)},
        "steps": {"undisturbed": len(base), "thread": len(thread_steps), "process": len(proc_steps)},
        "ratio_thread": median(thread_per),
        "ratio_process": median(proc_per),
        "ratio_thread_pooled": median(thread_steps) / mb,
        "ratio_process_pooled": median(proc_steps) / mb,
        "ratio_thread_per_trial": thread_per,
        "ratio_process_per_trial": proc_per,
        "median_write_s": {"thread": median(thread_write), "process": median(proc_write)},
    }


def bench_rss(work: Path, state: dict, saves: int, saver: shardsafe.Checkpointer) -> dict:
    import psutil

    proc = psutil.Process()
    first_tensor = next(iter(state.values()))
    rss: dict[int, int] = {}
    t0 = time.perf_counter()
    for i in range(1, saves + 1):
        first_tensor[0] = float(i)
        saver.async_save(state, work / f"rss{i % 2}", overwrite=True).result()
        if i in (1, 5, 10, saves):
            gc.collect()
            rss[i] = proc.memory_info().rss
    settle(work / "rss0", work / "rss1")
    growth = (rss[saves] - rss[1]) / rss[1]
    return {"saves": saves, "rss_bytes": rss, "growth_frac": growth, "pool_allocations": saver.memory.allocations,
            "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="a 64 MiB state and fewer saves, for a smoke run")
    ap.add_argument("--dir", default=None, help="parent of the temporary work directory (default /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_async.json"), help="JSON output")
    ap.add_argument("--rss-saves", type=int, default=None, help="async saves in the RSS part (default 20; 5 quick)")
    ap.add_argument("--rss-dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="parent directory for the RSS part's checkpoints (default /dev/shm: tmpfs keeps 20 x "
                         "1 GiB saves fast; tmpfs pages are not in the process's RSS)")
    args = ap.parse_args()
    reps = args.reps or (1 if args.quick else 3)
    rss_saves = args.rss_saves or (5 if args.quick else 20)
    n, numel = (16, MiB) if args.quick else (64, 4 * MiB)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    cpu0 = CpuMonitor.snapshot()

    state = make_state(n, numel)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    writer = ProcessWriter(nbytes)  # fork before any background thread exists
    saver = shardsafe.Checkpointer()
    try:
        with bench_dir(args.dir, prefix="shardsafe-bench-async-") as work:
            info = machine_info(work)
            print(f"state: {n} x {numel * 4 // MiB} MiB float32 + 4097 floats = {nbytes} bytes; dir {work} "
                  f"({info['fstype']} on {info['device']}); {info['cpus']} CPUs; load avg {load_start}", flush=True)
            stalls = bench_stalls(work, state, reps, saver)
            training = bench_training(work, state, max(3, reps), saver, writer)
            with bench_dir(args.rss_dir or args.dir, prefix="shardsafe-bench-async-rss-") as rss_work:
                rss = bench_rss(rss_work, state, rss_saves, saver)
                rss["dir"] = str(rss_work)
    finally:
        writer.close()
    foreign = CpuMonitor.foreign(cpu0, CpuMonitor.snapshot())
    load_end = os.getloadavg()

    ms_stall = stalls["median_stall_s"]
    dur = stalls["median_durable_s"]
    rows = []
    for k in ("copy_", "ss async", "ss sync", "dcp async", "dcp sync"):
        if k not in ms_stall:
            continue
        rows.append([k, ms(ms_stall[k]), ms(dur[k]) if k != "copy_" else "-",
                     f"{ms_stall[k] / ms_stall['copy_']:.2f}x", f"{nbytes / ms_stall[k] / 1e9:.2f}"])
    print()
    print(f"Stall per save (median of {reps} interleaved reps; {nbytes / 2**30:.2f} GiB state)")
    print(md_table(["contender", "stall", "durable", "stall / copy_", "GB/s blocked"], rows))
    cold = stalls["cold_first_save"]
    print(f"first (cold) saves: ss async stall {ms(cold['ss async']['stall_s'])} (allocates the pool), "
          f"dcp async stall {ms(cold['dcp async']['stall_s'])}, copy_ {ms(cold['copy_']['stall_s'])}")
    tr = training
    print()
    print(f"Training step while a background write runs (MLP batch {tr['batch']}, 1 thread)")
    print(md_table(["mode", "median step", "steps", "ratio", "write time"], [
        ["undisturbed", ms(tr["median_step_s"]["undisturbed"]), tr["steps"]["undisturbed"], "1.00", "-"],
        ["thread (shardsafe async)", ms(tr["median_step_s"]["thread"]), tr["steps"]["thread"],
         f"{tr['ratio_thread']:.2f}", ms(tr["median_write_s"]["thread"])],
        ["process (shm + forked writer)", ms(tr["median_step_s"]["process"]), tr["steps"]["process"],
         f"{tr['ratio_process']:.2f}", ms(tr["median_write_s"]["process"])],
    ]))
    print("ratio = median over trials of (median step while writing / median step of the undisturbed windows "
          "around it); "
          f"pooled medians: thread {tr['ratio_thread_pooled']:.2f}, process {tr['ratio_process_pooled']:.2f}")
    print()
    rb = rss["rss_bytes"]
    points = ", ".join(f"after {k}: {v / MiB:.0f} MiB" for k, v in rb.items())
    print(f"RSS across {rss['saves']} async saves (checkpoints in {rss['dir']}): {points}"
          + f"; growth {rss['growth_frac'] * 100:+.2f}% ; pool allocations {rss['pool_allocations']}")

    targets = {
        "ss_async_stall_le_1.3x_copy": stalls["ratio_ss_async_to_copy"] <= 1.3,
        "ss_async_stall_le_0.5x_dcp_async": stalls["ratio_ss_async_to_dcp_async"] <= 0.5,
        "train_step_slowdown_thread_le_1.25": tr["ratio_thread"] <= 1.25,
        "rss_growth_le_1pct": rss["growth_frac"] <= 0.01,
    }
    print()
    print(md_table(["target", "value", "result"], [
        ["ss async stall <= 1.3 x copy_", f"{stalls['ratio_ss_async_to_copy']:.2f}x",
         "PASS" if targets["ss_async_stall_le_1.3x_copy"] else "FAIL"],
        ["ss async stall <= 0.5 x dcp async stall", f"{stalls['ratio_ss_async_to_dcp_async']:.2f}x",
         "PASS" if targets["ss_async_stall_le_0.5x_dcp_async"] else "FAIL"],
        ["step slowdown (thread) <= 1.25", f"{tr['ratio_thread']:.2f}",
         "PASS" if targets["train_step_slowdown_thread_le_1.25"] else "FAIL"],
        ["RSS growth over saves <= 1 %", f"{rss['growth_frac'] * 100:+.2f}%",
         "PASS" if targets["rss_growth_le_1pct"] else "FAIL"],
    ], align="llc"))
    elapsed = time.perf_counter() - t_start
    print(f"\nother load on the CPUs during the run: {foreign:.2f} CPUs on average; load avg {load_start} -> "
          f"{load_end}; {elapsed:.0f} s")
    out = {
        "benchmark": "bench_async",
        "machine": info,
        "torch": torch.__version__,
        "shardsafe": shardsafe.__version__,
        "state": {"tensors": n, "numel_each": numel, "dtype": "float32", "bytes": nbytes},
        "reps": reps,
        "stalls": stalls,
        "training": training,
        "rss": rss,
        "targets": targets,
        "foreign_cpu_load": foreign,
        "loadavg": {"start": load_start, "end": load_end},
        "seconds": elapsed,
        "argv": sys.argv[1:],
    }
    path = write_json(args.out, out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
