"""The main job (`make demo`): elastic training with shardsafe, end to end, on CPU.

1. reference: a small GPT-style model trained with FSDP2 on 4 processes (gloo), uninterrupted;
2. crash:     the same run with a checkpoint every few steps; one rank is killed (SIGKILL)
              mid-run, and the launcher tears the job down like torchrun would;
3. resume:    a new job on 2 processes loads the latest valid checkpoint (resharding
              4 -> 2, same global batch, same global sample order) and trains to the end.

Prints a table (step, reference loss, crashed/resumed loss, checkpoint save/load times)
and writes a PNG plot of both loss curves. Everything it writes goes to ``--out``
(default ``demo-out/``, ignored by git) or to a temporary folder (the checkpoints), so a
run never changes a tracked file; ``--update-docs`` also refreshes the README's picture,
docs/demo-loss.png (for maintainers, on purpose).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

STEPS = 40
INTERVAL = 5
CRASH_AT = 23  # the killed rank dies during this step, after the checkpoint of step 20
GLOBAL_BATCH = 16
SEQ = 32
VOCAB = 64
KILLED_RANK = 2


# ----------------------------------------------------------------------------- worker


def build_model():
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.ln1 = nn.LayerNorm(d)
            self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
            self.ln2 = nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            n = x.shape[1]
            mask = torch.triu(torch.ones(n, n, dtype=torch.bool), 1)
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self, d: int = 64, heads: int = 4, layers: int = 2) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, d)
            self.pos = nn.Parameter(torch.zeros(SEQ, d))
            self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
            self.ln = nn.LayerNorm(d)
            self.head = nn.Linear(d, VOCAB, bias=False)

        def forward(self, idx):
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for b in self.blocks:
                x = b(x)
            return self.head(self.ln(x))

    torch.manual_seed(0)
    return GPT()


def corpus(n: int = 1024):
    """A tiny synthetic corpus with learnable structure: noisy arithmetic sequences mod VOCAB."""
    import torch

    g = torch.Generator().manual_seed(1234)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 5, (n, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(n, SEQ + 1, generator=g) < 0.05
    return torch.where(noise, torch.randint(0, VOCAB, (n, SEQ + 1), generator=g), seq)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import shardsafe
    from shardsafe.data import ElasticSampler, per_rank_batch

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build_model()
    mesh = init_device_mesh("cpu", (world,))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5) * (1 - s / (STEPS + 1)))
    data = corpus()
    sampler = ElasticSampler(len(data), GLOBAL_BATCH, seed=7)
    micro = per_rank_batch(GLOBAL_BATCH, world)
    ts = shardsafe.TrainState(model, opt, sched, data=sampler)
    out = Path(args.out)
    log = open(out / f"{args.phase}.jsonl", "a") if rank == 0 else None
    mgr = None
    if args.ckpt:
        mgr = shardsafe.CheckpointManager(args.ckpt, interval=INTERVAL, keep_last=2)
        t0 = time.perf_counter()
        step = mgr.load({"train": ts})
        if step is not None and log is not None:
            log.write(json.dumps({"event": "resumed", "step": step, "world": world,
                                  "load_s": time.perf_counter() - t0}) + "\n")
            log.flush()
    while ts.step < STEPS:
        if sampler.global_batches_left == 0:
            ts.epoch += 1
            sampler.set_epoch(ts.epoch)
        ids = list(iter(sampler))[:micro]
        batch = data[torch.tensor(ids)]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        sampler.advance()
        ts.step += 1
        ts.tokens_seen += GLOBAL_BATCH * SEQ
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        global_loss /= world
        if args.phase == "crash" and ts.step == CRASH_AT and rank == KILLED_RANK:
            os.kill(os.getpid(), signal.SIGKILL)
        save_s = None
        if mgr is not None and mgr.should_save(ts.step):
            t0 = time.perf_counter()
            mgr.save(ts.step, {"train": ts})
            save_s = time.perf_counter() - t0
        if log is not None:
            log.write(json.dumps({"step": ts.step, "loss": global_loss.item(), "save_s": save_s,
                                  "lr": sched.get_last_lr()[0]}) + "\n")
            log.flush()
    if mgr is not None:
        mgr.close()
    dist.destroy_process_group()


# ----------------------------------------------------------------------------- launcher


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(phase: str, world: int, out: Path, ckpt: str | None) -> int:
    """Start ``world`` worker processes; if one dies, stop the rest (as torchrun does)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker", "--phase", phase, "--out", str(out)]
        if ckpt:
            cmd += ["--ckpt", ckpt]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    failed = 0
    try:
        while any(p.poll() is None for p in procs):
            dead = [p for p in procs if p.poll() not in (None, 0)]
            if dead:
                failed = dead[0].returncode
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                break
            time.sleep(0.05)
        for p in procs:
            p.wait()
        if not failed:
            failed = next((p.returncode for p in procs if p.returncode), 0)
        if failed and phase != "crash":
            for p in procs:
                sys.stderr.write(p.stderr.read() if p.stderr else "")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
            if p.stderr:
                p.stderr.close()
    return failed


