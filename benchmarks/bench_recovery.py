"""Benchmark of the node-local recovery tier (issue 24): recovery after a node loss and
after a process crash, and what taking local saves costs.

4 gloo ranks as 2 simulated nodes (node = rank // 2; each node has its own local folder
under /dev/shm, or a temporary directory without it), the FSDP2 GPT + AdamW state of
bench_distributed (``--size full``: about 0.7 GB; ``--size small`` for a quick check),
``CheckpointManager(local=..., replicas=2)``; the persistent folder is on local disk.
Every repetition runs each measurement once, in this order (medians over ``--reps``):

1. Node loss: a local save (replicated to the other node), node 1's local folder deleted,
   ``manager.load`` into fresh state objects (tier "peers"). Against (a) a persistent load
   through ``storage/faults.py``'s FaultyBackend throttled to 200 MB/s of reads per rank
   (a Checkpointer(storage=...) given to a manager as ``checkpointer=``), (b) a DCP load of
   a DCP save of the same state in the persistent folder (unthrottled). The peer transfer
   bandwidth (bytes received / transfer seconds) against raw gloo isend/irecv of
   tier/transfer.py's PIECE-sized uint8 tensors between ranks r and r+2, in the same run.
2. Process crash (nothing deleted): ``manager.load`` (tier "local") against plain reads of
   the step folder's files on the node (split between its ranks), in GB/s, and against the
   engine's own load of the same folder (``Checkpointer.load``, verified and not): the
   floor of any restore, the node-loss one included.
3. Cost: blocking time of an async local save (until ``save_local`` returns) against
   ``Checkpointer.async_save`` of the same state; training steps with a local save and its
   replication in the background against without (CPU contention on 2 vCPUs).
4. Local folder bytes per node (own files + replicas), peak RSS above the model while a
   local save and its replication run (VmHWM reset before, read after).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _common import (  # noqa: E402
    REPO,
    bench_dir,
    md_table,
    median,
    reset_peak_rss,
    rss_now,
    vm_hwm,
    write_json,
)
from _dist_common import WorkerPool, malloc_trim, source_banner, source_state, verdict  # noqa: E402
from _young_daly import BYTES_PER_RANK, GPUS, MTBF  # noqa: E402
from _young_daly import measured as young_daly_measured  # noqa: E402
from _young_daly import table as young_daly_table  # noqa: E402
from bench_distributed import FULL, QUICK, _build_fsdp, _local_bytes, _state_of, _train_step, param_count  # noqa: E402

import shardsafe  # noqa: E402

SIZES = {"full": FULL, "small": QUICK}
THROTTLE_BPS = 200e6
TRAIN_STEPS = 3
TARGETS = {"peer_vs_throttled": 5.0, "bw_fraction": 0.7, "local_vs_raw": 0.8}

_W: dict[str, Any] = {}  # per-worker state, kept across cases
_LAST: dict[str, Any] = {}  # the last exchange()'s Stats on this rank


def _patch_exchange() -> None:
    """Record the Stats of every tier transfer (restore keeps only the byte count)."""
    import shardsafe.tier.local as tl

    if getattr(tl.exchange, "_bench", False):
        return
    orig = tl.exchange

    def exchange(*a: Any, **k: Any) -> Any:
        s = orig(*a, **k)
        _LAST["stats"] = s
        return s

    exchange._bench = True  # type: ignore[attr-defined]
    tl.exchange = exchange


class _Logs(logging.Handler):
    """The shardsafe.tier log lines (why a restore went to the persistent folder) while open."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> _Logs:
        log = logging.getLogger("shardsafe.tier")
        self._level = log.level
        log.setLevel(logging.INFO)
        log.addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        log = logging.getLogger("shardsafe.tier")
        log.removeHandler(self)
        log.setLevel(self._level)


def _fresh_state() -> dict:
    model, opt = _W["dest_objs"]
    return {"train": _state_of(model, opt)}


def _node_root(pattern: str, node: int) -> Path:
    return Path(pattern.format(node=node))


def _tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.exists() else 0


