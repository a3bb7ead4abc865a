"""Export memory bound, measured: ``shardsafe export`` streams tensor by tensor, so its
peak memory should stay near the largest tensor plus a buffer, not the checkpoint size.

    .venv/bin/python benchmarks/bench_export.py [--tensors 24] [--mib 32] [--reps 3] [--dir DIR] [--out FILE]
    .venv/bin/python benchmarks/bench_export.py --small [--reps 5] [--small-tensors 8000] [--small-numel 256]

Method
  * A checkpoint of N float32 tensors of M MiB each (default 24 x 32 MiB = 768 MiB; the
    largest tensor is 32 MiB) is saved once with shardsafe.save.
  * Each export runs in a fresh child process. The child imports everything, says
    "ready" and waits; the parent samples the child's RSS with psutil every ~1.5 ms,
    takes the baseline as the median RSS over 150 ms before it says "go", and the peak
    as the largest RSS sample after. The child also resets its kernel high-water mark
    (/proc/self/clear_refs) just before exporting and reports VmHWM afterwards, a
    cross-check that cannot miss a short spike.
  * Contenders: shardsafe export to hf (--max-shard-size 200MB), hf with --dtype
    bfloat16, one safetensors file, one torch.save file, a DCP folder; and the naive way, load_full
    + safetensors.torch.save_file (+ fsync), which holds the whole model.
  * Bound: largest tensor + 64 MiB (the reader's 16 MiB staging buffer, allocator and
    thread slack; with --dtype the converted copy of the largest tensor is added). Small
    tensors are read in batches of at most 16 MiB, within that slack.
  * Throughput: decimal GB/s of exported source bytes, median over --reps runs
    (each includes reading with checksum verification and an fsync of the output).
    The page cache is warm (the checkpoint was just written or read).

Many small tensors (``--small``; issue 22 section 4)
  * A checkpoint of 8,000 float32 tensors of 256 elements (``--small-tensors``,
    ``--small-numel``) is saved once. In one process, each of ``--reps`` repetitions (at
    least 5, after one unmeasured warm-up of each) times ``shardsafe.load_full`` and an
    export to each of torch, safetensors, hf and dcp (each output deleted after its run),
    in an order rotated by one every repetition, so every contender meets the same machine
    noise. Each export's time is divided by the same repetition's load_full time; the
    median of those per-repetition ratios is reported against the target (<= 2x).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
SLACK = 64 * MIB
CONTENDERS = ["hf", "hf-bf16", "safetensors", "torch", "dcp", "naive"]
SMALL_TARGETS = ["torch", "safetensors", "hf", "dcp"]
SMALL_BOUND = 2.0  # each export <= 2x load_full of the same checkpoint


# --------------------------------------------------------------------------------------------- child


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def child(method: str, ckpt: str, out: str) -> None:
    """Run one export when the parent says go; print a JSON result line."""
    import torch  # noqa: F401 - imported before the baseline is taken
    from safetensors.torch import save_file

    import shardsafe
    from shardsafe.tools import export_checkpoint

    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        hwm_reset = True
    except OSError:
        hwm_reset = False
    t0 = time.perf_counter()
    if method == "naive":
        state = shardsafe.load_full(ckpt)
        flat: dict[str, Any] = {}

        def walk(node: Any, prefix: str) -> None:
            if isinstance(node, dict):
                for k, v in node.items():
                    walk(v, f"{prefix}.{k}" if prefix else str(k))
            else:
                flat[prefix] = node

        walk(state, "")
        save_file(flat, out, metadata={"format": "pt"})
        fd = os.open(out, os.O_RDONLY)  # durable, like shardsafe's export
        os.fsync(fd)
        os.close(fd)
        nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    else:
        to = {"hf": "hf", "hf-bf16": "hf", "safetensors": "safetensors", "torch": "torch", "dcp": "dcp"}[method]
        report = export_checkpoint(ckpt, out, to, max_shard_size="200MB", progress=False,
                                   dtype="bfloat16" if method == "hf-bf16" else None)
        nbytes = report.bytes  # bytes written (half the source with --dtype bfloat16)
    seconds = time.perf_counter() - t0
    print(json.dumps({"seconds": seconds, "bytes": nbytes, "vm_hwm": _vm_hwm() if hwm_reset else None}), flush=True)


# --------------------------------------------------------------------------------------------- parent


def measure(method: str, ckpt: Path, out: Path, interval: float) -> dict[str, Any]:
    """Run one export child and sample its RSS; baseline, peak and the child's own numbers."""
    import psutil

    if out.exists():
        shutil.rmtree(out) if out.is_dir() else out.unlink()
    proc = subprocess.Popen([sys.executable, __file__, "--child", method, str(ckpt), str(out)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.stdout is not None and proc.stdin is not None
    line = proc.stdout.readline().strip()
    if line != "ready":
        proc.kill()
        raise RuntimeError(f"child for {method} did not start: {line!r}")
    ps = psutil.Process(proc.pid)
    base_samples = []
    t_end = time.perf_counter() + 0.15
    while time.perf_counter() < t_end:
        base_samples.append(ps.memory_info().rss)
        time.sleep(interval)
    baseline = int(statistics.median(base_samples))
    proc.stdin.write("go\n")
    proc.stdin.flush()
    peak, samples = baseline, 0
    t0 = time.perf_counter()
    while proc.poll() is None:
        try:
            rss = ps.memory_info().rss
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            break
        peak = max(peak, rss)
        samples += 1
        time.sleep(interval)
    elapsed = time.perf_counter() - t0
    result_line = proc.stdout.read().strip().splitlines()
    proc.wait()
    if proc.returncode != 0 or not result_line:
        raise RuntimeError(f"child for {method} failed with exit code {proc.returncode}")
    res = json.loads(result_line[-1])
    return {"method": method, "seconds": res["seconds"], "bytes": res["bytes"], "baseline_rss": baseline,
            "peak_rss": peak, "peak_minus_baseline": peak - baseline, "vm_hwm": res["vm_hwm"],
            "vm_hwm_minus_baseline": res["vm_hwm"] - baseline if res["vm_hwm"] else None,
            "samples": samples, "sample_interval_ms": 1000 * elapsed / max(samples, 1)}


def build_checkpoint(path: Path, tensors: int, mib: int) -> int:
    """Save ``tensors`` float32 tensors of ``mib`` MiB each; returns the total bytes."""
    import torch

    import shardsafe

    g = torch.Generator().manual_seed(0)
    rows = mib * MIB // 4 // 1024
    state = {"model": {f"layers.{i}.weight": torch.randn(rows, 1024, generator=g) for i in range(tensors)}}
    shardsafe.save(state, path)
    return tensors * mib * MIB


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) + " |"
            for r in rows]
    return "\n".join([line, sep, *body])


