"""The checks of benchmarks/gpu_check.py (see its docstring) and what they share: the
run's context, byte helpers, the states saved, the training loop's model. The DTensor /
FSDP2 check, which runs in child processes, is in gpu_check.py itself."""

from __future__ import annotations

import gc
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _common import median, rotated
from torch import nn

# The one bitwise comparison of the project (tests/bitwise.py).
sys.path.append(str(Path(__file__).resolve().parent.parent / "tests"))
from bitwise import assert_bitwise, bitwise_equal  # noqa: E402

MiB = 1 << 20
SKIP_MESSAGE = "no CUDA device: gpu_check skipped"


class Skip(Exception):
    """A check that does not apply on this machine (reported SKIP, not FAIL)."""


@dataclass
class Ctx:
    """What every check needs: the device, the sizes, the scratch folder."""

    device: torch.device
    cuda: bool
    quick: bool
    reps: int
    work: Path
    dist_world: int = 1
    inject: str = ""  # a check told to fail (tests of the FAIL path)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def fresh(self, name: str) -> Path:
        """An empty path ``name`` under the work folder (a previous one removed)."""
        p = self.work / name
        shutil.rmtree(p, ignore_errors=True)
        return p


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def flat_items(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts / lists by dotted key."""
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flat_items(v, f"{prefix}{k}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, v in enumerate(tree):
            out.update(flat_items(v, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: tree}


def cpu_copy(tree: dict[str, Any]) -> dict[str, Any]:
    """A CPU snapshot of every tensor leaf (DTensors whole), by dotted key."""
    out = {}
    for k, v in flat_items(tree).items():
        if isinstance(v, torch.Tensor):
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = v.detach().cpu().clone()
        else:
            out[k] = v
    return out


def assert_same(got: Any, want: Any, what: str) -> int:
    """Raise AssertionError naming where ``got`` first differs from ``want`` (tests/bitwise.py:
    dtypes, shapes and bytes of tensors, types and values of the rest); returns the bytes of
    tensors compared."""
    assert_bitwise(got, want, what)
    return sum(nbytes(v) for v in flat_items(want).values() if isinstance(v, torch.Tensor))


def flat_u8(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy: the floors copy from it)."""
    if not t.is_contiguous():
        raise ValueError("flat_u8 takes contiguous tensors")
    return t.detach().reshape(-1).view(torch.uint8)


def scramble(tensors: list[torch.Tensor]) -> None:
    """Change every byte of the storages of ``tensors`` (views included), on their device
    and current stream: what a training step does after an async save returns."""
    seen: set[int] = set()
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() == 0 or s.data_ptr() in seen:
            continue
        seen.add(s.data_ptr())
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        raw.set_(s)
        raw.add_(1)


def pinned_empty(n: int, cuda: bool) -> torch.Tensor:
    """``n`` bytes of host memory, page-locked when CUDA is used, touched once."""
    buf = torch.empty(n, dtype=torch.uint8, pin_memory=cuda)
    buf.fill_(0)
    return buf


def copy_out(tensors: list[torch.Tensor], buf: torch.Tensor, ctx: Ctx) -> None:
    """Every tensor's bytes back to back into host buffer ``buf`` (non-blocking, then one
    synchronize): the floor of any device-to-host staging."""
    pos = 0
    for t in tensors:
        n = nbytes(t)
        buf[pos: pos + n].copy_(flat_u8(t), non_blocking=ctx.cuda)
        pos += n
    ctx.sync()


def gbs(n: int, s: float) -> float:
    return n / s / 1e9 if s > 0 else float("nan")


def fmt_s(s: float) -> str:
    if s != s:
        return "n/a"
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


def host_stats() -> dict[str, int]:
    """The pinned host allocator's statistics (torch.cuda.host_memory_stats, where this
    torch has it and CUDA is up); {} otherwise."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return {}
    try:
        s = fn()
    except Exception:  # noqa: BLE001 - statistics are optional
        return {}
    keys = ("allocated_bytes.current", "allocated_bytes.peak", "active_bytes.current", "active_bytes.peak",
            "num_host_alloc", "num_host_free")
    return {k: int(s[k]) for k in keys if k in s}


def reset_host_peak() -> None:
    fn = getattr(torch.cuda, "reset_peak_host_memory_stats", None)
    if fn is not None and torch.cuda.is_available():
        try:
            fn()
        except Exception:  # noqa: BLE001
            pass


def kept_buffers(cp: Any) -> list[torch.Tensor]:
    """The staging buffers a Checkpointer keeps for its next save (HostMemory's pool)."""
    return list(getattr(cp.memory, "_kept", []))


# =============================================================================== states


def varied_state(device: torch.device, scale: int, zero: bool = False) -> dict[str, torch.Tensor]:
    """Tensors of every kind a save meets (see the module docstring), deterministic; with
    ``zero``, zeros of the same dtypes, shapes and layouts, each view over its own base."""
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if zero:
            return torch.zeros(shape, dtype=dtype, device=device)
        return torch.randn(shape, generator=g, device=device, dtype=dtype)

    wide = 5 * MiB // 4 + 3  # rows of 5 MiB: wider than the 4 MiB slots of an 8 MiB budget
    return {
        "f32": rnd(scale + 7),
        "bf16": rnd(513, 1031).to(torch.bfloat16),
        "f16_3d": rnd(7, 129, 65).to(torch.float16),
        "f64": rnd(1001, dtype=torch.float64),
        "i64": (rnd(4099) * 2**40).to(torch.int64),
        "bool": rnd(1000) > 0,
        "f8": rnd(64, 1031).to(torch.float8_e4m3fn),
        "c64": rnd(300, dtype=torch.complex64),
        "conj": rnd(300, dtype=torch.complex64).conj(),  # a lazy conjugate view
        "transposed": rnd(1031, 513).t(),
        "strided": rnd(3 * (scale // 4) + 3)[::3],
        "wide_t": rnd(wide, 3).t(),  # 3 non-contiguous rows of 5 MiB
        "scalar": rnd(),
        "empty": rnd(0, 5),
    }


def big_state(device: torch.device, total: int, piece: int = 64 * MiB) -> dict[str, torch.Tensor]:
    """``total // piece`` fp32 tensors of ``piece`` bytes plus one of 4097 elements (so the
    total, like a real model's, is not a multiple of the 64 MiB staging slot)."""
    g = torch.Generator(device=device).manual_seed(1)
    out = {f"w{i:02d}": torch.randn(piece // 4, generator=g, device=device) for i in range(max(1, total // piece))}
    out["tail"] = torch.randn(4097, generator=g, device=device)
    return out


class MLP(nn.Module):
    """``layers`` x (Linear dim->dim, GELU), then a Linear head: the training loop's model."""

    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(layers))
        self.head = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


# =============================================================================== checks


def check_save_load(ctx: Ctx) -> tuple[str, dict]:
    """Sync, async pinned, async through a small budget and (CUDA) async on a side stream:
    each loaded into zeroed tensors of the same layouts and by load_full, bitwise."""
    import shardsafe

    scale = (1 if ctx.quick else 8) * MiB // 4 * 3  # fp32 elements: 3 MiB / 24 MiB
    figures: dict[str, Any] = {}
    variants: list[tuple[str, dict, bool]] = [("sync", {}, False), ("async", {}, True),
                                              ("async_budget_8MiB", {"memory_budget": 8 * MiB}, True)]
    for name, opts, is_async in variants:
        with shardsafe.Checkpointer(**opts) as cp:
            figures[name] = _save_load_once(ctx, cp, name, scale, is_async, stream=None)
            if ctx.cuda and is_async:
                kept = kept_buffers(cp)
                if not kept or not all(t.is_pinned() for t in kept):
                    raise AssertionError(f"{name}: the kept staging slots are not pinned "
                                         f"({sum(t.is_pinned() for t in kept)} of {len(kept)})")
                figures[name]["pinned_slots"] = len(kept)
    if ctx.cuda:
        side = torch.cuda.Stream()
        with torch.cuda.stream(side), shardsafe.Checkpointer() as cp:
            figures["async_side_stream"] = _save_load_once(ctx, cp, "async_side_stream", scale, True, stream=side)
    n = figures["sync"]["bytes"]
    summary = (f"{len(figures)} variants x 14 tensors ({n / MiB:.1f} MiB) bitwise; sync save "
               f"{fmt_s(figures['sync']['save_s'])}, async stall {fmt_s(figures['async']['save_s'])}, "
               f"load {fmt_s(figures['sync']['load_s'])}")
    return summary, figures


def _save_load_once(ctx: Ctx, cp: Any, name: str, scale: int, is_async: bool, stream: Any) -> dict:
    import shardsafe

    state = varied_state(ctx.device, scale)
    want = cpu_copy(state)
    path = ctx.fresh(f"save_load_{name}")
    ctx.sync()
    t0 = time.perf_counter()
    if is_async:
        fut = cp.async_save(state, path)
        save_s = time.perf_counter() - t0
        scramble(list(state.values()))  # the next training step, on the same stream
        fut.result()
    else:
        cp.save(state, path)
        save_s = time.perf_counter() - t0
    dest = varied_state(ctx.device, scale, zero=True)
    ctx.sync()
    t0 = time.perf_counter()
    cp.load(dest, path)
    ctx.sync()
    load_s = time.perf_counter() - t0
    if stream is not None and torch.cuda.current_stream() != stream:
        raise AssertionError("the side stream is not current")
    n = assert_same(cpu_copy(dest), want, f"{name}: load into {ctx.device.type} tensors")
    wrong = [k for k, v in dest.items() if v.device != ctx.device]
    if wrong:
        raise AssertionError(f"{name}: loaded tensors moved off {ctx.device}: {wrong}")
    assert_same(cpu_copy(shardsafe.load_full(path)), want, f"{name}: load_full")
    shutil.rmtree(path, ignore_errors=True)
    return {"bytes": n, "save_s": save_s, "load_s": load_s}


def check_rng(ctx: Ctx) -> tuple[str, dict]:
    """TrainState restores every RNG stream exactly: the same draws after a load."""
    import shardsafe

    torch.manual_seed(1234)  # seeds every CUDA device too
    random.seed(5)
    np.random.seed(6)
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).to(ctx.device)
    ts = shardsafe.TrainState(model)
    torch.rand(1001, device=ctx.device)  # move the generators off their seeds (a Philox offset on CUDA)
    torch.rand(7)
    path = ctx.fresh("rng")
    saved_states = torch.cuda.get_rng_state_all() if ctx.cuda else []
    with shardsafe.Checkpointer() as cp:
        cp.save({"train": ts}, path)
        first = _draws(ctx, model)
        torch.manual_seed(999)
        random.seed(999)
        np.random.seed(999)
        perturbed = _draws(ctx, model)
        cp.load({"train": ts}, path)
    if ts.rng_restored != "exact":
        raise AssertionError(f"TrainState.rng_restored is {ts.rng_restored!r}, not 'exact'")
    again = _draws(ctx, model)
    assert_same(again, first, "draws after the load")
    unchanged = [k for k in first if bitwise_equal(perturbed[k], first[k])]
    if unchanged:
        raise AssertionError(f"reseeding did not change the draws {unchanged}: the check proves nothing for them")
    rng = shardsafe.load_full(path, "train.rng")["train"]["rng"]
    acc = rng.get("accelerator")
    if ctx.cuda:
        if acc is None or acc.get("type") != "cuda":
            raise AssertionError(f"the saved RNG streams hold no CUDA generator: {sorted(rng)}")
        assert_same({str(i): s for i, s in enumerate(acc["states"])},
                    {str(i): s for i, s in enumerate(saved_states)}, "saved CUDA generator states")
    elif acc is not None:
        raise AssertionError(f"an accelerator stream was saved on the CPU: {acc.get('type')}")
    shutil.rmtree(path, ignore_errors=True)
    streams = sorted(k for k in rng if k != "generators") + ([f"cuda x{len(acc['states'])}"] if acc else [])
    figures = {"streams": streams, "draws_compared": sorted(first), "cuda_generators": len(saved_states)}
    return f"streams {', '.join(streams)}: {len(first)} kinds of draws bitwise equal after the load", figures


def _draws(ctx: Ctx, model: nn.Module) -> dict[str, Any]:
    dev = ctx.device
    model.train()
    with torch.no_grad():
        mask = model(torch.ones(32, 64, device=dev)) != 0
    return {
        "device_rand": torch.rand(4096, device=dev),
        "device_randn": torch.randn(333, device=dev, dtype=torch.float64),
        "device_randint": torch.randint(0, 1 << 30, (257,), device=dev),
        "device_dropout_mask": mask,
        "cpu_rand": torch.rand(100),
        "python": random.random(),
        "numpy": float(np.random.rand()),
    }


def check_throughput(ctx: Ctx) -> tuple[str, dict]:
    """Device-to-host staging and load throughput against plain copy_ floors, same run."""
    import shardsafe

    total = (64 if ctx.quick else 1024) * MiB if ctx.cuda else (32 if ctx.quick else 256) * MiB
    piece = 64 * MiB if total >= 256 * MiB else 4 * MiB
    state = big_state(ctx.device, total, piece)
    tensors = list(state.values())
    n = sum(nbytes(t) for t in tensors)
    pinned = pinned_empty(n, ctx.cuda)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(0)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    flat_dest = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    kept = ctx.fresh("throughput_kept")
    cp = shardsafe.Checkpointer()
    try:
        cp.save(state, kept)
        contenders = _throughput_contenders(ctx, cp, state, tensors, pinned, pageable, dest, flat_dest, kept)
        for fn in contenders.values():  # warm-up: pool allocation, first-call costs, page faults
            fn()
        runs: dict[str, list[float]] = {k: [] for k in contenders}
        names = list(contenders)
        for r in range(ctx.reps):
            for name in rotated(names, r):
                gc.collect()
                runs[name].append(contenders[name]())
        assert_same(dest, state,
                    "throughput: the last load")
    finally:
        cp.close()
        shutil.rmtree(kept, ignore_errors=True)
    med = {k: median(v) for k, v in runs.items()}
    figures = {"bytes": n, "reps": ctx.reps, "median_s": med, "runs_s": runs,
               "gb_per_s": {k: gbs(n, v) for k, v in med.items()},
               "stall_over_pinned_copy": med["ss async stall"] / med["pinned copy_ d2h"],
               "load_over_h2d_copy": med["ss load (verify)"] / med["pinned copy_ h2d"]}
    summary = (f"{n / 2**30:.2f} GiB: pinned copy_ {gbs(n, med['pinned copy_ d2h']):.1f} GB/s, async stall "
               f"{gbs(n, med['ss async stall']):.1f} GB/s ({figures['stall_over_pinned_copy']:.2f}x the copy), "
               f"sync save {gbs(n, med['ss sync save']):.2f} GB/s, load {gbs(n, med['ss load (verify)']):.2f} GB/s")
    return summary, figures


def _throughput_contenders(ctx: Ctx, cp: Any, state: dict, tensors: list, pinned: torch.Tensor,
                           pageable: torch.Tensor, dest: dict, flat_dest: torch.Tensor,
                           kept: Path) -> dict[str, Callable[[], float]]:
    def timed(fn: Callable[[], Any]) -> float:
        ctx.sync()
        t0 = time.perf_counter()
        fn()
        ctx.sync()
        return time.perf_counter() - t0

    def ss_async() -> float:
        p = ctx.fresh("throughput_async")
        ctx.sync()
        t0 = time.perf_counter()
        fut = cp.async_save(state, p)
        stall = time.perf_counter() - t0
        fut.result()
        shutil.rmtree(p, ignore_errors=True)
        return stall

    def ss_sync() -> float:
        p = ctx.fresh("throughput_sync")
        t = timed(lambda: cp.save(state, p))
        shutil.rmtree(p, ignore_errors=True)
        return t

    def h2d() -> None:
        flat_dest.copy_(pinned, non_blocking=ctx.cuda)

    out = {"pinned copy_ d2h": lambda: timed(lambda: copy_out(tensors, pinned, ctx))}
    if ctx.cuda:
        out["pageable copy_ d2h"] = lambda: timed(lambda: copy_out(tensors, pageable, ctx))
    out.update({"ss async stall": ss_async, "ss sync save": ss_sync,
                "ss load (verify)": lambda: timed(lambda: cp.load(dest, kept)),
                "pinned copy_ h2d": lambda: timed(h2d)})
    return out


def check_train_async(ctx: Ctx) -> tuple[str, dict]:
    """A background save's stall and its effect on the step time of a GPU training loop."""
    import shardsafe

    dim, layers, target = (4096, 6, 0.040) if ctx.cuda and not ctx.quick else (1024, 2, 0.020) if ctx.cuda \
        else (256, 2, 0.010)
    torch.manual_seed(0)
    model = MLP(dim, layers).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = _calibrated_batch(ctx, model, opt, dim, target)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).float().square().mean().backward()
        opt.step()
        ctx.sync()
        return time.perf_counter() - t0

    state = {"train": shardsafe.TrainState(model, opt)}
    tensors = [t for t in flat_items(state["train"].state_dict()).values() if isinstance(t, torch.Tensor)]
    n = sum(nbytes(t) for t in tensors)
    floor_buf = pinned_empty(n, ctx.cuda)
    trials = 1 if ctx.quick else 3
    stalls, floors, base, during, durable = [], [], [], [], []
    with shardsafe.Checkpointer() as cp:
        cp.async_save(state, ctx.fresh("train_warm")).result()  # allocates the staging pool
        shutil.rmtree(ctx.work / "train_warm", ignore_errors=True)
        for trial in range(trials):
            base += [step() for _ in range(10)]
            t0 = time.perf_counter()
            copy_out(tensors, floor_buf, ctx)
            floors.append(time.perf_counter() - t0)
            snapshot = cpu_copy(state["train"].state_dict()["model"]) if trial == 0 else None
            path = ctx.fresh(f"train_{trial}")
            t0 = time.perf_counter()
            fut = cp.async_save(state, path)
            stalls.append(time.perf_counter() - t0)
            while not fut.done():
                during.append(step())
            fut.result()
            durable.append(time.perf_counter() - t0)
            base += [step() for _ in range(10)]
            if snapshot is not None:
                saved = shardsafe.load_full(path, "train.model")["train"]["model"]
                assert_same(cpu_copy(saved), snapshot, "train_async: the checkpoint against the weights at save time")
            shutil.rmtree(path, ignore_errors=True)
    mb, md = median(base), median(during)
    figures = {"bytes": n, "dim": dim, "layers": layers, "batch": x.shape[0], "trials": trials,
               "median_stall_s": median(stalls), "median_pinned_copy_s": median(floors),
               "stall_over_copy": median(stalls) / median(floors), "median_step_s": mb,
               "median_step_during_save_s": md, "steps_during_save": len(during),
               "step_ratio": md / mb if during else float("nan"), "median_durable_s": median(durable),
               "stalls_s": stalls, "pinned_copy_s": floors}
    ratio = f"x{md / mb:.2f}" if during else "n/a (no step overlapped the write)"
    summary = (f"{n / 2**30:.2f} GiB state: stall {fmt_s(median(stalls))} vs pinned copy_ {fmt_s(median(floors))} "
               f"({figures['stall_over_copy']:.2f}x); step {fmt_s(mb)} undisturbed, {fmt_s(md)} during the write "
               f"({ratio}, {len(during)} steps); durable after {fmt_s(median(durable))}")
    return summary, figures


def _calibrated_batch(ctx: Ctx, model: nn.Module, opt: Any, dim: int, target: float) -> torch.Tensor:
    """An input batch whose training step takes about ``target`` seconds."""
    batch = 256
    for _ in range(3):
        x = torch.randn(batch, dim, device=ctx.device)
        times = []
        for _ in range(4):
            ctx.sync()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).float().square().mean().backward()
            opt.step()
            ctx.sync()
            times.append(time.perf_counter() - t0)
        batch = max(16, min(16384, round(batch * target / max(median(times[1:]), 1e-6))))
    return torch.randn(batch, dim, device=ctx.device)


def check_non_current_device(ctx: Ctx) -> tuple[str, dict]:
    """Tensors on cuda:1 while cuda:0 is current: copies run on cuda:1's stream."""
    if not ctx.cuda:
        raise Skip("needs CUDA")
    if torch.cuda.device_count() < 2:
        raise Skip(f"needs 2+ GPUs ({torch.cuda.device_count()} here)")
    import shardsafe

    other = torch.device("cuda", 1)
    torch.cuda.set_device(0)
    figures: dict[str, Any] = {}
    state = big_state(other, (64 if ctx.quick else 512) * MiB)
    state.update({f"v_{k}": v for k, v in varied_state(other, MiB).items()})
    want = cpu_copy(state)
    for how in ("sync", "async"):
        path = ctx.fresh(f"other_device_{how}")
        with shardsafe.Checkpointer() as cp:
            if how == "async":
                fut = cp.async_save(state, path)
                scramble(list(state.values()))
                fut.result()
                for k, v in want.items():  # put the values back for the next variant
                    state[k].copy_(v)
            else:
                cp.save(state, path)
            dest = {k: torch.zeros_like(v) for k, v in state.items()}
            cp.load(dest, path)
        assert_same(cpu_copy(dest), want, f"{how} save of cuda:1 tensors (cuda:0 current)")
        assert_same(cpu_copy(shardsafe.load_full(path)), want, f"{how} save of cuda:1 tensors, load_full")
        figures[how] = "bitwise"
        shutil.rmtree(path, ignore_errors=True)
    n = sum(nbytes(v) for v in want.values())
    return f"{n / MiB:.0f} MiB on cuda:1, cuda:0 current: sync and async saves bitwise", figures


def check_pinned_budget(ctx: Ctx) -> tuple[str, dict]:
    """Peak pinned host memory against the budget: shardsafe's accounting and torch's."""
    import shardsafe

    budget = (16 if ctx.quick else 256) * MiB
    total = (64 if ctx.quick else 1024) * MiB
    state = big_state(ctx.device, total, 4 * MiB if ctx.quick else 64 * MiB)
    n = sum(nbytes(t) for t in state.values())
    gc.collect()
    ctx.sync()
    reset_host_peak()
    before = host_stats()
    figures: dict[str, Any] = {"budget": budget, "bytes": n, "host_stats_before": before}
    with shardsafe.Checkpointer(memory_budget=budget) as cp:
        for i in range(3):
            cp.async_save(state, ctx.fresh(f"budget_{i % 2}"), overwrite=True).result()
        cp.save(state, ctx.fresh("budget_sync"))
        dest = {k: torch.zeros_like(v) for k, v in state.items()}
        cp.load(dest, ctx.work / "budget_sync")
        assert_same(dest, state,
                    "pinned_budget: load")
        mem = cp.memory
        figures.update(peak=mem.peak, kept=mem.kept_bytes, allocations=mem.allocations,
                       kept_pinned=sum(t.is_pinned() for t in kept_buffers(cp)), kept_buffers=len(kept_buffers(cp)))
        figures["host_stats_during"] = host_stats()
    figures["host_stats_after_close"] = host_stats()
    if mem.peak > budget or figures["kept"] > budget:
        raise AssertionError(f"HostMemory peak {mem.peak} / kept {figures['kept']} bytes over the {budget}-byte budget")
    if ctx.cuda and figures["kept_pinned"] != figures["kept_buffers"]:
        raise AssertionError(f"{figures['kept_buffers'] - figures['kept_pinned']} kept slots are not pinned")
    figures["odd"] = _pinned_rounding(ctx)
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    if ctx.cuda and empty is not None:
        empty()
        figures["host_stats_after_empty_host_cache"] = host_stats()
    for k in ("budget_0", "budget_1", "budget_sync"):
        shutil.rmtree(ctx.work / k, ignore_errors=True)
    during = figures["host_stats_during"]
    active = during.get("active_bytes.peak", 0) - before.get("active_bytes.current", 0)
    figures["pinned_active_peak_over_budget"] = active / budget if during else None
    torch_part = (f"; torch pinned active peak {active / MiB:.0f} MiB ({active / budget:.2f}x budget), "
                  f"odd state: {figures['odd']['allocator_active_peak'] / MiB:.0f} MiB pinned for "
                  f"{figures['odd']['shardsafe_peak'] / MiB:.0f} MiB leased") if during else \
        "; torch pinned allocator statistics: n/a"
    summary = (f"budget {budget / MiB:.0f} MiB, {n / MiB:.0f} MiB state: shardsafe peak {mem.peak / MiB:.0f} MiB, "
               f"kept {figures['kept'] / MiB:.0f} MiB, {mem.allocations} allocations" + torch_part)
    return summary, figures


def _pinned_rounding(ctx: Ctx) -> dict:
    """An unbounded async save of a state whose slots are not a power of two (96 MiB: two
    48 MiB slots): what shardsafe leases and what the pinned allocator holds for it."""
    import shardsafe

    state = big_state(ctx.device, (6 if ctx.quick else 96) * MiB, 2 * MiB if ctx.quick else 32 * MiB)
    gc.collect()
    ctx.sync()
    reset_host_peak()
    before = host_stats()
    with shardsafe.Checkpointer() as cp:
        cp.async_save(state, ctx.fresh("budget_odd")).result()
        peak = cp.memory.peak
        during = host_stats()
    shutil.rmtree(ctx.work / "budget_odd", ignore_errors=True)
    active = during.get("active_bytes.peak", 0) - before.get("active_bytes.current", 0)
    return {"shardsafe_peak": peak, "allocator_active_peak": active, "host_stats": during}


