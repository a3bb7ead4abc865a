"""Random DTensor layouts, saved on one world size and loaded on another (run on every rank
of a WorkerPool; see test_layout_property.py).

A layout is a mesh shape (1 to 3 dims, its sizes multiplying to the world size), a tensor
shape (1 to 3 dims, uneven and empty dims included) and one placement per mesh dim:
``Shard(d)``, ``_StridedShard(d, split_factor)`` (1 to 64) or ``Replicate()``. The local
tensors come from torch's own ``distribute_tensor`` (``src_data_rank=None``: each rank
splits the full tensor itself, which also allows uneven strided shards), never from
shardsafe's geometry, so a disagreement between the two is caught.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any

import torch

import shardsafe
from shardsafe.errors import CheckpointError

DTYPES = (torch.float32, torch.bfloat16, torch.int32)


@dataclass(frozen=True)
class Layout:
    """One random layout: mesh shape, tensor shape, dtype and placements as (kind, dim, factor)."""

    mesh: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    placements: tuple[tuple[str, int, int], ...]


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """Every ordered way of writing ``n`` as a product of ``parts`` sizes >= 1."""
    if parts == 1:
        return [(n,)]
    return [(d, *rest) for d in range(1, n + 1) if n % d == 0 for rest in factorizations(n // d, parts - 1)]


def random_layout(rng: random.Random, world: int) -> Layout:
    """A layout on a mesh of ``world`` ranks (deterministic for a given ``rng`` state)."""
    mesh = rng.choice(factorizations(world, rng.randint(1, 3)))
    ndim = rng.randint(1, 3)
    shape = tuple(0 if rng.random() < 0.08 else rng.randint(1, 70 if d == 0 else 9) for d in range(ndim))
    placements = []
    for _ in mesh:
        r = rng.random()
        d = rng.randrange(ndim)
        if r < 0.25:
            placements.append(("R", 0, 1))
        elif r < 0.55:
            placements.append(("S", d, 1))
        else:
            placements.append(("SS", d, rng.choice([1, 2, 3, 5, 8, 13, 38, 64, rng.randint(1, 64)])))
    return Layout(mesh, shape, rng.choice(DTYPES), tuple(placements))


def layouts(seed: int, world: int, count: int) -> list[Layout]:
    """``count`` random layouts for ``world`` ranks (the same on every rank and in the parent)."""
    rng = random.Random(seed * 1000 + world)
    return [random_layout(rng, world) for _ in range(count)]


def full_tensor(layout: Layout, seed: int) -> torch.Tensor:
    """The global tensor of a layout: distinct values, reproducible anywhere."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in layout.shape:
        n *= s
    values = torch.randperm(max(n, 1), generator=g)[:n].view(layout.shape)
    if layout.dtype == torch.bfloat16:
        return (values.to(torch.float32) / 7.0).to(torch.bfloat16)
    return values.to(layout.dtype)


def _placements(layout: Layout) -> list[Any]:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    out: list[Any] = []
    for kind, d, factor in layout.placements:
        out.append(Replicate() if kind == "R" else Shard(d) if kind == "S" else _StridedShard(d, split_factor=factor))
    return out


def distribute(layout: Layout, full: torch.Tensor) -> Any:
    """The DTensor torch makes of ``full`` under ``layout`` (None when torch refuses the layout)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    mesh = init_device_mesh("cpu", layout.mesh)
    try:
        return distribute_tensor(full, mesh, _placements(layout), src_data_rank=None)
    except Exception:  # noqa: BLE001 - torch refusing a layout is an outcome, not a failure
        return None


def save_layouts(rank: int, world: int, root: str, seed: int, count: int) -> list[str]:
    """Save each layout to ``root/<i>``; per layout: "saved", "torch refuses" or "refused: <error>"
    (a CheckpointError at save; any other exception fails the case)."""
    outcomes = []
    for i, layout in enumerate(layouts(seed, world, count)):
        t = distribute(layout, full_tensor(layout, seed + i))
        if t is None:
            outcomes.append("torch refuses")
            continue
        path = os.path.join(root, str(i))
        try:
            shardsafe.save({"t": t, "step": i}, path)
            outcomes.append("saved")
        except CheckpointError as exc:
            outcomes.append(f"refused: {exc}")
            assert "'t'" in str(exc), f"layout {layout}: the refusal does not name the key: {exc}"
            assert not os.path.exists(path), f"layout {layout}: a refused save left {path}"
    return outcomes


def load_layouts(rank: int, world: int, root: str, seed: int, saved: list[tuple[int, Layout]]) -> int:
    """Load each saved checkpoint into a random destination layout of this world and compare
    the local tensor bitwise with torch's own split of the full tensor; returns the count."""
    rng = random.Random(seed * 7 + world)
    done = 0
    for i, source in saved:
        full = full_tensor(source, seed + i)
        dest_layout = Layout(**{**random_layout(rng, world).__dict__, "shape": source.shape, "dtype": source.dtype})
        dest_layout = _fit(dest_layout)
        expected = distribute(dest_layout, full)
        if expected is None:  # torch refuses this destination: load into a replicated copy instead
            dest_layout = Layout((world,), source.shape, source.dtype, (("R", 0, 1),))
            expected = distribute(dest_layout, full)
        dest = distribute(dest_layout, torch.zeros_like(full))
        state = {"t": dest, "step": -1}
        shardsafe.load(state, os.path.join(root, str(i)))
        got = state["t"].to_local()
        want = expected.to_local()
        assert state["step"] == i
        assert got.dtype == want.dtype and got.shape == want.shape, (source, dest_layout, got.shape, want.shape)
        assert torch.equal(got, want), (source, dest_layout)
        done += 1
    return done


def _fit(layout: Layout) -> Layout:
    """The layout with its placements' dims brought inside the tensor's dims."""
    ndim = len(layout.shape)
    return Layout(layout.mesh, layout.shape, layout.dtype,
                  tuple((k, d % ndim, f) for k, d, f in layout.placements))


def commit_check_case(rank: int, world: int, root: str) -> bool:
    """A rule the reader refuses (split factor above the world size), with the writer's
    fallback to explicit boxes switched off: the commit's parse must refuse it."""
    from shardsafe.ops import describe as saving

    layout = Layout((world,), (20, 2), torch.float32, (("SS", 0, 3 * world + 1),))
    t = distribute(layout, torch.arange(40.0).view(20, 2))
    fallback = saving._rule_problem
    saving._rule_problem = lambda *args: None
    try:
        shardsafe.save({"t": t}, os.path.join(root, "bad"))
    except CheckpointError as exc:
        assert "save refused: the checkpoint would not load" in str(exc) and "'t'" in str(exc), exc
    else:
        raise AssertionError("the commit published a manifest its reader refuses")
    finally:
        saving._rule_problem = fallback
    shardsafe.save({"t": t}, os.path.join(root, "ok"))
    return True
