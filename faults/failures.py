"""Injected storage failures through the fault backend (``shardsafe.storage.faults``):
ENOSPC after N bytes, EIO on fsync, failing renames and exchange, no exchange, no flock,
failing create / directory sync / lock / deletion, read failures on load; and a real
RLIMIT_FSIZE in a forked child (writes past it fail with EFBIG).

A save that fails must raise StorageError carrying the injected errno, leave the previous
checkpoint at the path bitwise, and leave no temp folder, thread or file descriptor
behind; a save that succeeds despite the fault (the fault hit something the save does
not need, like deleting the replaced checkpoint) must have committed the new state. In
both cases the next fault-free save succeeds and cleans every leftover."""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import shardsafe
from shardsafe.storage.faults import Fault, FaultyBackend

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

OLD, NEW = 0, 1
REMOVAL_OPS = ("remove", "remove_tree")


def _backend(spec: dict[str, Any]) -> FaultyBackend:
    faults = [Fault(f["op"], f.get("errno", errno.EIO), name=f.get("name"), skip=f.get("skip", 0),
                    times=f.get("times"), after_bytes=f.get("after_bytes")) for f in spec["faults"]]
    return FaultyBackend(faults=faults, exchange=spec.get("exchange", True), locks=spec.get("locks", True))


def _holds(path: str) -> int | None | str:
    """The seq state at ``path``: an int, None (no checkpoint), or a description of what
    is wrong with it."""
    try:
        return seq_of(shardsafe.load_full(path))
    except shardsafe.CheckpointNotFoundError:
        return None
    except Exception as exc:  # noqa: BLE001
        return describe_error(exc)


def _manager_holds(folder: str) -> int | None | str:
    mgr = shardsafe.CheckpointManager(folder, interval=1)
    try:
        dest = seq_state(-1)
        step = mgr.load(dest)
        if step is None:
            return None
        return step if seq_of(dest) == step else f"step {step} loads other content"
    except Exception as exc:  # noqa: BLE001
        return describe_error(exc)
    finally:
        mgr.close()


def _injected_save(how: str, backend: FaultyBackend, path: str, spec: dict[str, Any]) -> BaseException | None:
    """Save the new state through ``backend`` (sync, async, or a manager's step 2); the
    error raised, if any (close() included)."""
    error: BaseException | None = None
    cp = shardsafe.Checkpointer(storage=backend)
    try:
        if how == "sync":
            cp.save(seq_state(NEW), path, overwrite=True)
        elif how == "async":
            cp.async_save(seq_state(NEW), path, overwrite=True).result(timeout=60)
        else:
            mgr = shardsafe.CheckpointManager(path, interval=1, keep_last=spec.get("keep_last"),
                                              async_mode="async" if how == "manager async" else "disabled",
                                              checkpointer=cp)
            try:
                mgr.save(2, seq_state(2))
                mgr.wait()
            finally:
                try:
                    mgr.close()
                except Exception:  # noqa: BLE001 - already raised by wait()
                    pass
    except Exception as exc:  # noqa: BLE001 - classified by the caller
        error = exc
    finally:
        try:
            cp.close()
        except Exception as exc:  # noqa: BLE001
            error = error or exc
    return error


