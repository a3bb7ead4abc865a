"""TrainState: everything one resume needs, as a single Stateful.

Saved tree (all keys always present, ``None`` where a component is absent)::

    model        get_state_dict(model, ...) — FQNs without DDP's "module." or
                 torch.compile's "_orig_mod.", DTensors under FSDP2 / TP
    optim        the optimizer state keyed by FQN (get_state_dict)
    lr_scheduler, grad_scaler, data     their state_dict()
    counters     {"step", "epoch", "tokens_seen"}
    world_size   the saving world size
    rng          rank-local: every rank's streams (see state/rng.py)
    rng_base_seed, rng_policy           how streams are re-derived on another world size
    extra        user Statefuls and values

Restore order: model and optimizer (set_state_dict, which restores the saved LR into
the param groups), then the scheduler (it exists before the optimizer state is loaded,
and after load it shows the saved LR), the grad scaler, the data position, counters and
the RNG streams last, so nothing consumes random numbers after they are restored.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..hints import warn_user
from . import rng as rng_mod
from .context import current_rank_world
from .tree import RankLocal, rank_local

RNG_POLICY = (
    "same world size: every rank's streams restored exactly; other world size: every stream "
    "reseeded with derive_seed(rng_base_seed, step, rank) = XXH3-64('{base}:{step}:{rank}') & (2**63-1)"
)


def _world() -> tuple[int, int]:
    """(rank, world) of the group the save or load in progress runs on."""
    return current_rank_world()


class TrainState:
    """A Stateful bundling model, optimizer, scheduler, grad scaler, data position,
    counters (``step``, ``epoch``, ``tokens_seen``), RNG streams and user extras.

    Pass it (alone or inside a dict) to :func:`shardsafe.save` / :func:`shardsafe.load`."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: Any = None,
        grad_scaler: Any = None,
        data: Any = None,
        extra: dict[str, Any] | None = None,
        *,
        numpy_generators: dict[str, np.random.Generator] | None = None,
        rng_base_seed: int | None = None,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.grad_scaler = grad_scaler
        self.data = data
        self.extra = extra if extra is not None else {}
        self.numpy_generators = numpy_generators or {}
        self.rng_base_seed = int(torch.initial_seed()) if rng_base_seed is None else int(rng_base_seed)
        self.step = 0
        self.epoch = 0
        self.tokens_seen = 0
        self.rng_restored: str | None = None  # "exact" or "derived" after a load
        self._warned_rng = False  # the "RNG derived" warning is given once per TrainState

    def _check_optimizer(self) -> None:
        """Refuse an optimizer whose parameters are not the model's (typically one created
        before ``fully_shard`` / ``DDP`` replaced the parameters): its state would not
        match the sharded parameters."""
        if self.optimizer is None:
            return
        mine = {id(p) for p in self.model.parameters()}
        for gi, group in enumerate(self.optimizer.param_groups):
            for pi, p in enumerate(group["params"]):
                if id(p) not in mine:
                    from ..errors import CheckpointError

                    raise CheckpointError(
                        f"TrainState: parameter {pi} of the optimizer's param group {gi} is not a parameter of the "
                        "model. Was the optimizer created before fully_shard / DDP / model wrapping replaced the "
                        "parameters? Create the optimizer after wrapping the model: "
                        "optimizer = torch.optim.AdamW(model.parameters(), ...)")

    # -- Stateful ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The whole training state; model and optimizer via ``get_state_dict``."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        self._check_optimizer()
        if self.optimizer is not None:
            msd, osd = get_state_dict(self.model, self.optimizer)
        else:
            msd, osd = get_model_state_dict(self.model), None
        _, world = _world()
        return {
            "model": msd,
            "optim": osd,
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "grad_scaler": self.grad_scaler.state_dict() if self.grad_scaler is not None else None,
            "data": self.data.state_dict() if self.data is not None else None,
            "counters": {"step": self.step, "epoch": self.epoch, "tokens_seen": self.tokens_seen},
            "world_size": world,
            "rng": rank_local(rng_mod.capture(self.numpy_generators), missing="keep"),
            "rng_base_seed": self.rng_base_seed,
            "rng_policy": RNG_POLICY,
            "extra": self.extra,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore everything, in the order given in the module docstring."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        self._check_optimizer()
        if self.optimizer is not None:
            set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        else:
            set_model_state_dict(self.model, sd["model"])
        if self.lr_scheduler is not None and sd.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        if self.grad_scaler is not None and sd.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(sd["grad_scaler"])
        if self.data is not None and sd.get("data") is not None:
            self.data.load_state_dict(sd["data"])
        counters = sd["counters"]
        self.step = int(counters["step"])
        self.epoch = int(counters["epoch"])
        self.tokens_seen = int(counters["tokens_seen"])
        self.rng_base_seed = int(sd["rng_base_seed"])
        rank, world = _world()
        streams = sd["rng"].value if isinstance(sd["rng"], RankLocal) else sd["rng"]
        if int(sd["world_size"]) == world and isinstance(streams, dict) and "torch" in streams:
            rng_mod.restore(streams, self.numpy_generators)
            self.rng_restored = "exact"
        else:
            if not self._warned_rng:
                self._warned_rng = True
                warn_user(f"checkpoint saved on {sd['world_size']} ranks, resuming on {world}: RNG streams are "
                          "re-derived from (rng_base_seed, step, rank), not restored")
            rng_mod.reseed(rng_mod.derive_seed(self.rng_base_seed, self.step, rank), self.numpy_generators)
            self.rng_restored = "derived"
