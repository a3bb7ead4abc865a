"""Train a small GPT-like model with DDP (gloo, CPU), checkpointing with shardsafe; run it
again with the same --ckpt-dir and it resumes from the latest checkpoint, on any number
of ranks (the global batch is kept; see README.md).

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --steps 60 --ckpt-dir /tmp/ckpt-ddp
"""

from __future__ import annotations

import torch.distributed as dist
from _common import build_model, init_distributed, parse_args, train
from torch.nn.parallel import DistributedDataParallel


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rank, world = init_distributed()
    try:
        model = DistributedDataParallel(build_model(seed=0, dropout=args.dropout))
        train(args, model, rank=rank, world=world, layout="ddp")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
