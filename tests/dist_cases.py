"""Case functions run on every rank of a WorkerPool (see distributed.py).

Each takes (rank, world, *args). Models are tiny and deterministic; shapes are chosen
so that sharding is uneven for 3 ranks."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import shardsafe


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


def assert_bitwise(a, b, path: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
        )
        assert torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)), (
            f"{path}: values differ"
        )
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {sorted(map(str, a))} vs {sorted(map(str, b))}"
        for k in a:
            assert_bitwise(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {a!r} vs {b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise(x, y, f"{path}.{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def save_trained(rank: int, world: int, layout: str, path: str, ref_path: str) -> dict:
    """Train ``layout`` a few steps, save with shardsafe; rank 0 writes a full reference."""
    model, opt = build(layout, world)
    train(model, opt, 3, rank)
    state = train_state(model, opt)
    info = shardsafe.save(state, path)
    ref = full_reference(state)
    if rank == 0:
        torch.save(ref, ref_path)
    dist.barrier()
    return {"bytes": info.bytes_written}


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
