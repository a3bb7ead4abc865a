"""The main job (`make demo`): train a small model in one process, save a checkpoint,
then resume in a fresh process and check the resumed run matches an uninterrupted one.

Prints a table of losses (uninterrupted vs resumed) and the save/load times.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

import shardsafe

STEPS = 20
SAVE_AT = 10


def make():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
    return model, opt, sched


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(16, 32, generator=g)
    return x, x.flip(-1)


def run(start: int, stop: int, model, opt, sched) -> list[float]:
    losses = []
    model.train()
    for step in range(start, stop):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    return losses


def state(model, opt, sched, step: int) -> dict:
    return {"model": model, "optim": opt, "sched": sched, "step": step, "rng": torch.get_rng_state()}


def child(ckpt: str) -> None:
    """A fresh process: load the checkpoint, continue to the end, print JSON."""
    model, opt, sched = make()
    st = state(model, opt, sched, 0)
    t0 = time.perf_counter()
    shardsafe.load(st, ckpt)
    load_s = time.perf_counter() - t0
    torch.set_rng_state(st["rng"])
    losses = run(st["step"], STEPS, model, opt, sched)
    print(json.dumps({"losses": losses, "load_s": load_s, "lr": sched.get_last_lr()[0]}))


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        child(sys.argv[2])
        return
    model, opt, sched = make()
    reference = run(0, STEPS, model, opt, sched)

    model, opt, sched = make()
    first = run(0, SAVE_AT, model, opt, sched)
    with tempfile.TemporaryDirectory() as d:
        ckpt = str(Path(d) / f"step-{SAVE_AT:08d}")
        info = shardsafe.save(state(model, opt, sched, SAVE_AT), ckpt)
        out = subprocess.run([sys.executable, __file__, "--child", ckpt], check=True, capture_output=True, text=True)
        resumed = json.loads(out.stdout.strip().splitlines()[-1])
    losses = first + resumed["losses"]
    print(f"shardsafe {shardsafe.__version__}: train {SAVE_AT} steps, save, "
          f"resume in a fresh process, train to {STEPS}")
    print(f"save: {info.bytes_written} bytes in {info.seconds * 1e3:.1f} ms; "
          f"load in the fresh process: {resumed['load_s'] * 1e3:.1f} ms")
    print(f"{'step':>4}  {'uninterrupted':>14}  {'resumed':>14}  same")
    for i, (a, b) in enumerate(zip(reference, losses)):
        mark = "" if i != SAVE_AT else "  <- resumed here"
        print(f"{i:>4}  {a:>14.8f}  {b:>14.8f}  {'yes' if a == b else 'NO'}{mark}")
    same = reference == losses
    print(f"resumed run {'matches' if same else 'DIFFERS from'} the uninterrupted run bitwise "
          f"({STEPS} steps, last LR {resumed['lr']:.6f})")
    sys.exit(0 if same else 1)


if __name__ == "__main__":
    main()
