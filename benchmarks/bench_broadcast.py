"""Broadcast of replicated tensors on load: ``shardsafe.load(..., broadcast_replicated=True)``
vs ``False`` for a DDP-style (fully replicated) state at world 4 (spawned gloo processes).

    .venv/bin/python benchmarks/bench_broadcast.py [--reps N] [--quick] [--net-mbps MB/s] [--dir DIR] [--out FILE]

With broadcast, each replicated tensor that every rank needs whole is read and verified by
one rank (the bytes balanced over ranks) and sent to the others over the process group;
without, every rank reads (and verifies) every byte. The default is off for local paths and
on for object stores (``Backend.remote``). This benchmark measures both on one checkpoint:

  state  the GPT of bench_distributed.py (same config; --quick: its small one), not sharded:
         every rank builds it with the same seed and takes the same AdamW step, so the
         state {"model", "optim"} (weights + exp_avg + exp_avg_sq + steps) is identical on
         every rank, and shardsafe.save stores it as replicated tensors (balanced writers).
         Loads go into a second model + AdamW state (another seed), zeroed before each load
         outside the timed region, and every load is checked bitwise (torch.equal, every
         tensor) against the source.
  modes  warm  the local filesystem, page cache warm (the files read untimed first);
         cold  the local filesystem after ``sync; echo 3 > /proc/sys/vm/drop_caches``
               (needs root; skipped, and said so, when that fails); "disk read" = sectors
               read by the device holding the checkpoint during the load (/sys/block/*/stat,
               system-wide);
         net   an emulated network filesystem: the local backend wrapped in a
               FaultyBackend subclass (ThrottledBackend) that sends every read over a
               per-process link of --net-mbps (default 200 MB/s per rank; reads of all
               its threads queue on it) with a client cache (NFS keeps what it read in
               the client's page cache: a load hashes each verified block, then lands
               it with a second read, and only the first crosses the link; the cache is
               emptied before each load), the local page cache warm underneath, loaded
               through ``shardsafe.Checkpointer(storage=...)``. The backend is not
               ``remote``, so nothing is spilled: the only difference is the flag.
               "link read" = bytes that crossed the links.
  each repetition runs the 6 (mode, broadcast) loads in a rotated order; one untimed
  warm-up repetition first; medians over --reps (default 5) of the time (barrier -> load
  end, max over ranks) and of the per-repetition ratio off / on. bytes read / received =
  LoadInfo.bytes_read / bytes_received summed over ranks; rchar = /proc/self/io deltas
  (every read syscall, the manifest included) summed over ranks; CPU s/rank = process
  CPU time (all threads), mean over ranks (4 ranks share this machine's CPUs).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import threading
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    REPO,
    bench_dir,
    machine_info,
    md_table,
    median,
    mib,
    read_file_untimed,
    rotated,
    write_json,
)
from _dist_common import WorkerPool, loadavg, malloc_trim, proc_io, source_banner, source_state, verdict  # noqa: E402
from bench_distributed import FULL, GPT, QUICK, _local_bytes, _locals, _state_of, _train_step, param_count  # noqa: E402

import shardsafe  # noqa: E402
from shardsafe.format.manifest import MANIFEST_NAME, Manifest  # noqa: E402
from shardsafe.storage.base import Folder, ReadHandle  # noqa: E402
from shardsafe.storage.faults import FaultyBackend, FaultyFolder, FaultyRead  # noqa: E402
from shardsafe.storage.local import LocalBackend  # noqa: E402

WORLD = 4
MODES = ["warm", "cold", "net"]
BCAST = [False, True]


# ============================================================================ emulated network FS


class ThrottledBackend(FaultyBackend):
    """The local filesystem behind a per-process network link of ``bandwidth`` bytes/s,
    with a client cache like an NFS client's page cache: the first read of a file's byte
    crosses the link, later reads of it (a load reads verified blocks twice: hash, then
    land) are free until :meth:`forget`. A read that crosses the link reserves
    ``new bytes / bandwidth`` seconds on it (reads of concurrent threads queue behind each
    other) and returns when its reservation ends, at least ``latency`` s after it was
    issued. No faults. ``link_bytes``: bytes that crossed the link."""

    def __init__(self, bandwidth: float, latency: float = 0.0) -> None:
        super().__init__(LocalBackend())
        self.bandwidth = bandwidth
        self.latency = latency
        self.link_bytes = 0
        self.requests = 0
        self._link = threading.Lock()
        self._free_at = 0.0
        self._cached: dict[str, list[list[int]]] = {}  # file -> merged [lo, hi) ranges read

    def forget(self) -> None:
        """Empty the client cache (a fresh job)."""
        with self._link:
            self._cached.clear()

    def _uncached(self, where: str, lo: int, hi: int) -> int:
        """Bytes of [lo, hi) not read before; marks them read (caller holds the lock)."""
        runs = self._cached.setdefault(where, [])
        new = hi - lo
        for a, b in runs:
            new -= max(0, min(b, hi) - max(a, lo))
        runs.append([lo, hi])
        runs.sort()
        merged = [runs[0]]
        for a, b in runs[1:]:
            if a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self._cached[where] = merged
        return new

    def throttle(self, where: str, offset: int, nbytes: int) -> None:
        if nbytes <= 0:
            return
        with self._link:
            now = time.perf_counter()
            new = self._uncached(where, offset, offset + nbytes)
            if not new:
                return
            start = max(now, self._free_at)
            self._free_at = start + new / self.bandwidth
            until = max(self._free_at, now + self.latency)
            self.link_bytes += new
            self.requests += 1
        delay = until - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def open(self, location: str, create: bool = False) -> Folder:
        return _ThrottledFolder(self, self.inner.open(location, create))


class _ThrottledFolder(FaultyFolder):
    def open_read(self, name: str) -> ReadHandle:
        self._check("open_read", name)
        return _ThrottledRead(self.backend, self.inner.open_read(name), self.where(name))

    def open_folder(self, name: str, create: bool = False) -> Folder:
        self._check("open_folder", name)
        return _ThrottledFolder(self.backend, self.inner.open_folder(name, create))


class _ThrottledRead(FaultyRead):
    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        self.backend.throttle(self.where, offset, sum(memoryview(b).nbytes for b in buffers))
        super().read_into(buffers, offset)


# ============================================================================ worker side

_S: dict[str, Any] = {}  # per-worker state, kept across cases


def _build(cfg: dict, seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = GPT(**cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train_step(model, opt, cfg, 0)  # the same batch on every rank: replicas stay identical
    return model, opt


def c_setup(rank: int, world: int, cfg: dict, net_bps: float, net_latency: float) -> dict:
    """The source state (identical on every rank), the destination, the throttled Checkpointer."""
    warnings.filterwarnings("ignore")
    _S.clear()
    gc.collect()
    _S["src_objs"] = _build(cfg, seed=0)
    _S["src"] = _state_of(*_S["src_objs"])
    _S["dest_objs"] = _build(cfg, seed=1)
    _S["dest"] = _state_of(*_S["dest_objs"])
    _S["net"] = ThrottledBackend(net_bps, net_latency)
    _S["net_cp"] = shardsafe.Checkpointer(storage=_S["net"])
    gc.collect()
    return {"local_bytes": _local_bytes(_S["src"]), "tensors": len(_locals(_S["src"]))}


def c_save(rank: int, world: int, path: str) -> dict:
    info = shardsafe.save(_S["src"], Path(path))
    return {"bytes_written": info.bytes_written}


def c_load(rank: int, world: int, mode: str, bcast: bool, path: str) -> dict:
    dest = _S["dest"]
    for _, t in _locals(dest):
        t.zero_()
    gc.collect()
    malloc_trim()
    net = _S["net"]
    net.forget()
    net0 = net.link_bytes
    dist.barrier()
    io0 = proc_io()["rchar"]
    c0 = time.process_time()
    t0 = time.perf_counter()
    if mode == "net":
        info = _S["net_cp"].load(dest, path, broadcast_replicated=bcast)
    else:
        info = shardsafe.load(dest, path, broadcast_replicated=bcast)
    dt = time.perf_counter() - t0
    cpu = time.process_time() - c0
    rchar = proc_io()["rchar"] - io0
    mine, theirs = _locals(dest), _locals(_S["src"])
    equal = len(mine) == len(theirs) and all(
        ka == kb and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for (ka, a), (kb, b) in zip(mine, theirs)
    )
    dist.barrier()
    return {"seconds": dt, "cpu_s": cpu, "bytes_read": info.bytes_read, "bytes_received": info.bytes_received,
            "bytes_copied": info.bytes_copied, "rchar": rchar, "net_bytes": net.link_bytes - net0,
            "equal": equal}


def c_close(rank: int, world: int) -> None:
    cp = _S.pop("net_cp", None)
    if cp is not None:
        cp.close()
    _S.clear()
    gc.collect()


# ============================================================================ parent side


def drop_caches() -> str | None:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; None, or why it failed."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"


def _disk_stat_file(device: str) -> Path | None:
    """/sys/class/block/<dev>/stat of the device holding the checkpoint (None: unknown)."""
    p = Path("/sys/class/block") / Path(device).name / "stat"
    return p if device.startswith("/dev/") and p.exists() else None


def _sectors_read(stat: Path | None) -> int | None:
    if stat is None:
        return None
    try:
        return int(stat.read_text().split()[2])
    except (OSError, ValueError, IndexError):
        return None


def run_reps(pool: WorkerPool, ckpt: Path, reps: int, modes: list[str], stat: Path | None, res: dict) -> None:
    out: list[dict] = []
    for i in range(-1, reps):
        rep: dict[str, Any] = {"rep": i, "loadavg_before": loadavg()}
        order = [(m, b) for m in rotated(modes, i + 1) for b in rotated(BCAST, i + 1)]
        for mode, bcast in order:
            if mode == "cold":
                err = drop_caches()
                if err is not None:
                    raise RuntimeError(f"drop_caches failed mid-run: {err}")
            else:
                read_file_untimed(ckpt)
            s0 = _sectors_read(stat)
            rs = pool.run(c_load, mode, bcast, str(ckpt))
            s1 = _sectors_read(stat)
            if not all(r["equal"] for r in rs):
                raise RuntimeError(f"{mode} load with broadcast_replicated={bcast} does not reproduce the source")
            rep[f"{mode}/{'on' if bcast else 'off'}"] = {
                "seconds": max(r["seconds"] for r in rs),
                "per_rank_s": [r["seconds"] for r in rs],
                "cpu_s": [r["cpu_s"] for r in rs],
                "bytes_read": sum(r["bytes_read"] for r in rs),
                "bytes_received": sum(r["bytes_received"] for r in rs),
                "bytes_copied": sum(r["bytes_copied"] for r in rs),
                "rchar": sum(r["rchar"] for r in rs),
                "net_bytes": sum(r["net_bytes"] for r in rs),
                "disk_read": (s1 - s0) * 512 if s0 is not None and s1 is not None else None,
                "equal": True,
            }
        rep["loadavg_after"] = loadavg()
        rep["ratio_off_on"] = {m: rep[f"{m}/off"]["seconds"] / rep[f"{m}/on"]["seconds"] for m in modes}
        tag = "warm-up" if i < 0 else f"rep {i + 1}/{reps}"
        print(f"    {tag}: " + " | ".join(
            f"{m} off {rep[f'{m}/off']['seconds']:.2f}s on {rep[f'{m}/on']['seconds']:.2f}s" for m in modes)
            + f" | load avg {rep['loadavg_before']:.1f}-{rep['loadavg_after']:.1f}", flush=True)
        if i < 0:
            res["warmup"] = rep
        else:
            out.append(rep)
    res["reps"] = out


def summarize(res: dict) -> str:
    reps = res["reps"]
    modes = res["modes"]
    per_rank = res["state_bytes_per_rank"]
    lines = [f"## Broadcast of replicated tensors on load, world {WORLD}: GPT {res['params'] / 1e6:.1f}M params + "
             f"AdamW, replicated on every rank ({res['tensors']} tensors, {mib(per_rank)} per rank), "
             f"{len(reps)} reps, medians\n"]
    names = {"warm": "local, warm cache", "cold": "local, cold cache",
             "net": f"emulated network FS, {res['net_mbps']:.0f} MB/s per rank"}
    rows = []
    for m in modes:
        for b in ("off", "on"):
            k = f"{m}/{b}"

            def med(get: Any, k: str = k) -> float:
                return median([get(r[k]) for r in reps])

            t = med(lambda x: x["seconds"])
            disk = med(lambda x: x["disk_read"] if x["disk_read"] is not None else float("nan"))
            link = med(lambda x: x["net_bytes"])
            fetched = mib(disk) if m == "cold" and disk == disk else mib(link) if m == "net" else "-"
            rows.append([names[m], b, f"{t:.3f}", f"{per_rank / t / 1e9:.2f}",
                         f"{med(lambda x: sum(x['cpu_s']) / len(x['cpu_s'])):.2f}",
                         mib(med(lambda x: x["bytes_read"])), mib(med(lambda x: x["bytes_received"])),
                         mib(med(lambda x: x["rchar"])),
                         fetched,
                         verdict(all(r[k]["equal"] for r in reps))])
    lines.append(md_table(["mode", "broadcast", "load s (max rank)", "GB/s per rank", "CPU s/rank",
                           "bytes read (sum)", "bytes received (sum)", "rchar (sum)", "disk / link read", "bitwise"],
                          rows))
    lines.append("")
    ratio_rows = []
    for m in modes:
        rs = [r["ratio_off_on"][m] for r in reps]
        ratio_rows.append([names[m], f"{median(rs):.2f}x", ", ".join(f"{x:.2f}" for x in rs)])
    lines.append(md_table(["mode", "time off / on (median of per-rep ratios)", "per rep"], ratio_rows))
    la = [x for r in reps for x in (r["loadavg_before"], r["loadavg_after"])]
    lines.append("\ndisk / link read: cold = bytes the device read during the load (system-wide); net = bytes "
                 "that crossed the emulated links, summed over ranks (each byte once per rank: client cache).")
    lines.append(f"GB/s per rank = state bytes per rank / load time. 1-min load average during the reps (the 4 "
                 f"ranks included): {min(la):.1f}-{max(la):.1f} on {res['machine']['cpus']} CPUs.")
    if res.get("cold_skipped"):
        lines.append(f"cold-cache mode skipped: drop_caches failed ({res['cold_skipped']}).")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 5; 1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small model, for a smoke run")
    ap.add_argument("--net-mbps", type=float, default=200.0, help="emulated network FS: MB/s per rank (default 200)")
    ap.add_argument("--net-latency-ms", type=float, default=0.0, help="emulated network FS: least ms per read")
    ap.add_argument("--dir", default=None, help="parent of the temporary work directory (default /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_broadcast.json"), help="JSON output")
    args = ap.parse_args()
    reps = args.reps if args.reps is not None else (1 if args.quick else 5)
    cfg = QUICK if args.quick else FULL
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    src = source_state()
    print(source_banner(src), flush=True)
    res: dict[str, Any] = {"torch": torch.__version__, "shardsafe": shardsafe.__version__, "quick": args.quick,
                           "source": src, "config": cfg, "params": param_count(cfg), "world": WORLD,
                           "net_mbps": args.net_mbps, "net_latency_ms": args.net_latency_ms}
    modes = list(MODES)
    err = drop_caches()
    if err is not None:
        print(f"cannot drop the page cache ({err}): cold-cache mode skipped", flush=True)
        res["cold_skipped"] = err
        modes.remove("cold")
    res["modes"] = modes
    with bench_dir(args.dir, "shardsafe-bench-bcast-") as work:
        res["machine"] = machine_info(work)
        stat = _disk_stat_file(res["machine"]["device"])
        with WorkerPool(WORLD) as pool:
            t = time.perf_counter()
            setup = pool.run(c_setup, cfg, args.net_mbps * 1e6, args.net_latency_ms / 1e3, timeout=900)
            res["state_bytes_per_rank"] = setup[0]["local_bytes"]
            res["tensors"] = setup[0]["tensors"]
            ckpt = work / "ckpt"
            saved = pool.run(c_save, str(ckpt))
            m = Manifest.from_bytes((ckpt / MANIFEST_NAME).read_bytes())
            kinds: dict[str, int] = {}
            for e in m.tensors.values():
                kinds[e.kind] = kinds.get(e.kind, 0) + 1
            res["manifest_kinds"] = kinds
            res["bytes_written_per_rank"] = [s["bytes_written"] for s in saved]
            print(f"GPT {param_count(cfg) / 1e6:.1f}M params + AdamW, replicated on {WORLD} ranks: "
                  f"{setup[0]['tensors']} tensors, {mib(setup[0]['local_bytes'])} per rank; saved tensors by kind "
                  f"{kinds}; written per rank {[mib(b) for b in res['bytes_written_per_rank']]} "
                  f"(setup + save {time.perf_counter() - t:.1f}s)", flush=True)
            run_reps(pool, ckpt, reps, modes, stat, res)
            pool.run(c_close)
    text = summarize(res)
    res["wall_s"] = time.perf_counter() - t0
    print()
    print(text)
    print(f"\nwall time {res['wall_s']:.0f}s; JSON: {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
