"""Writes a checkpoint in an older format for tests/test_old_formats.py: the suite's Tiny
model + AdamW, trained 3 steps on 4 gloo ranks under FSDP2 over tensor parallelism
(``fsdp_tp``: _StridedShard, Shard and Replicate placements), saved by the shardsafe on
PYTHONPATH, as ``assets/<folder>/fsdp_tp`` with ``fsdp_tp.ref.pt`` (every tensor in full,
``torch.save`` of plain tensors). Run from the repository root with the last commit that
wrote that format:

    format2   (2.0)  98d6641
    format3_0 (3.0)  57f503f

    git worktree add /tmp/ss-old COMMIT
    PYTHONPATH=/tmp/ss-old/src:/tmp/ss-old/tests .venv/bin/python tests/assets/make_old_format.py FOLDER VERSION
    git worktree remove /tmp/ss-old
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

ASSETS = Path(__file__).resolve().parent


def work(rank: int, world: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        import dist_cases

        dist_cases.save_trained(rank, world, "fsdp_tp", str(Path(out) / "fsdp_tp"), str(Path(out) / "fsdp_tp.ref.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    folder, expected = sys.argv[1], [int(v) for v in sys.argv[2].split(".")]
    out = ASSETS / folder
    out.mkdir(exist_ok=True)
    mp.spawn(work, args=(4, str(out)), nprocs=4)
    version = json.loads((out / "fsdp_tp" / "manifest.json").read_bytes())["version"]
    assert version == expected, f"the shardsafe on PYTHONPATH wrote format {version}, not {sys.argv[2]}"
    print("wrote", out / "fsdp_tp", file=sys.stderr)
