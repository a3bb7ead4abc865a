"""Single-process save/load benchmark: shardsafe vs torch.distributed.checkpoint (DCP),
torch.save/torch.load and raw vectored I/O, on one local disk.

    .venv/bin/python benchmarks/bench_single.py [--reps N] [--quick] [--dir DIR] [--out FILE]

Method
  * Two states: A = 32 tensors x 8 MiB float32, B = 1024 tensors x 256 KiB float32.
  * The disk's fsync'd write speed swings a lot from minute to minute, so every
    repetition runs all contenders back to back (in a rotated order), and the ratios
    below are computed *per repetition* (paired) before taking the median over
    repetitions. Throughputs are medians too (decimal GB/s of tensor payload).
  * Saves are durable: shardsafe.save (fsyncs data file, manifest and directories);
    DCP with FileSystemWriter (sync_files=True is its default: it fsyncs the data file
    and .metadata, not the directory); torch.save + fsync of the file; raw = pwritev of
    the tensors' bytes into one file + fsync of the file and of its directory. Each save
    goes to a fresh path that is deleted afterwards (outside the timed region).
  * Loads are warm-page-cache measurements (one untimed read of every file first; the
    page cache is not dropped). In-place loads fill one preallocated destination dict.
  * Checksum cost (the target): what checksums add to save time = 1 - save without
    checksums / save, paired per repetition, measured with fsync off (with fsync the
    disk's time swamps and hides it); checksums are disabled by monkeypatching
    engine.writer._block_sum, the per-block hash of the writer (src/ is not modified). Shown beside it: the same with
    fsync on, and xxh3_64 over 1 MiB blocks of the state on one thread as a share of the
    save time (the cost if hashing were not overlapped with writing).
  * Load ceiling: "torch.load mmap=True + copy_ to dest" does nothing but the one copy
    from the page cache into the destination that any in-place load needs; its speed-up
    over DCP bounds what any in-place loader can reach on this machine.
  * Peak RSS of a load: in a fresh child process per measurement; the kernel high-water
    mark (VmHWM, reset through /proc/self/clear_refs right before the load) is the
    primary number, cross-checked by a 1 ms psutil-free /proc/self/statm sampling thread.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import inspect
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import (
    REPO,
    CpuMonitor,
    RssSampler,
    bench_dir,
    fsync_path,
    gbps,
    machine_info,
    md_table,
    median,
    mib,
    preadv_all,
    pwritev_all,
    read_file_untimed,
    remove,
    reset_peak_rss,
    rotated,
    rss_now,
    ru_maxrss,
    run_child,
    spread,
    timed,
    vm_hwm,
    wait_for_quiet,
    write_json,
)

MiB = 1 << 20
FLOOR_META = "floor + metadata: json.loads of manifest, indexes, headers; 4 reads per tensor"
KiB = 1 << 10
CHECKSUM_BLOCK = 1 << 20  # shardsafe.api.CHECKSUM_BLOCK

# name -> (tensors, bytes per tensor, description)
STATES = {"A": (32, 8 * MiB), "B": (1024, 256 * KiB)}
QUICK_STATES = {"A": (8, 1 * MiB), "B": (128, 16 * KiB)}

TARGETS = {
    "save_vs_raw": (">=", 0.85, "shardsafe save / raw write throughput"),
    "dcp_save_over_ss": ("info", None, "DCP save time / shardsafe save time"),
    "load_speedup_vs_dcp": (">=", 4.0, "shardsafe load speedup vs DCP load"),
    "load_vs_raw": (">=", {"A": 0.8, "B": 0.7}, "shardsafe load / raw read throughput"),
    "floor_vs_raw": ("info", None, "floor (hash pass + read pass) / raw read throughput"),
    "load_vs_floor": ("info", None, "shardsafe load / floor throughput"),
    "floor_meta_vs_raw": ("info", None, "floor + metadata (json.loads, 4 reads per tensor) / raw read throughput"),
    "load_vs_floor_meta": ("info", None, "shardsafe load / (floor + metadata) throughput"),
    "csum_share": ("info", None, "xxh3 (1 thread) time / shardsafe save time (if hashing were serialized)"),
    "nocsum_saving": ("info", None, "1 - save(no checksums) / save"),
    "nofsync_hash_overhead": ("<=", 0.15, "checksum cost: [no fsync] 1 - save(no checksums) / save"),
    "nofsync_vs_raw": ("info", None, "[no fsync] shardsafe save / raw write throughput"),
}
PCT = ("csum_share", "nocsum_saving", "nofsync_hash_overhead")


def goal_text(goal: Any) -> str:
    """A target's goal, one number or one per state."""
    return ", ".join(f"{k} {v}" for k, v in goal.items()) if isinstance(goal, dict) else str(goal)


