"""Concurrent saves and loads on one path: overwrite saves (one or two savers) racing
loads into a destination and ``load_full`` of the same path, as threads of one process
and as separate processes (forked by the zygote).

Every load must give one whole checkpoint (every tensor consistent with its ``seq``) or
raise a CheckpointError (a load that keeps seeing its checkpoint replaced gives up with
CheckpointChangedError); every save must commit or raise a CheckpointError; afterwards
the path holds one of the saved states and no temp folder, and no thread or descriptor
of the trial is left."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import shardsafe

from .common import (
    ALL_MARKS,
    DETECTED,
    HANG,
    LEFTOVERS,
    LOADED,
    OTHER,
    SILENT,
    TORN,
    LeakCheck,
    describe_error,
    outcome,
    seq_of,
    seq_state,
    temp_siblings,
)
from .context import Context
from .pool import Failure

ROLES = ("saver", "loader", "full")


def _classify_error(method: str, exc: BaseException) -> dict[str, Any]:
    """Nothing is damaged in a race, so a failing save is a wrong outcome, and so is a load
    told that there is no checkpoint; a load that gives up because its checkpoint kept
    being replaced (CheckpointChangedError, after its retries) detected just that."""
    if isinstance(exc, shardsafe.CheckpointChangedError) and method != "concurrent save":
        return outcome(DETECTED, method, describe_error(exc), error=type(exc).__name__)
    return outcome(OTHER, method, describe_error(exc), error=type(exc).__name__)


def run_role(role: str, path: str, seconds: float, seed: int, stop: Callable[[], bool] | None = None,
             shared: bool = False) -> list[dict[str, Any]]:
    """Run one role until ``seconds`` pass: "saver" saves seq states seed, seed+2, ...
    over ``path``; "loader" loads it in place into a sentinel-filled destination; "full"
    uses load_full. ``shared``: use the default Checkpointer (shared by every thread)."""
    cp = shardsafe.default_checkpointer() if shared else shardsafe.Checkpointer()
    out: list[dict[str, Any]] = []
    deadline = time.monotonic() + seconds
    seq = seed
    try:
        while time.monotonic() < deadline and not (stop and stop()):
            if role == "saver":
                try:
                    cp.save(seq_state(seq), path, overwrite=True)
                    out.append(outcome(LOADED, "concurrent save", seq=seq))
                except Exception as exc:  # noqa: BLE001 - classified
                    out.append(_classify_error("concurrent save", exc))
                seq += 2
                continue
            try:
                if role == "loader":
                    dest = seq_state(-1)
                    cp.load(dest, path)
                    got = dest
                else:
                    got = cp.load_full(path)
            except Exception as exc:  # noqa: BLE001 - classified
                out.append(_classify_error(f"concurrent {role}", exc))
                continue
            held = seq_of(got)
            out.append(outcome(LOADED if held is not None else SILENT, f"concurrent {role}",
                               "" if held is not None else "a load mixed two checkpoints", seq=held))
    finally:
        if not shared:
            cp.close()
    return out


def worker_loop(role: str, path: str, result: str, seconds: float, seed: int) -> None:
    """Process variant: run the role and write its outcomes as JSON to ``result``."""
    out = run_role(role, path, seconds, seed)
    with open(result, "w") as f:
        json.dump(out, f)


def thread_trial(rank: int, world: int, root: str, roles: list[str], seconds: float, shared: bool,
                 seed: int) -> list[dict[str, Any]]:
    """Threads of this process in ``roles`` race on one path for ``seconds``."""
    base = Path(root)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    path = str(base / "ckpt")
    shardsafe.save(seq_state(seed - 2), path)
    leak = LeakCheck()
    results: list[list[dict[str, Any]]] = [[] for _ in roles]
    errors: list[str] = []

    def body(i: int, role: str) -> None:
        try:
            results[i] = run_role(role, path, seconds, seed + i, shared=shared)
        except BaseException as exc:  # noqa: BLE001 - reported
            errors.append(describe_error(exc))

    threads = [threading.Thread(target=body, args=(i, r), name=f"faults-{r}-{i}") for i, r in enumerate(roles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 120)
    out = [o for r in results for o in r]
    if any(t.is_alive() for t in threads):
        out.append(outcome(HANG, "concurrent threads", "a thread did not finish"))
    out.extend(outcome(OTHER, "concurrent threads", e) for e in errors)
    saved = {o["seq"] for o in out if o["method"] == "concurrent save" and o["cls"] == LOADED}
    out.extend(final_check(path, saved | {seed - 2}))
    leaks = leak.leaks()
    if leaks:
        out.append(outcome(LEFTOVERS, "threads/descriptors after the trial", leaks))
    return out


def final_check(path: str, saved: set[int]) -> list[dict[str, Any]]:
    """Once every saver stopped: the path holds one of the saved states; no hidden sibling."""
    try:
        held = seq_of(shardsafe.load_full(path))
    except Exception as exc:  # noqa: BLE001
        return [outcome(TORN, "path after the race", describe_error(exc))]
    out = [outcome(LOADED if held in saved else TORN, "path after the race",
                   "" if held in saved else f"holds {held}, saved {sorted(saved)[:10]}")]
    left = temp_siblings(path, ALL_MARKS)
    if left:
        out.append(outcome(LEFTOVERS, "path after the race", f"left: {left}"))
    return out


def check_final(rank: int, world: int, path: str, saved: list[int]) -> list[dict[str, Any]]:
    return final_check(path, set(saved))


TRIALS: list[tuple[str, list[str], bool]] = [
    ("1 saver, loaders", ["saver", "loader", "full"], False),
    ("2 savers, loaders", ["saver", "saver", "loader", "full"], False),
    ("1 saver, loaders, shared Checkpointer", ["saver", "loader", "full"], True),
]


def run_concurrency(ctx: Context, trials: int, seconds: float, seed: int) -> None:
    """``trials`` thread trials and as many process trials, ``seconds`` each."""
    from .kills import is_dead

    rng = random.Random(seed + 4)
    t0 = time.perf_counter()
    root = ctx.root / "concurrency"
    root.mkdir(exist_ok=True)
    for i in range(trials):
        name, roles, shared = TRIALS[i % len(TRIALS)]
        got = ctx.solo.run("faults.concurrency:thread_trial", str(root / f"threads-{i}"), roles, seconds, shared,
                           1000 * (i + 1), timeout=seconds + ctx.timeout)
        probes = [outcome(HANG if got.kind == "hang" else OTHER, "threads", got.detail)] \
            if isinstance(got, Failure) else got[0]
        _tally(ctx, f"concurrent threads: {name}", probes, i, 1000 * (i + 1) - 2)
    zyg = ctx.zygote()
    try:
        for i in range(trials):
            name, roles, _ = TRIALS[i % 2]
            trial = root / f"procs-{i}"
            trial.mkdir()
            path = trial / "ckpt"
            first = 1000 * (i + 1) + 100_000
            shardsafe.save(seq_state(first - 2), path)
            pids = [(zyg.start("concurrent_loop", role=r, path=str(path), result=str(trial / f"r{j}.json"),
                               seconds=seconds + rng.uniform(0, 0.5), seed=first + j), j)
                    for j, r in enumerate(roles)]
            probes: list[dict[str, Any]] = []
            deadline = time.monotonic() + seconds + ctx.timeout
            for pid, j in pids:
                while not is_dead(pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
                if not is_dead(pid):
                    zyg.kill(pid)
                    probes.append(outcome(HANG, "concurrent processes", f"process {j} did not finish"))
                    continue
                zyg.reap(pid)
                try:
                    probes.extend(json.loads((trial / f"r{j}.json").read_text()))
                except (OSError, ValueError) as exc:
                    probes.append(outcome(OTHER, "concurrent processes", f"process {j}: {exc}: {zyg.stderr()}"))
            saved = sorted({o["seq"] for o in probes if o["method"] == "concurrent save" and o["cls"] == LOADED})
            got = ctx.solo.run("faults.concurrency:check_final", str(path), [*saved, first - 2], timeout=ctx.timeout)
            probes.extend([outcome(OTHER, "check", got.detail)] if isinstance(got, Failure) else got[0])
            _tally(ctx, f"concurrent processes: {name}", probes, i, first - 2)
            shutil.rmtree(trial, ignore_errors=True)
    finally:
        ctx.tally.seconds["concurrency"] += time.perf_counter() - t0


def _tally(ctx: Context, kind: str, probes: list[dict[str, Any]], trial: int, initial: int) -> None:
    """Each load and each save of a race counts as one trial; the checks afterwards as one
    more. Notes count the loads that got a checkpoint saved during the race (the race was real)."""
    for p in probes:
        ctx.tally.add(kind, [p], trial=trial)
        if p.get("error"):
            ctx.tally.note(f"{kind}: errors", f"{p['method']}: {p['error']}")
        if p["method"] in ("concurrent loader", "concurrent full") and p["cls"] == LOADED:
            ctx.tally.note(f"{kind}: loads", "a checkpoint saved during the race" if p.get("seq") != initial
                           else "the initial checkpoint")
