"""Compression benchmark (issue 25): how far lossless codecs shrink a real training state,
how fast they run, and what shardsafe's ``compression=`` does to save and load times on a
fast disk, a slow (200 MB/s) one and an object store.

    .venv/bin/python benchmarks/bench_compression.py [--reps N] [--quick] [--steps N]
        [--bf16-train cast|autocast] [--threads N] [--no-s3] [--no-reshard] [--dir DIR] [--out FILE]

The state
  The GPT of bench_distributed.py (about 9M parameters; --quick: about 1.2M) trained for
  --steps AdamW steps (lr 1e-3, weight decay 0.1; 50, --quick 20) on batches with a
  learnable pattern, fp32 master weights: its weights and Adam moments (exp_avg,
  exp_avg_sq) have the statistics training gives them. Two states: "fp32 + AdamW"
  (fp32 weights + moments) and "bf16 + AdamW" (the weights as bf16, as a bf16 model or its
  autocast forward holds them, + the moments). --bf16-train cast (the default on a CPU:
  bf16 autocast there runs ~20x slower without bf16 units) takes the fp32 run's weights
  cast to bf16 and its moments; --bf16-train autocast (the default with CUDA) trains a
  second run under bf16 autocast and takes its weights (as bf16) and moments.

Parts
  1. Ratio per kind of tensor and per state, every codec on the same 1 MiB blocks (each
     tensor cut into blocks, as shardsafe compresses its checksum blocks): zstd level 1 and
     lz4 (lz4.block) on the raw bytes; a numpy byte-shuffle by element size, then zstd-1 /
     lz4; blosc2's shuffle + zstd / lz4 (clevel 1); ZipNN (zipnn, its defaults: byte
     grouping, AUTO method); shardsafe's own block codecs (shardsafe.format.codecs) when
     the installed shardsafe has them. A block that does not shrink counts as stored raw.
     ratio = raw bytes / stored bytes. Every codec's output is decompressed once and
     checked bitwise.
  2. Throughput: compress and decompress every block of both states (distinct bytes), on
     one thread and on --threads threads (default: all CPUs) from a thread pool;
     MB/s = raw bytes (decimal MB) / seconds. Repetitions interleaved (codec order rotated
     per repetition); median [min-max].
  3. Save and load of the fp32 state through shardsafe with compression off / zstd / lz4 /
     auto on (a) the local disk (fsync'd saves, warm page cache loads), (b) the local disk
     behind storage/faults.py's throttle at --throttle-mbps (200 MB/s) for writes and reads,
     with a page cache for re-reads (throttle_cache: a verified load reads each block twice,
     to hash it, then to land it; the cache is emptied before each load, so loads are cold),
     (c) moto's S3 server on loopback (as bench_s3.py starts it). One untimed save and load
     per mode first ("auto" learns the storage's bandwidth from raw saves); then per
     repetition all saves (rotated order), then all loads (rotated), each load into a zeroed
     destination and checked bitwise. Stored bytes: SaveInfo.bytes_stored where present,
     else the checkpoint's size. Ratios paired per repetition. A codec the installed
     shardsafe refuses is skipped with a line saying so (and without compression= at all,
     only "off" runs).
  4. Reshard 4 -> 2: the fp32 state as DTensors (Shard(0)) saved by 4 gloo ranks with
     compression (zstd; off as the control), loaded by 2 ranks through a FaultyBackend
     that records every read; read amplification = bytes of data files each rank read at
     least once, summed over the 2 ranks / the data files' size (together they need every
     stored byte once; a compressed block that straddles two ranks' shards is read by
     both: so is an uncompressed one, whose checksum blocks are verified whole; "off"
     measures that share, and the target is zstd's amplification / off's). Every read
     counted (a verified load reads a block to hash it, then to land it) and
     LoadInfo.bytes_read / bytes_stored_read (where present) are shown too.
Noise: other CPU load (busy CPUs not used by this process) per repetition, as bench_single.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import os
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from _common import (  # noqa: E402
    REPO,
    CpuMonitor,
    bench_dir,
    machine_info,
    md_table,
    median,
    remove,
    rotated,
    spread,
    write_json,
)
from _zcodecs import (  # noqa: E402
    Blocks,
    blocks_of,
    check_round_trip,
    compress_all,
    kinds_of,
    library_codecs,
    shardsafe_codecs,
    state_of,
    stored_bytes,
    timed_pass,
    train,
)

import shardsafe  # noqa: E402

FULL = {"vocab": 8005, "dim": 256, "layers": 6, "heads": 8, "ctx": 128, "batch": 8, "seq": 64}
QUICK = {"vocab": 2053, "dim": 128, "layers": 4, "heads": 4, "ctx": 64, "batch": 4, "seq": 32}
MODES = ["off", "zstd", "lz4", "auto"]
TARGETS = {
    "ratio_fp32": (">=", 1.20, "overall ratio, fp32 + AdamW state"),
    "ratio_bf16": (">=", 1.25, "overall ratio, bf16 + AdamW state"),
    "vs_zipnn": (">=", 0.965, "ratio / ZipNN's ratio on the same bytes (both states; within 3.5%)"),
    "auto_fast": ("<=", 1.05, "auto / off time on the fast disk, save and load (never slower, within 5% noise)"),
    "auto_slow": (">=", 1.15, "off / auto time on the throttled disk, save and load"),
    "reshard_read": ("<=", 1.10, "reshard 4 -> 2: bytes read / compressed bytes needed (zstd vs off)"),
}


# ============================================================================ part 1-2: codecs


def _fmt_range(xs: list[float], f: str = "{:.0f}") -> str:
    m, lo, hi = spread(xs)
    return f"{f.format(m)} [{f.format(lo)}-{f.format(hi)}]"


def part_ratios(codecs: list, kinds: dict[str, Blocks], states: dict[str, list[str]]) -> dict[str, dict[str, float]]:
    """Ratio of every codec per kind and per state (raw / stored), printed as a table."""
    out: dict[str, dict[str, float]] = {}
    for codec in codecs:
        t0 = time.perf_counter()
        sizes = {}
        for kind, blocks in kinds.items():
            packed = compress_all(codec, blocks)
            check_round_trip(codec, blocks, packed)
            sizes[kind] = (blocks.nbytes, sum(stored_bytes(blocks, packed)))
            del packed
        row = {k: raw / st for k, (raw, st) in sizes.items()}
        for sname, members in states.items():
            raw = sum(sizes[k][0] for k in members)
            row[sname] = raw / sum(sizes[k][1] for k in members)
        out[codec.name] = row
        print(f"  {codec.name}: ratios measured and round trip checked in {time.perf_counter() - t0:.1f}s", flush=True)
    cols = [*kinds, *states]
    print("\n### Ratio per kind of tensor (raw / stored, 1 MiB blocks; a block that does not shrink is stored raw)\n")
    print(md_table(["codec", *[f"{c} ({_mib(kinds[c].nbytes) if c in kinds else 'state'})" for c in cols]],
                   [[name, *[f"{row[c]:.3f}" for c in cols]] for name, row in out.items()]))
    return out


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def part_throughput(codecs: list, blocks: Blocks, reps: int, threads: int) -> dict[str, dict[str, list[float]]]:
    """MB/s per codec: compress / decompress, 1 thread and ``threads`` threads."""
    n, raw = len(blocks.views), blocks.nbytes
    out: dict[str, dict[str, list[float]]] = {c.name: {} for c in codecs}
    other: list[float] = []
    with ThreadPoolExecutor(threads) as pool:
        for r in range(reps):
            cpu0 = CpuMonitor.snapshot()
            for codec in rotated(codecs, r):
                packed: list[Any] = [None] * n

                def comp(i: int, codec=codec, packed=packed) -> None:
                    packed[i] = codec.compress(blocks.views[i], blocks.itemsizes[i])

                def decomp(i: int, codec=codec, packed=packed) -> None:
                    c, v = packed[i], blocks.views[i]
                    if c is not None and len(c) < v.nbytes:
                        codec.decompress(c, blocks.itemsizes[i], v.nbytes)
                    else:  # stored raw: a load copies it
                        v.tobytes()

                res = out[codec.name]
                for label, fn, th in (("compress 1T", comp, 1), (f"compress {threads}T", comp, threads),
                                      ("decompress 1T", decomp, 1), (f"decompress {threads}T", decomp, threads)):
                    gc.collect()
                    res.setdefault(label, []).append(raw / timed_pass(fn, n, th, pool) / 1e6)
                del packed
            other.append(CpuMonitor.foreign(cpu0, CpuMonitor.snapshot()))
            print(f"  throughput rep {r + 1}/{reps}: other CPU load {other[-1]:.2f}", flush=True)
    labels = ["compress 1T", f"compress {threads}T", "decompress 1T", f"decompress {threads}T"]
    print(f"\n### Throughput, MB/s of raw bytes ({_mib(raw)}, {n} blocks; median [min-max] of {reps} interleaved "
          f"reps; {threads}T = {threads} threads)\n")
    print(md_table(["codec", *labels], [[name, *[_fmt_range(res[k]) for k in labels]] for name, res in out.items()]))
    out["_other_cpu_load"] = {"per_rep": other}  # type: ignore[assignment]
    return out


# ============================================================================ part 3: save / load tiers


def supported_modes(cp: Any, work: Path) -> tuple[list[str], list[str]]:
    """The compression modes the installed shardsafe accepts (a tiny save each) and a line
    for each one it refuses."""
    if "compression" not in inspect.signature(shardsafe.save).parameters:
        return ["off"], [f"shardsafe at {Path(shardsafe.__file__).parent} has no compression= on save: "
                         f"the zstd / lz4 / auto save and load rows are skipped (off runs as the control)"]
    ok, lines = [], []
    for mode in MODES:
        p = work / f"probe-{mode}"
        try:
            cp.save({"x": torch.randn(4096)}, p, compression=mode)
            ok.append(mode)
        except Exception as exc:  # noqa: BLE001 - whatever refusal the installed version raises
            lines.append(f"compression={mode!r} refused by the installed shardsafe ({type(exc).__name__}: {exc}): "
                         f"its rows are skipped")
        remove(p)
    return ok, lines


def _save_kw(mode: str, has_arg: bool) -> dict[str, Any]:
    return {"compression": mode} if has_arg else {}


def _zero(dest: dict) -> None:
    for t in _tensors(dest):
        t.zero_()


def _tensors(tree: Any) -> list[torch.Tensor]:
    if torch.is_tensor(tree):
        return [tree]
    if isinstance(tree, dict):
        return [t for v in tree.values() for t in _tensors(v)]
    return []


def _check(dest: dict, src: dict, what: str) -> None:
    for a, b in zip(_tensors(dest), _tensors(src)):
        if not torch.equal(a.view(torch.uint8), b.view(torch.uint8)):
            raise SystemExit(f"{what}: the loaded state differs from the saved one")


class Tier:
    """One storage: a Checkpointer, where a checkpoint of a given name goes, its size, and
    how to remove it."""

    def __init__(self, name: str, cp: Any, place: Any, size: Any, drop: Any, backend: Any = None) -> None:
        self.name, self.cp, self.place, self.size, self.drop, self.backend = name, cp, place, size, drop, backend


def _dir_size(p: Any) -> int:
    p = Path(p)
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file()) if p.exists() else 0


def make_tiers(work: Path, mbps: float, moto: Any) -> list[Tier]:
    from shardsafe.storage.faults import FaultyBackend

    tiers = [Tier("local disk", shardsafe.Checkpointer(), lambda n: work / n, _dir_size, remove)]
    try:
        slow = FaultyBackend(throttle_write_bps=mbps * 1e6, throttle_read_bps=mbps * 1e6, throttle_cache=True)
        tiers.append(Tier(f"local disk @ {mbps:.0f} MB/s", shardsafe.Checkpointer(storage=slow), lambda n: work / n,
                          _dir_size, remove, slow))
    except TypeError as exc:
        print(f"the installed shardsafe's storage/faults.py has no throttle ({exc}): the {mbps:.0f} MB/s tier "
              f"is skipped")
    if moto is not None:
        from bench_s3 import ss_options

        tiers.append(Tier("S3 (moto, loopback)", shardsafe.Checkpointer(storage_options=ss_options(moto.endpoint)),
                          lambda n: moto.url(f"zbench/{n}"), lambda u: moto.size(u.split("/", 3)[3] + "/"),
                          lambda u: moto.delete(u.split("/", 3)[3] + "/")))
    return tiers


def _one(tier: Tier, state: dict, mode: str, label: str, has_arg: bool) -> tuple[float, Any, Any, int]:
    """One timed save of ``state`` on ``tier``: (seconds, path, SaveInfo, stored bytes)."""
    path = tier.place(label)
    gc.collect()
    t0 = time.perf_counter()
    info = tier.cp.save(state, path, **_save_kw(mode, has_arg))
    save_s = time.perf_counter() - t0
    stored = getattr(info, "bytes_stored", None) or tier.size(path)
    return save_s, path, info, stored


def part_tiers(tiers: list[Tier], state: dict, dest: dict, modes: list[str], has_arg: bool,
               reps: int) -> dict[str, Any]:
    """Save / load seconds per tier and mode, stored bytes, the codec each save used."""
    payload = sum(t.nbytes for t in _tensors(state))
    res: dict[str, Any] = {}
    for tier in tiers:
        rec = res[tier.name] = {m: {"save": [], "load": [], "stored": [], "codec": [], "read": [], "paid": []}
                                for m in modes}
        for mode in modes:  # warm-up: first-call costs; "auto" learns the bandwidth from the raw save before it
            _s, path, _i, _st = _one(tier, state, mode, f"warm-{mode}", has_arg)
            tier.cp.load(dest, path)
            _check(dest, state, f"{tier.name} {mode}")
            tier.drop(path)
        other = []
        for r in range(reps):
            cpu0 = CpuMonitor.snapshot()
            paths = {}
            for mode in rotated(modes, r):
                save_s, paths[mode], info, stored = _one(tier, state, mode, f"{mode}-{r}", has_arg)
                rec[mode]["save"].append(save_s)
                rec[mode]["stored"].append(stored)
                rec[mode]["codec"].append(str(getattr(info, "compression", "off")))
            for mode in rotated(modes, r):
                _zero(dest)
                b = tier.backend
                if b is not None:
                    b.forget()  # cold reads: the disk's page cache starts empty
                    before, paid = b.bytes_read, b.read_throttle.bytes
                gc.collect()
                t0 = time.perf_counter()
                tier.cp.load(dest, paths[mode])
                rec[mode]["load"].append(time.perf_counter() - t0)
                if b is not None:
                    rec[mode]["read"].append(b.bytes_read - before)
                    rec[mode]["paid"].append(b.read_throttle.bytes - paid)
                _check(dest, state, f"{tier.name} {mode}")
            for p in paths.values():
                tier.drop(p)
            other.append(CpuMonitor.foreign(cpu0, CpuMonitor.snapshot()))
            print(f"  {tier.name} rep {r + 1}/{reps}: other CPU load {other[-1]:.2f}; "
                  + ", ".join(f"{m} save {rec[m]['save'][-1]:.2f}s load {rec[m]['load'][-1]:.2f}s" for m in modes),
                  flush=True)
        rec["_other_cpu_load"] = other
        _print_tier(tier.name, rec, modes, payload, reps)
    return res


def _print_tier(name: str, rec: dict, modes: list[str], payload: int, reps: int) -> None:
    print(f"\n### {name}: save / load of the fp32 + AdamW state ({_mib(payload)}; median [min-max] of {reps} "
          f"interleaved reps)\n")
    rows = []
    for m in modes:
        d = rec[m]
        off = rec["off"]
        sv = [o / s for o, s in zip(off["save"], d["save"])]
        ld = [o / s for o, s in zip(off["load"], d["load"])]
        codecs = sorted(set(d["codec"]))
        read = f"{median(d['read']) / median(d['stored']):.2f} / {median(d['paid']) / median(d['stored']):.2f}" \
            if d["read"] else "-"
        rows.append([m, "/".join(codecs), f"{payload / median(d['stored']):.3f}", read,
                     _fmt_range(d["save"], "{:.2f}"),
                     f"{payload / median(d['save']) / 1e6:.0f}", _fmt_range(d["load"], "{:.2f}"),
                     f"{payload / median(d['load']) / 1e6:.0f}", _fmt_range(sv, "{:.2f}"), _fmt_range(ld, "{:.2f}")])
    print(md_table(["compression", "codec used", "ratio", "load read / stored: all, throttled", "save s", "save MB/s",
                    "load s", "load MB/s", "off/this save", "off/this load"], rows, "llrrrrrrrr"))


# ============================================================================ part 4: reshard 4 -> 2


def _dtensors(flat_file: str, world: int, zero: bool) -> tuple[dict, dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.load(flat_file, weights_only=True)
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for k, t in full.items():
        dt = distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None)
        if zero:
            dt.to_local().zero_()
        out[k] = dt
    return {"t": out}, full


def c_rs_save(rank: int, world: int, flat_file: str, path: str, mode: str, has_arg: bool) -> dict:
    state, _ = _dtensors(flat_file, world, zero=False)
    info = shardsafe.save(state, path, **_save_kw(mode, has_arg))
    return {"bytes_written": info.bytes_written, "codec": str(getattr(info, "compression", "off"))}


def _counting_backend() -> Any:
    """A FaultyBackend (no faults) that records every read's file, offset and length."""
    from shardsafe.storage.faults import FaultyBackend, FaultyFolder, FaultyRead

    class Read(FaultyRead):
        def read_into(self, buffers: Any, offset: int) -> None:
            n = sum(memoryview(b).nbytes for b in buffers)
            with self.backend._lock:
                self.backend.ranges.setdefault(self.where, []).append((offset, offset + n))
            super().read_into(buffers, offset)

    class Folder(FaultyFolder):
        def open_read(self, name: str) -> Any:
            self._check("open_read", name)
            return Read(self.backend, self.inner.open_read(name), self.where(name))

        def open_folder(self, name: str, create: bool = False) -> Any:
            self._check("open_folder", name)
            return Folder(self.backend, self.inner.open_folder(name, create))

    class Counting(FaultyBackend):
        def __init__(self) -> None:
            super().__init__()
            self.ranges: dict[str, list[tuple[int, int]]] = {}

        def open(self, location: str, create: bool = False) -> Any:
            return Folder(self, self.inner.open(location, create))

    return Counting()