def save_trial(rank: int, world: int, root: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """One injected-failure save (``spec``: how, faults, exchange, locks, errno expected);
    see the module docstring for what is checked."""
    how = spec["how"]
    manager = how.startswith("manager")
    base = Path(root)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    path = str(base / ("steps" if manager else "ckpt"))
    if manager:
        with shardsafe.CheckpointManager(path, interval=1) as m:
            m.save(1, seq_state(1))
    else:
        shardsafe.save(seq_state(OLD), path)
    backend = _backend(spec)
    leak = LeakCheck()
    with warnings.catch_warnings(record=True) as warned:  # retention warns when it cannot delete
        warnings.simplefilter("always")
        error = _injected_save(how, backend, path, spec)
    fired = sum(f.fired for f in backend.faults)
    out: list[dict[str, Any]] = []
    old, new = (1, 2) if manager else (OLD, NEW)
    held = _manager_holds(path) if manager else _holds(path)
    want_errno = spec.get("errno")
    if error is not None:
        if isinstance(error, shardsafe.StorageError) and (want_errno is None or error.errno == want_errno):
            cls = DETECTED
        else:
            cls = OTHER
        out.append(outcome(cls, "save", describe_error(error) + ("" if cls == DETECTED else
                                                                 f" (expected StorageError errno {want_errno})"),
                           error=type(error).__name__, fired=fired))
        if manager:  # the previous step must be intact; a new step may have committed before the error
            first = _holds(str(Path(path) / "step-00000001"))
            if first != old or held not in (old, new):
                out.append(outcome(TORN, "previous checkpoint after the failed save",
                                   f"step 1 holds {first!r}, the newest step {held!r}"))
        elif held != old:
            out.append(outcome(TORN, "previous checkpoint after the failed save",
                               f"path holds {held!r}, expected the previous state {old}"))
    else:
        if held == new:
            out.append(outcome(LOADED, "save", "" if fired else "fault never fired", fired=fired))
        else:
            out.append(outcome(SILENT if fired else OTHER, "save",
                               f"save returned, but the path holds {held!r}, not the new state {new}", fired=fired))
    removal = any(f["op"] in REMOVAL_OPS for f in spec["faults"])
    left = temp_siblings(path, (".shardsafe-tmp-",)) if not manager else \
        [n for n in os.listdir(path) if ".shardsafe-tmp-" in n]
    if left and error is not None and not removal:
        out.append(outcome(LEFTOVERS, "temp folders after the failed save", f"left: {left}"))
    leaks = leak.leaks()
    if leaks:
        out.append(outcome(LEFTOVERS, "threads/descriptors after the save", leaks))
    out.append(_next_save(path, manager))
    if warned:
        out[0]["warnings"] = [str(w.message)[:200] for w in warned]
    return out


def _next_save(path: str, manager: bool) -> dict[str, Any]:
    """A fault-free save afterwards succeeds, loads back and leaves no hidden sibling."""
    try:
        if manager:
            with shardsafe.CheckpointManager(path, interval=1) as m:
                m.save(9, seq_state(9))
            ok = _manager_holds(path) == 9
            left = [n for n in os.listdir(path) if n.startswith(".")]
        else:
            shardsafe.save(seq_state(9), path, overwrite=True)
            ok = _holds(path) == 9
            left = temp_siblings(path, ALL_MARKS)
    except Exception as exc:  # noqa: BLE001
        return outcome(OTHER, "next save", describe_error(exc))
    if not ok:
        return outcome(TORN, "next save", "the next save does not load back")
    return outcome(LEFTOVERS if left else LOADED, "next save", f"left: {left}" if left else "")


def load_trial(rank: int, world: int, root: str, spec: dict[str, Any]) -> list[dict[str, Any]]:
    """A load (in place, into a sentinel-filled destination, and load_full) through a
    backend whose reads fail: StorageError with the errno, destination untouched."""
    from .probes import try_load

    base = Path(root)
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    path = str(base / "ckpt")
    shardsafe.save(seq_state(OLD), path)
    errors = (shardsafe.StorageError,)
    out = []
    for method in ("load", "load_full"):
        backend = _backend(spec)
        cp = shardsafe.Checkpointer(storage=backend)
        try:
            if method == "load":
                dest = seq_state(-1)
                r = try_load("load (read fault)", lambda c=cp, d=dest: c.load(d, path), dest, seq_state(OLD), errors)
            else:
                r = try_load("load_full (read fault)", lambda c=cp: c.load_full(path), None, seq_state(OLD), errors)
        finally:
            cp.close()
        if r["cls"] == DETECTED and spec.get("errno") and f"[Errno {spec['errno']}]" not in r["detail"] and \
                os.strerror(spec["errno"]) not in r["detail"]:
            r = outcome(OTHER, r["method"], "wrong errno: " + r["detail"])
        r["fired"] = sum(f.fired for f in backend.faults)
        out.append(r)
    return out


# ----------------------------------------------------------------------------- specs


def specs(rng: random.Random, per_kind: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(kind, target function, spec) for every injected-failure trial. Each kind cycles
    through its save paths (sync, async, manager, async manager; overwrite-only faults:
    sync and async) and, one round of paths at a time, through its variants (which call
    fails, which file), so every combination comes up; sizes and errnos are random."""
    total = 8 * (1 << 20) + 4096  # bytes a seq_state save writes, about
    every = ("sync", "async", "manager", "manager async")
    overwrite = ("sync", "async")  # a manager saves a new step: no exchange, one rename
    out: list[tuple[str, str, dict[str, Any]]] = []

    def add(kind: str, count: int, make: Any, variants: list[Any] | tuple[Any, ...] = (None,),
            hows: tuple[str, ...] = every, target: str = "save_trial") -> None:
        for i in range(count):
            spec = make(variants[(i // len(hows)) % len(variants)])
            spec.setdefault("how", hows[i % len(hows)])
            out.append((kind, target, spec))

    n = per_kind
    add("ENOSPC after N bytes", 2 * n, lambda v: {
        "faults": [{"op": "write", "errno": errno.ENOSPC, "after_bytes": rng.randrange(total)}],
        "errno": errno.ENOSPC})
    add("EIO on fsync (finish)", n, lambda v: {
        "faults": [{"op": "finish", "errno": errno.EIO, "name": v[0], "skip": v[1], "times": 1}],
        "errno": errno.EIO}, variants=[(None, 0), (None, 1), ("manifest", 0), ("data-", 0)])
    add("EIO writing the manifest", max(4, n // 4), lambda v: {
        "faults": [{"op": "write", "errno": errno.EIO, "name": "manifest"}], "errno": errno.EIO})
    add("rename fails (no exchange)", n, lambda v: {
        "exchange": False, "faults": [{"op": "rename", "errno": rng.choice([errno.EIO, errno.EACCES, errno.EXDEV]),
                                       "skip": v, "times": 1}], "errno": None}, variants=[0, 1], hows=overwrite)
    add("exchange fails", n, lambda v: {
        "faults": [{"op": "exchange", "errno": rng.choice([errno.EIO, errno.EACCES]), "times": 1}], "errno": None},
        hows=overwrite)
    add("exchange unavailable", max(4, n // 2), lambda v: {"exchange": False, "faults": []})
    add("no flock", max(4, n // 2), lambda v: {"locks": False, "faults": []})
    add("no flock + ENOSPC", max(4, n // 2), lambda v: {
        "locks": False, "faults": [{"op": "write", "errno": errno.ENOSPC, "after_bytes": rng.randrange(total)}],
        "errno": errno.ENOSPC})
    add("no exchange, no flock + EIO on fsync", max(4, n // 2), lambda v: {
        "exchange": False, "locks": False, "faults": [{"op": "finish", "errno": errno.EIO, "times": 1}],
        "errno": errno.EIO})
    add("create fails", max(4, n // 2), lambda v: {
        "faults": [{"op": "create", "errno": rng.choice([errno.EACCES, errno.EMFILE, errno.ENOSPC]),
                    "name": v, "times": 1}], "errno": None}, variants=[None, "manifest"])
    add("directory fsync fails", max(4, n // 2), lambda v: {
        "faults": [{"op": "sync", "errno": errno.EIO, "skip": v, "times": 1}], "errno": errno.EIO}, variants=[0, 1])
    add("lock / open folder fails", max(4, n // 2), lambda v: {
        "faults": [{"op": v, "errno": errno.EIO, "times": 1}], "errno": errno.EIO}, variants=["lock", "open_folder"])
    add("deleting the replaced checkpoint fails", max(4, n // 2), lambda v: {
        "exchange": v[0], "keep_last": 1, "faults": [{"op": v[1], "errno": errno.EIO}], "errno": errno.EIO},
        variants=[(True, "remove_tree"), (False, "remove_tree"), (True, "remove"), (False, "remove")])
    add("read fails on load", max(4, n // 2), lambda v: {
        "faults": [{"op": v[0], "errno": rng.choice([errno.EIO, errno.EACCES]), "skip": v[1]}], "errno": None},
        variants=[("read", 0), ("read", 2), ("open_read", 0), ("open_read", 1), ("open_folder", 0)],
        hows=("load",), target="load_trial")
    return out


# ----------------------------------------------------------------------------- RLIMIT_FSIZE


def check_rlimit(rank: int, world: int, path: str, result: str) -> list[dict[str, Any]]:
    """After a save under RLIMIT_FSIZE in a forked child: StorageError with EFBIG (or a
    commit when the limit was not reached), the previous (or new) state at the path, no temp
    folder, thread or descriptor left in the child; the next save cleans up."""
    with open(result) as f:
        got = json.load(f)
    out = []
    held = _holds(path)
    if got["error"] is None:
        out.append(outcome(LOADED if held == NEW else SILENT, "save under RLIMIT_FSIZE",
                           "" if held == NEW else f"returned, path holds {held!r}"))
    else:
        ok = got["error"] == "StorageError" and got["errno"] == errno.EFBIG
        out.append(outcome(DETECTED if ok else OTHER, "save under RLIMIT_FSIZE",
                           f"{got['error']} errno {got['errno']}: {got['message']}"))
        if held != OLD:
            out.append(outcome(TORN, "previous checkpoint after the failed save", f"path holds {held!r}"))
        if got["temp"]:
            out.append(outcome(LEFTOVERS, "temp folders after the failed save", f"left: {got['temp']}"))
    if got["leaks"]:
        out.append(outcome(LEFTOVERS, "threads/descriptors in the child", got["leaks"]))
    out.append(_next_save(path, manager=False))
    return out


def run_rlimit(ctx: Context, n: int, rng: random.Random) -> None:
    """``n`` saves (two sync, one async, ...) over a committed checkpoint in a forked child
    whose RLIMIT_FSIZE is a random size below what the save writes."""
    from .kills import is_dead

    root = ctx.root / "rlimit"
    root.mkdir(exist_ok=True)
    zyg = ctx.zygote()
    total = 8 * (1 << 20) + 4096
    kind = "injected: RLIMIT_FSIZE in a child (EFBIG)"
    for i in range(n):
        trial = root / f"t{i}"
        trial.mkdir()
        path = trial / "ckpt"
        shardsafe.save(seq_state(OLD), path)
        result = trial / "result.json"
        how = "async" if i % 3 == 2 else "sync"
        limit = rng.randrange(total)
        pid = zyg.start("rlimit_save", path=str(path), result=str(result), limit=limit, seq=NEW, how=how)
        deadline = time.monotonic() + 120
        while not is_dead(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        if not is_dead(pid):
            os.kill(pid, signal.SIGKILL)
            zyg.reap(pid)
            probes = [outcome(HANG, "save under RLIMIT_FSIZE", "no exit in 120 s")]
        else:
            status = zyg.reap(pid)
            if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0) or not result.exists():
                probes = [outcome(OTHER, "save under RLIMIT_FSIZE", f"child status {status}: {zyg.stderr()}")]
            else:
                got = ctx.solo.run("faults.failures:check_rlimit", str(path), str(result), timeout=ctx.timeout)
                probes = [outcome(HANG if got.kind == "hang" else OTHER, "check", got.detail)] \
                    if isinstance(got, Failure) else got[0]
        cls = ctx.tally.add(kind, probes, trial=i, limit=limit, how=how)
        ctx.tally.note("injected: class per kind and save path", f"RLIMIT_FSIZE / {how}: {cls}")
        shutil.rmtree(trial, ignore_errors=True)


# ----------------------------------------------------------------------------- the section


def run_failures(ctx: Context, per_kind: int, rlimit: int, seed: int, skip: tuple[str, ...] = ()) -> None:
    """Every injected-failure kind (``per_kind`` trials each, ENOSPC twice as many; kinds in
    ``skip`` left out) and ``rlimit`` RLIMIT_FSIZE trials."""
    rng = random.Random(seed + 3)
    t0 = time.perf_counter()
    root = ctx.root / "failures"
    for i, (kind, target, spec) in enumerate(specs(rng, per_kind)):
        if kind in skip:
            continue
        got = ctx.solo.run(f"faults.failures:{target}", str(root / f"t{i}"), spec, timeout=ctx.timeout)
        if isinstance(got, Failure):
            probes = [outcome(HANG if got.kind == "hang" else OTHER, spec["how"], got.detail)]
        else:
            probes = got[0]
        cls = ctx.tally.add(f"injected: {kind}", probes, trial=i, spec=json.dumps(spec))
        ctx.tally.note("injected: class per kind and save path", f"{kind} / {spec['how']}: {cls}")
        if not any(p.get("fired") for p in probes):
            ctx.tally.note("injected: the fault never fired (the save did not reach it)", kind)
        shutil.rmtree(root / f"t{i}", ignore_errors=True)
    run_rlimit(ctx, rlimit, rng)
    ctx.tally.seconds["injected failures"] += time.perf_counter() - t0

