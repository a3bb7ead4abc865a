"""Functions the worker pools run (``fn(rank, world, *args)``): building the FSDP2
checkpoint, and the load probes that classify one damaged checkpoint.

Each worker keeps its destinations between trials (``_CACHE``): before a probe every
destination tensor is refilled with a sentinel and snapshotted, so a failed load that
wrote anything is caught, and a successful one is compared bitwise with what the
pristine checkpoint loads into the same destination.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn as nn

import shardsafe
from shardsafe import errors as ss_errors

from .common import (
    DETECTED,
    LOADED,
    OTHER,
    SILENT,
    TOUCHED,
    LeakCheck,
    bitwise_equal,
    describe_error,
    first_difference,
    fresh_full_tensors,
    outcome,
    sentinel_tree,
    snapshot,
    worst,
)
from .common import LEFTOVERS as LEFT

_CACHE: dict[Any, Any] = {}


def expected_errors(names: list[str]) -> tuple[type[BaseException], ...]:
    """The error classes named (``shardsafe.errors`` names)."""
    return tuple(getattr(ss_errors, n) for n in names)


# ----------------------------------------------------------------------------- the FSDP2 checkpoint


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    """A small transformer-like model; odd sizes so that 4-way sharding is uneven."""

    def __init__(self, vocab: int = 509, dim: int = 96, hidden: int = 203, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _mesh(world: int) -> Any:
    mesh = _CACHE.get(("mesh", world))
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = _CACHE[("mesh", world)] = init_device_mesh("cpu", (world,))
    return mesh


def fsdp_state(rank: int, world: int, steps: int) -> tuple[dict[str, Any], Any]:
    """Tiny under fully_shard on a ``world``-rank mesh, trained ``steps`` AdamW steps; its
    state (model and optimizer via get_state_dict, a counter, a rank-local RNG value)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny()
    mesh = _mesh(world)
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        loss = model(torch.randint(0, 509, (4, 6), generator=g)).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": steps, "meta": {"world": world, "note": "fsdp2 tiny"},
             "rng": shardsafe.rank_local({"torch": torch.Generator().manual_seed(rank).get_state(), "rank": rank})}
    return state, (model, opt)


