"""Random number streams: capture and restore every stream a training step may draw
from, and re-derive them deterministically when the world size changes.

Captured: Python ``random``, NumPy's global RandomState, any registered
``numpy.random.Generator``, torch's CPU generator, and every accelerator device's
generator (CUDA or another ``torch.accelerator`` backend; guarded, skipped when absent).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from ..format.checksum import checksum


def _accelerator_module() -> Any | None:
    """The torch device module (torch.cuda, torch.xpu, ...) of an available accelerator, or None."""
    try:
        acc = getattr(torch, "accelerator", None)
        if acc is not None and acc.is_available():
            dev = acc.current_accelerator()
            mod = torch.get_device_module(dev.type) if dev is not None else None
            if mod is not None and hasattr(mod, "get_rng_state_all"):
                return mod
    except Exception:  # noqa: BLE001 - a broken accelerator stack must not break checkpoints
        return None
    if torch.cuda.is_available():
        return torch.cuda
    return None


def _numpy_state(state: dict) -> dict:
    """A bit generator state with numpy arrays turned into tensors (saveable without pickle)."""
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _numpy_state(v)
        elif isinstance(v, np.ndarray):
            out[k] = torch.from_numpy(v.copy())
        elif isinstance(v, np.integer):
            out[k] = int(v)
        elif isinstance(v, np.floating):
            out[k] = float(v)
        else:
            out[k] = v
    return out


def _numpy_restore(state: dict) -> dict:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _numpy_restore(v)
        elif isinstance(v, torch.Tensor):
            out[k] = v.numpy().copy()
        else:
            out[k] = v
    return out


def capture(generators: dict[str, np.random.Generator] | None = None) -> dict[str, Any]:
    """Every stream's state as a saveable tree (tensors, ints, tuples)."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(np.random.get_state(legacy=False)),
        "torch": torch.get_rng_state(),
        "generators": {name: _numpy_state(g.bit_generator.state) for name, g in (generators or {}).items()},
    }
    mod = _accelerator_module()
    if mod is not None:
        state["accelerator"] = {"type": mod.__name__.rsplit(".", 1)[-1], "states": list(mod.get_rng_state_all())}
    return state


def restore(state: dict[str, Any], generators: dict[str, np.random.Generator] | None = None) -> None:
    """Put every captured stream back exactly."""
    random.setstate(_as_python_state(state["python"]))
    np.random.set_state(_numpy_restore(state["numpy"]))
    torch.set_rng_state(state["torch"])
    for name, g in (generators or {}).items():
        saved = state.get("generators", {}).get(name)
        if saved is None:
            raise KeyError(f"no saved state for numpy generator '{name}'")
        g.bit_generator.state = _numpy_restore(saved)
    acc = state.get("accelerator")
    mod = _accelerator_module()
    if acc is not None and mod is not None:
        states = acc["states"]
        if len(states) == mod.device_count():
            mod.set_rng_state_all(states)
        else:  # a different number of devices per process: seed from the first stream
            mod.manual_seed_all(int(torch.as_tensor(states[0])[:8].view(torch.int64).item()) & (2**63 - 1))


def _as_python_state(s: Any) -> tuple:
    version, internal, gauss = s
    return (version, tuple(internal), gauss)


def derive_seed(base_seed: int, step: int, rank: int) -> int:
    """The documented re-derivation: XXH3-64 of ``"{base_seed}:{step}:{rank}"``, as an int < 2**63."""
    return int(checksum(f"{base_seed}:{step}:{rank}".encode()), 16) & (2**63 - 1)


def reseed(seed: int, generators: dict[str, np.random.Generator] | None = None) -> None:
    """Seed every stream from ``seed`` (Python, NumPy, torch CPU and accelerators, generators)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every accelerator device
    for i, (_, g) in enumerate(sorted((generators or {}).items())):
        g.bit_generator.state = np.random.default_rng([seed, i]).bit_generator.state
