"""CheckpointManager's final export: the model's full weights as a Hugging Face folder."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .comm import resolve


def _join(folder: Any, name: str) -> Path | str:
    text = os.fspath(folder)
    if "://" in text:  # a URL: Path would fold "s3://" into "s3:/"
        return text.rstrip("/") + "/" + name
    return Path(text) / name

PathLike = str | os.PathLike


class ExportMethods:
    """Mixed into CheckpointManager; uses its folder, config, checkpointer and process group."""

    folder: Any
    config: Any
    checkpointer: Any
    process_group: Any

    def _complete_pending(self) -> None: ...  # CheckpointManager's

    def save_final(self, model: torch.nn.Module, path: PathLike | None = None, *,
                   dtype: torch.dtype | str | None = None, config: Any = None, generation_config: Any = None,
                   rename: Any = None, max_shard_size: int | str = "5GB") -> Path:
        """Export the model's full weights as a Hugging Face folder (every rank calls; rank 0
        writes) that ``transformers.AutoModelForCausalLM.from_pretrained(folder)`` loads when
        there is a config: ``model.safetensors`` (past ``max_shard_size``, like ``5GB``:
        shards and ``model.safetensors.index.json``), converted to ``dtype`` (default: the
        config's ``export_dtype``; None keeps the training dtype), config.json and
        generation_config.json from ``config`` / ``generation_config`` (dicts, transformers
        configs, or the path of a config.json or Hugging Face folder; default: the model's own
        ``config`` and ``generation_config``, if any), tied weights written once, names renamed
        by ``rename`` (see :mod:`shardsafe.hf_folder`). The folder (default ``FOLDER/final``)
        is built beside its place and replaces it atomically. Returns the weights file
        (``model.safetensors``, or the index when sharded); every rank raises rank 0's error."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from . import hf_folder
        from .comm import describe, rebuild

        self._complete_pending()
        out = path if path is not None else _join(self.folder, "final")
        comm = resolve(self.process_group)
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dtype is None:
            dtype = self.config.export_dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype.removeprefix("torch."))
        first, error = hf_folder.SINGLE_NAME, None
        if comm.rank == 0:
            try:
                tensors = {k: v.detach().to(dtype) if dtype is not None and v.is_floating_point() else v.detach()
                           for k, v in sd.items()}
                cfg, gen = hf_folder.resolve_configs(config, generation_config, self.checkpointer.locate, model)
                backend, location = self.checkpointer.locate(out)
                first, _ = hf_folder.save_model_folder(
                    backend, location, tensors, max_shard_size=hf_folder.parse_size(max_shard_size), config=cfg,
                    generation_config=gen, rename=rename, cls=hf_folder.model_class(model))
            except Exception as exc:
                if not comm.distributed:
                    raise
                error = exc
        del sd
        if comm.distributed:
            status = comm.broadcast_status(describe(error, 0) if error is not None else None)
            if status is not None:
                raise error if error is not None else rebuild(status)
            sharded = comm.broadcast_ints([int(first == hf_folder.INDEX_NAME)] if comm.rank == 0 else None, 1)[0]
            first = hf_folder.INDEX_NAME if sharded else hf_folder.SINGLE_NAME
        return _join(out, first)