def c_setup(rank: int, world: int, cfg: dict, work: str, local: str) -> dict:
    warnings.filterwarnings("ignore")
    _patch_exchange()
    _W.clear()
    model, opt = _build_fsdp(cfg, world, seed=0)
    _train_step(model, opt, cfg, rank)
    _W["src_objs"] = (model, opt)
    _W["dest_objs"] = _build_fsdp(cfg, world, seed=1)
    _W["cfg"], _W["work"], _W["local"] = cfg, Path(work), local
    state = {"train": _state_of(model, opt)}
    _W["mgr"] = shardsafe.CheckpointManager(Path(work) / "persistent", interval=10**9, local=local,
                                            local_interval=1, local_keep=2, replicas=2, node=rank // 2,
                                            local_async=True)
    _W["mgr"].save(0, state)  # the persistent copy the throttled load reads
    _W["mgr"].wait()
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=Path(work) / "dcp")
    gc.collect()
    malloc_trim()
    return {"local_bytes": _local_bytes(state), "rss": rss_now()[0]}


def c_p2p(rank: int, world: int, piece: int, nbytes: int) -> dict:
    """Raw gloo isend/irecv between r and r+2 (mod world), piece by piece: one way (node 0
    sends, node 1 receives, as a restore after node 1's loss) and both ways (replication)."""
    buf_s = torch.ones(piece, dtype=torch.uint8)
    buf_r = torch.empty(piece, dtype=torch.uint8)
    peer = (rank + 2) % world
    n = max(1, nbytes // piece)
    out = {}
    for mode in ("one way", "both ways"):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            reqs = []
            if mode == "both ways" or rank < 2:
                reqs.append(dist.isend(buf_s, dst=peer))
            if mode == "both ways" or rank >= 2:
                reqs.append(dist.irecv(buf_r, src=peer))
            for r in reqs:
                r.wait()
        dt = time.perf_counter() - t0
        out[mode] = n * piece / dt if (mode == "both ways" or rank >= 2) else None
    return out


def c_rep(rank: int, world: int, step: int) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from shardsafe.storage.faults import FaultyBackend

    mgr = _W["mgr"]
    model, opt = _W["src_objs"]
    cfg, work, local = _W["cfg"], _W["work"], _W["local"]
    out: dict[str, Any] = {}
    state = {"train": _state_of(model, opt)}

    # 3+4: local save, blocking time, RSS above the model during write + replication
    gc.collect()
    malloc_trim()
    dist.barrier()
    rss0 = rss_now()[0]
    hwm_ok = reset_peak_rss()
    t0 = time.perf_counter()
    mgr.save_local(step, state)
    out["local_block"] = time.perf_counter() - t0
    mgr.wait()
    out["local_total"] = time.perf_counter() - t0
    hwm = vm_hwm()
    out["rss_above"] = (hwm - rss0) if (hwm_ok and hwm is not None) else None
    st = mgr.tier.last_stats
    out["repl"] = tuple(st) if st is not None else None
    dist.barrier()
    root = _node_root(local, rank // 2)
    out["node_bytes"] = sum(_tree_bytes(p) for p in root.iterdir() if p.is_dir() and f"{step:08d}" in p.name
                            and "tmp" not in p.name)  # this step only (local_keep=2 keeps an older one too)

    # 2: process crash: restore from this node's folder, then raw reads of the same folder
    dest = _fresh_state()
    dist.barrier()
    t0 = time.perf_counter()
    got = mgr.load(dest)
    out["crash_s"] = time.perf_counter() - t0
    out["crash_tier"] = mgr.last_load.tier
    out["crash_step"] = got
    out["crash_bytes"] = getattr(mgr.last_load, "bytes_read", None)
    step_dir = next(p for p in root.iterdir() if p.is_dir() and f"{step:08d}" in p.name and "tmp" not in p.name)
    files = sorted(f for f in step_dir.rglob("*") if f.is_file())
    mine = [f for f in files if f"-r{rank:05d}" in f.name]  # this rank's data and index files: what it loads
    if not mine:  # another naming: the node's files split between its ranks by size
        mine = [f for i, f in enumerate(sorted(files, key=lambda f: -f.stat().st_size)) if i % 2 == rank % 2]
    out["raw_files"] = [f.name for f in mine]
    buf = bytearray(8 << 20)
    mv = memoryview(buf)
    dist.barrier()
    t0 = time.perf_counter()
    raw = 0
    for f in mine:
        with open(f, "rb", buffering=0) as fh:
            while (k := fh.readinto(mv)) > 0:
                raw += k
    out["raw_s"] = time.perf_counter() - t0
    out["raw_bytes"] = raw
    # the floor of a restore: the engine's own load of the node's step folder (no tier:
    # no holdings all-gather, no fetch plan), verified and not
    for key, verify in (("plain_s", True), ("noverify_s", False)):
        dest = _fresh_state()
        dist.barrier()
        t0 = time.perf_counter()
        mgr.checkpointer.load(dest, mgr.tier.location(step), verify=verify)
        out[key] = time.perf_counter() - t0

    # 1: node loss: node 1's local folder deleted, restore from peers
    dist.barrier()
    if rank == 2:
        shutil.rmtree(_node_root(local, 1))
    dist.barrier()
    dest = _fresh_state()
    _LAST.clear()
    dist.barrier()
    logs = _Logs()
    with warnings.catch_warnings(record=True) as caught, logs:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        mgr.load(dest)
        out["peers_s"] = time.perf_counter() - t0
    out["peers_notes"] = [str(w.message) for w in caught] + logs.lines
    out["peers_tier"] = mgr.last_load.tier
    out["peers_received"] = getattr(mgr.last_load, "bytes_from_peers", 0)
    s = _LAST.get("stats")
    out["peers_xfer"] = tuple(s) if s is not None else None

    # 1a: persistent load, reads throttled to 200 MB/s on this rank
    slow = shardsafe.Checkpointer(storage=FaultyBackend(throttle_read_bps=THROTTLE_BPS, throttle_cache=True))
    pm = shardsafe.CheckpointManager(work / "persistent", interval=10**9, checkpointer=slow)
    dest = _fresh_state()
    dist.barrier()
    t0 = time.perf_counter()
    pm.load(dest)
    out["slow_s"] = time.perf_counter() - t0
    out["slow_tier"] = pm.last_load.tier
    pm.close() if hasattr(pm, "close") else None

    # 1b: DCP load (unthrottled)
    m2, o2 = _W["dest_objs"]
    dest = {"train": _state_of(m2, o2)}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(dest, checkpoint_id=work / "dcp")
    set_state_dict(m2, o2, model_state_dict=dest["train"]["model"], optim_state_dict=dest["train"]["optim"])
    out["dcp_s"] = time.perf_counter() - t0

    # 3: ordinary async save's blocking time
    cp = mgr.checkpointer
    dist.barrier()
    t0 = time.perf_counter()
    fut = cp.async_save(state, work / f"async-{step}", overwrite=True)
    out["async_block"] = time.perf_counter() - t0
    fut.result()
    dist.barrier()
    if rank == 0:
        shutil.rmtree(work / f"async-{step}", ignore_errors=True)

    # 3: training steps alone, then with a local save + replication in the background
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(TRAIN_STEPS):
        _train_step(model, opt, cfg, rank)
    out["train_alone"] = time.perf_counter() - t0
    state = {"train": _state_of(model, opt)}
    dist.barrier()
    mgr.save_local(step + 1, state)
    t0 = time.perf_counter()
    for _ in range(TRAIN_STEPS):
        _train_step(model, opt, cfg, rank)
    out["train_bg"] = time.perf_counter() - t0
    mgr.wait()
    out["train_bg_total"] = time.perf_counter() - t0
    gc.collect()
    return out


def c_close(rank: int, world: int) -> None:
    mgr = _W.pop("mgr", None)
    if mgr is not None:
        mgr.close()
    _W.clear()


def _summarize(res: dict) -> tuple[str, dict]:
    reps = res["reps"]

    def med(f: Any) -> float:
        return median([f(r) for r in reps])

    def mx(k: str) -> Any:
        return lambda r: max(x[k] for x in r)

    peers = med(mx("peers_s"))
    slow = med(mx("slow_s"))
    dcp_s = med(mx("dcp_s"))
    crash = med(mx("crash_s"))
    plain = med(mx("plain_s"))
    noverify = med(mx("noverify_s"))
    # bandwidths: per receiving rank of node 1 (ranks 2, 3)
    xfer = med(lambda r: median([x["peers_xfer"][1] / x["peers_xfer"][2] for x in r[2:] if x["peers_xfer"]]))
    raw1 = median([p["one way"] for p in res["p2p"][2:]])
    raw2 = median([p["both ways"] for p in res["p2p"]])
    repl = med(lambda r: median([x["repl"][1] / x["repl"][2] for x in r if x["repl"] and x["repl"][2] > 0]))
    local_bytes = res["local_bytes"]
    crash_gbps = med(lambda r: median([(x["crash_bytes"] or lb) / x["crash_s"] for lb, x in zip(local_bytes, r)]))
    raw_gbps = med(lambda r: median([x["raw_bytes"] / x["raw_s"] for x in r if x["raw_s"] > 0]))
    blk_local = med(mx("local_block"))
    blk_async = med(mx("async_block"))
    tr_alone = med(mx("train_alone"))
    tr_bg = med(mx("train_bg"))
    rss_vals = [x["rss_above"] for r in reps for x in r if x["rss_above"] is not None]
    node_bytes = med(lambda r: r[0]["node_bytes"])
    node1_bytes = med(lambda r: r[2]["node_bytes"])
    tiers = {x["peers_tier"] for r in reps for x in r}
    crash_tiers = {x["crash_tier"] for r in reps for x in r}
    slow_tiers = {x["slow_tier"] for r in reps for x in r}
    total = sum(local_bytes)
    checks = {
        "peers_tier": tiers == {"peers"},
        "crash_tier": crash_tiers == {"local"},
        "slow_tier": slow_tiers == {"persistent"},
        "peer_vs_throttled": slow / peers >= TARGETS["peer_vs_throttled"],
        "bw_fraction": xfer / raw1 >= TARGETS["bw_fraction"],
        "local_vs_raw": crash_gbps / raw_gbps >= TARGETS["local_vs_raw"],
    }
    gb = 1e9
    rows = [
        ["node loss: restore from peers (tier " + "/".join(sorted(tiers)) + ")", f"{peers:.3f} s", "", ""],
        [f"  (a) persistent load, reads throttled to {THROTTLE_BPS / 1e6:.0f} MB/s per rank (tier "
         + "/".join(sorted(slow_tiers)) + ")", f"{slow:.3f} s", f"throttled / peers {slow / peers:.1f}x",
         f"{verdict(checks['peer_vs_throttled'] and checks['peers_tier'])} (>= {TARGETS['peer_vs_throttled']:.0f}x)"],
        ["  (b) DCP load, persistent folder, unthrottled", f"{dcp_s:.3f} s",
         f"DCP / peers {dcp_s / peers:.1f}x", "info"],
        ["  (c) floor: the engine's verified load of a node's step folder (nothing to fetch, no tier)",
         f"{plain:.3f} s", f"throttled / floor {slow / plain:.1f}x", "info"],
        ["peer transfer bandwidth per receiving rank (bytes / transfer s)", f"{xfer / gb:.3f} GB/s", "", ""],
        ["  raw gloo isend/irecv, r -> r+2, one way, same piece size", f"{raw1 / gb:.3f} GB/s",
         f"{xfer / raw1:.2f} of raw", f"{verdict(checks['bw_fraction'])} (>= {TARGETS['bw_fraction']})"],
        ["replication bandwidth per rank (received / transfer s)", f"{repl / gb:.3f} GB/s",
         f"{repl / raw2:.2f} of raw both ways ({raw2 / gb:.3f} GB/s)", "info"],
        ["process crash: restore from the node's folder (tier " + "/".join(sorted(crash_tiers)) + ")",
         f"{crash:.3f} s ({crash_gbps / gb:.2f} GB/s per rank)", "", ""],
        ["  plain reads of the node's step folder files", f"{raw_gbps / gb:.2f} GB/s per rank",
         f"{crash_gbps / raw_gbps:.2f}x of raw",
         f"{verdict(checks['local_vs_raw'] and checks['crash_tier'])} (>= {TARGETS['local_vs_raw']}x)"],
        ["  the engine's load of the same folder, verified / verify=False (no tier)",
         f"{plain:.3f} / {noverify:.3f} s", f"restore / verified load {crash / plain:.2f}x", "info"],
        ["blocking time: async local save (save_local returns)", f"{blk_local:.3f} s", "", ""],
        ["  blocking time: Checkpointer.async_save, same state", f"{blk_async:.3f} s",
         f"{blk_local / blk_async:.2f}x", "info"],
        [f"{TRAIN_STEPS} training steps, nothing in the background", f"{tr_alone:.3f} s", "", ""],
        [f"  {TRAIN_STEPS} training steps during a local save + replication (CPU contention, 2 vCPUs)",
         f"{tr_bg:.3f} s", f"{tr_bg / tr_alone:.2f}x", "info"],
        ["local folder bytes of one step, node 0 / node 1 (own + replicas; state total "
         f"{total / gb:.3f} GB)", f"{node_bytes / gb:.3f} / {node1_bytes / gb:.3f} GB",
         f"{node_bytes / total:.2f}x state", "info"],
        ["peak RSS above the model during a local save + replication (max rank)",
         f"{max(rss_vals) / 2**20:.0f} MiB" if rss_vals else "n/a", "", "info"],
    ]
    text = md_table(["measurement", "median", "vs", "target"], rows, "lrrl")
    notes = sorted({n for r in reps for x in r if x["peers_tier"] != "peers" for n in x["peers_notes"]})
    if notes:
        text += "\n\nthe restore after the node loss did not come from peers:\n" + "\n".join(f"- {n}" for n in notes)
    return text, checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full",
                    help="full: bench_distributed's ~0.7 GB FSDP2 GPT + AdamW; small: a quick check")
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions (default 3)")
    ap.add_argument("--dir", default=None, help="parent of the persistent work directory (default /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_recovery.json"), help="JSON output")
    args = ap.parse_args()
    cfg = SIZES[args.size]
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    src = source_state()
    print(source_banner(src), flush=True)
    res: dict[str, Any] = {"torch": torch.__version__, "shardsafe": shardsafe.__version__, "size": args.size,
                           "config": cfg, "params": param_count(cfg), "source": src}
    shm = Path("/dev/shm")
    local_parent = Path(tempfile.mkdtemp(prefix="shardsafe-bench-recovery-",
                                         dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None))
    local = str(local_parent / "node{node}")
    res["local_folder"] = local
    try:
        with bench_dir(args.dir, "shardsafe-bench-recovery-") as work, WorkerPool(4) as pool:
            setup = pool.run(c_setup, cfg, str(work), local, timeout=900)
            res["local_bytes"] = [s["local_bytes"] for s in setup]
            total = sum(res["local_bytes"])
            print(f"FSDP2 GPT {param_count(cfg) / 1e6:.1f}M params ({args.size}), state {total / 1e9:.3f} GB over "
                  f"4 ranks as 2 nodes; local folder {local}, persistent {work}", flush=True)
            from shardsafe.tier.transfer import PIECE

            piece_total = max(4 * PIECE, min(max(res["local_bytes"]), 256 << 20))
            res["p2p"] = pool.run(c_p2p, PIECE, piece_total)
            res["reps"] = []
            for i in range(args.reps):
                r = pool.run(c_rep, 10 * (i + 1), timeout=1800)
                res["reps"].append(r)
                print(f"rep {i + 1}/{args.reps}: peers {max(x['peers_s'] for x in r):.3f}s, throttled "
                      f"{max(x['slow_s'] for x in r):.3f}s, dcp {max(x['dcp_s'] for x in r):.3f}s, local "
                      f"{max(x['crash_s'] for x in r):.3f}s", flush=True)
            pool.run(c_close)
    finally:
        shutil.rmtree(local_parent, ignore_errors=True)
    text, checks = _summarize(res)
    res["checks"] = checks
    res["wall_s"] = time.perf_counter() - t0
    print()
    print(f"### Local recovery tier ({args.size}: {sum(res['local_bytes']) / 1e9:.3f} GB state, 4 ranks as 2 nodes, "
          f"replicas=2, {args.reps} reps, medians; max over ranks unless said)")
    print()
    print(text)
    print(f"\n### Expected lost work, {GPUS:,} GPUs, one failure every {MTBF / 3600:.0f} h, "
          f"{BYTES_PER_RANK / 1e6:.0f} MB of state per rank (measured costs scaled by bytes; _young_daly.py)\n")
    print(young_daly_table(young_daly_measured(res)))
    print(f"\nwall time {res['wall_s']:.0f}s; JSON: {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
