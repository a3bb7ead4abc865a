"""Case functions run on every rank of a WorkerPool (see distributed.py).

Each takes (rank, world, *args). Models are tiny and deterministic; shapes are chosen
so that sharding is uneven for 3 ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import shardsafe
from bitwise import assert_bitwise, first_difference


class Block(nn.Module):
    def __init__(self, dim: int = 12, hidden: int = 20) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Tiny(nn.Module):
    def __init__(self, vocab: int = 31, dim: int = 12, hidden: int = 20, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def build(layout: str, world: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A Tiny model under ``layout`` (single, ddp, fsdp, fsdp_tp, hsdp) and its AdamW."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny()
    if layout == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif layout == "fsdp_tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for b in model.blocks:
            parallelize_module(b, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        for b in model.blocks:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif layout == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    elif layout != "single":
        raise ValueError(layout)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def data_rank(layout: str, rank: int) -> int:
    """The data-parallel rank that picks a rank's batches: tensor-parallel peers must see
    the same batch (their replicated parameters would drift apart otherwise)."""
    return rank // 2 if layout == "fsdp_tp" else rank


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, rank: int, seed: int = 1) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
        tokens = torch.randint(0, 31, (4, 6), generator=g)
        loss = model(tokens).float().logsumexp(-1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()


def train_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def full_reference(state: dict) -> dict:
    """Full (unsharded) CPU copies of every tensor in a state tree (collective for DTensors)."""
    from torch.distributed.tensor import DTensor

    def walk(x):
        if isinstance(x, DTensor):
            return x.full_tensor().detach().clone()
        if isinstance(x, torch.Tensor):
            return x.detach().clone()
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if isinstance(x, tuple):
            return tuple(walk(v) for v in x)
        return x

    return walk(state)


def tensors_of(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flat dotted key -> tensor of a nested state (dicts, lists, tuples)."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(tensors_of(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(tensors_of(v, f"{prefix}.{i}" if prefix else str(i)))
    return out


def dtensor_differences(rank: int, world: int) -> dict:
    """What bitwise.first_difference says of DTensors: the same, a changed shard, other
    placements, a DTensor against its local shard (see test_bitwise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh("cpu", (world,))
    a = DTensor.from_local(torch.zeros(2), mesh, [Shard(0)])
    changed = a.to_local().clone()
    changed[0] = 1.0
    b = DTensor.from_local(changed, mesh, [Shard(0)])
    r = DTensor.from_local(torch.zeros(2 * world), mesh, [Replicate()])  # the same global shape
    return {"same": first_difference({"t": a}, {"t": DTensor.from_local(torch.zeros(2), mesh, [Shard(0)])}),
            "shard": first_difference({"t": a}, {"t": b}), "placement": first_difference({"t": a}, {"t": r}),
            "plain": first_difference({"t": a}, {"t": a.to_local()})}


def save_trained(rank: int, world: int, layout: str, path: str, ref_path: str) -> dict:
    """Train ``layout`` a few steps, save with shardsafe; rank 0 writes a full reference.
    Reports the bytes written, the plan cache flag and the model's DTensor placements."""
    model, opt = build(layout, world)
    train(model, opt, 3, data_rank(layout, rank))
    state = train_state(model, opt)
    info = shardsafe.save(state, path)
    ref = full_reference(state)
    if rank == 0:
        torch.save(ref, ref_path)
    dist.barrier()
    return {"bytes": info.bytes_written, "plan_cached": info.plan_cached, "placements": placements_of(state["model"])}


def load_into(rank: int, world: int, layout: str, path: str, ref_path: str) -> dict:
    """Build ``layout`` fresh, load the checkpoint, compare the full state with the reference."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = build(layout, world)
    state = train_state(model, opt)
    info = shardsafe.load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_reference(train_state(model, opt))
    ref = torch.load(ref_path, weights_only=True)
    assert_bitwise(ref, got)
    return {"bytes_read": info.bytes_read}


# ----------------------------------------------------------------------------- helpers


def local_nbytes(state) -> int:
    """Bytes of the tensors this rank holds in a state tree (local shards of DTensors)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local().nbytes
    if isinstance(state, torch.Tensor):
        return state.nbytes
    if isinstance(state, dict):
        return sum(local_nbytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(local_nbytes(v) for v in state)
    return 0


def local_snapshot(state):
    """Clones of this rank's local tensors (DTensor: its local shard) in a state tree."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local().detach().clone()
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: local_snapshot(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(local_snapshot(v) for v in state)
    return state


def placements_of(state: dict) -> dict:
    """{key: [placement reprs]} for every DTensor of a model state dict."""
    from torch.distributed.tensor import DTensor

    return {k: [repr(p) for p in v.placements] for k, v in state.items() if isinstance(v, DTensor)}


# ----------------------------------------------------------------------------- cases


def load_measured(rank: int, world: int, layout: str, path: str, ref_path: str) -> dict:
    """:func:`load_into` that also reports the bytes of the destination's local shards."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = build(layout, world)
    state = train_state(model, opt)
    dest_bytes = local_nbytes(state)
    info = shardsafe.load(state, path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    got = full_reference(train_state(model, opt))
    ref = torch.load(ref_path, weights_only=True)
    assert_bitwise(ref, got)
    return {"bytes_read": info.bytes_read, "bytes_copied": info.bytes_copied, "dest_bytes": dest_bytes,
            "tensors": info.tensors}


def load_then_save(rank: int, world: int, layout: str, src: str, dst: str, ref_path: str) -> dict:
    """Load ``src`` into a fresh ``layout`` model (checked against ``ref_path``), then save
    the model's state again at ``dst`` (the middle leg of an N -> M -> N round trip)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    model, opt = build(layout, world)
    state = train_state(model, opt)
    shardsafe.load(state, src)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    again = train_state(model, opt)
    assert_bitwise(torch.load(ref_path, weights_only=True), full_reference(again))
    info = shardsafe.save(again, dst)
    return {"bytes": info.bytes_written}


def save_twice(rank: int, world: int, layout: str, path1: str, path2: str, path3: str) -> list[bool]:
    """Save the same layout twice (second plan from the cache), then a changed layout."""
    shardsafe.default_checkpointer().plans.clear()  # earlier cases in this worker may have planned it
    model, opt = build(layout, world)
    train(model, opt, 1, data_rank(layout, rank))
    state = train_state(model, opt)
    first = shardsafe.save(state, path1).plan_cached
    second = shardsafe.save(state, path2).plan_cached
    state["extra"] = torch.arange(5.0)
    third = shardsafe.save(state, path3).plan_cached
    return [first, second, third]


def save_rank_local(rank: int, world: int, path: str) -> int:
    state = {
        "rng": shardsafe.rank_local({"seed": rank, "t": torch.full((3,), rank)}),
        "w": torch.arange(6.0),
    }
    return shardsafe.save(state, path).bytes_written


def load_rank_local(rank: int, world: int, path: str, form: str) -> dict:
    """Load the rank-local value 'rng' into a destination of the given ``form``:
    ``marked_empty`` (rank_local({})), ``marked_tensor`` (rank_local with a tensor to fill
    in place), ``plain`` (a plain value that gets replaced)."""
    from shardsafe.state.tree import RankLocal

    if form == "marked_empty":
        dest = {"rng": shardsafe.rank_local({})}
    elif form == "marked_tensor":
        holder = torch.full((3,), -7)
        dest = {"rng": shardsafe.rank_local({"seed": -1, "t": holder})}
    elif form == "plain":
        dest = {"rng": None}
    else:
        raise ValueError(form)
    dest["w"] = torch.zeros(6)
    shardsafe.load(dest, path)
    got = dest["rng"]
    if form == "plain":
        assert not isinstance(got, RankLocal), "a plain position must get a plain value"
    else:
        assert isinstance(got, RankLocal), "the rank_local marker must stay"
        got = got.value
    assert set(got) == {"seed", "t"}, got
    assert got["seed"] == rank, got
    assert_bitwise(torch.full((3,), rank), got["t"], "rng.t")
    if form == "marked_tensor":
        assert got["t"] is holder, "a destination tensor must be filled in place"
    assert_bitwise(torch.arange(6.0), dest["w"], "w")
    return {"seed": got["seed"], "t": got["t"].tolist()}


def load_with_fault(rank: int, world: int, layout: str, path: str, fault: str, bad_rank: int) -> dict:
    """Load with a destination that is wrong on ``bad_rank`` only; report the error each
    rank raised, check the destination is untouched, then check the group still works
    by loading a correct destination."""
    model, opt = build(layout, world)
    state = train_state(model, opt)
    if rank == bad_rank:
        if fault == "shape":
            state["model"]["head.weight"] = torch.zeros(31, 13)
        elif fault == "extra_key":
            state["model"]["extra.weight"] = torch.zeros(3)
        else:
            raise ValueError(fault)
    before = local_snapshot(state)
    error = None
    try:
        shardsafe.load(state, path)
    except shardsafe.CheckpointError as exc:
        error = (type(exc).__name__, str(exc))
    assert_bitwise(before, local_snapshot(state), "destination after failed load")
    good = train_state(model, opt)
    shardsafe.load(good, path)  # the group is still in step after the failure
    return {"error": error}


def save_with_fault(rank: int, world: int, path: str, bad_rank: int) -> dict:
    """Save where only ``bad_rank`` holds a value that cannot be saved (a set)."""
    state = {"w": torch.ones(4), "meta": {"tags": {1, 2} if rank == bad_rank else [1, 2]}}
    error = None
    try:
        shardsafe.save(state, path)
    except shardsafe.CheckpointError as exc:
        error = (type(exc).__name__, str(exc))
    # The group still works: a good save right after succeeds everywhere.
    ok = shardsafe.save({"w": torch.ones(4)}, path + "-after")
    return {"error": error, "after_bytes": ok.bytes_written}


def big_replicated(shapes: list[tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic float32 tensors, identical on every rank."""
    g = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(shape, generator=g) for i, shape in enumerate(shapes)}


def save_replicated(rank: int, world: int, path: str, shapes: list[tuple[int, ...]]) -> int:
    info = shardsafe.save(big_replicated(shapes), path)
    return info.bytes_written


def save_load_subgroups(rank: int, world: int, root: str) -> dict:
    """Two process groups of half the ranks each save and load their own checkpoint at
    the same time, through ``process_group=``."""
    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    g = rank // half
    path = f"{root}/g{g}"
    state = {"w": torch.full((5,), float(g)), "mine": shardsafe.rank_local({"r": rank})}
    info = shardsafe.save(state, path, process_group=groups[g])
    dest = {"w": torch.zeros(5), "mine": shardsafe.rank_local({})}
    shardsafe.load(dest, path, process_group=groups[g])
    for group in groups:
        dist.destroy_process_group(group)
    return {"w": dest["w"].tolist(), "mine": dest["mine"].value, "bytes": info.bytes_written}


def save_with_write_failure(rank: int, world: int, path: str, bad_rank: int) -> dict:
    """Save where writing the data file fails on ``bad_rank`` only (a full disk, say)."""
    import errno

    from shardsafe.storage.faults import Fault, FaultyBackend

    # The rank-local tensor makes sure that ``bad_rank`` has a file of its own to write.
    state = {"w": torch.zeros(1024), "local": shardsafe.rank_local(torch.full((256,), rank))}
    faults = [Fault("write", errno.ENOSPC, name="data-r")] if rank == bad_rank else []
    error = None
    with shardsafe.Checkpointer(storage=FaultyBackend(faults=faults)) as cp:
        try:
            cp.save(state, path)
        except Exception as exc:  # noqa: BLE001 - report whatever each rank raised
            error = (type(exc).__name__, str(exc), isinstance(exc, shardsafe.CheckpointError))
    ok = shardsafe.save({"w": torch.ones(4)}, path + "-after")  # the group is still in step
    return {"error": error, "after_bytes": ok.bytes_written}


def save_on_own_one_rank_group(rank: int, world: int, path: str) -> dict:
    """Each rank saves a DTensor of its own one-rank sub-mesh through that sub-mesh's
    group (group rank 0, global rank ``rank``); the checkpoint loads back whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "solo"))
    solo = mesh["solo"]
    w = distribute_tensor(torch.arange(8.0) + rank, solo, [Shard(0)])
    target = f"{path}-{rank}"
    shardsafe.save({"w": w}, target, process_group=solo.get_group())
    got = shardsafe.load_full(target)["w"]
    return {"equal": torch.equal(got, torch.arange(8.0) + rank)}