def _union(ranges: list[tuple[int, int]]) -> int:
    """Bytes covered by the [lo, hi) ranges."""
    total, end = 0, -1
    for lo, hi in sorted(ranges):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def c_rs_load(rank: int, world: int, flat_file: str, path: str) -> dict:
    state, _ = _dtensors(flat_file, world, zero=True)
    backend = _counting_backend()
    info = shardsafe.Checkpointer(storage=backend).load(state, path)
    expect, _ = _dtensors(flat_file, world, zero=False)
    for k, dt in state["t"].items():
        if not torch.equal(dt.to_local().view(torch.uint8), expect["t"][k].to_local().view(torch.uint8)):
            raise RuntimeError(f"reshard load: {k} differs on rank {rank}")
    data = {w: r for w, r in backend.ranges.items() if w.endswith(".safetensors")}
    return {"data_distinct": sum(_union(r) for r in data.values()),
            "data_read": sum(hi - lo for r in data.values() for lo, hi in r),
            "all_read": backend.bytes_read, "info_bytes_read": getattr(info, "bytes_read", None),
            "info_stored_read": getattr(info, "bytes_stored_read", None),
            "local": sum(dt.to_local().nbytes for dt in state["t"].values())}


def part_reshard(state: dict, work: Path, modes: list[str], has_arg: bool) -> dict[str, Any]:
    from _dist_common import WorkerPool

    flat = {}
    for fqn, t in state["model"].items():
        flat[f"w.{fqn}"] = t
    for fqn, st in state["optim"].items():
        flat[f"m.{fqn}"], flat[f"v.{fqn}"] = st["exp_avg"], st["exp_avg_sq"]
    flat_file = str(work / "flat.pt")
    torch.save(flat, flat_file)
    out: dict[str, Any] = {}
    with contextlib.closing(WorkerPool(4)) as pool:
        for mode in modes:
            out[mode] = {"save": pool.run(c_rs_save, flat_file, str(work / f"rs-{mode}"), mode, has_arg)}
    with contextlib.closing(WorkerPool(2)) as pool:
        for mode in modes:
            path = work / f"rs-{mode}"
            rs = pool.run(c_rs_load, flat_file, str(path))
            files = sum(f.stat().st_size for f in path.rglob("*.safetensors"))
            out[mode].update(load=rs, data_files=files, amplification=sum(r["data_distinct"] for r in rs) / files,
                             amplification_total=sum(r["data_read"] for r in rs) / files)
            remove(path)
    remove(flat_file)
    for d in out.values():  # a block that straddles two ranks is needed (verified) by both, compressed or not:
        d["vs_off"] = d["amplification"] / out["off"]["amplification"] if "off" in out else None  # off measures it
    rows = []
    for mode, d in out.items():
        rs = d["load"]
        info_read = [r["info_bytes_read"] for r in rs]
        stored_read = [r["info_stored_read"] for r in rs]
        rows.append([mode, "/".join(sorted({s["codec"] for s in d["save"]})), _mib(d["data_files"]),
                     _mib(sum(r["data_distinct"] for r in rs)), f"{d['amplification']:.3f}",
                     "-" if d["vs_off"] is None else f"{d['vs_off']:.3f}",
                     _mib(sum(r["data_read"] for r in rs)), f"{d['amplification_total']:.3f}",
                     _mib(sum(info_read)) if None not in info_read else "-",
                     _mib(sum(stored_read)) if None not in stored_read else "-", _mib(sum(r["local"] for r in rs))])
    print("\n### Reshard 4 -> 2 (fp32 + AdamW as Shard(0) DTensors; reads recorded through a FaultyBackend; "
          "distinct = bytes of data files read at least once by a rank, summed over the 2 ranks; all = every read, "
          "a byte read twice (verify, then land) counted twice)\n")
    print(md_table(["compression", "codec", "data files", "read, distinct", "distinct / files",
                    "distinct / files, / off's", "read, all", "all / files", "LoadInfo.bytes_read (sum)",
                    "LoadInfo.bytes_stored_read (sum)", "destination bytes"], rows, "llrrrrrrrrr"))
    return out