def preadv_at(fd: int, views: list, offset: int) -> None:
    """Fill ``views`` from ``fd`` at ``offset`` (IOV_MAX buffers per call, short reads continued)."""
    pos = offset
    for i in range(0, len(views), 1024):
        part = views[i: i + 1024]
        want = sum(v.nbytes for v in part)
        got = os.preadv(fd, part, pos)
        if got != want:
            raise SystemExit(f"short read at {pos}: {got} of {want}")
        pos += got


def state_desc(n: int, size: int) -> str:
    unit = f"{size // MiB} MiB" if size % MiB == 0 else f"{size // KiB} KiB"
    return f"{n} x {unit} f32"


def key(i: int) -> str:
    return f"t{i:04d}"


# =========================================================================== child: peak RSS


def rss_child(method: str, ckpt: str, n: int, numel: int) -> None:
    """Runs in a fresh process: baseline RSS, allocate + touch the destination, then load
    while tracking the peak. Prints one JSON line."""
    warnings.simplefilter("ignore")
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    import shardsafe

    torch.set_num_threads(1)
    gc.collect()
    base, base_anon = rss_now()
    dest = {key(i): torch.empty(numel, dtype=torch.float32) for i in range(n)}
    for t in dest.values():
        t.zero_()
    alloc, alloc_anon = rss_now()
    dest_bytes = n * numel * 4
    hwm_reset = reset_peak_rss()
    ru_before = ru_maxrss()
    t0 = time.perf_counter()
    with RssSampler(0.001) as s:
        if method == "shardsafe":
            shardsafe.load(dest, ckpt)
        elif method == "shardsafe-noverify":
            shardsafe.load(dest, ckpt, verify=False)
        elif method == "dcp":
            dcp.load(dest, storage_reader=FileSystemReader(ckpt))
        else:
            raise SystemExit(f"unknown method {method}")
    secs = time.perf_counter() - t0
    hwm = vm_hwm() if hwm_reset else None
    ru_after = ru_maxrss()
    ok = bool(dest[key(n - 1)].abs().sum() > 0)
    peak = max(hwm or 0, s.peak)
    print(json.dumps({
        "method": method, "dest_bytes": dest_bytes, "baseline": base, "baseline_anon": base_anon,
        "after_alloc": alloc, "after_alloc_anon": alloc_anon, "hwm_reset": hwm_reset,
        "vm_hwm": hwm, "sampled_peak": s.peak, "sampled_peak_anon": s.peak_anon, "samples": s.samples,
        "ru_maxrss_before": ru_before, "ru_maxrss_after": ru_after, "peak": peak,
        "peak_minus_baseline": peak - base, "peak_anon_minus_baseline": s.peak_anon - base_anon,
        "seconds": secs, "loaded_nonzero": ok,
    }))


# =========================================================================== main benchmark


def source_info(pkg_file: Path) -> dict[str, Any]:
    """Which shardsafe is measured: its location and the repo's HEAD / dirty state (read-only git)."""
    import subprocess

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return "?"

    return {
        "shardsafe_file": str(pkg_file.parent),
        "git_head": git("rev-parse", "--short", "HEAD") or "?",
        "src_dirty": bool(git("status", "--porcelain", "--", "src")),
    }


