"""Does a saved state fit a Stateful? Decided before the first destination byte changes.

``load`` fills tensors in place and calls ``load_state_dict`` only once every byte has
landed; for the Statefuls that matter the checks that their ``load_state_dict`` would make
(and fail on, half way through a load) are made here first, on the tree the load is about
to hand them:

- ``nn.Module`` (strict): exactly the module's keys (missing keys are refused by matching;
  extra saved keys here);
- ``torch.optim.Optimizer``: the same number of param groups, each with as many params;
- LR schedulers: a dict; ``LambdaLR``-style schedulers: as many lambdas;
- ``GradScaler``: an enabled scaler needs a non-empty state;
- ``TrainState``: its model (strict keys), optimizer (param groups), scheduler, scaler and
  data position by the rules above; ``ElasticSampler``: its own validation.

What is not checked (a user's own Stateful, a StatefulDataLoader's internals) can still
fail in ``load_state_dict``; that failure becomes a CheckpointError naming the key, and the
tensors of the load have landed by then (docs/format.md, "What a failed load changes").
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError, UnexpectedKeysError


def _keys(d: Any) -> set:
    return set(d.keys()) if isinstance(d, dict) else set()


def _module(new: Any, current: Any, path: str, strict: bool) -> list[CheckpointError]:
    if not strict:
        return []
    extra = sorted(str(k) for k in _keys(new) - _keys(current))
    if extra:
        shown = ", ".join(repr(k) for k in extra[:5]) + (" ..." if len(extra) > 5 else "")
        return [UnexpectedKeysError(f"key '{path}': the checkpoint has {len(extra)} key(s) the model does not: "
                                    f"{shown} (load with strict=False to ignore them)")]
    return []


def _optimizer(opt: torch.optim.Optimizer, new: Any, path: str) -> list[CheckpointError]:
    groups = new.get("param_groups") if isinstance(new, dict) else None
    if not isinstance(groups, list):
        return [CheckpointError(f"key '{path}': the saved optimizer state has no param_groups list")]
    if len(groups) != len(opt.param_groups):
        return [CheckpointError(f"key '{path}': the checkpoint's optimizer has {len(groups)} param group(s), "
                                f"this optimizer {len(opt.param_groups)}")]
    for i, (saved, mine) in enumerate(zip(groups, opt.param_groups)):
        params = saved.get("params") if isinstance(saved, dict) else None
        if not isinstance(params, list) or len(params) != len(mine["params"]):
            n = len(params) if isinstance(params, list) else "no"
            return [CheckpointError(f"key '{path}': param group {i} of the checkpoint has {n} params, this "
                                    f"optimizer's has {len(mine['params'])}")]
    return []


def _scheduler(sched: Any, new: Any, path: str) -> list[CheckpointError]:
    if not isinstance(new, dict):
        return [CheckpointError(f"key '{path}': the saved LR scheduler state is not a dict")]
    lambdas = getattr(sched, "lr_lambdas", None)
    saved = new.get("lr_lambdas")
    if isinstance(lambdas, list) and isinstance(saved, list) and len(saved) != len(lambdas):
        return [CheckpointError(f"key '{path}': the checkpoint's scheduler has {len(saved)} lr_lambdas, this one "
                                f"{len(lambdas)}")]
    return []


def _scaler(scaler: Any, new: Any, path: str) -> list[CheckpointError]:
    if getattr(scaler, "_enabled", False) and not new:
        return [CheckpointError(f"key '{path}': the saved GradScaler state is empty (saved from a disabled scaler) "
                                "but this scaler is enabled")]
    return []


def _data(obj: Any, new: Any, path: str) -> list[CheckpointError]:
    check = getattr(obj, "validate_state_dict", None)
    if callable(check):
        try:
            check(new)
        except (ValueError, TypeError) as exc:
            return [CheckpointError(f"key '{path}': {exc}")]
    return []


def fit_problems(obj: Any, new: Any, current: Any, path: str, strict: bool) -> list[CheckpointError]:
    """Why ``obj.load_state_dict(new)`` would fail (``current``: ``obj.state_dict()`` as the
    load saw it), for the Statefuls listed in the module docstring; [] when it fits or
    when ``obj`` is of another kind."""
    from torch.optim.lr_scheduler import LRScheduler

    from .train_state import TrainState

    if isinstance(obj, TrainState):
        if not isinstance(new, dict):
            return [CheckpointError(f"key '{path}': the saved TrainState is not a dict")]
        out = _module(new.get("model"), current.get("model"), f"{path}.model", strict)
        if obj.optimizer is not None and new.get("optim") is not None:
            out += _optimizer(obj.optimizer, new["optim"], f"{path}.optim")
        if obj.lr_scheduler is not None and new.get("lr_scheduler") is not None:
            out += fit_problems(obj.lr_scheduler, new["lr_scheduler"], None, f"{path}.lr_scheduler", strict)
        if obj.grad_scaler is not None and new.get("grad_scaler") is not None:
            out += _scaler(obj.grad_scaler, new["grad_scaler"], f"{path}.grad_scaler")
        if obj.data is not None and new.get("data") is not None:
            out += _data(obj.data, new["data"], f"{path}.data")
        return out
    if isinstance(obj, torch.nn.Module):
        return _module(new, current, path, strict)
    if isinstance(obj, torch.optim.Optimizer) and isinstance(current, dict) and "param_groups" in current:
        return _optimizer(obj, new, path)  # (containers such as torchtitan's flatten their own state)
    if isinstance(obj, LRScheduler):
        return _scheduler(obj, new, path)
    if type(obj).__name__ == "GradScaler":
        return _scaler(obj, new, path)
    return _data(obj, new, path)
