"""SIGKILL at random moments: of ``shardsafe.save(..., overwrite=True)``, of sync and async
``CheckpointManager`` saves, and of retention (``keep_last=1``: every save deletes the
step before). Workers are forked by the zygote (:mod:`faults.zygote`); half the kills
come after a random delay, half right before a random storage operation of a save.

Pass criterion: after the kill the path holds the previous or the new checkpoint,
bitwise (a checkpoint that mixes two saves, or none where one had committed, is torn or
lost); ``CheckpointManager.load`` loads the newest committed step and every listed step
loads; the next save cleans every leftover."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import shardsafe

from .common import (
    ALL_MARKS,
    HANG,
    LEFTOVERS,
    LOADED,
    OTHER,
    TORN,
    describe_error,
    outcome,
    seq_of,
    seq_state,
    temp_siblings,
)
from .context import Context
from .pool import Failure

REPO = Path(__file__).resolve().parent.parent


class Zygote:
    """The forking child (see :mod:`faults.zygote`), in its own session; ``close()`` kills
    it and every worker left."""

    def __init__(self, root: Path) -> None:
        self.errlog = root / "zygote-stderr.txt"
        self._err = open(self.errlog, "wb")
        env = dict(os.environ, OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p))
        self.proc = subprocess.Popen([sys.executable, "-m", "faults.zygote"], cwd=str(REPO), env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True,
                                     start_new_session=True)
        self.pids: set[int] = set()
        if self._ask(None) != "up":
            raise RuntimeError(f"zygote did not start: {self.stderr()}")

    def _ask(self, cmd: dict[str, Any] | None) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            raise RuntimeError(f"zygote gave no answer (exit {self.proc.poll()}): {self.stderr()}")
        return answer

    def stderr(self, tail: int = 3000) -> str:
        self._err.flush()
        return self.errlog.read_text(errors="replace")[-tail:]

    def start(self, target: str, **args: Any) -> int:
        pid = int(self._ask({"cmd": "start", "target": target, "args": args}))
        self.pids.add(pid)
        return pid

    def reap(self, pid: int) -> int:
        """Wait for worker ``pid`` (the zygote reaps it); its raw wait status."""
        status = int(self._ask({"cmd": "wait", "pid": pid}))
        self.pids.discard(pid)
        return status

    def kill(self, pid: int) -> int:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return self.reap(pid)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the zygote and any worker left
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout, self._err):
            if f is not None:
                f.close()


def is_dead(pid: int) -> bool:
    """True when ``pid`` has exited (a zombie waiting for the zygote to reap it counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def marks(marker: Path) -> list[int]:
    """The values a worker appended to its marker file (complete lines only)."""
    try:
        text = marker.read_text()
    except FileNotFoundError:
        return []
    return [int(x) for x in text.split("\n")[:-1] if x.strip()]


def wait_for(pred: Any, timeout: float, pid: int) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if is_dead(pid) or time.monotonic() > deadline:
            return False
        time.sleep(0.003)
    return True


# ----------------------------------------------------------------------------- checks (run in the 1-process pool)


def check_save(rank: int, world: int, path: str, allowed: list[int | None], resave: int) -> list[dict[str, Any]]:
    """After a kill: ``path`` holds one of the ``allowed`` seq states (None: no checkpoint)
    bitwise, by load_full and in place; then a save of ``resave`` cleans every leftover."""
    out = []
    held: int | None = None
    try:
        got = shardsafe.load_full(path)
        held = seq_of(got)
        ok = held is not None and held in allowed
        out.append(outcome(LOADED if ok else TORN, "load_full after kill",
                           "" if ok else f"holds seq {got.get('seq') if isinstance(got, dict) else '?'} "
                                         f"(consistent: {held is not None}); allowed {allowed}", held=held))
        if held is not None:
            dest = seq_state(-1)
            shardsafe.load(dest, path)
            out.append(outcome(LOADED if seq_of(dest) == held else TORN, "load after kill"))
    except shardsafe.CheckpointNotFoundError as exc:
        out.append(outcome(LOADED if None in allowed else TORN, "load_full after kill",
                           "" if None in allowed else f"lost: {describe_error(exc)}; allowed {allowed}", held=None))
    except Exception as exc:  # noqa: BLE001 - anything else is a torn checkpoint
        out.append(outcome(TORN, "load_full after kill", describe_error(exc)))
    out.append(_resave(path, resave))
    return out


def _resave(path: str, seq: int) -> dict[str, Any]:
    """The next save to ``path`` must succeed, load back and leave no hidden sibling."""
    try:
        shardsafe.save(seq_state(seq), path, overwrite=True)
        if seq_of(shardsafe.load_full(path)) != seq:
            return outcome(TORN, "next save", "the next save does not load back")
    except Exception as exc:  # noqa: BLE001
        return outcome(OTHER, "next save", describe_error(exc))
    left = temp_siblings(path, ALL_MARKS)
    return outcome(LEFTOVERS if left else LOADED, "next save", f"left: {left}" if left else "")


def check_manager(rank: int, world: int, folder: str, allowed: list[int], keep_last: int,
                  resave: bool) -> list[dict[str, Any]]:
    """After a kill: ``CheckpointManager.load`` loads a step in ``allowed`` (the newest
    committed one) bitwise without skipping any; every listed step loads bitwise; the next
    save (a fresh sync manager) leaves no hidden sibling."""
    out = []
    mgr = shardsafe.CheckpointManager(folder, interval=1, keep_last=keep_last)
    try:
        steps = mgr.steps()
        dest = seq_state(-1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                step = mgr.load(dest)
            except Exception as exc:  # noqa: BLE001
                step = None
                out.append(outcome(TORN, "manager load", describe_error(exc)))
        skipped = [str(w.message) for w in caught if "skipping" in str(w.message)]
        if not out:
            good = step in allowed and seq_of(dest) == step and not skipped and (not steps or step == steps[-1])
            out.append(outcome(LOADED if good else TORN, "manager load", "" if good else
                               f"loaded {step} (content ok: {seq_of(dest) == step}), allowed {allowed}, "
                               f"listed {steps}, skipped {skipped}", step=step))
        bad = []
        for s in steps:
            try:
                if seq_of(shardsafe.load_full(mgr.path(s))) != s:
                    bad.append(f"{s}: wrong content")
            except Exception as exc:  # noqa: BLE001
                bad.append(f"{s}: {describe_error(exc)}")
        out.append(outcome(TORN if bad else LOADED, "listed steps load", "; ".join(bad)))
        if resave:
            nxt = (steps[-1] if steps else 0) + 1
            try:
                mgr.save(nxt, seq_state(nxt))
                left = [n for n in os.listdir(folder) if n.startswith(".")]
                out.append(outcome(LEFTOVERS if left else LOADED, "next save", f"left: {left}" if left else "",
                                   saved=nxt))
            except Exception as exc:  # noqa: BLE001
                out.append(outcome(OTHER, "next save", describe_error(exc)))
    finally:
        mgr.close()
    return out


# ----------------------------------------------------------------------------- the section


KINDS = (("save overwrite", 0.25), ("manager sync", 0.20), ("manager async", 0.20), ("retention", 0.25),
         ("2-rank save", 0.10))


def run_kills(ctx: Context, n: int, seed: int) -> None:
    """``n`` kills spread over the kinds (``KINDS`` shares), alternating random delays and
    kills before a random storage operation."""
    rng = random.Random(seed + 2)
    root = ctx.root / "kills"
    root.mkdir(exist_ok=True)
    zyg = ctx.zygote()
    t0 = time.perf_counter()
    counts = {kind: max(1, round(share * n)) for kind, share in KINDS}
    counts["save overwrite"] += n - sum(counts.values())
    try:
        held: dict[str, int | None] = {}
        for kind, count in counts.items():
            for i in range(count):
                at_op = i % 2 == 1
                label = f"kill: {kind} ({'before an operation' if at_op else 'random delay'})"
                early = kind == "save overwrite" and i < max(2, count // 10)
                probes, info = _trial(ctx, zyg, root, kind, i, rng, at_op, early, held)
                ctx.tally.add(label, probes, trial=i, **info)
                if info.get("op"):
                    ctx.tally.note(f"kill: {kind}: operation killed before", info["op"].split(" ")[0])
    finally:
        ctx.tally.seconds["kills"] += time.perf_counter() - t0


def _trial(ctx: Context, zyg: Zygote, root: Path, kind: str, i: int, rng: random.Random, at_op: bool, early: bool,
           held: dict[str, int | None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    if kind == "2-rank save":
        return _dist_trial(ctx, zyg, root, i, rng, at_op, held)
    manager = kind != "save overwrite"
    where = root / kind.replace(" ", "-")
    path = where / f"early-{i}" / "ckpt" if early else where / "ckpt"
    prev = None if early else held.get(kind)
    start = (prev or 0) + 1
    marker = root / f"marker-{kind.replace(' ', '-')}-{i}"
    fraction = rng.uniform(0.0, 1.5) * rng.choice([1, -1]) if at_op else None  # negative: not writes
    info: dict[str, Any] = {"what": kind, "early": early, "at_op": at_op}
    if manager:
        async_mode = "async" if kind == "manager async" else "disabled"
        keep_last = 1 if kind == "retention" else 3
        pid = zyg.start("manager_loop", folder=str(where), marker=str(marker), start=start, async_mode=async_mode,
                        keep_last=keep_last, kill_at=fraction)
    else:
        pid = zyg.start("save_loop", path=str(path), marker=str(marker), start=start, kill_at=fraction)
    try:
        if early:
            time.sleep(rng.uniform(0.0, 0.15))
        else:
            need = 2 if kind == "manager async" else 1
            if not wait_for(lambda: len(marks(marker)) >= need, 60.0, pid):
                if not is_dead(pid):
                    return [outcome(HANG, "worker", "no commit within 60 s")], info
            if at_op:
                wait_for(lambda: False, 30.0, pid)  # it kills itself
            else:
                time.sleep(rng.uniform(0.0, 0.3))
    finally:
        status = zyg.kill(pid)
    if not (os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL):
        return [outcome(OTHER, "worker", f"worker ended otherwise (status {status}): {zyg.stderr()}")], info
    done = marks(marker)
    last = done[-1] if done else None
    op_file = Path(str(marker) + ".op")
    if op_file.exists():
        info["op"] = op_file.read_text()
    info["last_committed"] = last
    if manager:
        spread = 2 if kind == "manager async" else 1  # steps that may have committed after the last mark
        if last is not None:
            allowed = list(range(last, last + spread + 1))
        else:
            allowed = ([prev] if prev is not None else []) + list(range(start, start + spread))
        got = ctx.solo.run("faults.kills:check_manager", str(where), allowed, 1 if kind == "retention" else 3,
                           True, timeout=ctx.timeout)
        if isinstance(got, Failure):
            return [outcome(HANG if got.kind == "hang" else OTHER, "check", got.detail)], info
        probes = got[0]
        held[kind] = next((p["saved"] for p in probes if p.get("saved") is not None), held.get(kind))
        _note_state(ctx, kind, probes, last)
        return probes, info
    allowed_seq: list[int | None] = [last, last + 1] if last is not None else [prev, start]
    if early and last is None:
        allowed_seq = [None, start]
    resave = (last or start) + 10
    got = ctx.solo.run("faults.kills:check_save", str(path), allowed_seq, resave, timeout=ctx.timeout)
    if isinstance(got, Failure):
        return [outcome(HANG if got.kind == "hang" else OTHER, "check", got.detail)], info
    if not early:
        held[kind] = resave
    _note_state(ctx, kind, got[0], last)
    return got[0], info


def check_dist(rank: int, world: int, path: str, allowed: list[int], ranks: int, resave: int
               ) -> list[dict[str, Any]]:
    """After killing ranks of a multi-rank save: ``path`` holds one allowed seq, the same for
    every saving rank's rank-local part, bitwise; then a (1-process) save cleans leftovers."""
    from .common import dist_seq_of

    out = []
    try:
        seqs = [dist_seq_of(shardsafe.load_full(path, rank=r), r) for r in range(ranks)]
        ok = len(set(seqs)) == 1 and seqs[0] in allowed
        out.append(outcome(LOADED if ok else TORN, "load_full of every rank after kill",
                           "" if ok else f"ranks hold {seqs}, allowed {allowed}", held=seqs[0]))
    except Exception as exc:  # noqa: BLE001
        out.append(outcome(TORN, "load_full of every rank after kill", describe_error(exc)))
    out.append(_resave(path, resave))
    return out


def _dist_trial(ctx: Context, zyg: Zygote, root: Path, i: int, rng: random.Random, at_op: bool,
                held: dict[str, int | None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Kill one rank (or both) of a 2-rank gloo job that saves in a loop; the survivor is
    killed a moment later (it may also fail on its own when its peer vanishes)."""
    kind, world = "2-rank save", 2
    where = root / "2-rank"
    where.mkdir(exist_ok=True)
    path = where / "ckpt"
    prev = held.get(kind)
    start = (prev or 0) + 1
    marker = root / f"marker-2rank-{i}"
    init_file = where / f"pg-{i}"
    victims = rng.choice([[0], [1], [0, 1]])
    fraction = rng.uniform(0.0, 1.5) * rng.choice([1, -1]) if at_op else None
    info: dict[str, Any] = {"what": kind, "victims": victims, "at_op": at_op}
    pids = [zyg.start("dist_save_loop", path=str(path), marker=str(marker), start=start, rank=r, world=world,
                      init_file=str(init_file), kill_at=fraction if r == victims[0] else None) for r in range(world)]
    statuses: dict[int, int] = {}
    try:
        if not wait_for(lambda: len(marks(marker)) >= 1, 90.0, pids[0]):
            if not any(is_dead(p) for p in pids):
                return [outcome(HANG, "workers", "no commit within 90 s")], info
        if at_op:
            wait_for(lambda: False, 30.0, pids[victims[0]])
        else:
            time.sleep(rng.uniform(0.0, 0.3))
        for r in victims:
            statuses[r] = zyg.kill(pids[r])
        time.sleep(0.3)
    finally:
        for r in range(world):
            if r not in statuses:
                statuses[r] = zyg.kill(pids[r])
        init_file.unlink(missing_ok=True)
    for r, status in statuses.items():
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        failed = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3 and r != victims[0]  # its peer vanished
        if not (killed or failed):
            return [outcome(OTHER, "workers", f"rank {r} ended otherwise (status {status}): {zyg.stderr()}")], info
    done = marks(marker)
    last = done[-1] if done else None
    info["last_committed"] = last
    op_file = Path(str(marker) + ".op")
    if op_file.exists():
        info["op"] = op_file.read_text()
    allowed = [last, last + 1] if last is not None else [s for s in (prev, start) if s is not None]
    resave = (last or start) + 10
    got = ctx.solo.run("faults.kills:check_dist", str(path), allowed, world, resave, timeout=ctx.timeout)
    if isinstance(got, Failure):
        return [outcome(HANG if got.kind == "hang" else OTHER, "check", got.detail)], info
    held[kind] = resave
    _note_state(ctx, kind, got[0], last)
    return got[0], info


def _note_state(ctx: Context, kind: str, probes: list[dict[str, Any]], last: int | None) -> None:
    """Count whether the kill left the previous checkpoint or the new one."""
    for p in probes:
        value = p.get("held", p.get("step", "absent"))
        if value != "absent":
            what = "none (first save cut short)" if value is None else \
                "last committed" if value == last else "newer (committed, marker not yet written)" \
                if last is not None and value > last else "previous"
            ctx.tally.note(f"kill: {kind}: state found", what)
            return

