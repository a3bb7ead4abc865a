"""Incremental saves: ``shardsafe.save(state, path, base=OTHER)`` (chunks whose bytes equal
the base's are referred to, not written) vs full saves, single process, one local disk.

    .venv/bin/python benchmarks/bench_incremental.py [--reps N] [--dense-reps N] [--settle S] [--quick]
                                                     [--dir DIR] [--out FILE]

Parts (all in one run; checkpoints go to a temporary folder under /tmp, or --dir, removed
at the end, also on error):
  1. LoRA fine-tune of the benchmark GPT of bench_distributed.py (FULL config: 58.1M params,
     a ~240 MB checkpoint; --quick: a 11.6M-param GPT, ~47 MB). Every weight is frozen
     (requires_grad False); rank-8 LoRA adapters (A: r x in, B: out x r, alpha 16; forward
     base(x) + (x @ A.T) @ B.T * alpha / r) wrap the attention (qkv, proj) and MLP (fc, out)
     linears; AdamW on the adapters only. State = {"model": model.state_dict() (frozen
     weights + adapters), "optim": optimizer.state_dict(), "step": n}. Each repetition:
     3 real training steps (random tokens, loss.backward(), optimizer.step()), a full save
     of step k (the base; made by the Checkpointer of the version_skip variant, with
     version_skip=True, so that its memo is warm), 3 more steps, then in a rotated order:
       * full           shardsafe.save(state_k+1, new)
       * incremental    shardsafe.save(state_k+1, new, base=step-k checkpoint)
       * incr+vskip     same, version_skip=True, on the Checkpointer that saved the base
       * raw floor      the adapter + optimizer tensors' bytes written into one new file
                        with pwritev + fsync of the file and of its folder (no header,
                        no checksums, no manifest): the I/O an incremental save cannot avoid.
       * DCP            torch.distributed.checkpoint.save of the same state (FileSystemWriter,
                        no process group): the anchor, which rewrites everything.
     "bytes written" = the total size of every file in the checkpoint folder (os.walk;
     manifest.json and *.index.json included). "adapter+optim bytes" = sum of
     numel * element_size of the adapter parameters and of every tensor in the optimizer
     state. Targets: incremental bytes <= adapter+optim bytes + 1% of the full checkpoint
     (worst repetition); save time incremental / full <= 0.2 (median of per-repetition
     ratios), with and without version_skip.
  2. Dense training: plain AdamW on every parameter of the same GPT (~700 MB checkpoint:
     weights + exp_avg + exp_avg_sq), 3 steps between checkpoints, so every tensor changes.
     Each repetition saves the new state full and incremental (base = the previous
     repetition's full checkpoint), the order alternating between repetitions; target:
     median of per-repetition time ratios incremental / full <= 1.03. The wall time of a
     665 MB save swings by +-10-20% from save to save here, so this part runs --dense-reps
     repetitions (default 3 x --reps). Beside it, what the incremental save spends in the
     two functions that make it one (shardsafe.ops.incremental.open_base and refer, timed by
     wrapping them: reading the base's manifest and indexes, hashing first blocks, whole
     chunks where the first blocks agree), as a share of the full save's time: the
     overhead without the disk's noise. Also the share of bytes referred
     (SaveInfo.bytes_referred / full checkpoint bytes; expected ~0).
  3. An embedding table of 1,000,000 x 64 fp32 (256 MB; --quick 200,000 x 64) saved full
     (the base), then 5% of its rows changed (a) at random rows, (b) as one contiguous block
     at a random place, then the changed table saved full and incrementally on the base
     (order alternating between repetitions; the four cases rotated). Each tensor of a
     single-process save is one chunk, so the table saved as one tensor is rewritten whole
     either way; saved as 16 row blocks ({"emb.00": rows 0..N/16, ...}, separate tensors) the random rows still
     touch every block while the contiguous ones touch 1-2. Reported: bytes written /
     full checkpoint bytes for the four cases (beside the chunks touched), and, for
     information, the time ratio incremental / full of the changed table. An unchanged
     first checksum block (1 MiB) makes the save hash the whole chunk (XXH3-128) before
     finding that it changed, so a chunk changed past its first MiB costs one hash pass
     more than a full save of it. Also computed (block granularity is not built): the bytes
     a save that referred to unchanged 1 MiB checksum blocks would write for the table, as a
     share of it (the changed blocks, from the tables before and after the change).

Timing: time.perf_counter around the save call (after --settle idle seconds, default 3,
and a gc.collect); also the process's CPU time (all threads, time.process_time). Saves are
durable as shardsafe makes them (fsync'd); nothing is dropped from the page cache and
os.sync() is not called. Untimed full and incremental saves of each state first warm the
save-plan caches and first-call costs. Variants run in a rotated / alternating order and
ratios are paired per repetition before the median. Two order effects seen on the 2-CPU
VM this was written on (ext4 with discard on a virtual disk) are kept out:
  * no checkpoint is deleted between timed saves (all are kept until the end of the run, or
    of each part when the disk lacks room): a save made right after a big folder was
    deleted ran 2-4x faster than one made while nothing had been freed (665 MB: ~0.6 s vs
    ~2.8 s; plain write+fsync of a file shows the same), which made whichever save came
    first after a deletion look fast;
  * the settle pause: a 665 MB save started right after another one took ~1.3x as long as
    one started after a pause (9 alternating pairs without it: every pair's second save
    was the slower one); with 3 s before each save the order no longer shows.
Every incremental checkpoint of the last repetition of parts 1 and 2 and of the first
repetition of part 3 is loaded back (load_full, checksums verified) and compared bitwise
with the state it saved (untimed).
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import sys
import time
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _common import (  # noqa: E402
    REPO,
    bench_dir,
    fsync_path,
    machine_info,
    md_table,
    median,
    mib,
    pwritev_all,
    remove,
    rotated,
    write_json,
)
from _dist_common import source_banner, source_state, verdict  # noqa: E402
from bench_distributed import FULL, GPT, param_count  # noqa: E402

import shardsafe  # noqa: E402

# the quick run's GPT: a ~47 MB LoRA checkpoint (FULL, bench_distributed's config: ~240 MB)
QUICK = {"vocab": 16384, "dim": 256, "layers": 4, "heads": 4, "ctx": 128, "batch": 2, "seq": 32}
LORA_RANK = 8
LORA_ALPHA = 16.0
LORA_TARGETS = ("attn.qkv", "attn.proj", "fc", "out")  # module paths inside each block
TRAIN_STEPS = 3  # optimizer steps between two checkpoints
EMB = (1_000_000, 64)
QUICK_EMB = (200_000, 64)
EMB_BLOCKS = 16
EMB_FRACTION = 0.05
TARGETS = {
    "lora_bytes_slack": 0.01,  # incremental bytes <= adapter+optim bytes + this share of the full checkpoint
    "lora_time": 0.2,  # incremental / full save time (with and without version_skip)
    "dense_time": 1.03,  # incremental / full save time when every tensor changed
}


# ============================================================================ helpers


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-``r`` update: base(x) + (x @ A.T) @ B.T * scale."""

    def __init__(self, base: nn.Linear, r: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, base.in_features) / math.sqrt(base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))
        self.scale = alpha / r

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.A.T) @ self.B.T * self.scale


