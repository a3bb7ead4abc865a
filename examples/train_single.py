"""Train a small GPT-like model in one process, checkpointing with shardsafe; run it
again with the same --ckpt-dir and it resumes exactly where the last checkpoint was.

    python examples/train_single.py --steps 60 --ckpt-dir /tmp/ckpt-single --stop-at 25
    python examples/train_single.py --steps 60 --ckpt-dir /tmp/ckpt-single

(``torchrun --nproc_per_node=1 examples/train_single.py ...`` works too.)
"""

from __future__ import annotations

import os

import torch
from _common import build_model, parse_args, train


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun, copies would share --ckpt-dir
        raise SystemExit("train_single.py runs one process: use train_ddp.py or train_fsdp.py for more")
    torch.set_num_threads(1)  # tiny model: threads only add overhead (and run-to-run noise)
    train(args, build_model(seed=0, dropout=args.dropout), layout="single")


if __name__ == "__main__":
    main()
