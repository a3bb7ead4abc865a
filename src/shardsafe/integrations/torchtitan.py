"""shardsafe checkpoints for torchtitan 0.3.0 trainers.

One flag switches a torchtitan job from DCP to shardsafe::

    --override.imports shardsafe.integrations.torchtitan.use_shardsafe

(or, in a config function, ``config.checkpoint = ShardsafeCheckpointManager.Config(...)``).
The trainer then builds :class:`ShardsafeCheckpointManager` with its own model parts,
``OptimizersContainer``, ``LRSchedulersContainer``, dataloader and ``states={"train_state":
trainer}``, and every field of torchtitan's ``[checkpoint]`` config keeps its meaning (see
docs/torchtitan.md). A setting shardsafe cannot apply (``initial_load_in_hf_quantized``)
raises ValueError naming it when the trainer is built.

Saved tree of a step checkpoint (``FOLDER/step-00000010/``): ``model`` (the model parts'
state dict, DTensors under FSDP / TP), ``optimizer`` (torchtitan's flat FQN-keyed state),
``lr_scheduler``, ``dataloader`` (``{"state": rank_local(...)}``: each rank's own
``{"dp_rank_<r>": bytes, "world_size": n}``; the bytes are a pickle that torchtitan makes
and reads itself, shardsafe stores them as opaque checksummed bytes), ``train_state``
(``step``, ``ntokens_seen``) and any other entry of ``states``. The last step with
``last_save_model_only`` holds only ``model`` in ``export_dtype``, or, with
``last_save_in_hf``, ``hf_model`` (Hugging Face names) plus an exported Hugging Face folder
``FOLDER/step-00000010-hf/``.
"""

from __future__ import annotations

import glob
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torchtitan.components.checkpointer import BaseCheckpointManager, ModelWrapper
from torchtitan.components.checkpointer import CheckpointManager as DcpCheckpointManager
from torchtitan.config.override import derive, override
from torchtitan.tools import filesystem

import shardsafe
from shardsafe import (
    CheckpointError,
    CheckpointManager,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DtypeMismatchError,
    FormatVersionError,
    MissingKeysError,
    rank_local,
)
from shardsafe.hints import as_keys, nearest

EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
MODEL, OPTIMIZER, DATALOADER, LR_SCHEDULER = "model", "optimizer", "dataloader", "lr_scheduler"
HF_MODEL = "hf_model"  # top-level key of a last-step checkpoint saved under Hugging Face names
_SKIPPABLE = (CorruptCheckpointError, CheckpointNotFoundError, FormatVersionError)


class RankLocalDataloader:
    """torchtitan's dataloader as a Stateful whose state is rank-local: every rank saves
    and gets back its own ``{"dp_rank_<r>": bytes, "world_size": n}``."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def state_dict(self) -> dict[str, Any]:
        """``{"state": rank_local(dataloader.state_dict())}``."""
        return {"state": rank_local(self.dataloader.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand this rank's saved state back to the dataloader."""
        value = state_dict["state"]
        self.dataloader.load_state_dict(getattr(value, "value", value))