def add_lora(model: GPT, r: int, alpha: float) -> list[nn.Parameter]:
    """Freeze ``model`` and wrap the attention and MLP linears of every block with LoRA
    adapters; returns the adapter parameters (the only trainable ones)."""
    for p in model.parameters():
        p.requires_grad_(False)
    adapters: list[nn.Parameter] = []
    for block in model.blocks:
        for path in LORA_TARGETS:
            *parents, name = path.split(".")
            owner = block
            for p in parents:
                owner = getattr(owner, p)
            wrapped = LoRALinear(getattr(owner, name), r, alpha)
            setattr(owner, name, wrapped)
            adapters += [wrapped.A, wrapped.B]
    return adapters


class Trainer:
    """A GPT, its optimizer and a token stream; ``steps(n)`` runs n real training steps."""

    def __init__(self, cfg: dict, lora: bool, seed: int) -> None:
        torch.manual_seed(seed)
        self.cfg = cfg
        self.model = GPT(**cfg)
        self.adapters = add_lora(self.model, LORA_RANK, LORA_ALPHA) if lora else []
        params = self.adapters if lora else list(self.model.parameters())
        self.opt = torch.optim.AdamW(params, lr=1e-3)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.step = 0

    def steps(self, n: int) -> float:
        loss = torch.zeros(())
        for _ in range(n):
            tokens = torch.randint(0, self.cfg["vocab"], (self.cfg["batch"], self.cfg["seq"] + 1), generator=self.gen)
            logits = self.model(tokens[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
            self.step += 1
        return float(loss.detach())

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step}


def leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key (str keys) -> leaf of a nested dict/list state."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(leaves(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(leaves(v, f"{prefix}.{i}" if prefix else str(i)))
        return out
    return {prefix: tree}


def tensors_of(tree: Any) -> list[torch.Tensor]:
    return [v for v in leaves(tree).values() if isinstance(v, torch.Tensor)]


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def folder_bytes(path: Path) -> int:
    """Total size of every file under ``path`` (os.walk)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            total += os.path.getsize(os.path.join(root, f))
    return total


def check_roundtrip(path: Path, state: dict[str, Any]) -> None:
    """Load ``path`` back (checksums verified) and compare every leaf with ``state``."""
    got, want = leaves(shardsafe.load_full(path)), leaves(state)
    if set(got) != set(want):
        raise AssertionError(f"{path.name}: keys differ: {sorted(set(got) ^ set(want))[:5]}")
    for k, w in want.items():
        g = got[k]
        ok = torch.equal(g, w) if isinstance(w, torch.Tensor) else g == w
        if not ok:
            raise AssertionError(f"{path.name}: {k} differs from the saved state")


def dcp_save(state: dict[str, Any], path: Path) -> int:
    """torch.distributed.checkpoint's save of ``state`` (no process group; FileSystemWriter,
    which fsyncs its files), as the anchor: DCP has no incremental mode. Returns the bytes."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns about running without a process group
        dcp.save(state, storage_writer=FileSystemWriter(str(path)))
    return folder_bytes(path)