# ============================================================================ main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="a small model and few steps, for a smoke run")
    ap.add_argument("--steps", type=int, default=None, help="AdamW steps (default 50; 20 with --quick)")
    ap.add_argument("--bf16-train", choices=["cast", "autocast"], default=None,
                    help="how the bf16 state is made (default: autocast with CUDA, cast on a CPU)")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="the all-thread count")
    ap.add_argument("--throttle-mbps", type=float, default=200.0, help="the slow disk's MB/s (default 200)")
    ap.add_argument("--no-s3", action="store_true", help="skip the moto S3 tier")
    ap.add_argument("--no-reshard", action="store_true", help="skip the 4 -> 2 reshard part")
    ap.add_argument("--no-tiers", action="store_true", help="codec tables only")
    ap.add_argument("--dir", default=None, help="parent of the temporary work directory (default /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_compression.json"), help="JSON output")
    args = ap.parse_args()
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else (20 if args.quick else 50)
    args.bf16_train = args.bf16_train or ("autocast" if torch.cuda.is_available() else "cast")
    if args.reps < 1 or args.threads < 1:
        ap.error("--reps and --threads must be >= 1")
    warnings.simplefilter("ignore")
    with bench_dir(args.dir, prefix="shardsafe-zbench-") as work:
        return run(work, args)