def small(args: argparse.Namespace) -> None:
    """Many small tensors: each export target's time over load_full's, interleaved."""
    import gc

    import torch

    import shardsafe
    from shardsafe.tools import export_checkpoint

    reps = max(5, args.reps)
    work = Path(tempfile.mkdtemp(prefix="shardsafe-bench-export-small-", dir=args.dir))
    try:
        ckpt = work / "ckpt"
        g = torch.Generator().manual_seed(0)
        state = {"model": {f"layers.{i}.weight": torch.randn(args.small_numel, generator=g)
                           for i in range(args.small_tensors)}}
        shardsafe.save(state, ckpt)
        del state
        total = args.small_tensors * args.small_numel * 4
        print(f"checkpoint: {args.small_tensors} tensors x {args.small_numel} float32 = {total / MIB:.1f} MiB; "
              f"{reps} repetitions (+1 warm-up), order rotated each repetition", flush=True)
        contenders = ["load_full", *SMALL_TARGETS]

        def run(name: str) -> float:
            out = work / f"out-{name}"
            gc.collect()
            t0 = time.perf_counter()
            if name == "load_full":
                value = shardsafe.load_full(ckpt)
                seconds = time.perf_counter() - t0
                del value
            else:
                export_checkpoint(ckpt, out, name, progress=False)
                seconds = time.perf_counter() - t0
                shutil.rmtree(out) if out.is_dir() else out.unlink()
            return seconds

        for name in contenders:  # warm-up: imports, first-use costs, page cache
            run(name)
        times: dict[str, list[float]] = {n: [] for n in contenders}
        for rep in range(reps):
            k = rep % len(contenders)
            for name in contenders[k:] + contenders[:k]:
                times[name].append(run(name))
            print(f"  rep {rep + 1}: " + "  ".join(f"{n} {times[n][-1]:.3f}s" for n in contenders), flush=True)
        rows, summary = [], []
        for name in SMALL_TARGETS:
            ratios = [t / lf for t, lf in zip(times[name], times["load_full"])]
            ratio = statistics.median(ratios)
            sec = statistics.median(times[name])
            summary.append({"target": name, "seconds_median": sec, "ratio_median": ratio,
                            "ratio_min": min(ratios), "ratio_max": max(ratios), "within_target": ratio <= SMALL_BOUND})
            rows.append([name, f"{sec:.3f}", f"{ratio:.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}",
                         f"{SMALL_BOUND:g}", "yes" if ratio <= SMALL_BOUND else "NO"])
        print()
        print(f"export of {args.small_tensors} x {args.small_numel} float32 ({total / MIB:.1f} MiB); load_full median "
              f"{statistics.median(times['load_full']):.3f} s over {reps} repetitions")
        print(table(["target", "s (median)", "x load_full (median of ratios)", "ratio range", "target <=",
                     "within"], rows))
        result = {"benchmark": "bench_export --small", "created": time.time(),
                  "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                              "platform": platform.platform(), "torch": torch.__version__},
                  "config": {"tensors": args.small_tensors, "numel": args.small_numel, "reps": reps},
                  "summary": summary, "seconds": times}
        out_path = Path(args.out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {out_path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=24)
    ap.add_argument("--mib", type=int, default=32, help="MiB per tensor (the largest tensor)")
    ap.add_argument("--reps", type=int, default=3, help="runs of the hf export (others run once)")
    ap.add_argument("--interval", type=float, default=0.0015, help="RSS sampling interval in seconds")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--out", default=None, help="JSON output (default bench-out/bench_export[_small].json)")
    ap.add_argument("--small", action="store_true", help="many small tensors: every export target vs load_full")
    ap.add_argument("--small-tensors", type=int, default=8000)
    ap.add_argument("--small-numel", type=int, default=256)
    ap.add_argument("--child", nargs=3, metavar=("METHOD", "CKPT", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.out is None:
        args.out = str(REPO / "bench-out" / ("bench_export_small.json" if args.small else "bench_export.json"))
    if args.small:
        small(args)
        return
    work = Path(tempfile.mkdtemp(prefix="shardsafe-bench-export-", dir=args.dir))
    try:
        ckpt = work / "ckpt"
        t0 = time.perf_counter()
        total = build_checkpoint(ckpt, args.tensors, args.mib)
        print(f"checkpoint: {args.tensors} x {args.mib} MiB float32 = {total / MIB:.0f} MiB, saved in "
              f"{time.perf_counter() - t0:.1f} s at {ckpt}", flush=True)
        largest = args.mib * MIB
        runs: list[dict[str, Any]] = []
        for method in CONTENDERS:
            reps = args.reps if method == "hf" else 1
            for _ in range(reps):
                out = work / ("out" + ("" if method in ("hf", "hf-bf16", "dcp") else ".bin"))
                r = measure(method, ckpt, out, args.interval)
                r["bound"] = largest + SLACK + (largest // 2 if method == "hf-bf16" else 0)
                runs.append(r)
                print(f"  {method:<12} {r['seconds']:.2f} s  peak-baseline {r['peak_minus_baseline'] / MIB:.0f} MiB",
                      flush=True)
                shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
        rows = []
        summary = []
        for method in CONTENDERS:
            rs = [r for r in runs if r["method"] == method]
            sec = statistics.median(r["seconds"] for r in rs)
            peak = max(r["peak_minus_baseline"] for r in rs)
            hwm = [r["vm_hwm_minus_baseline"] for r in rs if r["vm_hwm_minus_baseline"] is not None]
            bound = rs[0]["bound"]
            within = peak <= bound
            summary.append({"method": method, "runs": len(rs), "seconds_median": sec,
                            "gb_per_s": total / sec / 1e9, "peak_minus_baseline": peak,
                            "vm_hwm_minus_baseline": max(hwm) if hwm else None, "bound": bound,
                            "within_bound": within, "peak_over_largest": peak / largest})
            rows.append([method, str(len(rs)), f"{sec:.2f}", f"{total / sec / 1e9:.2f}", f"{peak / MIB:.0f}",
                         f"{max(hwm) / MIB:.0f}" if hwm else "-", f"{bound / MIB:.0f}", f"{peak / largest:.2f}",
                         "yes" if within else "NO"])
        print()
        print(f"export of {total / MIB:.0f} MiB ({args.tensors} tensors, largest {largest / MIB:.0f} MiB); "
              f"RSS sampled every {statistics.median(r['sample_interval_ms'] for r in runs):.1f} ms (median)")
        print(table(["method", "runs", "s (median)", "GB/s", "peak-base MiB", "VmHWM-base MiB", "bound MiB",
                     "peak/largest", "within bound"], rows))
        result = {
            "benchmark": "bench_export", "created": time.time(),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "config": {"tensors": args.tensors, "mib_per_tensor": args.mib, "total_bytes": total,
                       "largest_tensor": largest, "slack": SLACK, "interval_s": args.interval, "reps": args.reps},
            "summary": summary, "runs": runs,
        }
        import torch

        result["machine"]["torch"] = torch.__version__
        out_path = Path(args.out)
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {out_path}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
