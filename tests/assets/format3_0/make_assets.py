"""Writes the format-3.0 checkpoint that tests/test_old_formats.py loads: the suite's Tiny
model + AdamW, trained 3 steps on 4 gloo ranks under FSDP2 over tensor parallelism
(``fsdp_tp``: _StridedShard, Shard and Replicate placements), saved by the shardsafe of
commit 57f503f (the last to write format 3.0), with ``fsdp_tp.ref.pt`` (every tensor in
full, ``torch.save`` of plain tensors). Run from the repository root:

    git worktree add /tmp/ss-format3 57f503f
    PYTHONPATH=/tmp/ss-format3/src:/tmp/ss-format3/tests .venv/bin/python tests/assets/format3_0/make_assets.py
    git worktree remove /tmp/ss-format3
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

OUT = Path(__file__).resolve().parent


def work(rank: int, world: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import dist_cases

        dist_cases.save_trained(rank, world, "fsdp_tp", str(OUT / "fsdp_tp"), str(OUT / "fsdp_tp.ref.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(work, args=(4,), nprocs=4)
    version = json.loads((OUT / "fsdp_tp" / "manifest.json").read_bytes())["version"]
    assert version == [3, 0], f"the shardsafe on PYTHONPATH wrote format {version}, not 3.0"
    print("wrote", OUT / "fsdp_tp", file=sys.stderr)