def make_states(args: argparse.Namespace) -> tuple[dict, dict, dict[str, Any]]:
    from bench_distributed import param_count

    cfg = QUICK if args.quick else FULL
    model, opt, losses, secs = train(cfg, args.steps, autocast=False)
    s32 = state_of(model, opt, torch.float32)
    meta = {"params": param_count(cfg), "steps": args.steps, "fp32_run": {"loss": [losses[0], losses[-1]],
                                                                           "seconds": secs}}
    if args.bf16_train == "autocast":
        m16, o16, l16, s = train(cfg, args.steps, autocast=True)
        s16 = state_of(m16, o16, torch.bfloat16)
        meta["bf16_run"] = {"loss": [l16[0], l16[-1]], "seconds": s}
    else:
        s16 = state_of(model, opt, torch.bfloat16)
    print(f"trained {meta['params'] / 1e6:.1f}M params, {args.steps} AdamW steps: fp32 run loss "
          f"{losses[0]:.2f} -> {losses[-1]:.2f} in {secs:.0f}s"
          + (f"; bf16 autocast run loss {meta['bf16_run']['loss'][0]:.2f} -> {meta['bf16_run']['loss'][1]:.2f} "
             f"in {meta['bf16_run']['seconds']:.0f}s" if "bf16_run" in meta else
             "; bf16 state = that run's weights cast to bf16 + its moments (--bf16-train cast)"), flush=True)
    return s32, s16, meta