def read(out: Path, phase: str) -> list[dict]:
    path = out / f"{phase}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def plot(ref: dict[int, float], crash: dict[int, float], resumed: dict[int, float], resumed_at: int,
         paths: list[Path]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    ax.plot(list(ref), list(ref.values()), color="#999999", lw=4, label="uninterrupted (4 ranks)")
    ax.plot(list(crash), list(crash.values()), color="#d62728", lw=1.5, marker=".", label="run that crashed (4 ranks)")
    ax.plot(list(resumed), list(resumed.values()), color="#1f77b4", lw=1.5, marker=".",
            label=f"resumed from step {resumed_at} (2 ranks)")
    ax.axvline(CRASH_AT, color="#d62728", ls=":", lw=1)
    ax.text(CRASH_AT + 0.3, max(ref.values()) * 0.98, f"rank {KILLED_RANK} killed", color="#d62728", fontsize=8)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("shardsafe: FSDP2 on 4 ranks, crash, elastic resume on 2 ranks")
    ax.legend(fontsize=8)
    fig.tight_layout()
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(p)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", default="reference", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="demo-out", help="folder for the plot and logs (default: demo-out)")
    parser.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--update-docs", action="store_true",
                        help="also write the plot to docs/demo-loss.png (the README's picture; a tracked file)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return

    t_start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("*.jsonl"):
        f.unlink()
    with tempfile.TemporaryDirectory(prefix="shardsafe-demo-") as tmp:
        ckpt = str(Path(tmp) / "checkpoints")
        print(f"[1/3] reference run: FSDP2 on 4 processes, {STEPS} steps, global batch {GLOBAL_BATCH}", flush=True)
        if launch("reference", 4, out, None):
            sys.exit("reference run failed")
        print(f"[2/3] crash run: checkpoint every {INTERVAL} steps; rank {KILLED_RANK} is killed at step {CRASH_AT}",
              flush=True)
        rc = launch("crash", 4, out, ckpt)
        print(f"      the job died (exit status {rc}); checkpoints on disk: "
              f"{sorted(p.name for p in Path(ckpt).iterdir() if p.name.startswith('step-'))}", flush=True)
        print("[3/3] resume on 2 processes from the latest valid checkpoint", flush=True)
        if launch("resume", 2, out, ckpt):
            sys.exit("resumed run failed")

    ref = {r["step"]: r["loss"] for r in read(out, "reference") if "loss" in r}
    crash_rows = [r for r in read(out, "crash") if "loss" in r]
    crash = {r["step"]: r["loss"] for r in crash_rows}
    saves = {r["step"]: r["save_s"] for r in crash_rows if r.get("save_s") is not None}
    resume_rows = read(out, "resume")
    event = next(r for r in resume_rows if r.get("event") == "resumed")
    resumed = {r["step"]: r["loss"] for r in resume_rows if "loss" in r}
    resumed_at = event["step"]

    print()
    print(f"{'step':>4}  {'uninterrupted':>13}  {'crash/resumed':>13}  {'rel. diff':>9}  note")
    worst = 0.0
    for step in range(1, STEPS + 1):
        a = ref.get(step)
        b = resumed.get(step, crash.get(step))
        note = ""
        if step in saves:
            note = f"saved ({saves[step] * 1e3:.0f} ms)"
        if step == CRASH_AT - 1 and step not in resumed:
            note = f"last step before rank {KILLED_RANK} was killed"
        if step == resumed_at + 1:
            note = f"resumed from step {resumed_at} on 2 ranks (load {event['load_s'] * 1e3:.0f} ms)"
        if b is None:
            print(f"{step:>4}  {a:>13.6f}  {'-':>13}  {'':>9}  {note}")
            continue
        rel = abs(a - b) / abs(a)
        if step in resumed:
            worst = max(worst, rel)
        print(f"{step:>4}  {a:>13.6f}  {b:>13.6f}  {rel:>9.1e}  {note}")
    plots = [out / "loss.png"]
    if args.update_docs:
        plots.append(Path(__file__).resolve().parent.parent / "docs" / "demo-loss.png")
    plot(ref, crash, resumed, resumed_at, plots)
    ok = worst <= 1e-4 and len(resumed) == STEPS - resumed_at
    print()
    print(f"resumed {STEPS - resumed_at} steps on 2 ranks from the step-{resumed_at} checkpoint written by 4 ranks; "
          f"largest relative loss difference vs the uninterrupted run: {worst:.1e} "
          f"({'OK' if ok else 'TOO LARGE'}, reduction order differs across world sizes)")
    print(f"plot: {', '.join(str(p) for p in plots)}; total time {time.perf_counter() - t_start:.0f} s")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