def raw_write(path: Path, ts: list[torch.Tensor]) -> int:
    """The raw floor: the tensors' bytes back to back into a new file, fsync of the file and
    of its folder. Returns bytes written."""
    views = [t.detach().contiguous().reshape(-1).view(torch.uint8).numpy() for t in ts]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        n = pwritev_all(fd, views)
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_path(path.parent, directory=True)
    return n


class RefTimer:
    """Wall seconds spent in ``shardsafe.ops.incremental.open_base`` and ``refer``:
    reading the base's manifest and indexes, hashing first blocks (and whole chunks where
    those agree) to find the unchanged chunks, agreeing on the referenced files: the work an
    incremental save adds to a full one. Measured by wrapping the two functions (src/ is not
    modified); ``available`` is False if this shardsafe has no such functions."""

    NAMES = ("open_base", "refer")

    def __init__(self) -> None:
        import shardsafe.ops.incremental as saving

        self.module = saving
        self.available = all(callable(getattr(saving, n, None)) for n in self.NAMES)
        self.seconds = 0.0
        self.saved: dict[str, Any] = {}

    def _wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        return wrapper

    def __enter__(self) -> RefTimer:
        if self.available:
            for n in self.NAMES:
                self.saved[n] = getattr(self.module, n)
                setattr(self.module, n, self._wrap(self.saved[n]))
        return self

    def __exit__(self, *exc: object) -> None:
        for n, fn in self.saved.items():
            setattr(self.module, n, fn)
        self.saved.clear()


REF: RefTimer | None = None  # installed by main()
SETTLE = 3.0  # seconds of idle before each timed save (--settle)


def timed_save(fn: Callable[[], Any]) -> tuple[float, float, float | None, Any]:
    """Run ``fn`` once after SETTLE idle seconds and a garbage collection: (wall seconds,
    process CPU seconds of all threads, seconds spent finding references (None if not
    measurable), result)."""
    time.sleep(SETTLE)
    gc.collect()
    r0 = REF.seconds if REF is not None and REF.available else None
    c0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    secs, cpu = time.perf_counter() - t0, time.process_time() - c0
    ref = REF.seconds - r0 if REF is not None and r0 is not None else None
    return secs, cpu, ref, out


class Trash:
    """Checkpoints a part is done with. They are deleted at the end of the run when the disk
    has room for all of them (see the module docstring: deleting a big folder makes the next
    save on this kind of VM disk much faster), else at the end of each part."""

    def __init__(self, keep: bool) -> None:
        self.keep = keep
        self.paths: list[Path] = []

    def add(self, *paths: Path) -> None:
        self.paths.extend(paths)

    def end_of_part(self) -> None:
        if not self.keep:
            for p in self.paths:
                remove(p)
            self.paths.clear()


def save_record(seconds: float, cpu: float, ref: float | None, info: Any, path: Path) -> dict[str, Any]:
    return {"seconds": seconds, "cpu_s": cpu, "ref_s": ref, "folder_bytes": folder_bytes(path),
            "bytes_written": info.bytes_written,
            "bytes_referred": info.bytes_referred, "chunks_referred": info.chunks_referred,
            "tensors": info.tensors, "info_seconds": info.seconds, "plan_cached": info.plan_cached}


def ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms"


def log(msg: str) -> None:
    print(msg, flush=True)


# ============================================================================ 1. LoRA


LORA_VARIANTS = ["full", "incremental", "incr+vskip", "raw floor", "DCP"]
PLAIN = ("raw floor", "DCP")  # variants without a SaveInfo