def run(work: Path, args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    info = machine_info(work)
    print(f"shardsafe {shardsafe.__version__} from {Path(shardsafe.__file__).parent}; torch {torch.__version__}; "
          f"{info['affinity']} CPUs ({info['cpu']}); {info['fstype']} on {info['device']}", flush=True)
    s32, s16, meta = make_states(args)
    k32, k16 = kinds_of(s32), kinds_of(s16)
    kinds = {k: blocks_of(v) for k, v in k32.items()}
    kinds["weights bf16"] = blocks_of(k16["weights bf16"])
    states = {"fp32 + AdamW": ["weights fp32", "exp_avg", "exp_avg_sq"]}
    if args.bf16_train == "autocast":
        kinds["exp_avg (autocast run)"] = blocks_of(k16["exp_avg"])
        kinds["exp_avg_sq (autocast run)"] = blocks_of(k16["exp_avg_sq"])
        states["bf16 + AdamW"] = ["weights bf16", "exp_avg (autocast run)", "exp_avg_sq (autocast run)"]
    else:
        states["bf16 + AdamW"] = ["weights bf16", "exp_avg", "exp_avg_sq"]
    codecs, missing = library_codecs()
    own, own_line = shardsafe_codecs()
    for line in [*missing, own_line]:
        print(line)
    codecs += own
    print("\n## Part 1: ratios", flush=True)
    ratios = part_ratios(codecs, kinds, states)
    print("\n## Part 2: throughput", flush=True)
    every = Blocks()
    for b in kinds.values():
        every = every + b
    speed = part_throughput(codecs, every, args.reps, args.threads)
    results: dict[str, Any] = {"bench": "bench_compression", "quick": args.quick, "reps": args.reps, "machine": info,
                               "torch": torch.__version__, "shardsafe": shardsafe.__version__,
                               "shardsafe_file": shardsafe.__file__, "state": meta, "missing": missing,
                               "shardsafe_codecs": own_line, "ratios": ratios, "throughput_mbps": speed}
    if not args.no_tiers:
        run_tiers(work, args, s32, results)
    report(results, args, codecs)
    results["wall_seconds"] = time.perf_counter() - t_start
    out = write_json(args.out, results)
    print(f"\nwrote {out}; total {results['wall_seconds']:.0f}s")
    return 0


def run_tiers(work: Path, args: argparse.Namespace, state: dict, results: dict) -> None:
    print("\n## Part 3: save / load", flush=True)
    probe = shardsafe.Checkpointer()
    modes, lines = supported_modes(probe, work)
    has_arg = "compression" in inspect.signature(shardsafe.save).parameters
    for line in lines:
        print(line)
    moto = None
    if not args.no_s3:
        try:
            from bench_s3 import MotoProcess

            moto = MotoProcess()
        except Exception as exc:  # noqa: BLE001 - moto missing or failing to start: skip that tier, say so
            print(f"moto S3 server unavailable ({type(exc).__name__}: {exc}): the S3 tier is skipped")
    dest = {"model": {k: torch.empty_like(v) for k, v in state["model"].items()},
            "optim": {k: {"exp_avg": torch.empty_like(st["exp_avg"]), "exp_avg_sq": torch.empty_like(st["exp_avg_sq"]),
                          "step": 0.0} for k, st in state["optim"].items()}}
    try:
        results["tiers"] = part_tiers(make_tiers(work, args.throttle_mbps, moto), state, dest, modes, has_arg,
                                      args.reps)
    finally:
        if moto is not None:
            moto.stop()
    results["modes"], results["mode_lines"] = modes, lines
    if not args.no_reshard:
        print("\n## Part 4: reshard 4 -> 2", flush=True)
        rs_modes = [m for m in ("off", "zstd") if m in modes]
        results["reshard"] = part_reshard(state, work, rs_modes, has_arg)


def _pick_own(ratios: dict) -> str:
    """The codec the ratio targets judge: shardsafe's zstd when present, else the
    reference shuffle+zstd-1 it is built on."""
    return "shardsafe zstd" if "shardsafe zstd" in ratios else "shuffle+zstd-1"


def targets(results: dict, threads: int) -> list[list[str]]:
    ratios = results["ratios"]
    own = _pick_own(ratios)
    rows: list[list[str]] = []

    def add(key: str, value: float | None, shown: str) -> None:
        op, goal, desc = TARGETS[key]
        ok = None if value is None else (value >= goal if op == ">=" else value <= goal)
        rows.append([desc, shown, f"{op} {goal}", "n/a" if ok is None else ("PASS" if ok else "FAIL")])
        results.setdefault("targets", {})[key] = {"value": value, "goal": goal, "op": op, "pass": ok}

    add("ratio_fp32", ratios[own]["fp32 + AdamW"], f"{ratios[own]['fp32 + AdamW']:.3f} ({own})")
    add("ratio_bf16", ratios[own]["bf16 + AdamW"], f"{ratios[own]['bf16 + AdamW']:.3f} ({own})")
    if "ZipNN" in ratios:
        vs = min(ratios[own][s] / ratios["ZipNN"][s] for s in ("fp32 + AdamW", "bf16 + AdamW"))
        add("vs_zipnn", vs, f"{vs:.3f} (worst state; ZipNN {ratios['ZipNN']['fp32 + AdamW']:.3f} / "
            f"{ratios['ZipNN']['bf16 + AdamW']:.3f})")
    else:
        add("vs_zipnn", None, "ZipNN not installed")
    tiers = results.get("tiers", {})
    for key, tier in (("auto_fast", "local disk"), ("auto_slow", next((t for t in tiers if "@" in t), ""))):
        rec = tiers.get(tier, {})
        if "auto" not in rec:
            add(key, None, "no compression=auto in the installed shardsafe" if tiers else "tiers skipped")
            continue
        worst = []
        for op in ("save", "load"):
            per = [a / o for a, o in zip(rec["auto"][op], rec["off"][op])]
            worst.append(median(per) if key == "auto_fast" else 1 / median(per))
        value = max(worst) if key == "auto_fast" else min(worst)
        add(key, value, f"save {worst[0]:.2f}, load {worst[1]:.2f}")
    rs = results.get("reshard", {})
    if "zstd" in rs and "off" in rs:
        add("reshard_read", rs["zstd"]["vs_off"], f"{rs['zstd']['vs_off']:.3f} (distinct / files: zstd "
            f"{rs['zstd']['amplification']:.3f}, off {rs['off']['amplification']:.3f})")
    else:
        add("reshard_read", None, "no compressed reshard run")
    return rows


def report(results: dict, args: argparse.Namespace, codecs: list) -> None:
    rows = targets(results, args.threads)
    print("\n### Targets\n")
    print(md_table(["target", "measured", "goal", "verdict"], rows, "lrrl"))
    ratios, speed = results["ratios"], results["throughput_mbps"]
    print("\n### README table\n")
    t = args.threads
    hdr = ["codec", "weights fp32", "exp_avg", "exp_avg_sq", "weights bf16", "fp32 + AdamW", "bf16 + AdamW",
           "compress MB/s 1T", f"{t}T", "decompress MB/s 1T", f"{t}T"]
    out = []
    for c in codecs:
        r, s = ratios[c.name], speed[c.name]
        out.append([c.name, *[f"{r[k]:.3f}" for k in hdr[1:7]],
                    *[f"{median(s[k]):.0f}" for k in ("compress 1T", f"compress {t}T", "decompress 1T",
                                                      f"decompress {t}T")]])
    print(md_table(hdr, out))
    for tier, rec in results.get("tiers", {}).items():
        modes = [m for m in MODES if m in rec]
        print(f"\n{tier}: " + "; ".join(
            f"{m} save {median(rec[m]['save']):.2f}s load {median(rec[m]['load']):.2f}s" for m in modes))
    others = speed["_other_cpu_load"]["per_rep"] + [x for rec in results.get("tiers", {}).values()
                                                    for x in rec["_other_cpu_load"]]
    busy = median(others)
    results["other_cpu_load"] = others
    print(f"\n{args.reps} interleaved reps, medians; {results['machine']['affinity']} CPUs; torch {torch.__version__}; "
          f"{results['state']['params'] / 1e6:.1f}M params after {results['state']['steps']} AdamW steps")
    print(f"other CPU load during the reps (median, CPUs; includes kernel I/O threads): {busy:.2f} "
          f"[per rep: {', '.join(f'{x:.2f}' for x in others)}]"
          + ("  ** WARNING: other processes competed for the CPUs; rerun on a quiet machine **" if busy >= 0.3 else ""))


if __name__ == "__main__":
    sys.exit(main())
