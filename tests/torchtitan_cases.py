"""Test harness: torchtitan 0.3.0's llama3 debug model trained on CPU with gloo, checkpointed
by shardsafe (``--override.imports shardsafe.integrations.torchtitan.use_shardsafe``).

Run in subprocesses by tests/test_torchtitan.py (never imported by pytest itself), one per
rank (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT in the environment)::

    python -c "import torchtitan_cases as c; c.main()" SPEC.json OUT.json

SPEC: {"world": N, "jobs": [{"name", "args", "op": "train" | "load" | "seed" | "build",
"stop_at": step, "model_dtype": "bfloat16"}, ...]}.
Each job builds a Trainer from ``BASE_ARGS + args`` in this process (one gloo group shared
by the jobs), runs its op and records a digest of the final training state; rank 0 writes
OUT.json, rank r > 0 writes OUT.json.rank<r>.

The CPU workarounds below belong to this harness only (torchtitan 0.3.0 targets CUDA and a
newer torch); the library needs none of them:
1. ``torchtitan.distributed.minimal_async_ep.kernels`` imports triton (MoE kernels, unused by
   llama3): a stub module stands in for it;
2. no CUDA: torchtitan's device type / module are set to CPU shims;
3. ``torch.distributed.set_timeout`` (newer torch) is missing in 2.13: it is given torch
   2.13's own ``distributed_c10d._set_pg_timeout(timeout, group)``, which really sets the
   timeout of the (gloo) group, so torchtitan's shorter training timeout takes effect;
4. gloo has no PREMUL_SUM (what FSDP reduces with once torchtitan sets the divide factor to
   1): after each Trainer is built, every FSDPModule of its model parts is told, through the
   public ``set_force_sum_reduction_for_comms(True)``, to reduce with SUM (factor 1, same
   math; FSDP reads the flag at each reduction, so setting it after ``parallelize`` counts);
5. flex attention has no CPU backward: an override runs SDPA on the dense mask;
6. the trainer's 2 s end-of-training sleep is skipped;
7. on 2 ranks the tests pass ``--parallelism.spmd_backend partial_dtensor`` (torch 2.13's
   ``fully_shard`` rejects the default spmd_types path).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import types
from dataclasses import dataclass
from typing import Any

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_KERNEL_NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
                 "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
                 "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def _unavailable(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("triton kernels are unavailable on this CPU-only build")


def cpu_workarounds() -> None:
    """Apply workarounds 1-3 and 6 (idempotent); must run before torchtitan is imported."""
    if _KERNELS not in sys.modules:
        stub = types.ModuleType(_KERNELS)
        for name in _KERNEL_NAMES:
            setattr(stub, name, _unavailable)
        sys.modules[_KERNELS] = stub
    import torch
    import torch.distributed as dist
    import torchtitan.tools.utils as tt_utils

    class CpuDeviceModule:
        """torch.cpu plus the CUDA-style calls torchtitan makes."""

        def __getattr__(self, name: str) -> Any:
            return getattr(torch.cpu, name)

        set_device = staticmethod(lambda *a, **k: None)
        get_device_name = staticmethod(lambda *a, **k: "cpu")
        get_device_properties = staticmethod(lambda *a, **k: types.SimpleNamespace(name="cpu", total_memory=1 << 34))
        reset_peak_memory_stats = staticmethod(lambda *a, **k: None)
        empty_cache = staticmethod(lambda *a, **k: None)
        memory_stats = staticmethod(lambda *a, **k: {})
        current_device = staticmethod(lambda: 0)

    tt_utils.device_type, tt_utils.device_module = "cpu", CpuDeviceModule()
    if not hasattr(dist, "set_timeout"):
        from torch.distributed.distributed_c10d import _set_pg_timeout

        dist.set_timeout = _set_pg_timeout
    import torchtitan.trainer as trainer_mod

    class NoSleep:
        def __getattr__(self, name: str) -> Any:
            return getattr(time, name)

        sleep = staticmethod(lambda seconds: None)

    trainer_mod.time = NoSleep()


cpu_workarounds()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.attention.flex_attention import create_mask  # noqa: E402
from torchtitan.config.override import derive, override  # noqa: E402
from torchtitan.models.common.attention import FlexAttention  # noqa: E402


class CpuSdpaAttention(FlexAttention):
    """FlexAttention's contract, run as SDPA on the BlockMask's dense bool mask (workaround 5)."""

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,  # noqa: N803 (local_map)
                attention_masks: Any, score_mod: Any = None, scale: float | None = None, enable_gqa: bool = False,
                out_transform: Any = None, **kwargs: Any) -> torch.Tensor:
        assert score_mod is None and out_transform is None
        b, length = q_BLNH.shape[:2]
        mask = create_mask(attention_masks.mask_mod, b, None, length, k_BLNH.shape[1], device=q_BLNH.device)
        out = F.scaled_dot_product_attention(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
                                             attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)


@override(target=FlexAttention.Config, description="CPU: dense-mask SDPA instead of flex attention")
def cpu_attention(cfg: FlexAttention.Config) -> CpuSdpaAttention.Config:
    """Workaround 5, activated with ``--override.imports torchtitan_cases.cpu_attention``."""
    return derive(cfg, CpuSdpaAttention.Config)


ASSETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "torchtitan")
SWITCH = "shardsafe.integrations.torchtitan.use_shardsafe"
BASE_ARGS = ["--module", "llama3", "--config", "llama3_debugmodel", "--hf_assets_path", ASSETS,
             "--training.seq_len", "64", "--training.local_batch_size", "2", "--debug.seed", "7",
             "--metrics.log_freq", "100", "--checkpoint.keep_latest_k", "0",
             "--override.imports", "torchtitan_cases.cpu_attention", SWITCH]

# ------------------------------------------------------------------------------- digests
def _tensor_digest(t: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    t = t.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def _digest(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _tensor_digest(value)
    if isinstance(value, dict):
        return {str(k): _digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_digest(v) for v in value]
    if isinstance(value, bytes):
        return "bytes:" + hashlib.sha256(value).hexdigest()[:16]
    return value


def state_digest(trainer: Any, model_dtype: str | None = None) -> dict[str, Any]:
    """Digests of the model (rounded through ``model_dtype`` when given), optimizer, LR
    scheduler, counters and dataloader position."""
    model: dict[str, Any] = {}
    for part in trainer.model_parts:
        model.update(part.state_dict())
    if model_dtype is not None:
        dtype = getattr(torch, model_dtype)
        model = {k: v.to(dtype).to(v.dtype) for k, v in model.items()}
    data = trainer.dataloader.state_dict()
    return {
        "model": _digest(model),
        "optimizer": _digest(trainer.optimizers.state_dict()),
        "lr_scheduler": _digest(trainer.lr_schedulers.state_dict()),
        "train_state": _digest(trainer.state_dict()),
        "dataloader": _digest(data),
        "lr": [g["lr"] for o in trainer.optimizers.optimizers for g in o.param_groups],
    }


# ------------------------------------------------------------------------------- jobs
def build(args: list[str]) -> Any:
    """A torchtitan Trainer for ``BASE_ARGS + args``, its FSDP modules reducing with SUM
    (workaround 4)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(BASE_ARGS + list(args))
    trainer = config.build()
    for part in trainer.model_parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return trainer


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Build a trainer, run ``job["op"]``, report what the test checks."""
    t0 = time.perf_counter()
    trainer = build(job["args"])
    out: dict[str, Any] = {"checkpointer": type(trainer.checkpointer).__name__}
    try:
        op = job.get("op", "train")
        if op == "train":
            if job.get("stop_at"):  # a job stopped (preempted) after step stop_at, its config unchanged
                trainer.should_continue_training = lambda: trainer.step < job["stop_at"]
            trainer.train()
            out["digest"] = state_digest(trainer, job.get("model_dtype"))
        elif op == "seed":  # what torchtitan's train.py does with create_seed_checkpoint
            trainer.checkpointer.save(curr_step=0, last_step=True)
            out["digest"] = state_digest(trainer, job.get("model_dtype"))
        elif op == "load":  # the checkpoint load that starts train(), alone
            out["loaded"] = trainer.checkpointer.load(step=trainer.config.checkpoint.load_step)
            out["step"] = trainer.step
            out["digest"] = state_digest(trainer, job.get("model_dtype"))
        elif op == "build":
            pass
        else:
            raise ValueError(f"unknown op {op!r}")
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        trainer.close()
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def main() -> None:
    """Entry point: ``SPEC.json OUT.json``; runs every job, writes the results as JSON."""
    spec_path, out_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("RANK", str(spec.get("rank", 0)))
    os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
    os.environ.setdefault("WORLD_SIZE", str(spec.get("world", 1)))
    os.environ.setdefault("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])
    results = []
    for job in spec["jobs"]:
        try:
            results.append({"name": job["name"], **run_job(job)})
        except Exception as exc:  # noqa: BLE001 - a trainer that fails to build
            results.append({"name": job["name"], "error": f"{type(exc).__name__}: {exc}"})
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    rank = int(os.environ["RANK"])
    with open(out_path if rank == 0 else f"{out_path}.rank{rank}", "w") as f:
        json.dump(results, f, indent=1)
