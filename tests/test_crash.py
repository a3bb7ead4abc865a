"""Crash safety: a real process saving in a loop is killed with SIGKILL at random moments;
afterwards the path holds either no checkpoint (only when the very first save was cut
short) or one complete checkpoint, exactly state A or state B — never a mix."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import shardsafe
from bitwise import tensors_equal
from shardsafe import CheckpointNotFoundError

# Shared by the child (exec'd there) and the parent: two distinct deterministic states of
# 8 tensors x 2 MiB each.
STATES_SRC = textwrap.dedent(
    """
    import torch

    def make_state(which):
        g = torch.Generator().manual_seed(1 if which == "A" else 2)
        tensors = {
            f"t{i}": torch.randint(-(2**31), 2**31 - 1, (512 * 1024,), dtype=torch.int32, generator=g)
            for i in range(8)
        }
        return {"which": which, "tensors": tensors, "meta": {"n": 8, "tag": which * 3}}
    """
)

# The child: imports torch once, builds both states, then for each command line it
# reads ("<path>\t<ready>\t<first>") forks a worker that saves A, B, A, ... to <path>
# with overwrite=True until it is killed, and answers with the worker's pid. "wait <pid>"
# reaps a worker and answers with its raw wait status. Forking keeps each trial cheap
# (no torch import per trial) while every kill still hits a real, separate process.
CHILD_SRC = textwrap.dedent(
    r"""
    import os
    import sys
    import traceback
    from pathlib import Path

    import torch

    torch.set_num_threads(1)
    import shardsafe

    exec(compile(Path(sys.argv[1]).read_text(), "states", "exec"))
    states = {"A": make_state("A"), "B": make_state("B")}

    def save_forever(path, ready, first):
        ready.touch()
        n = 0
        while True:
            shardsafe.save(states["AB"[n % 2]], path, overwrite=True)
            n += 1
            if n == 1:
                first.touch()

    print("up", flush=True)
    for line in sys.stdin:
        words = line.rstrip("\n").split("\t")
        if words[0] == "wait":
            _, status = os.waitpid(int(words[1]), 0)
            print(status, flush=True)
            continue
        pid = os.fork()
        if pid == 0:
            try:
                save_forever(words[0], Path(words[1]), Path(words[2]))
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(3)
        print(pid, flush=True)
    """
)

EARLY_TRIALS = 4  # kill during the very first save (fresh path each time)
LATE_TRIALS = 16  # kill at a random moment after at least one commit (one shared path)


def _states() -> dict:
    ns: dict = {}
    exec(compile(STATES_SRC, "states", "exec"), ns)
    return {w: ns["make_state"](w) for w in "AB"}


def _matches(out: dict, want: dict) -> bool:
    if out.keys() != want.keys() or out["which"] != want["which"] or out["meta"] != want["meta"]:
        return False
    if out["tensors"].keys() != want["tensors"].keys():
        return False
    return all(tensors_equal(out["tensors"][k], v) for k, v in want["tensors"].items())


def _wait_for(flag: Path, zygote: subprocess.Popen, errlog: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not flag.exists():
        if zygote.poll() is not None:
            pytest.fail(f"child exited with {zygote.returncode}:\n{errlog.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"worker did not reach {flag.name} in {timeout}s:\n{errlog.read_text()}")
        time.sleep(0.002)


class Child:
    """The child process (see CHILD_SRC), its own process group, killed whole on close."""

    def __init__(self, tmp_path: Path) -> None:
        (tmp_path / "states.py").write_text(STATES_SRC)
        (tmp_path / "child.py").write_text(CHILD_SRC)
        self.errlog = tmp_path / "child-stderr.txt"
        env = dict(os.environ)
        src_root = str(Path(shardsafe.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([src_root, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["OMP_NUM_THREADS"] = "1"
        self._err = open(self.errlog, "wb")
        self.proc = subprocess.Popen(
            [sys.executable, str(tmp_path / "child.py"), str(tmp_path / "states.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            start_new_session=True,
        )
        assert self._ask(None) == "up"

    def _ask(self, line: str | None) -> str:
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline().strip()
        if not answer:
            pytest.fail(f"child gave no answer (exit {self.proc.poll()}):\n{self.errlog.read_text()}")
        return answer

    def start_worker(self, path: Path, ready: Path, first: Path) -> int:
        return int(self._ask(f"{path}\t{ready}\t{first}"))

    def reap(self, pid: int) -> int:
        return int(self._ask(f"wait\t{pid}"))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)  # the child and any worker left
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        for f in (self.proc.stdin, self.proc.stdout, self._err):
            f.close()


def _run_trial(child: Child, tmp_path: Path, index: int, path: Path, early: bool, rng: random.Random) -> bool:
    """Start a saving worker, SIGKILL it, and return whether its first save had completed."""
    ready = tmp_path / f"ready-{index}"
    first = tmp_path / f"first-{index}"
    pid = child.start_worker(path, ready, first)
    try:
        if early:
            _wait_for(ready, child.proc, child.errlog)
            # Mostly inside the first save; the later early trials may land just after it.
            time.sleep(rng.uniform(0.0, 0.03) if index < 2 else rng.uniform(0.0, 0.25))
        else:
            _wait_for(first, child.proc, child.errlog)
            time.sleep(rng.uniform(0.0, 0.3))
    finally:
        os.kill(pid, signal.SIGKILL)
        status = child.reap(pid)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (
        f"worker ended otherwise (status {status}):\n{child.errlog.read_text()}"
    )
    return first.exists()


def _check(path: Path, states: dict, committed: bool) -> str | None:
    """The state the path holds after a kill ('A' or 'B'), or None when there is none."""
    try:
        out = shardsafe.load_full(path)
    except CheckpointNotFoundError:
        assert not committed, "a save that returned must leave a checkpoint"
        assert not (path / "manifest.json").exists()
        return None
    which = out.get("which")
    assert which in states, f"unexpected content {which!r}"
    assert _matches(out, states[which]), f"checkpoint mixes states (says {which!r})"
    # The committed directory is complete and holds nothing else.
    assert sorted(p.name for p in path.iterdir()) == ["data-r00000-00.index.json", "data-r00000-00.safetensors",
                                                      "manifest.json"]
    # The in-place path agrees.
    dest = {"which": None, "tensors": {k: torch.zeros_like(v) for k, v in states[which]["tensors"].items()},
            "meta": {}}
    shardsafe.load(dest, path)
    assert _matches(dest, states[which])
    return which


@pytest.mark.timeout(120)
def test_sigkill_during_saves_leaves_old_or_new_checkpoint(tmp_path):
    states = _states()
    rng = random.Random(20240607)
    seen: list[str | None] = []
    child = Child(tmp_path)
    try:
        for i in range(EARLY_TRIALS):
            path = tmp_path / f"early-{i}" / "ckpt"
            committed = _run_trial(child, tmp_path, i, path, early=True, rng=rng)
            seen.append(_check(path, states, committed))

        shared = tmp_path / "late" / "ckpt"
        for i in range(EARLY_TRIALS, EARLY_TRIALS + LATE_TRIALS):
            committed = _run_trial(child, tmp_path, i, shared, early=False, rng=rng)
            assert committed
            which = _check(shared, states, committed)
            assert which is not None
            seen.append(which)
    finally:
        child.close()

    # After all the debris of killed saves, a normal save still works and cleans up.
    shardsafe.save(states["B"], shared, overwrite=True)
    assert _matches(shardsafe.load_full(shared), states["B"])
    leftovers = [p.name for p in shared.parent.iterdir() if p.name != "ckpt"]
    assert not [n for n in leftovers if ".shardsafe-tmp-" in n], leftovers
    assert len(seen) == EARLY_TRIALS + LATE_TRIALS
    print(f"states found after each kill: {seen}")  # shown with pytest -s
