"""Exit stress (issue 28): run the end of a job — resume, maybe save, close, gather the
full model, destroy the process group, exit — many times on 4 gloo ranks under
``torchrun`` and count abnormal exits ("terminate called without an active exception",
SIGABRT, any non-zero exit) and what a rank still holds after ``close()`` (threads of
ours, descriptors, process groups).

    python -m faults.exit_stress --runs 50                 # every variant, 50 runs each
    python -m faults.exit_stress --runs 5 --only async-load-close
    python -m faults.exit_stress --list

A first job per model trains 8 steps and saves steps 4 and 8
(``CheckpointManager(folder, interval=4, keep_last=2, async_mode="async")``); each run of
a variant copies that folder and runs the second job on the copy (its manager in the
variant's mode). Exit status 1 when any
run exited abnormally or left something behind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4
TERMINATE = "terminate called"


@dataclass(frozen=True)
class Variant:
    """One way to end the second job. ``close``: "explicit" (``mgr.close()``), "with" (the
    manager as a context manager) or "none" (left to the interpreter's exit); ``destroy``:
    "after" or "before" close (before: the user destroys the default group first, the
    manager is closed after), or "never"; ``save``: one more (forced) save after the load.
    ``manager`` False: a control with no shardsafe object (the same model, gather,
    ``destroy_process_group()`` and exit); ``settle`` then says whether shardsafe's exit
    handler is installed (``import shardsafe.checkpointer``). The control without it is
    torch alone: its aborts are counted and shown, never a failure (``expect_clean``)."""

    name: str
    mode: str = "async"
    save: bool = False
    close: str = "explicit"
    destroy: str = "after"
    gather: bool = True
    manager: bool = True
    settle: bool = True

    @property
    def expect_clean(self) -> bool:
        """False for the torch-only control: its aborts are torch's, reported as evidence."""
        return self.manager or self.settle


VARIANTS = (
    Variant("async-load-close"),  # the reported sequence
    Variant("sync-load-close", mode="disabled"),
    Variant("async-save-close", save=True),
    Variant("sync-save-close", mode="disabled", save=True),
    Variant("async-save-destroy-first", save=True, destroy="before"),
    Variant("async-load-destroy-first", destroy="before"),
    Variant("async-save-no-close", save=True, close="none"),
    Variant("async-load-no-close", close="none"),
    Variant("async-save-no-close-no-destroy", save=True, close="none", destroy="never"),
    Variant("async-save-with", save=True, close="with"),
    Variant("sync-save-no-close", mode="disabled", save=True, close="none"),
    # The controls: the same model, gather, destroy and exit with no shardsafe object. torch alone aborts
    # (pytorch/pytorch#190489); with shardsafe's exit handler installed it must not.
    Variant("torch-only-gather", manager=False, settle=False),
    Variant("torch-gather-settled", manager=False),
)


# ----------------------------------------------------------------------------- the job (each rank)

def build(kind: str) -> Any:
    """A tiny model, FSDP2 over its blocks and root on a CPU mesh of every rank."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    if kind == "gpt2":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32))
        blocks = list(model.transformer.h)
    else:
        blocks = [torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.GELU()) for _ in range(2)]
        model = torch.nn.Sequential(torch.nn.Embedding(128, 32), *blocks, torch.nn.Linear(32, 128))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train_step(model: Any, opt: Any, kind: str, step: int) -> None:
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    tokens = torch.randint(0, 128, (2, 8), generator=g)
    if kind == "gpt2":
        loss = model(tokens, labels=tokens).loss
    else:
        loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 128), tokens.reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def snapshot() -> dict[str, Any]:
    """What this process holds: threads (names), descriptors (their targets), process groups."""
    import threading

    from torch.distributed import distributed_c10d as c10d

    fds = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the descriptor of the listing itself
    return {"threads": sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()),
            "fds": fds, "groups": len(c10d._world.pg_map)}


def leftovers(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What ``after`` holds that ``before`` did not: threads, descriptors, process groups."""
    threads = [t for t in after["threads"] if t not in before["threads"]]
    fds = sorted(f"{fd}->{t}" for fd, t in after["fds"].items() if before["fds"].get(fd) != t)
    return {"threads": threads, "fds": fds, "groups": after["groups"] - before["groups"]}


def _gather_full(model: Any) -> int:
    """The user's end of job: the full model gathered to the CPU (FSDP all-gathers)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return len(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def job(args: argparse.Namespace) -> None:
    """One rank of the first ("train") or second ("resume") job."""
    import torch
    import torch.distributed as dist

    import shardsafe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build(args.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ts = shardsafe.TrainState(model, opt)
    before = snapshot()
    if not args.manager:  # the controls: the same model, gather and exit, no shardsafe object at all
        if args.settle:
            import shardsafe.checkpointer  # noqa: F401 - installs the exit handler, nothing else
        dist.barrier()
        _gather_full(model)
        dist.destroy_process_group()
        Path(args.reports, f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "control": True}))
        return
    mgr = shardsafe.CheckpointManager(args.folder, interval=4, keep_last=2, async_mode=args.mode)
    if args.job == "train":
        for step in range(1, 9):
            train_step(model, opt, args.model, step)
            ts.step = step
            mgr.maybe_save(step, {"train": ts})
        mgr.close()
        dist.destroy_process_group()
        return
    report: dict[str, Any] = {"rank": rank}

    def body() -> None:
        report["loaded"] = mgr.load({"train": ts})
        report["rng"] = ts.rng_restored
        if args.save:
            train_step(model, opt, args.model, 9)
            ts.step = 9
            mgr.save(9, {"train": ts})

    def gather() -> None:
        if args.gather:
            report["gathered"] = _gather_full(model)

    if args.close == "with":
        with mgr:
            body()
    else:
        body()
    if args.destroy == "before":  # the user tears the default group down first
        gather()
        dist.destroy_process_group()
    if args.close == "explicit":
        mgr.close()
    if args.close != "none":
        report["left"] = leftovers(before, snapshot())
    if args.destroy == "after":
        gather()
        dist.destroy_process_group()
    Path(args.reports, f"rank-{rank}.json").write_text(json.dumps(report))
    # close == "none": the manager (and its Checkpointer) is left to the interpreter's exit


# ----------------------------------------------------------------------------- the driver

def torchrun() -> list[str]:
    exe = Path(sys.executable).with_name("torchrun")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _cores_on() -> None:
    """(In the child, before exec) let an aborting rank leave a core file in its folder."""
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def backtraces(where: Path) -> list[str]:
    """The C++ stacks (gdb, every thread) of the core files under ``where``, which are removed."""
    out = []
    for core in sorted(where.glob("core*")):
        try:
            p = subprocess.run(["gdb", "-batch", "-nx", "-ex", "thread apply all bt 80", sys.executable, str(core)],
                               capture_output=True, text=True, timeout=300)
            out.append(p.stdout[-20000:])
        except (OSError, subprocess.TimeoutExpired) as exc:
            out.append(f"gdb failed on {core.name}: {exc}")
        core.unlink()
    return out


def excerpt(text: str) -> str:
    """Where the ranks' stderr tells of an abort (C++ message, faulthandler's Python stacks)."""
    at = min((i for i in (text.find(TERMINATE), text.find("Fatal Python error")) if i >= 0), default=-1)
    return text[max(0, at - 500): at + 6000] if at >= 0 else text[-4000:]


def launch(folder: Path, job_name: str, model: str, variant: Variant, timeout: float,
           cores: bool = False) -> dict[str, Any]:
    """Run one job on WORLD ranks under torchrun; its exit code, per-rank reports, and the
    abnormal exits torchrun and the ranks printed (with ``cores``: the aborting ranks' C++
    stacks, from their core files)."""
    reports = folder.with_name(folder.name + "-reports")
    reports.mkdir()
    cmd = [*torchrun(), "--standalone", f"--nproc-per-node={WORLD}", "--max-restarts=0", "-m", "faults.exit_stress",
           "--job", job_name, "--folder", str(folder), "--model", model, "--mode", variant.mode,
           "--close", variant.close, "--destroy", variant.destroy, "--reports", str(reports)]
    if variant.save:
        cmd.append("--save")
    if not variant.gather:
        cmd.append("--no-gather")
    if not variant.manager:
        cmd.append("--no-manager")
    if not variant.settle:
        cmd.append("--no-settle")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src")]),
           "PYTHONFAULTHANDLER": "1"}
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=reports, env=env, capture_output=True, text=True, timeout=timeout,
                           preexec_fn=_cores_on if cores else None)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "hang"
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    seconds = time.perf_counter() - t0
    found = [json.loads(p.read_text()) for p in sorted(reports.glob("rank-*.json"))]
    stacks = backtraces(reports) if cores else []
    shutil.rmtree(reports)
    return {"rc": rc, "seconds": seconds, "reports": found,
            "terminate": err.count(TERMINATE) + out.count(TERMINATE),
            "signals": re.findall(r"exitcode\s*:\s*(-?\d+)", err), "stderr": excerpt(err), "stacks": stacks}


def problems(variant: Variant, run: dict[str, Any]) -> list[str]:
    """What is wrong with one run of the second job (empty: a clean run)."""
    bad = []
    if run["rc"] != 0:
        bad.append(f"exit {run['rc']}")
    if run["terminate"]:
        bad.append(f"{run['terminate']} x '{TERMINATE}'")
    if run["signals"]:
        bad.append(f"rank exit codes {run['signals']}")
    if len(run["reports"]) != WORLD:
        bad.append(f"{len(run['reports'])} of {WORLD} ranks reported")
    for r in run["reports"]:
        if r.get("control"):
            continue
        if r.get("loaded") != 8 or r.get("rng") != "exact":
            bad.append(f"rank {r['rank']}: loaded {r.get('loaded')} rng {r.get('rng')}")
        left = r.get("left")
        if left and (left["threads"] or left["fds"] or left["groups"] > 0):
            bad.append(f"rank {r['rank']} left {left}")
    return bad


def prepare(work: Path, model: str, timeout: float) -> Path:
    """The first job's folder (steps 4 and 8) for ``model``, saved by an async manager (its
    checkpoints are the same bytes a sync one writes, so every variant resumes from it)."""
    folder = work / f"base-{model}"
    if not folder.exists():
        run = launch(folder, "train", model, Variant("train"), timeout)
        if run["rc"] != 0 or sorted(p.name for p in folder.iterdir()) != ["step-00000004", "step-00000008"]:
            raise RuntimeError(f"the first job failed (exit {run['rc']}): {run['stderr']}")
    return folder


def stress(variants: list[Variant], runs: int, model: str = "mlp", timeout: float = 120.0,
           log: Any = print, cores: bool = False) -> dict[str, Any]:
    """Run each variant ``runs`` times; per variant: abnormal runs and examples."""
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="shardsafe-exit-") as tmp:
        work = Path(tmp)
        for v in variants:
            base = prepare(work, model, timeout)
            bad_runs, examples, seconds = 0, [], 0.0
            for i in range(runs):
                folder = work / f"run-{v.name}-{i}"
                shutil.copytree(base, folder)
                run = launch(folder, "resume", model, v, timeout, cores)
                shutil.rmtree(folder, ignore_errors=True)
                seconds += run["seconds"]
                bad = problems(v, run)
                if bad:
                    bad_runs += 1
                    if len(examples) < 3:
                        examples.append({"run": i, "problems": bad, "stderr": run["stderr"], "stacks": run["stacks"]})
            out[v.name] = {"runs": runs, "abnormal": bad_runs, "seconds": round(seconds, 1), "examples": examples,
                           "expect_clean": v.expect_clean}
            log(f"{v.name}: {bad_runs}/{runs} abnormal ({seconds / max(runs, 1):.1f} s a run)")
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m faults.exit_stress", description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=50, help="runs of each variant (default 50)")
    p.add_argument("--only", default="", help="comma-separated variant names (default: all)")
    p.add_argument("--model", default="mlp", choices=("mlp", "gpt2"), help="the model (default: a plain torch one)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a run counts as a hang")
    p.add_argument("--cores", action="store_true", help="keep the C++ stacks (gdb) of aborting ranks' cores")
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    p.add_argument("--out", help="write the JSON report here")
    # one rank of a job (what torchrun starts)
    p.add_argument("--job", choices=("train", "resume"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    p.add_argument("--reports", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="async", help=argparse.SUPPRESS)
    p.add_argument("--close", default="explicit", help=argparse.SUPPRESS)
    p.add_argument("--destroy", default="after", help=argparse.SUPPRESS)
    p.add_argument("--save", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--no-gather", dest="gather", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--no-manager", dest="manager", action="store_false", help=argparse.SUPPRESS)
    p.add_argument("--no-settle", dest="settle", action="store_false", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.job is not None:
        job(args)
        return 0
    if args.list:
        for v in VARIANTS:
            print(f"{v.name}: {v}")
        return 0
    names = [n for n in args.only.split(",") if n]
    known = {v.name: v for v in VARIANTS}
    unknown = [n for n in names if n not in known]
    if unknown:
        from shardsafe.hints import nearest

        raise SystemExit(f"unknown variant {unknown[0]!r} (closest: {', '.join(nearest(unknown[0], known))}; "
                         f"known: {', '.join(known)})")
    chosen = [known[n] for n in names] if names else list(VARIANTS)
    report = stress(chosen, args.runs, args.model, args.timeout,
                    log=lambda m: print(m, file=sys.stderr, flush=True), cores=args.cores)
    bad = sum(r["abnormal"] for r in report.values() if r["expect_clean"])
    print(f"\nexit stress ({args.model}, {args.runs} runs of {len(chosen)} variants on {WORLD} ranks): "
          f"{bad} abnormal where shardsafe is in the job")
    for name, r in report.items():
        note = "" if r["expect_clean"] else " (control: torch alone, not counted)"
        print(f"| {name} | {r['abnormal']}/{r['runs']}{note} |")
        for ex in r["examples"]:
            print(f"  - run {ex['run']}: {'; '.join(ex['problems'])}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
