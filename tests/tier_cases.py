"""One rank of a local-tier run, started as its own process by tests/test_tier.py.

``python tests/tier_cases.py SPEC.json`` with RANK, WORLD_SIZE and INIT_FILE set: joins a
gloo group, builds resume_cases' FSDP2 recipe (model, AdamW, LR schedule, sampler,
DataLoader, TrainState with every RNG stream), opens a CheckpointManager with a local
tier (``local`` with ``{node}`` in it: each simulated node has its own folder), optionally
restores, trains to ``stop`` saving as the manager says, and writes what it saw to
``OUT.rank<r>.json``: the step records, digests of the full state after every save and at
the end, the step and tier restored. ``kill`` makes one rank SIGKILL itself at a named
point (during a local save's write, its replication, or a restore's transfers), as a
crashed process would die there; it is patched in here, never in the library.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))


def digest(tree: Any) -> str:
    """SHA-1 of every tensor's bytes and every plain value in a state tree, in order."""
    h = hashlib.sha1()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            h.update(str((x.dtype, tuple(x.shape))).encode())
            h.update(x.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if x.numel() else b"")
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                h.update(str(k).encode())
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(tree)
    return h.hexdigest()


def full_digest(snap: dict[str, Any]) -> str:
    """The digest of what does not depend on the world size: full model and optimizer
    state, LR schedule, counters."""
    return digest({k: snap[k] for k in ("model", "optim", "sched", "counters")})


def _kill_hook(spec: dict[str, Any], rank: int) -> None:
    kill = spec.get("kill")
    if not kill or kill["rank"] != rank:
        return
    import shardsafe.tier.local as tl

    def die(*_a: Any, **_k: Any) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    if kill["at"] == "replicate":  # the rank's files are written; it dies as their copying starts
        orig = tl.exchange
        calls = [0]

        def exchange(transfers, *a, **k):  # noqa: ANN001, ANN202
            if any(t.src == rank for t in transfers):
                calls[0] += 1
                if calls[0] == kill["step"] // 2:  # local saves every 2 steps
                    die()
            return orig(transfers, *a, **k)

        tl.exchange = exchange
    elif kill["at"] == "save":  # in the middle of writing the local save's data file
        import shardsafe.storage.local as sl

        orig_write = sl.LocalWriteHandle.write

        def write(self, buffers, offset):  # noqa: ANN001, ANN202
            if f".step-{kill['step']:08d}.shardsafe-tmp-tier" in getattr(self.folder, "location", ""):
                die()
            return orig_write(self, buffers, offset)

        sl.LocalWriteHandle.write = write
    elif kill["at"] == "restore":
        orig = tl.exchange

        def exchange_r(transfers, *a, **k):  # noqa: ANN001, ANN202
            if any(t.src == rank or t.dst == rank for t in transfers):
                die()
            return orig(transfers, *a, **k)

        tl.exchange = exchange_r


def main(path: str) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    with open(path) as f:
        spec = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    from datetime import timedelta

    dist.init_process_group("gloo", init_method=f"file://{os.environ['INIT_FILE']}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    import shardsafe
    from resume_cases import build_run, config, snapshot, train

    logging.basicConfig(level=logging.INFO, format=f"rank {rank}: %(name)s %(message)s")
    _kill_hook(spec, rank)
    cfg = config(**spec.get("cfg", {}))
    run = build_run(cfg, "fsdp", rank, world, init_seed=0, rng_seed=100)
    out: dict[str, Any] = {"saves": {}, "saves_full": {}, "loaded": None, "tier": None}
    kw = {k: spec[k] for k in ("local_keep", "replicas", "local_max_bytes", "promote_every") if k in spec}
    mgr = shardsafe.CheckpointManager(spec["persistent"], interval=spec.get("interval", 1000),
                                      local=spec["local"], local_interval=spec.get("local_interval", 2),
                                      node=spec["nodes"][rank], local_async=spec.get("local_async", True), **kw)
    state = {"train": run.state}
    try:
        if spec.get("load"):
            out["loaded"] = mgr.load(state)
            out["tier"] = mgr.last_load.tier if mgr.last_load is not None else None
            out["received"] = getattr(mgr.last_load, "bytes_from_peers", 0)
            snap = snapshot(run)
            out["restored"], out["restored_full"] = digest(snap), full_digest(snap)

        def on_step(r: Any) -> None:
            step = r.state.step
            if mgr.maybe_save(step, state):
                mgr.wait()
                snap = snapshot(r)
                out["saves"][str(step)], out["saves_full"][str(step)] = digest(snap), full_digest(snap)

        out["records"] = train(run, spec["stop"], on_step)
        out["final"] = digest(snapshot(run))
        mgr.close()
    except shardsafe.CheckpointError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
        if spec.get("then_persistent"):  # the persistent tier still saves
            mgr.save(run.state.step, state)
            out["persistent_after_error"] = run.state.step
        mgr.close()
    with open(f"{spec['out']}.rank{rank}.json", "w") as f:
        json.dump(out, f)
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