def part_lora(work: Path, cfg: dict, reps: int, trash: Trash) -> dict[str, Any]:
    tr = Trainer(cfg, lora=True, seed=0)
    ck_vs = shardsafe.Checkpointer()  # the version_skip variant's Checkpointer (its memo)
    adapter_bytes = nbytes(list(tr.adapters))
    tr.steps(TRAIN_STEPS)
    warm = work / "lora-warmup"
    shardsafe.save(tr.state(), warm)  # warms the Checkpointers' plan caches and first-call costs
    shardsafe.save(tr.state(), work / "lora-warmup-incr", base=warm)
    ck_vs.save(tr.state(), work / "lora-warmup-vskip", base=warm, version_skip=True)
    trash.add(warm, work / "lora-warmup-incr", work / "lora-warmup-vskip")
    rounds: list[dict[str, Any]] = []
    for r in range(reps):
        t_train = time.perf_counter()
        loss = tr.steps(TRAIN_STEPS)
        t_train = time.perf_counter() - t_train
        base = work / f"lora-{tr.step:05d}-base"
        base_info = ck_vs.save(tr.state(), base, version_skip=True)  # full; warms ck_vs's memo
        tr.steps(TRAIN_STEPS)
        state = tr.state()
        small = list(tr.adapters) + tensors_of(state["optim"])
        ab = nbytes(small)
        paths = {v: work / f"lora-{tr.step:05d}-{v.replace(' ', '-').replace('+', '-')}" for v in LORA_VARIANTS}
        saves: dict[str, Callable[[], Any]] = {
            "full": partial(shardsafe.save, state, paths["full"]),
            "incremental": partial(shardsafe.save, state, paths["incremental"], base=base),
            "incr+vskip": partial(ck_vs.save, state, paths["incr+vskip"], base=base, version_skip=True),
            "raw floor": partial(raw_write, paths["raw floor"], small),
            "DCP": partial(dcp_save, state, paths["DCP"]),
        }
        rec: dict[str, Any] = {"step": tr.step, "loss": loss, "train_s_per_step": t_train / TRAIN_STEPS,
                               "adapter_optim_bytes": ab, "base_folder_bytes": folder_bytes(base),
                               "base_plan_cached": base_info.plan_cached, "order": rotated(LORA_VARIANTS, r)}
        for v in rec["order"]:
            secs, cpu, ref, info = timed_save(saves[v])
            if v in PLAIN:
                rec[v] = {"seconds": secs, "cpu_s": cpu, "folder_bytes": info}
            else:
                rec[v] = save_record(secs, cpu, ref, info, paths[v])
        if r == reps - 1:
            check_roundtrip(paths["incremental"], state)
            check_roundtrip(paths["incr+vskip"], state)
            rec["roundtrip_checked"] = True
        trash.add(base, *paths.values())
        rounds.append(rec)
        log(f"  [lora rep {r + 1}/{reps}] step {tr.step}: " + ", ".join(
            f"{v} {ms(rec[v]['seconds'])} / {mib(rec[v]['folder_bytes'])}" for v in LORA_VARIANTS))
    full_b = rounds[0]["full"]["folder_bytes"]
    return {"config": cfg, "params": param_count(cfg), "adapter_params": adapter_bytes // 4,
            "adapter_bytes": adapter_bytes, "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA,
            "full_folder_bytes": full_b, "tensors": rounds[0]["full"]["tensors"], "reps": rounds}


def lora_summary(res: dict[str, Any]) -> dict[str, Any]:
    reps = res["reps"]
    out: dict[str, Any] = {}
    for v in ("incremental", "incr+vskip"):
        ratios = [r[v]["seconds"] / r["full"]["seconds"] for r in reps]
        limits = [r["adapter_optim_bytes"] + TARGETS["lora_bytes_slack"] * r["full"]["folder_bytes"] for r in reps]
        worst = max(r[v]["folder_bytes"] / lim for r, lim in zip(reps, limits))
        out[v] = {"time_ratio": median(ratios), "time_ratios": ratios,
                  "bytes": max(r[v]["folder_bytes"] for r in reps),
                  "bytes_ok": all(r[v]["folder_bytes"] <= lim for r, lim in zip(reps, limits)),
                  "bytes_over_limit": worst, "limit": max(limits),
                  "vs_raw": median([r[v]["seconds"] / r["raw floor"]["seconds"] for r in reps])}
    out["full_s"] = median([r["full"]["seconds"] for r in reps])
    out["raw_s"] = median([r["raw floor"]["seconds"] for r in reps])
    out["dcp_s"] = median([r["DCP"]["seconds"] for r in reps])
    out["dcp_over_incremental"] = median([r["DCP"]["seconds"] / r["incremental"]["seconds"] for r in reps])
    out["adapter_optim_bytes"] = max(r["adapter_optim_bytes"] for r in reps)
    out["full_bytes"] = median([r["full"]["folder_bytes"] for r in reps])
    return out