def full_of(tree: Any) -> Any:
    """Full CPU copies of a tree's tensors (collective for DTensors); rank-local values unwrapped."""
    from torch.distributed.tensor import DTensor

    if isinstance(tree, DTensor):
        return tree.full_tensor().detach().clone()
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: full_of(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(full_of(v) for v in tree)
    value = getattr(tree, "value", None)
    if type(tree).__name__ == "RankLocal" and value is not None:
        return full_of(value)
    return tree


def setup_fsdp(rank: int, world: int, path: str, alt_path: str) -> dict[str, Any]:
    """Save the FSDP2 checkpoint at ``path`` (and the same layout one step later at
    ``alt_path``); rank 0 checks that ``load_full`` gives back the full state bitwise."""
    state, _ = fsdp_state(rank, world, 3)
    shardsafe.save(state, path)
    full = full_of({k: v for k, v in state.items() if k != "rng"})
    alt, _ = fsdp_state(rank, world, 4)
    shardsafe.save(alt, alt_path)
    if rank == 0:
        got = shardsafe.load_full(path)
        rng = got.pop("rng")
        where = first_difference(full, got)
        assert where is None, f"the pristine FSDP2 checkpoint does not load back: {where}"
        assert rng["rank"] == 0
    return {"ok": True}


# ----------------------------------------------------------------------------- destinations


def shard_dim0(full: torch.Tensor, world: int, rank: int) -> Any:
    """``full`` as a DTensor sharded on dim 0 over the world mesh (torch.chunk split)."""
    from torch.distributed.tensor import DTensor, Shard

    full = full.contiguous()
    size = -(-full.shape[0] // world)
    lo, hi = min(rank * size, full.shape[0]), min((rank + 1) * size, full.shape[0])
    return DTensor.from_local(full[lo:hi].clone(), _mesh(world), [Shard(0)], run_check=False, shape=full.shape,
                              stride=full.stride())


def _dtensors_of(tree: Any, world: int, rank: int) -> Any:
    if isinstance(tree, torch.Tensor):
        return shard_dim0(tree, world, rank) if tree.dim() >= 1 and tree.shape[0] > 0 else tree.clone()
    if isinstance(tree, dict):
        return {k: _dtensors_of(v, world, rank) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(_dtensors_of(v, world, rank) for v in tree)
    return tree


def _template4(rank: int, world: int, ckpt: str, pristine: str) -> tuple[Any, Any]:
    """(destination template, expected loaded destination) of this rank for a 4-rank load."""
    key = ("dest4", ckpt, pristine)
    if key not in _CACHE:
        if ckpt == "fsdp":  # the model as saved, rebuilt (training is deterministic)
            state, live = fsdp_state(rank, world, 3)
            template: Any = {**state, "rng": state["rng"].value}
            _CACHE[("live", ckpt)] = live  # the destination's DTensors are the model's parameters
        else:  # the single-process checkpoint, resharded: dim 0 split over the ranks
            full = shardsafe.load_full(pristine)
            full.pop("rl")  # rank-local: only rank 0 has a saved counterpart
            template = _dtensors_of(full, world, rank)
        truth = snapshot(template)
        dest = sentinel_tree(template)
        shardsafe.load(dest, pristine)
        where = first_difference(truth, snapshot(dest))
        assert where is None, f"rank {rank}: the pristine {ckpt} checkpoint loads wrong on {world} ranks: {where}"
        _CACHE[key] = (template, truth)
    return _CACHE[key]


def _template1(ckpt: str, pristine: str) -> tuple[Any, Any]:
    """(destination template of full tensors, what load_full of the pristine checkpoint gives)."""
    key = ("dest1", ckpt, pristine)
    if key not in _CACHE:
        full = shardsafe.load_full(pristine)
        _CACHE[key] = (fresh_full_tensors(full), full)
    return _CACHE[key]


# ----------------------------------------------------------------------------- probes


def try_load(method: str, run: Any, dest: Any, expected: Any, errors: tuple[type[BaseException], ...],
             rss: bool = False, compare: bool = True) -> dict[str, Any]:
    """Run ``run()`` (a load into ``dest``, or returning a tree when ``dest`` is None) and
    classify it: detected (an expected error, destination unchanged), loaded bitwise-correct,
    silent wrong data, another exception, destination touched, leaked threads/descriptors.
    ``compare=False``: a load that succeeds counts as loaded whatever it gave (cases that
    change values on purpose)."""
    before = snapshot(dest) if dest is not None else None
    leak = LeakCheck()
    base = peak_reset() if rss else 0
    result: dict[str, Any]
    try:
        got = run()
    except Exception as exc:  # noqa: BLE001 - classified
        cls = DETECTED if isinstance(exc, errors) else OTHER
        result = outcome(cls, method, describe_error(exc), error=type(exc).__name__)
        if dest is not None and not bitwise_equal(snapshot(dest), before):
            changed = first_difference(before, snapshot(dest))
            result = outcome(TOUCHED, method, f"{describe_error(exc)}; changed: {changed}", error=type(exc).__name__)
    else:
        tree = dest if dest is not None else got
        if not compare or bitwise_equal(snapshot(tree), expected):
            result = outcome(LOADED, method)
        else:
            result = outcome(SILENT, method, f"differs at {first_difference(expected, snapshot(tree))}")
    if rss:
        result["rss_kib"] = peak_kib() - base
    leaks = leak.leaks()
    if leaks and result["cls"] in (DETECTED, LOADED):
        result = outcome(LEFT, method, leaks + f" (after: {result['cls']} {result['detail']})")
    return result


def load4(rank: int, world: int, ckpt: str, pristine: str, work: str, error_names: list[str],
          compare: bool = True) -> dict[str, Any]:
    """Load ``work`` on every rank into this rank's sentinel-filled destination."""
    template, expected = _template4(rank, world, ckpt, pristine)
    dest = sentinel_tree(template)
    return try_load("load 4 ranks", lambda: shardsafe.load(dest, work), dest, expected, expected_errors(error_names),
                    compare=compare)


def combine_ranks(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One outcome for a multi-rank probe: the worst rank's, and OTHER when ranks disagree
    (one rank loaded while another raised, or they raised different errors)."""
    cls = worst(r["cls"] for r in results)
    pick = next(r for r in results if r["cls"] == cls)
    errors = {r.get("error") for r in results}
    failed = {r["cls"] == LOADED for r in results}
    if cls in (DETECTED, LOADED) and (len(errors) > 1 or len(failed) > 1):
        return outcome(OTHER, pick["method"], "ranks disagree: " + "; ".join(
            f"rank {i}: {r['cls']} {r.get('error') or ''}" for i, r in enumerate(results)))
    return pick


def verify_probe(work: str, errors: tuple[type[BaseException], ...], rss: bool = False) -> dict[str, Any]:
    """``shardsafe.tools.verify_checkpoint``: DETECTED when it reports problems (or raises an
    expected error), LOADED when it finds none (the caller checks that against the loads)."""
    from shardsafe.tools import verify_checkpoint

    leak = LeakCheck()
    base = peak_reset() if rss else 0
    try:
        report = verify_checkpoint(work)
    except Exception as exc:  # noqa: BLE001 - classified
        result = outcome(DETECTED if isinstance(exc, errors) else OTHER, "verify", describe_error(exc),
                         error=type(exc).__name__)
    else:
        result = outcome(LOADED, "verify") if report.ok else outcome(
            DETECTED, "verify", "; ".join(str(p) for p in report.problems)[:600], error="report")
    if rss:
        result["rss_kib"] = peak_kib() - base
    leaks = leak.leaks()
    if leaks:
        result = outcome(LEFT, "verify", leaks)
    return result


def solo(rank: int, world: int, ckpt: str, pristine: str, work: str, error_names: list[str],
         rss: bool = False, extra: bool = False, compare: bool = True, verify: bool = True,
         in_place: list[str] | None = None) -> list[dict[str, Any]]:
    """One process, no process group: ``load`` into sentinel-filled full tensors,
    ``load_full``, and ``verify_checkpoint`` of ``work`` (``extra``: also
    ``read_manifest``, a ``load_full`` of one key and a load with ``cast_dtype=True``;
    ``verify=False``: the loads skip checksums, a negative control that must show silent
    wrong data on flipped data). ``in_place``: more errors that count as detection for the
    loads into a destination (and the one-key load_full, whose key may be gone)."""
    errors = expected_errors(error_names)
    errors_in_place = errors + expected_errors(in_place or [])
    template, expected = _template1(ckpt, pristine)
    dest = sentinel_tree(template)
    out = [try_load("load 1 process", lambda: shardsafe.load(dest, work, verify=verify), dest, expected,
                    errors_in_place, rss, compare),
           try_load("load_full", lambda: shardsafe.load_full(work, verify=verify), None, expected, errors, rss,
                    compare)]
    if verify:
        out.append(verify_probe(work, errors, rss))
    if extra:
        key = "big" if ckpt == "single" else "model"
        out.append(try_load("load_full one key", lambda: shardsafe.load_full(work, keys=[key]), None,
                            {key: expected[key]}, errors_in_place, rss, compare))
        out.append(try_load("read_manifest", lambda: shardsafe.read_manifest(work), None, None, errors, rss,
                            compare=False))
        dest2 = sentinel_tree(template)
        out.append(try_load("load cast_dtype=True", lambda: shardsafe.load(dest2, work, cast_dtype=True), dest2,
                            expected, errors_in_place, rss, compare))
        out.extend(tool_probes(work, errors_in_place))
    return out


TOOL_TARGETS = ("torch", "safetensors", "dcp")  # hf writes what safetensors does, in shards


def tool_probes(work: str, errors: tuple[type[BaseException], ...]) -> list[dict[str, Any]]:
    """The tools on ``work``, each a probe: ``inspect``, ``diff`` of it with itself (every
    tensor read on both sides) and ``export`` to each of :data:`TOOL_TARGETS` (into a temporary folder,
    deleted after). A tool must refuse a hostile checkpoint with a CheckpointError naming
    the cause, never a plain Python error; what they return is not compared (a load probe
    does that)."""
    import tempfile
    import warnings

    from shardsafe.tools import diff_checkpoints, export_checkpoint, inspect_checkpoint

    out = [try_load("inspect", lambda: inspect_checkpoint(work), None, None, errors, compare=False),
           try_load("diff", lambda: diff_checkpoints(work, work), None, None, errors, compare=False)]
    with tempfile.TemporaryDirectory(prefix="shardsafe-faults-export-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's own warnings about a process-group-free save
        for to in TOOL_TARGETS:
            target = f"{tmp}/out-{to}"
            out.append(try_load(f"export {to}", lambda t=to, o=target: export_checkpoint(work, o, t), None, None,
                                errors, compare=False))
    return out


# ----------------------------------------------------------------------------- memory


def peak_reset() -> int:
    """Reset this process's peak RSS (VmHWM) and return the current RSS in KiB."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def peak_kib() -> int:
    """Peak RSS (VmHWM) since the last reset, in KiB."""
    return _status("VmHWM")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+)", f.read(), re.M)
    return int(m.group(1)) if m else 0
