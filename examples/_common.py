"""Shared parts of the training examples: a small GPT-like model, a synthetic token
dataset, the command line, and one training loop that checkpoints with shardsafe and
resumes automatically from the latest checkpoint in ``--ckpt-dir``.

What makes the resume exact (see README.md):

* everything that changes during training lives in one ``shardsafe.TrainState``: model,
  optimizer, LR scheduler, data position (an ``ElasticSampler``), counters and every RNG
  stream (per rank);
* the loop calls ``sampler.advance()`` after each optimizer step, so the saved data
  position is what the loop consumed, not what the DataLoader had prefetched;
* the DataLoader has its own ``generator``, so creating an iterator (at each epoch and at
  a resume) does not draw from the global torch RNG that dropout uses.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import shardsafe
from shardsafe.data import ElasticSampler, keep_global_batch, per_rank_batch

VOCAB, SEQ, DIM, HEADS, LAYERS = 64, 16, 64, 4, 2


# ----------------------------------------------------------------------------- model


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and an MLP, with dropout."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, dropout: float = 0.1) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.drop(self.proj(a.transpose(1, 2).reshape(b, t, d)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, seq: int = SEQ, dim: int = DIM, layers: int = LAYERS,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, HEADS, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(tokens) + self.pos(torch.arange(tokens.shape[1])))
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))


def build_model(seed: int, dropout: float = 0.1) -> TinyGPT:
    """The same initial weights on every rank (FSDP2 shards each rank's copy)."""
    torch.manual_seed(seed)
    return TinyGPT(dropout=dropout)


# ----------------------------------------------------------------------------- data


def synthetic_dataset(n: int = 4096, seed: int = 0) -> TensorDataset:
    """Token sequences with a learnable rule: x[t+1] = (a * x[t] + c) % VOCAB, a and c per
    sample. Items are (inputs, targets, sample id)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, 8, (n, 1), generator=g)
    c = torch.randint(0, VOCAB, (n, 1), generator=g)
    x = torch.empty(n, SEQ + 1, dtype=torch.long)
    x[:, 0] = torch.randint(0, VOCAB, (n,), generator=g)
    for t in range(SEQ):
        x[:, t + 1] = (a[:, 0] * x[:, t] + c[:, 0]) % VOCAB
    return TensorDataset(x[:, :-1].contiguous(), x[:, 1:].contiguous(), torch.arange(n))


# ----------------------------------------------------------------------------- command line


def parse_args(description: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=200, help="train until this many optimizer steps in total")
    p.add_argument("--ckpt-dir", default="checkpoints", help="checkpoint folder (resumes from its latest step)")
    p.add_argument("--global-batch", type=int, default=32, help="samples per optimizer step over all ranks")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="samples per forward pass on one rank (default: the rank's whole share; a smaller "
                        "value accumulates gradients so the global batch stays the same)")
    p.add_argument("--interval", type=int, default=10, help="save every this many steps")
    p.add_argument("--keep-last", type=int, default=3, help="keep this many newest checkpoints")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout probability (0 makes a resume on another world size match the losses of an "
                        "uninterrupted run to float rounding: the dropout streams are re-derived there)")
    p.add_argument("--seed", type=int, default=1234, help="seeds the data order and the RNG streams")
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--stop-at", type=int, default=None,
                   help="exit right after this step, as if the job had been preempted (for trying resume)")
    return p.parse_args()


# ----------------------------------------------------------------------------- distributed


def init_distributed() -> tuple[int, int]:
    """Join the process group torchrun describes in the environment (gloo, CPU)."""
    if "RANK" not in os.environ:
        raise SystemExit("launch with torchrun, e.g. torchrun --standalone --nproc_per_node=2 " + __file__)
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


# ----------------------------------------------------------------------------- training


def train(args: argparse.Namespace, model: nn.Module, *, rank: int = 0, world: int = 1,
          layout: str = "single", log: Callable[[str], None] | None = None) -> None:
    """Train ``model`` (already wrapped for DDP / FSDP2) to ``args.steps``, checkpointing
    every ``args.interval`` steps and resuming from the latest checkpoint if there is one."""
    say = log or (lambda msg: print(msg, flush=True) if rank == 0 else None)
    g = args.global_batch
    micro = args.micro_batch or per_rank_batch(g, world)
    accum = keep_global_batch(g, world, micro)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warmup = max(1, min(20, args.steps // 10))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, WarmupCosine(warmup, args.steps))
    data = synthetic_dataset()
    sampler = ElasticSampler(len(data), g, seed=args.seed)  # rank / world size from the process group
    loader = DataLoader(data, batch_size=micro, sampler=sampler, num_workers=args.workers,
                        generator=torch.Generator().manual_seed(args.seed))
    state = shardsafe.TrainState(model, opt, sched, data=sampler, rng_base_seed=args.seed,
                                 extra={"layout": layout, "global_batch": g})
    torch.manual_seed(args.seed + rank)  # dropout streams differ per rank; restored on resume

    mgr = shardsafe.CheckpointManager(args.ckpt_dir, interval=args.interval, keep_last=args.keep_last)
    t0 = time.perf_counter()
    loaded = mgr.load({"train": state})
    if loaded is None:
        say(f"[{layout}] no checkpoint in {args.ckpt_dir}: starting at step 0 on {world} rank(s), "
            f"global batch {g} = {micro} per forward x {world} rank(s) x {accum} accumulation step(s)")
    else:
        saved_world = shardsafe.read_manifest(mgr.path(loaded)).world_size
        say(f"[{layout}] resumed from {mgr.path(loaded)} in {time.perf_counter() - t0:.2f}s: step {state.step}, "
            f"epoch {state.epoch}, sample {sampler.consumed} of the epoch, lr {sched.get_last_lr()[0]:.3e}; "
            f"saved on {saved_world} rank(s), now {world}; RNG {state.rng_restored}; global batch {g} = "
            f"{micro} per forward x {world} rank(s) x {accum} accumulation step(s)")
    if state.step >= args.steps:
        say(f"[{layout}] already at step {state.step} >= --steps {args.steps}: nothing to do")

    model.train()
    while state.step < args.steps:
        if sampler.global_batches_left == 0:  # epoch done: the next one, in a new global order
            sampler.set_epoch(sampler.epoch + 1)
            state.epoch = sampler.epoch
        it = iter(loader)  # starts at the sampler's (possibly restored) position
        for _ in range(min(sampler.global_batches_left, args.steps - state.step)):
            loss = _step(model, opt, it, accum)
            sched.step()
            sampler.advance()  # one global batch consumed by the loop
            state.step += 1
            state.tokens_seen += g * SEQ
            if world > 1:
                dist.all_reduce(loss)
                loss /= world
            say(f"step {state.step:5d}  loss {loss.item():.4f}  lr {sched.get_last_lr()[0]:.3e}")
            if mgr.maybe_save(state.step, {"train": state}):
                say(f"saved checkpoint {mgr.path(state.step)}")
            if args.stop_at is not None and state.step == args.stop_at:
                say(f"stopping after step {state.step} (--stop-at: simulated preemption)")
                del it
                mgr.close()
                return
        del it
    if state.step not in mgr.steps():
        mgr.save(state.step, {"train": state})
        say(f"saved checkpoint {mgr.path(state.step)}")
    mgr.close()
    say(f"done: step {state.step}, {state.tokens_seen} tokens seen, checkpoints kept: {mgr.steps()}")


def _step(model: nn.Module, opt: torch.optim.Optimizer, it, accum: int) -> torch.Tensor:
    """One optimizer step over ``accum`` micro-batches; this rank's mean loss."""
    total = torch.zeros(())
    for _ in range(accum):
        x, y, _ids = next(it)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()) / accum
        loss.backward()
        total += loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


class WarmupCosine:
    """LR factor: linear warmup, then cosine decay to 10%. A callable object rather than a
    lambda: LambdaLR's state_dict() saves an object's attributes (two ints here) and
    nothing for a plain function."""

    def __init__(self, warmup: int, total: int) -> None:
        self.warmup, self.total = warmup, total

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.warmup) / max(1, self.total - self.warmup))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))