@dataclass
class Case:
    name: str
    n: int
    size: int
    state: dict  # key -> tensor
    views: list  # uint8 numpy views of the state's tensors
    dest: dict  # preallocated destination, same keys/shapes
    dest_views: list
    paths: dict[str, Path] = field(default_factory=dict)
    save: dict[str, list[float]] = field(default_factory=dict)
    load: dict[str, list[float]] = field(default_factory=dict)
    csum: list[float] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return self.n * self.size


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 5; 2 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small states, for a smoke run")
    ap.add_argument("--dir", default=None, help="parent of the temporary work directory (default /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_single.json"), help="JSON output")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS child processes")
    ap.add_argument("--wait-quiet", type=float, default=30.0, metavar="S",
                    help="wait up to S seconds for other processes to leave the CPUs idle (default 30)")
    ap.add_argument("--rss-child", nargs=4, metavar=("METHOD", "CKPT", "N", "NUMEL"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rss_child:
        m, ck, n, numel = args.rss_child
        rss_child(m, ck, int(n), int(numel))
        return 0
    reps = args.reps if args.reps is not None else (2 if args.quick else 5)
    if reps < 1:
        ap.error("--reps must be >= 1")
    with bench_dir(args.dir) as work:
        return run(work, reps, QUICK_STATES if args.quick else STATES, args)


def run(work: Path, reps: int, states: dict, args: argparse.Namespace) -> int:
    t_start = time.perf_counter()
    warnings.simplefilter("ignore")  # DCP warns about running without a process group
    import numpy as np  # noqa: F401  (numpy views back the tensors' bytes)
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    import shardsafe
    import shardsafe.engine.writer as writer_mod

    block_sum = writer_mod.checksum
    zero = "0" * 16

    def block_checksums(view, block: int) -> list[str]:
        """XXH3-64 of each ``block``-byte piece of ``view`` (one thread)."""
        mv = memoryview(view)
        return [block_sum(mv[i: i + block]) for i in range(0, max(len(mv), 1), block)]

    @contextlib.contextmanager
    def no_checksums():
        writer_mod.checksum = lambda piece: zero  # the writer's per-block hash
        try:
            yield
        finally:
            writer_mod.checksum = block_sum

    def byte_view(t: torch.Tensor):
        return t.reshape(-1).view(torch.uint8).numpy()

    # ---- DCP defaults (read from the installed torch, not assumed)
    import torch.distributed.checkpoint.filesystem as dcp_fs

    sync_default = inspect.signature(FileSystemWriter.__init__).parameters["sync_files"].default
    dcp_src = inspect.getsource(dcp_fs)
    dcp_file = Path(dcp_fs.__file__)
    dcp_file = dcp_file.relative_to(REPO) if dcp_file.is_relative_to(REPO) else dcp_file
    dcp_note = (
        f"DCP FileSystemWriter(sync_files={sync_default}) is the default in torch {torch.__version__} "
        f"({dcp_file}): "
        f"it {'fsyncs' if 'os.fsync(stream.fileno())' in dcp_src else 'does NOT fsync'} each data file and "
        f"{'fsyncs' if 'os.fsync(metadata_file.fileno())' in dcp_src else 'does not fsync'} .metadata "
        "(then renames it into place); it does not fsync the directory. Used here with thread_count=1 "
        "(default), single process, no process group."
    )

    # ---- states, destinations
    cases: list[Case] = []
    g = torch.Generator().manual_seed(0)
    for name, (n, size) in states.items():
        state = {key(i): torch.randn(size // 4, generator=g) for i in range(n)}
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        cases.append(Case(name, n, size, state, [byte_view(t) for t in state.values()], dest,
                          [byte_view(t) for t in dest.values()]))

    # ---- contenders
    def save_ss(c: Case, p: Path) -> None:
        shardsafe.save(c.state, p)

    def save_ss_nocsum(c: Case, p: Path) -> None:
        with no_checksums():
            shardsafe.save(c.state, p)

    def save_dcp(c: Case, p: Path) -> None:
        dcp.save(c.state, storage_writer=FileSystemWriter(p))

    def save_torch(c: Case, p: Path) -> None:
        with open(p, "wb") as f:
            torch.save(c.state, f)
            f.flush()
            os.fsync(f.fileno())

    def save_raw(c: Case, p: Path) -> None:
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            pwritev_all(fd, c.views)
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_path(p.parent, directory=True)

    @contextlib.contextmanager
    def fsync_disabled():
        """os.fsync as a no-op (for shardsafe too: it calls os.fsync at call time)."""
        real = os.fsync
        os.fsync = lambda fd: None
        try:
            yield
        finally:
            os.fsync = real

    # (name, fn, durable): durable saves fsync; the others run with os.fsync patched out and
    # measure the CPU side only (copy into the page cache + checksums), without disk noise.
    saves: list[tuple[str, Callable[[Case, Path], None], bool]] = [
        ("shardsafe.save", save_ss, True),
        ("shardsafe.save (no checksums)", save_ss_nocsum, True),
        ("DCP save", save_dcp, True),
        ("torch.save + fsync", save_torch, True),
        ("raw pwritev + fsync", save_raw, True),
        ("[no fsync] shardsafe.save", save_ss, False),
        ("[no fsync] shardsafe.save (no checksums)", save_ss_nocsum, False),
        ("[no fsync] raw pwritev", save_raw, False),
    ]

    def load_ss(c: Case) -> Any:
        return shardsafe.load(c.dest, c.paths["ss"])

    def load_ss_nv(c: Case) -> Any:
        return shardsafe.load(c.dest, c.paths["ss"], verify=False)

    def load_ss_full(c: Case) -> Any:
        return shardsafe.load_full(c.paths["ss"])

    def load_dcp(c: Case) -> Any:
        return dcp.load(c.dest, storage_reader=FileSystemReader(c.paths["dcp"]))

    def load_torch(c: Case) -> Any:
        return torch.load(c.paths["pt"], weights_only=True)

    def load_torch_mmap(c: Case) -> Any:
        return torch.load(c.paths["pt"], weights_only=True, mmap=True)

    def load_torch_mmap_copy(c: Case) -> Any:
        sd = torch.load(c.paths["pt"], weights_only=True, mmap=True)
        for k, t in c.dest.items():
            t.copy_(sd[k])
        return sd

    def load_raw(c: Case) -> Any:
        fd = os.open(c.paths["raw"], os.O_RDONLY | os.O_CLOEXEC)
        try:
            preadv_all(fd, c.dest_views)
        finally:
            os.close(fd)

    window = bytearray(2 * MiB), bytearray(2 * MiB)
    floor_pool = ThreadPoolExecutor(1, thread_name_prefix="bench-floor")

    def load_floor(c: Case) -> Any:
        """The floor of a verified in-place load that leaves the destination untouched
        until every block is verified: a hash pass (pread into a 2 MiB buffer, xxh3 of
        each 1 MiB block) over the raw file, then a read pass into the destination; each
        pass on two threads (like shardsafe's reader), no per-tensor work at all."""
        fd = os.open(c.paths["raw"], os.O_RDONLY | os.O_CLOEXEC)
        try:
            half = c.nbytes // 2 // CHECKSUM_BLOCK * CHECKSUM_BLOCK

            def hash_range(lo: int, hi: int, buf: bytearray) -> None:
                mv = memoryview(buf)
                for pos in range(lo, hi, len(buf)):
                    n = os.preadv(fd, [mv[: min(len(buf), hi - pos)]], pos)
                    for b in range(0, n, CHECKSUM_BLOCK):
                        block_sum(mv[b: min(n, b + CHECKSUM_BLOCK)])

            fut = floor_pool.submit(hash_range, half, c.nbytes, window[1])
            hash_range(0, half, window[0])
            fut.result()
            mid = len(c.dest_views) // 2
            offset = sum(v.nbytes for v in c.dest_views[:mid])
            fut = floor_pool.submit(preadv_at, fd, c.dest_views[mid:], offset)
            preadv_at(fd, c.dest_views[:mid], 0)
            fut.result()
        finally:
            os.close(fd)

    def load_floor_meta(c: Case) -> Any:
        """The floor above plus the least metadata work any Python loader of this checkpoint
        does: the manifest, the file indexes and the data files' safetensors headers read
        and parsed by the C JSON parser (json.loads, no checks), and four attribute reads per
        destination tensor (data pointer, dtype, shape, contiguity). What a verified load of
        many small tensors can reach here, with no validation and no planning at all."""
        ss = c.paths["ss"]
        json.loads((ss / "manifest.json").read_bytes())
        for f in sorted(ss.iterdir()):
            if f.name.endswith(".index.json"):
                json.loads(f.read_bytes())
            elif f.name.endswith(".safetensors"):
                with open(f, "rb") as fh:
                    json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for t in c.dest.values():
            t.data_ptr(), t.dtype, t.shape, t.is_contiguous()
        load_floor(c)

    # (name, fn, where the result lands: "dest" in place, "ret" a returned dict)
    loads: list[tuple[str, Callable[[Case], Any], str]] = [
        ("shardsafe.load", load_ss, "dest"),
        ("shardsafe.load verify=False", load_ss_nv, "dest"),
        ("shardsafe.load_full", load_ss_full, "ret"),
        ("DCP load", load_dcp, "dest"),
        ("torch.load", load_torch, "ret"),
        ("torch.load mmap=True + copy_ to dest", load_torch_mmap_copy, "dest"),
        ("torch.load mmap=True (lazy, untouched)", load_torch_mmap, "ret"),
        ("raw preadv", load_raw, "dest"),
        ("floor: hash pass + read pass, 2 threads", load_floor, "dest"),
        (FLOOR_META, load_floor_meta, "dest"),
    ]

    info = machine_info(work)
    info.update(source_info(Path(shardsafe.__file__)))
    print("== shardsafe bench_single ==")
    print(f"machine: {info['cpu']}, {info['affinity']}/{info['cpus']} CPUs, {info['mem_gib']} GiB RAM, "
          f"kernel {info['kernel']}, python {info['python']}, torch {torch.__version__}, "
          f"shardsafe {shardsafe.__version__}")
    print(f"shardsafe imported from {info['shardsafe_file']} (repo HEAD {info['git_head']}, "
          f"uncommitted changes under src/: {info['src_dirty']})")
    print(f"work dir: {work} on {info['device']} ({info['fstype']}, mounted at {info['mount']})")
    print(f"reps: {reps}; states: " + "; ".join(f"{c.name} = {state_desc(c.n, c.size)} = {mib(c.nbytes)}"
                                                 for c in cases))
    print(dcp_note)
    print("shardsafe.save: fsyncs the data file and manifest, the temp dir, renames, fsyncs the parent.")
    print("Before each fsync'd save: os.sync() (untimed), so no save pays for the previous one's delete "
          "(this ext4 is mounted with 'discard'). '[no fsync]' rows: os.fsync patched to a no-op.")
    if args.wait_quiet > 0:
        other = wait_for_quiet(args.wait_quiet, 0.25)
        print(f"other CPU load before start: {other:.2f} CPUs"
              + ("  ** WARNING: the machine is busy; results will be noisy **" if other >= 0.25 else ""))
    print(flush=True)

    # ---- load fixtures (written once), warm cache, correctness check
    for c in cases:
        base = work / f"fixture-{c.name}"
        base.mkdir()
        c.paths = {"ss": base / "ss", "dcp": base / "dcp", "pt": base / "state.pt", "raw": base / "state.raw"}
        save_ss(c, c.paths["ss"])
        save_dcp(c, c.paths["dcp"])
        save_torch(c, c.paths["pt"])
        save_raw(c, c.paths["raw"])
        for p in c.paths.values():
            read_file_untimed(p)
        for name, fn, where in loads:
            for t in c.dest.values():
                t.zero_()
            out = fn(c)
            got = c.dest if where == "dest" else out
            bad = [k for k, v in c.state.items() if not torch.equal(got[k], v)]
            if bad:
                raise SystemExit(f"{name} on state {c.name}: wrong data for {bad[:3]}")
            del out, got
        # and one untimed run of each save (first-call imports, thread pools, ...)
        for _name, fn, _durable in saves:
            p = work / f"warm-{c.name}"
            fn(c, p)
            remove(p)

    # ---- timed repetitions, interleaved
    other_load: list[float] = []
    for r in range(reps):
        t_rep = time.perf_counter()
        cpu0 = CpuMonitor.snapshot()
        for c in cases:
            for name, fn, durable in rotated(saves, r):
                p = work / f"save-{c.name}-{r}"
                os.sync()
                with contextlib.nullcontext() if durable else fsync_disabled():
                    secs, _ = timed(lambda fn=fn, c=c, p=p: fn(c, p))
                remove(p)
                c.save.setdefault(name, []).append(secs)
            for name, fn, _where in rotated(loads, r):
                secs, out = timed(lambda fn=fn, c=c: fn(c))
                del out
                c.load.setdefault(name, []).append(secs)
            secs, _ = timed(lambda c=c: [block_checksums(v, CHECKSUM_BLOCK) for v in c.views])
            c.csum.append(secs)
        other_load.append(CpuMonitor.foreign(cpu0, CpuMonitor.snapshot()))
        print(f"rep {r + 1}/{reps} done in {time.perf_counter() - t_rep:.1f}s (other CPU load "
              f"{other_load[-1]:.2f}): "
              + ", ".join(f"{c.name} ss save {gbps(c.nbytes, c.save['shardsafe.save'][-1]):.2f} GB/s "
                          f"raw {gbps(c.nbytes, c.save['raw pwritev + fsync'][-1]):.2f} GB/s" for c in cases),
              flush=True)

    # ---- ratios, paired per repetition
    def paired(num: list[float], den: list[float]) -> list[float]:
        return [a / b for a, b in zip(num, den)]

    results: dict[str, Any] = {
        "bench": "bench_single", "reps": reps, "quick": bool(args.quick), "machine": info,
        "torch": torch.__version__, "shardsafe": shardsafe.__version__,
        "dcp_sync_files_default": sync_default, "dcp_note": dcp_note,
        "checksum_block": CHECKSUM_BLOCK, "states": {}, "targets": {},
        "other_cpu_load_per_rep": other_load,
    }
    ratios: dict[str, dict[str, list[float]]] = {}
    for c in cases:
        s, ld = c.save, c.load
        ratios[c.name] = {
            "save_vs_raw": paired(s["raw pwritev + fsync"], s["shardsafe.save"]),
            "dcp_save_over_ss": paired(s["DCP save"], s["shardsafe.save"]),
            "load_speedup_vs_dcp": paired(ld["DCP load"], ld["shardsafe.load"]),
            "load_vs_raw": paired(ld["raw preadv"], ld["shardsafe.load"]),
            "floor_vs_raw": paired(ld["raw preadv"], ld["floor: hash pass + read pass, 2 threads"]),
            "load_vs_floor": paired(ld["floor: hash pass + read pass, 2 threads"], ld["shardsafe.load"]),
            "floor_meta_vs_raw": paired(ld["raw preadv"], ld[FLOOR_META]),
            "load_vs_floor_meta": paired(ld[FLOOR_META], ld["shardsafe.load"]),
            "csum_share": paired(c.csum, s["shardsafe.save"]),
            "nocsum_saving": [1 - x for x in paired(s["shardsafe.save (no checksums)"], s["shardsafe.save"])],
            "nofsync_hash_overhead": [1 - x for x in paired(s["[no fsync] shardsafe.save (no checksums)"],
                                                            s["[no fsync] shardsafe.save"])],
            "nofsync_vs_raw": paired(s["[no fsync] raw pwritev"], s["[no fsync] shardsafe.save"]),
            # secondary: the same ratios for verify=False
            "load_speedup_vs_dcp_noverify": paired(ld["DCP load"], ld["shardsafe.load verify=False"]),
            # the ceiling of any in-place load here: one copy from the page cache, nothing else
            "load_speedup_vs_dcp_copy_floor": paired(ld["DCP load"], ld["torch.load mmap=True + copy_ to dest"]),
            "load_vs_raw_noverify": paired(ld["raw preadv"], ld["shardsafe.load verify=False"]),
        }
        results["states"][c.name] = {
            "tensors": c.n, "bytes_per_tensor": c.size, "bytes": c.nbytes,
            "save_seconds": s, "load_seconds": ld, "checksum_1thread_seconds": c.csum,
            "save_gbps_median": {k: gbps(c.nbytes, median(v)) for k, v in s.items()},
            "load_gbps_median": {k: gbps(c.nbytes, median(v)) for k, v in ld.items()},
            "checksum_gbps_median": gbps(c.nbytes, median(c.csum)),
            "ratios_per_rep": ratios[c.name],
            "ratios_median": {k: median(v) for k, v in ratios[c.name].items()},
        }

    # ---- per-state detail
    for c in cases:
        print(f"\n### State {c.name}: {state_desc(c.n, c.size)} = {mib(c.nbytes)} "
              f"(median over {reps} reps; min-max of the per-rep GB/s)\n")
        rows = []
        for kind, table in (("save", c.save), ("load", c.load)):
            for name, secs in table.items():
                m, lo, hi = spread(secs)
                rows.append([kind, name, f"{m * 1e3:.1f}", f"{gbps(c.nbytes, m):.2f}",
                             f"{gbps(c.nbytes, hi):.2f}-{gbps(c.nbytes, lo):.2f}"])
        m, lo, hi = spread(c.csum)
        rows.append(["hash", "xxh3_64 1 MiB blocks, 1 thread", f"{m * 1e3:.1f}", f"{gbps(c.nbytes, m):.2f}",
                     f"{gbps(c.nbytes, hi):.2f}-{gbps(c.nbytes, lo):.2f}"])
        print(md_table(["op", "method", "ms", "GB/s", "GB/s range"], rows, "llrrr"))

    # ---- targets
    print("\n### Targets (ratios paired per repetition; median [min-max])\n")
    trows = []
    all_pass = True
    for tk, (op, goal, desc) in TARGETS.items():
        row = [desc]
        verdicts = []
        for c in cases:
            m, lo, hi = spread(ratios[c.name][tk])
            pct = tk in PCT
            f = (lambda x: f"{x * 100:.1f}%") if pct else (lambda x: f"{x:.2f}")
            row.append(f"{f(m)} [{f(lo)}-{f(hi)}]")
            g = goal.get(c.name) if isinstance(goal, dict) else goal
            if op == ">=":
                verdicts.append(m >= g)
            elif op == "<=":
                verdicts.append(m <= g)
        if op == "info":
            row += ["-", "info"]
        else:
            ok = all(verdicts)
            all_pass &= ok
            goal_s = f"{op} {goal * 100:.0f}%" if tk in PCT else f"{op} {goal_text(goal)}"
            row += [goal_s, "PASS" if ok else "FAIL (" + ",".join(
                c.name for c, v in zip(cases, verdicts) if not v) + ")"]
        results["targets"][tk] = {
            "description": desc, "op": op, "goal": goal,
            "median": {c.name: median(ratios[c.name][tk]) for c in cases},
            "pass": None if op == "info" else all(verdicts),
        }
        trows.append(row)
    for extra, desc in (("load_speedup_vs_dcp_noverify", "(verify=False) load speedup vs DCP"),
                        ("load_speedup_vs_dcp_copy_floor", "(copy floor: mmap + copy_ into dest) speedup vs DCP"),
                        ("load_vs_raw_noverify", "(verify=False) load / raw read")):
        trows.append([desc] + [f"{median(ratios[c.name][extra]):.2f}" for c in cases] + ["", "info"])
    print(md_table(["ratio"] + [f"state {c.name}" for c in cases] + ["goal", "verdict"], trows, "lrrrrl"))

    # ---- peak RSS in child processes
    rss: dict[str, dict[str, Any]] = {}
    if not args.no_rss:
        print("\n### Peak RSS during load (fresh child process per row)\n")
        print("peak = kernel RSS high-water mark (VmHWM, reset via /proc/self/clear_refs after the destination "
              "is allocated and touched), cross-checked with a 1 ms /proc/self/statm sampling thread; "
              "baseline = RSS after imports, before allocating the destination. "
              "anon = excluding file-backed (mmap'd page cache) pages.\n")
        rrows = []
        for c in cases:
            rss[c.name] = {}
            for method, ck in (("shardsafe", "ss"), ("shardsafe-noverify", "ss"), ("dcp", "dcp")):
                res = run_child([str(Path(__file__).resolve()), "--rss-child", method, str(c.paths[ck]),
                                 str(c.n), str(c.size // 4)])
                rss[c.name][method] = res
                over = res["peak_minus_baseline"] - res["dest_bytes"]
                ok = over <= 64 * MiB
                if method == "shardsafe":
                    all_pass &= ok
                rrows.append([
                    c.name, method, mib(res["dest_bytes"]), mib(res["peak_minus_baseline"]),
                    mib(res["sampled_peak"] - res["baseline"]), mib(res["peak_anon_minus_baseline"]),
                    mib(over), ("PASS" if ok else "FAIL") if method == "shardsafe" else "info",
                ])
        print(md_table(["state", "load", "dest", "peak - base (HWM)", "peak - base (1 ms)", "anon peak - base",
                        "over dest", "<= dest + 64 MiB"], rrows, "llrrrrrl"))
        results["rss"] = rss

    # ---- README table
    print("\n### README table\n")
    hdr = ["", *[f"{state_desc(c.n, c.size)} ({mib(c.nbytes)})" for c in cases]]
    rows = []
    for name, _, _ in saves:
        rows.append([f"save: {name}"] + [f"{gbps(c.nbytes, median(c.save[name])):.2f} GB/s" for c in cases])
    for name, _, _ in loads:
        rows.append([f"load: {name}"] + [f"{gbps(c.nbytes, median(c.load[name])):.2f} GB/s" for c in cases])
    for tk, (op, goal, desc) in TARGETS.items():
        pct = tk in PCT
        f = (lambda x: f"{x * 100:.1f}%") if pct else (lambda x, tk=tk: f"{x:.2f}x" if "dcp" in tk else f"{x:.2f}")
        goal_s = "" if op == "info" else (f" (target {op} {goal * 100:.0f}%)" if pct else
                                          f" (target {op} {goal_text(goal)})")
        rows.append([desc + goal_s] + [f(median(ratios[c.name][tk])) for c in cases])
    if rss:
        rows.append(["load peak RSS over destination (target <= 64 MiB)"]
                    + [mib(rss[c.name]["shardsafe"]["peak_minus_baseline"] - rss[c.name]["shardsafe"]["dest_bytes"])
                       for c in cases])
        rows.append(["DCP load peak RSS over destination"]
                    + [mib(rss[c.name]["dcp"]["peak_minus_baseline"] - rss[c.name]["dcp"]["dest_bytes"])
                       for c in cases])
    print(md_table(hdr, rows, "l" + "r" * len(cases)))
    print(f"\n{reps} interleaved reps, medians; fsync'd saves; warm-page-cache loads; "
          f"{info['affinity']} CPUs, {info['fstype']} on {info['device']}; torch {torch.__version__}.")
    busy = median(other_load)
    print(f"other CPU load during the reps (median, CPUs; includes kernel I/O threads): {busy:.2f} "
          f"[per rep: {', '.join(f'{x:.2f}' for x in other_load)}]"
          + ("  ** WARNING: other processes competed for the CPUs; rerun on a quiet machine **"
             if busy >= 0.3 else ""))

    floor_pool.shutdown()
    results["all_targets_pass"] = all_pass
    results["wall_seconds"] = time.perf_counter() - t_start
    out = write_json(args.out, results)
    print(f"\nall targets pass: {all_pass}; wrote {out}; total {results['wall_seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