def lora_table(res: dict[str, Any]) -> str:
    reps = res["reps"]
    rows = []
    for v in LORA_VARIANTS:
        secs = [r[v]["seconds"] for r in reps]
        row = [v, ms(median(secs)), ", ".join(f"{s * 1e3:.0f}" for s in secs),
               mib(median([r[v]["folder_bytes"] for r in reps]))]
        if v in PLAIN:
            row += ["-", "-"]
        else:
            row += [mib(median([r[v]["bytes_referred"] for r in reps])),
                    f"{median([r[v]['chunks_referred'] for r in reps]):.0f} / {reps[0][v]['tensors']}"]
        row.append(f"{median([r[v]['seconds'] / r['full']['seconds'] for r in reps]):.3f}")
        row.append(ms(median([r[v]["cpu_s"] for r in reps])))
        refs = [r[v].get("ref_s") for r in reps]
        row.append(ms(median(refs)) if v.startswith("incr") and None not in refs else "-")
        rows.append(row)
    return md_table(["save", "time (median)", "per rep (ms)", "bytes written", "bytes referred",
                     "chunks referred / tensors", "time / full (median of per-rep ratios)", "CPU time",
                     "of which finding refs (wall)"], rows)


# ============================================================================ 2. dense


def part_dense(work: Path, cfg: dict, reps: int, trash: Trash) -> dict[str, Any]:
    tr = Trainer(cfg, lora=False, seed=10)
    tr.steps(TRAIN_STEPS)
    prev = work / f"dense-{tr.step:05d}-full"
    shardsafe.save(tr.state(), prev)  # the first base; warms the plan cache
    shardsafe.save(tr.state(), work / "dense-warmup-incr", base=prev)  # first-call costs of incremental saves
    trash.add(work / "dense-warmup-incr")
    rounds: list[dict[str, Any]] = []
    for r in range(reps):
        tr.steps(TRAIN_STEPS)
        state = tr.state()
        paths = {v: work / f"dense-{tr.step:05d}-{v}" for v in ("full", "incremental")}
        order = ["full", "incremental"] if r % 2 == 0 else ["incremental", "full"]
        rec: dict[str, Any] = {"step": tr.step, "order": order}
        for v in order:
            fn = partial(shardsafe.save, state, paths[v], base=prev if v == "incremental" else None)
            secs, cpu, ref, info = timed_save(fn)
            rec[v] = save_record(secs, cpu, ref, info, paths[v])
        if r == reps - 1:
            check_roundtrip(paths["incremental"], state)
            rec["roundtrip_checked"] = True
        trash.add(prev, paths["incremental"])
        prev = paths["full"]
        rounds.append(rec)
        log(f"  [dense rep {r + 1}/{reps}] step {tr.step}: full {ms(rec['full']['seconds'])}, incremental "
            f"{ms(rec['incremental']['seconds'])} ({rec['incremental']['chunks_referred']} chunks, "
            f"{mib(rec['incremental']['bytes_referred'])} referred)")
    trash.add(prev)
    return {"config": cfg, "params": param_count(cfg), "full_folder_bytes": rounds[0]["full"]["folder_bytes"],
            "tensors": rounds[0]["full"]["tensors"], "reps": rounds}


def dense_summary(res: dict[str, Any]) -> dict[str, Any]:
    reps = res["reps"]
    ratios = [r["incremental"]["seconds"] / r["full"]["seconds"] for r in reps]
    referred = [r["incremental"]["bytes_referred"] / r["full"]["folder_bytes"] for r in reps]
    return {"time_ratio": median(ratios), "time_ratios": ratios, "referred_share": median(referred),
            "chunks_referred": max(r["incremental"]["chunks_referred"] for r in reps),
            "full_s": median([r["full"]["seconds"] for r in reps]),
            "incremental_s": median([r["incremental"]["seconds"] for r in reps]),
            "cpu_ratio": median([r["incremental"]["cpu_s"] / r["full"]["cpu_s"] for r in reps]),
            "ref_s": median([r["incremental"]["ref_s"] for r in reps if r["incremental"]["ref_s"] is not None]),
            "ref_share": median([r["incremental"]["ref_s"] / r["full"]["seconds"] for r in reps
                                 if r["incremental"]["ref_s"] is not None]),
            "extra_cpu_s": median([r["incremental"]["cpu_s"] - r["full"]["cpu_s"] for r in reps])}


def dense_table(res: dict[str, Any]) -> str:
    reps = res["reps"]
    rows = []
    for v in ("full", "incremental"):
        secs = [r[v]["seconds"] for r in reps]
        rows.append([v, ms(median(secs)), ", ".join(f"{s * 1e3:.0f}" for s in secs),
                     mib(median([r[v]["folder_bytes"] for r in reps])),
                     mib(median([r[v]["bytes_referred"] for r in reps])),
                     f"{max(r[v]['chunks_referred'] for r in reps)} / {reps[0][v]['tensors']}",
                     f"{median([r[v]['seconds'] / r['full']['seconds'] for r in reps]):.3f}",
                     ms(median([r[v]["cpu_s"] for r in reps])),
                     f"{median([r[v]['cpu_s'] / r['full']['cpu_s'] for r in reps]):.3f}",
                     ms(median([r[v]["ref_s"] for r in reps])) if v == "incremental" and
                     None not in [r[v]["ref_s"] for r in reps] else "-"])
    return md_table(["save", "time (median)", "per rep (ms)", "bytes written", "bytes referred",
                     "chunks referred / tensors", "time / full (median of per-rep ratios)", "CPU time",
                     "CPU time / full", "finding refs"], rows)