class FlatOptimizerState:
    """torchtitan's ``OptimizersContainer`` as a plain Stateful. The container is a
    ``torch.optim.Optimizer`` whose state dict is flat and FQN-keyed (``state.<fqn>.<name>``,
    ``param_groups.<fqn>.<key>``), not torch's ``{"state", "param_groups": [...]}``, so
    shardsafe's pre-load checks for torch's optimizer layout must not be applied to it."""

    def __init__(self, optimizers: Any) -> None:
        self.optimizers = optimizers

    def state_dict(self) -> dict[str, Any]:
        """The container's flat state dict."""
        return self.optimizers.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Hand the loaded flat state back to the container."""
        self.optimizers.load_state_dict(state_dict)


class ShardsafeCheckpointManager(BaseCheckpointManager):
    """torchtitan's checkpoint manager contract, backed by :class:`shardsafe.CheckpointManager`.

    Saves are crash-safe shardsafe checkpoints (no pickle read by shardsafe, per-chunk
    checksums, atomic commit); loads pick the latest valid step (skipping corrupt ones with a
    warning) and reshard DTensors to the current layout."""

    @dataclass(kw_only=True, slots=True)
    class Config(DcpCheckpointManager.Config):
        """Every field of torchtitan's ``CheckpointManager.Config`` (0.3.0), same meanings,
        plus shardsafe's own ``compression`` ("off", "auto", "zstd", "lz4"; see shardsafe.save)."""

        compression: str = "off"

    def __init__(self, config: Config, *, dataloader: Any, model_parts: list[torch.nn.Module], optimizers: Any,
                 lr_schedulers: Any, states: dict[str, Any], sd_adapter: Any, base_folder: str = "") -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        if config.initial_load_in_hf_quantized:
            raise ValueError(
                "checkpoint.initial_load_in_hf_quantized=True: shardsafe cannot load quantized Hugging Face "
                "checkpoints (torchtitan reads them through DCP's model-specific quantized readers). Dequantize the "
                "checkpoint first, or unset initial_load_in_hf_quantized.")
        if config.last_save_in_hf and sd_adapter is None:
            raise ValueError("checkpoint.last_save_in_hf=True needs the model's state-dict adapter; this model "
                             "has none")
        self.config = config
        self.folder = filesystem.join(base_folder, config.folder)
        self.sd_adapter = sd_adapter
        self.model = ModelWrapper(model_parts)
        self.states = states
        states.update({MODEL: self.model, OPTIMIZER: optimizers, DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers})
        excluded = as_keys(config.exclude_from_loading, "checkpoint.exclude_from_loading") or ()
        for key in excluded:  # a str is one state's name, as in shardsafe.load(exclude=...)
            if key not in states:
                near = nearest(key, states)
                hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else ""
                raise ValueError(f"checkpoint.exclude_from_loading: {key!r} is not a checkpointed state{hint} "
                                 f"(states: {', '.join(sorted(states))})")
        self.excluded = excluded
        self.export_dtype = EXPORT_DTYPES[config.export_dtype]
        self.manager = CheckpointManager(
            self.folder, interval=config.interval, keep_last=config.keep_latest_k or None,
            async_mode=config.async_mode, exclude_from_loading=excluded,
            load_only=config.load_only, compression=config.compression)

    # -- state ------------------------------------------------------------------------
    def _full_state(self) -> dict[str, Any]:
        """Everything a resume needs, keyed like torchtitan's states."""
        out = dict(self.states)
        if out.get(OPTIMIZER) is not None:
            out[OPTIMIZER] = FlatOptimizerState(out[OPTIMIZER])
        if out.get(DATALOADER) is not None:
            out[DATALOADER] = RankLocalDataloader(out[DATALOADER])
        return {k: v for k, v in out.items() if v is not None}

    def _export_model_state(self) -> dict[str, Any]:
        """The model state in ``export_dtype`` (floating-point tensors only)."""
        return {k: v.to(self.export_dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in self.model.state_dict().items()}

    # -- saving -----------------------------------------------------------------------
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        """Save when torchtitan's rules say so: every ``interval`` steps, at step 1 with
        ``enable_first_step_checkpoint``, and at the last step; never with ``load_only``."""
        cfg = self.config
        if cfg.load_only:
            return False
        first = curr_step == 1 and cfg.enable_first_step_checkpoint
        if not (last_step or first or curr_step % cfg.interval == 0):
            return False
        if last_step:
            self._save_last_step(curr_step)
            return True
        self.manager.save(curr_step, self._full_state())
        self.save_future = self.manager.last_future if cfg.async_mode != "disabled" else None
        return True

    def _save_last_step(self, step: int) -> None:
        """The last step (and a seed checkpoint) is saved synchronously: the full state, or
        with ``last_save_model_only`` the model in ``export_dtype`` (under Hugging Face names
        and exported to ``FOLDER/step-N-hf/`` with ``last_save_in_hf``)."""
        cfg = self.config
        if not cfg.last_save_model_only:
            state = self._full_state()
        elif cfg.last_save_in_hf:
            state = {HF_MODEL: self.sd_adapter.to_hf(self._export_model_state())}
        else:
            state = {MODEL: self._export_model_state()}
        self.manager.save(step, state)
        self.manager.wait()
        self.save_future = None
        if cfg.last_save_model_only and cfg.last_save_in_hf:
            self._export_hf(step)

    def _export_hf(self, step: int) -> None:
        """Rank 0 writes the Hugging Face folder (safetensors shards and index) of ``step``."""
        from shardsafe.tools import export_checkpoint

        if _rank() == 0:
            export_checkpoint(self.manager.path(step), self.hf_path(step), "hf", keys=[HF_MODEL], strip=HF_MODEL,
                              overwrite=True, progress=False)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def hf_path(self, step: int) -> str:
        """Where ``last_save_in_hf`` exports step ``step``: ``FOLDER/step-00000010-hf``."""
        return f"{self.manager.path(step)}-hf"

    # -- loading ----------------------------------------------------------------------
    def _load(self, step: int = -1) -> bool:
        """Load ``step`` (-1: the latest valid checkpoint of the folder); with none in the
        folder, the initial load (``initial_load_path`` / ``initial_load_in_hf``). Step 0 and
        model-only checkpoints restore the model only, like torchtitan."""
        steps = self.manager.agreed_steps()
        if step != -1:
            if step not in steps:
                raise FileNotFoundError(f"checkpoint.load_step={step}: no committed checkpoint at "
                                        f"{self.manager.path(step)} (committed steps: {steps})")
            self._load_checkpoint(str(self.manager.path(step)), step, model_only=step == 0)
            return True
        for s in reversed(steps):
            try:
                self._load_checkpoint(str(self.manager.path(s)), s, model_only=s == 0)
                return True
            except _SKIPPABLE as exc:
                warnings.warn(f"skipping checkpoint {self.manager.path(s)}: {exc}", stacklevel=2)
        return self._initial_load()

    def _initial_load(self) -> bool:
        """``initial_load_path`` (a shardsafe checkpoint, or with ``initial_load_in_hf`` a
        Hugging Face folder; default for HF: the model's ``hf_assets_path``)."""
        cfg = self.config
        path = cfg.initial_load_path
        if cfg.initial_load_in_hf:
            path = path or (self.sd_adapter.hf_assets_path if self.sd_adapter is not None else None)
            if self.sd_adapter is None or not path or not os.path.isdir(path):
                raise ValueError(f"checkpoint.initial_load_in_hf=True: no Hugging Face folder to load ({path!r}; "
                                 "set checkpoint.initial_load_path or the model's hf_assets_path)")
            self._land(self.sd_adapter.from_hf(read_hf_folder(path)))
            return True
        if not path:
            return False
        if os.path.isfile(os.path.join(path, ".metadata")) and not os.path.isfile(os.path.join(path, "manifest.json")):
            raise ValueError(f"checkpoint.initial_load_path={path!r} is a torch.distributed.checkpoint (DCP) "
                             "checkpoint, whose metadata is a pickle; convert it once with "
                             "`shardsafe import --source dcp --trust-pickle SRC OUT` and point initial_load_path "
                             "at OUT")
        self._load_checkpoint(path, None, model_only=cfg.initial_load_model_only)
        return True

    def _load_checkpoint(self, path: str, step: int | None, *, model_only: bool) -> None:
        """Load the checkpoint at ``path`` (step ``step`` of the folder, or None): only the
        model when ``model_only``, else all of ``states`` minus ``exclude_from_loading``. A
        model-only checkpoint (a ``last_save_model_only`` export) cannot resume a full
        state: CheckpointError naming it, never a partial load."""
        keys = set(shardsafe.read_manifest(path, indexes=False).tree)
        model_key = HF_MODEL if HF_MODEL in keys else MODEL
        if not model_only and OPTIMIZER not in keys:
            raise CheckpointError(
                f"{path} holds only the model (a last_save_model_only export), not the training state to resume; "
                "start from its weights with checkpoint.initial_load_path (and initial_load_model_only) in a new "
                "folder, or pick a full checkpoint with checkpoint.load_step")
        if model_only:
            self._load_model(path, step, model_key)
        elif step is not None:
            self.manager.load(self._full_state(), step=step)
        else:
            shardsafe.load(self._full_state(), path, exclude=self.excluded)

    def _load_model(self, path: str, step: int | None, key: str) -> None:
        """The model from ``key`` (``model``, or ``hf_model`` in Hugging Face names): in place
        when the dtypes match, else read whole and converted (a model exported in another
        ``export_dtype``)."""
        hf = key == HF_MODEL
        dest = self.model.state_dict()
        if hf:
            dest = self.sd_adapter.to_hf(dest)
        try:
            if step is not None:
                self.manager.load({key: dest}, step=step)
            else:
                shardsafe.load({key: dest}, path)
        except DtypeMismatchError:
            dest = shardsafe.load_full(path, keys=key)[key]
        self._land(self.sd_adapter.from_hf(dest) if hf else dest)

    def _land(self, native: dict[str, Any]) -> None:
        """Copy full or sharded model tensors into the model parts (in the parameters' dtype
        and, for DTensor parameters, their placements)."""
        from torch.distributed.tensor import DTensor, distribute_tensor

        current = self.model.state_dict()
        missing = sorted(set(current) - set(native))
        if missing:
            raise MissingKeysError(f"the loaded model lacks {len(missing)} key(s) of the model, e.g. {missing[:5]}")
        out = {}
        for k, d in current.items():
            v = native[k]
            if v is not d and isinstance(d, torch.Tensor):
                v = v.to(d.dtype)
                if isinstance(d, DTensor) and not isinstance(v, DTensor):
                    v = distribute_tensor(v, d.device_mesh, d.placements, src_data_rank=None)
            out[k] = v
        self.model.load_state_dict(out)

    # -- async / lifecycle --------------------------------------------------------------
    def _maybe_wait_for_staging(self) -> None:
        """Nothing to wait for: an async save returns once its state is staged."""

    def _wait_for_saving(self) -> None:
        """Block until the async save in flight has committed (raises its error)."""
        self.manager.wait()
        self.save_future = None

    def _close(self) -> None:
        """Wait for a pending save, then release the manager's buffers."""
        self.manager.close()


def read_hf_folder(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in a Hugging Face folder (full tensors,
    read with the safetensors library: no pickle)."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"checkpoint.initial_load_in_hf=True: no *.safetensors file in {path}")
    out: dict[str, torch.Tensor] = {}
    for name in files:
        with safe_open(name, framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


@override(target=BaseCheckpointManager.Config, description="shardsafe checkpoints (no pickle, checksums, commit)")
def use_shardsafe(cfg: BaseCheckpointManager.Config) -> ShardsafeCheckpointManager.Config:
    """The override behind ``--override.imports shardsafe.integrations.torchtitan.use_shardsafe``:
    the job's checkpoint config, every field kept, now building a ShardsafeCheckpointManager."""
    return derive(cfg, ShardsafeCheckpointManager.Config)


__all__ = ["ShardsafeCheckpointManager", "FlatOptimizerState", "RankLocalDataloader", "read_hf_folder", "use_shardsafe",
           "HF_MODEL"]
