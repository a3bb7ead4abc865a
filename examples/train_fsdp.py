"""Train a small GPT-like model with FSDP2 (fully_shard, gloo, CPU), checkpointing with
shardsafe; run it again with the same --ckpt-dir and it resumes from the latest
checkpoint, also on a different number of ranks: parameters and optimizer state are
resharded, the data continues in the same global order and the global batch is kept.

    torchrun --standalone --nproc_per_node=4 examples/train_fsdp.py --steps 60 --ckpt-dir /tmp/ckpt-fsdp --stop-at 30
    torchrun --standalone --nproc_per_node=2 examples/train_fsdp.py --steps 60 --ckpt-dir /tmp/ckpt-fsdp
"""

from __future__ import annotations

import torch.distributed as dist
from _common import build_model, init_distributed, parse_args, train
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rank, world = init_distributed()
    try:
        model = build_model(seed=0, dropout=args.dropout)  # identical on every rank before sharding
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        train(args, model, rank=rank, world=world, layout="fsdp2")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