# ============================================================================ 3. embedding


EMB_CASES = [("one tensor", "random"), ("one tensor", "contiguous"),
             (f"{EMB_BLOCKS} row blocks", "random"), (f"{EMB_BLOCKS} row blocks", "contiguous")]


def part_embedding(work: Path, shape: tuple[int, int], reps: int, trash: Trash) -> dict[str, Any]:
    n, d = shape
    k = int(n * EMB_FRACTION)
    per = -(-n // EMB_BLOCKS)
    g = torch.Generator().manual_seed(20)
    table = torch.randn(n, d, generator=g)

    def make(layout: str) -> tuple[dict[str, torch.Tensor], list[tuple[int, int]]]:
        if layout == "one tensor":
            return {"emb": table.clone()}, [(0, n)]
        spans = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
        return {f"emb.{j:02d}": table[lo:hi].clone() for j, (lo, hi) in enumerate(spans)}, spans

    shardsafe.save(make("one tensor")[0], work / "emb-warm-1")  # plan caches of both layouts
    shardsafe.save(make(EMB_CASES[2][0])[0], work / "emb-warm-16")
    trash.add(work / "emb-warm-1", work / "emb-warm-16")
    rounds: list[dict[str, Any]] = []
    for r in range(reps):
        rec: dict[str, Any] = {}
        for i, (layout, pattern) in enumerate(rotated(EMB_CASES, r)):
            state, spans = make(layout)
            base = work / f"emb-{r}-{i}-base"
            full = work / f"emb-{r}-{i}-full"
            inc = work / f"emb-{r}-{i}-incremental"
            base_info = shardsafe.save(state, base)
            if pattern == "random":
                rows = torch.randperm(n, generator=g)[:k]
            else:
                start = int(torch.randint(0, n - k + 1, (1,), generator=g))
                rows = torch.arange(start, start + k)
            before = [t.clone() for t in state.values()]
            touched = 0
            for (lo, hi), t in zip(spans, state.values()):
                sel = rows[(rows >= lo) & (rows < hi)] - lo
                if sel.numel():
                    t[sel] += 1.0  # in place: the tensor's _version moves
                    touched += 1
            saves = {"full": partial(shardsafe.save, state, full), "incremental": partial(shardsafe.save, state, inc,
                                                                                          base=base)}
            got = {}
            for v in (["full", "incremental"] if r % 2 == 0 else ["incremental", "full"]):
                secs, cpu, ref, info = timed_save(saves[v])
                got[v] = save_record(secs, cpu, ref, info, full if v == "full" else inc)
            if r == 0:
                check_roundtrip(inc, state)
            rec[f"{layout} / {pattern}"] = {
                **got, "block_bytes": changed_block_bytes(before, list(state.values())),
                "base_folder_bytes": folder_bytes(base), "base_plan_cached": base_info.plan_cached,
                "chunks": len(spans), "chunks_touched": touched, "rows_changed": k,
                "first_row": int(rows.min()) if pattern == "contiguous" else None}
            trash.add(base, full, inc)
        rounds.append(rec)
        log(f"  [embedding rep {r + 1}/{reps}] " + ", ".join(
            f"{c}: {v['incremental']['folder_bytes'] / v['full']['folder_bytes']:.3f}" for c, v in rec.items()))
    return {"shape": [n, d], "table_bytes": n * d * 4, "blocks": EMB_BLOCKS, "fraction": EMB_FRACTION,
            "reps": rounds}


def changed_block_bytes(old: list[torch.Tensor], new: list[torch.Tensor], block: int = 1 << 20) -> int:
    """Bytes a save at checksum-block granularity (not built) would write for the data: the
    1 MiB blocks of each chunk whose bytes changed (the last block of a chunk may be shorter)."""
    total = 0
    for a, b in zip(old, new):
        x = a.contiguous().view(-1).view(torch.uint8)
        y = b.contiguous().view(-1).view(torch.uint8)
        for lo in range(0, x.numel(), block):
            if not torch.equal(x[lo: lo + block], y[lo: lo + block]):
                total += min(block, x.numel() - lo)
    return total


def emb_summary(res: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for layout, pattern in EMB_CASES:
        c = f"{layout} / {pattern}"
        recs = [r[c] for r in res["reps"]]
        out[c] = {"bytes_ratio": median([x["incremental"]["folder_bytes"] / x["full"]["folder_bytes"] for x in recs]),
                  "bytes_ratios": [x["incremental"]["folder_bytes"] / x["full"]["folder_bytes"] for x in recs],
                  "chunks_touched": [x["chunks_touched"] for x in recs], "chunks": recs[0]["chunks"],
                  "incremental_bytes": median([x["incremental"]["folder_bytes"] for x in recs]),
                  "block_ratio": median([x["block_bytes"] / res["table_bytes"] for x in recs]),
                  "full_bytes": median([x["full"]["folder_bytes"] for x in recs]),
                  "time_ratio": median([x["incremental"]["seconds"] / x["full"]["seconds"] for x in recs]),
                  "full_s": median([x["full"]["seconds"] for x in recs]),
                  "incremental_s": median([x["incremental"]["seconds"] for x in recs])}
    return out


def emb_table(summary: dict[str, Any]) -> str:
    rows = []
    for c, s in summary.items():
        touched = sorted(set(s["chunks_touched"]))
        rows.append([c, mib(s["full_bytes"]), mib(s["incremental_bytes"]), f"{s['bytes_ratio']:.4f}",
                     f"{'/'.join(map(str, touched))} of {s['chunks']}", f"{s['block_ratio']:.4f}", ms(s["full_s"]),
                     ms(s["incremental_s"]), f"{s['time_ratio']:.3f}"])
    return md_table(["table saved as / 5% rows changed", "full bytes", "incremental bytes", "bytes ratio",
                     "chunks touched", "1 MiB blocks changed / table (block granularity, not built)", "full time",
                     "incr. time", "time ratio"], rows)


# ============================================================================ summary


def summary_table(res: dict[str, Any]) -> str:
    lo, de, em = res["lora"]["summary"], res["dense"]["summary"], res["embedding"]["summary"]
    slack = TARGETS["lora_bytes_slack"]
    rows = []
    for v, name in (("incremental", "incremental"), ("incr+vskip", "incremental, version_skip")):
        s = lo[v]
        rows.append([f"LoRA: bytes written, {name} (worst rep)", mib(s["bytes"]),
                     f"<= {mib(s['limit'])} (adapter+optim {mib(lo['adapter_optim_bytes'])} + "
                     f"{slack:.0%} of full {mib(lo['full_bytes'])})", verdict(s["bytes_ok"])])
    for v, name in (("incremental", "incremental"), ("incr+vskip", "incremental, version_skip")):
        s = lo[v]
        rows.append([f"LoRA: save time {name} / full", f"{s['time_ratio']:.3f} "
                     f"({', '.join(f'{x:.3f}' for x in s['time_ratios'])})", f"<= {TARGETS['lora_time']}",
                     verdict(s["time_ratio"] <= TARGETS["lora_time"])])
    rows.append(["LoRA: full save time", ms(lo["full_s"]), "", "info"])
    rows.append(["LoRA: raw floor (adapter+optim bytes, pwritev+fsync)", ms(lo["raw_s"]), "", "info"])
    rows.append(["LoRA: DCP save of the same state (rewrites everything)", ms(lo["dcp_s"]), "", "info"])
    rows.append(["LoRA: DCP save time / incremental save time", f"{lo['dcp_over_incremental']:.1f}", "", "info"])
    for v, name in (("incremental", "incremental"), ("incr+vskip", "incremental, version_skip")):
        rows.append([f"LoRA: save time {name} / raw floor", f"{lo[v]['vs_raw']:.2f}", "", "info"])
    rows.append(["dense: save time incremental / full", f"{de['time_ratio']:.3f} "
                 f"({', '.join(f'{x:.3f}' for x in de['time_ratios'])})", f"<= {TARGETS['dense_time']}",
                 verdict(de["time_ratio"] <= TARGETS["dense_time"])])
    rows.append(["dense: time finding references (open_base + _refer) / full save time",
                 f"{de['ref_share']:.4f} ({ms(de['ref_s'])})", "", "info"])
    rows.append(["dense: CPU time (all threads) incremental / full", f"{de['cpu_ratio']:.3f} "
                 f"({de['extra_cpu_s'] * 1e3:+.0f} ms)", "", "info"])
    rows.append(["dense: bytes referred / full checkpoint", f"{de['referred_share']:.2e} "
                 f"({de['chunks_referred']} chunks)", "~0", "info"])
    for c, s in em.items():
        touched = "/".join(map(str, sorted(set(s["chunks_touched"]))))
        rows.append([f"embedding {c}: bytes written / full", f"{s['bytes_ratio']:.4f}",
                     f"({touched} of {s['chunks']} chunks touched)", "info"])
    return md_table(["measure", "value (median; per rep)", "target", "result"], rows, "lllc")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=None, help="repetitions (default 3; 1 with --quick)")
    ap.add_argument("--dense-reps", type=int, default=None,
                    help="repetitions of part 2 (default 3 x --reps: its ratio is close to 1 and the noise large)")
    ap.add_argument("--settle", type=float, default=None, metavar="S",
                    help="idle seconds before each timed save (default 3; 0.5 with --quick)")
    ap.add_argument("--quick", action="store_true", help="small model and table, for a smoke run")
    ap.add_argument("--dir", default=None, help="parent of the temporary work directory (default /tmp)")
    ap.add_argument("--out", default=str(REPO / "bench-out" / "bench_incremental.json"), help="JSON output")
    args = ap.parse_args()
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    dense_reps = args.dense_reps if args.dense_reps is not None else 3 * reps
    global SETTLE
    SETTLE = args.settle if args.settle is not None else (0.5 if args.quick else 3.0)
    if reps < 1 or dense_reps < 1:
        ap.error("--reps and --dense-reps must be >= 1")
    cfg = QUICK if args.quick else FULL
    emb = QUICK_EMB if args.quick else EMB
    warnings.filterwarnings("ignore")
    t0 = time.perf_counter()
    src = source_state()
    log(source_banner(src, f"torch threads {torch.get_num_threads()}"))
    res: dict[str, Any] = {"torch": torch.__version__, "shardsafe": shardsafe.__version__, "quick": args.quick,
                           "reps": reps, "dense_reps": dense_reps, "settle_s": SETTLE, "source": src,
                           "targets": TARGETS}
    global REF
    REF = RefTimer()
    with REF, bench_dir(args.dir, "shardsafe-bench-incr-") as work:
        res["machine"] = machine_info(work)
        m = res["machine"]
        log(f"machine: {m['cpu']}, {m['affinity']}/{m['cpus']} CPUs, {m['mem_gib']} GiB RAM, {m['fstype']} on "
            f"{m['device']} ({m['dir']})")
        params = param_count(cfg)
        need = int(1.05 * ((1 + 2 * reps) * params * 4 + (1 + 2 * dense_reps) * params * 12
                           + (2 + 12 * reps) * emb[0] * emb[1] * 4)) + (1 << 30)
        free = shutil.disk_usage(work).free
        trash = Trash(keep=free > need)
        res["disk"] = {"free": free, "needed_to_keep_all": need, "kept_until_end": trash.keep}
        log(f"disk: {mib(free)} free, {mib(need)} needed to keep every checkpoint until the end: "
            + ("kept (no deletion between timed saves)" if trash.keep else
               "NOT enough: deleted at the end of each part (timings of a part's first saves may be faster)"))
        log(f"[1] LoRA fine-tune: GPT {param_count(cfg) / 1e6:.1f}M params {cfg}, rank {LORA_RANK} on "
            f"{', '.join(LORA_TARGETS)}")
        res["lora"] = part_lora(work, cfg, reps, trash)
        res["lora"]["summary"] = lora_summary(res["lora"])
        trash.end_of_part()
        log("[2] dense training: same GPT, AdamW on every parameter")
        res["dense"] = part_dense(work, cfg, dense_reps, trash)
        res["dense"]["summary"] = dense_summary(res["dense"])
        trash.end_of_part()
        log(f"[3] embedding table {emb[0]:,} x {emb[1]} fp32 ({mib(emb[0] * emb[1] * 4)})")
        res["embedding"] = part_embedding(work, emb, reps, trash)
        res["embedding"]["summary"] = emb_summary(res["embedding"])
    lo, de = res["lora"], res["dense"]
    lines = [
        "",
        f"## 1. LoRA fine-tune: GPT {lo['params'] / 1e6:.1f}M params (frozen) + {lo['adapter_params'] / 1e6:.2f}M "
        f"adapter params (rank {LORA_RANK}), AdamW on the adapters; {lo['tensors']} tensors, full checkpoint "
        f"{mib(lo['full_folder_bytes'])}; adapter+optim bytes {mib(lo['summary']['adapter_optim_bytes'])}; "
        f"{reps} reps, {TRAIN_STEPS} steps between checkpoints",
        lora_table(lo),
        "",
        f"## 2. dense training: same GPT, AdamW on all {de['params'] / 1e6:.1f}M params; {de['tensors']} tensors, "
        f"full checkpoint {mib(de['full_folder_bytes'])}; {dense_reps} reps, order alternating",
        dense_table(de),
        "",
        f"## 3. embedding table {emb[0]:,} x {emb[1]} fp32, {EMB_FRACTION:.0%} of rows changed; {reps} reps",
        emb_table(res["embedding"]["summary"]),
        "",
        "## summary",
        summary_table(res),
        "",
        "bytes written = total size of the checkpoint folder (data file, manifest.json, *.index.json); "
        "times = perf_counter around the save call; ratios paired per repetition, median over repetitions.",
    ]
    text = "\n".join(lines)
    res["wall_s"] = time.perf_counter() - t0
    print(text)
    print(f"\nwall time {res['wall_s']:.0f}s; JSON: {write_json(args.out, res)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
