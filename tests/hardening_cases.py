"""Distributed cases for test_hardening.py."""

from __future__ import annotations

import torch

import shardsafe


def save_partial(rank: int, world: int, path: str) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    mesh = init_device_mesh("cpu", (world,))
    p = DTensor.from_local(torch.ones(4), mesh, [Partial()])
    try:
        shardsafe.save({"p": p, "w": torch.zeros(2)}, path)
    except shardsafe.CheckpointError as exc:
        return str(exc)
    return "saved"
