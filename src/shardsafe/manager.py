"""CheckpointManager: a folder of step checkpoints with an interval, retention, resume
from the latest valid checkpoint, async saves and a final model-only export.

Layout: ``FOLDER/step-00000500/`` (one shardsafe checkpoint per step, 8-digit zero padded;
larger steps simply use more digits). Retention runs on rank 0 after a newer checkpoint
has committed: it keeps the ``keep_last`` newest steps and every step divisible by
``keep_every``, and never deletes the checkpoint being written or the one last loaded.
"""

from __future__ import annotations

import contextlib
import os
import tomllib
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .checkpoint_folder import clean_leftovers, delete_checkpoint, is_committed, leftover_of
from .checkpointer import Checkpointer, SaveFuture
from .comm import resolve
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from .steps import parse_step, step_name
from .storage.base import Folder

PathLike = str | os.PathLike
ASYNC_MODES = ("disabled", "async", "async_pinned")


def step_dir(folder: PathLike, step: int) -> Path:
    """The folder of ``step``: ``FOLDER/step-00000500``."""
    return Path(folder) / step_name(step)


@dataclass
class CheckpointConfig:
    """The manager's settings, mirroring torchtitan's ``[checkpoint]`` section.

    ``CheckpointConfig.from_dict(d)`` / ``from_toml(path, section="checkpoint")`` accept
    torchtitan's names too: ``keep_latest_k`` (= keep_last), ``load_step`` (-1 = latest),
    ``last_save_model_only`` / ``export_dtype`` for the final export."""

    folder: str = "checkpoints"
    enable: bool = True
    interval: int = 500
    keep_last: int | None = None
    keep_every: int | None = None
    async_mode: str = "disabled"
    max_staging_bytes: int | None = None
    load_step: int | None = None
    exclude_from_loading: list[str] = field(default_factory=list)
    last_save_model_only: bool = True
    export_dtype: str | None = None  # None: export in the training dtype

    _ALIASES = {"keep_latest_k": "keep_last", "enable_checkpoint": "enable"}

    def __post_init__(self) -> None:
        self.async_mode = {"async_with_pinned_mem": "async_pinned"}.get(self.async_mode, self.async_mode)
        if self.async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode must be one of {ASYNC_MODES}, not {self.async_mode!r}")
        if self.interval <= 0:
            raise ValueError(f"interval must be positive, not {self.interval}")
        if self.keep_last is not None and self.keep_last <= 0:
            self.keep_last = None  # torchtitan: 0 keeps everything
        if self.load_step is not None and self.load_step < 0:
            self.load_step = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointConfig:
        """Build from a dict (unknown keys raise ValueError naming them)."""
        names = {f.name for f in fields(cls) if not f.name.startswith("_")}
        out: dict[str, Any] = {}
        for k, v in d.items():
            k = cls._ALIASES.get(k, k)
            if k not in names:
                raise ValueError(f"unknown checkpoint setting {k!r} (known: {', '.join(sorted(names))})")
            out[k] = v
        return cls(**out)

    @classmethod
    def from_toml(cls, path: PathLike, section: str = "checkpoint") -> CheckpointConfig:
        """Build from the ``[section]`` table of a TOML file."""
        with open(path, "rb") as f:
            data = tomllib.load(f)
        return cls.from_dict(data.get(section, {}))

    def to_dict(self) -> dict[str, Any]:
        """The settings as a plain dict (the inverse of ``from_dict``)."""
        return {k: v for k, v in asdict(self).items() if not k.startswith("_")}


class CheckpointManager:
    """Step checkpoints in one folder; every rank of the job calls every method.

    The manager owns a :class:`~shardsafe.Checkpointer` (its memory budget, staging
    buffers and async save in flight); ``close()`` releases it. Rank 0 lists the folder,
    chooses what to load and applies retention; the other ranks follow its choice."""

    def __init__(
        self,
        folder: PathLike,
        *,
        interval: int = 500,
        keep_last: int | None = None,
        keep_every: int | None = None,
        async_mode: str = "disabled",
        max_staging_bytes: int | None = None,
        exclude_from_loading: list[str] | tuple[str, ...] = (),
        process_group: Any = None,
        checkpointer: Checkpointer | None = None,
    ) -> None:
        self.config = CheckpointConfig(str(folder), True, interval, keep_last, keep_every, async_mode,
                                       max_staging_bytes, None, list(exclude_from_loading))
        self.folder = Path(folder)
        self.process_group = process_group
        self.checkpointer = checkpointer if checkpointer is not None else Checkpointer(
            pin_memory=async_mode == "async_pinned")
        self._owns_checkpointer = checkpointer is None
        self._async = async_mode != "disabled"
        self._pending_step: int | None = None
        self._loaded_step: int | None = None
        self.last_future: SaveFuture | None = None
        self._closed = False
        backend, location = self.checkpointer.locate(folder)
        self._backend, self._location = backend, location
        with self._open(create=True) as f:
            if resolve(process_group).rank == 0:
                self._clean(f)

    @classmethod
    def from_config(cls, config: CheckpointConfig | dict[str, Any], process_group: Any = None) -> CheckpointManager:
        """A manager driven by a :class:`CheckpointConfig` (or its dict form)."""
        if isinstance(config, dict):
            config = CheckpointConfig.from_dict(config)
        mgr = cls(config.folder, interval=config.interval, keep_last=config.keep_last, keep_every=config.keep_every,
                  async_mode=config.async_mode, max_staging_bytes=config.max_staging_bytes,
                  exclude_from_loading=config.exclude_from_loading, process_group=process_group)
        mgr.config = config
        return mgr

    def _open(self, create: bool = False) -> Folder:
        return self._backend.open(self._location, create=create)

    # -- listing ----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present), ascending, as this rank sees them."""
        out = []
        try:
            with self._open() as f:
                for name in f.names():
                    step = parse_step(name)
                    if step is not None and is_committed(f, name):
                        out.append(step)
        except CheckpointNotFoundError:
            return []
        return sorted(out)

    def path(self, step: int) -> Path:
        """The folder of ``step`` in this manager's folder."""
        return step_dir(self.folder, step)

    def _clean(self, folder: Folder) -> None:
        """Repair and delete what interrupted saves and deletions left (rank 0)."""
        names = {found[0] for found in (leftover_of(n) for n in folder.names()) if found is not None}
        for name in sorted(names):
            if parse_step(name) is not None:
                with contextlib.suppress(CheckpointError):
                    clean_leftovers(folder, name)

    # -- saving -----------------------------------------------------------------------
    def should_save(self, step: int, *, force: bool = False) -> bool:
        """True when ``maybe_save(step, ...)`` would save."""
        return force or (self.config.enable and step % self.config.interval == 0)

    def maybe_save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """Save when ``step`` is a multiple of the interval (or ``force``); True if it saved."""
        if not self.should_save(step, force=force):
            return False
        self.save(step, state)
        return True

    def save(self, step: int, state: dict[str, Any]) -> SaveFuture | None:
        """Save ``state`` as step ``step`` (sync or async per ``async_mode``), then apply retention."""
        self._complete_pending()
        path = self.path(step)
        if not self._async:
            self.checkpointer.save(state, path, overwrite=True, process_group=self.process_group)
            self._retain(protect=step)
            return None
        self._pending_step = step
        self.last_future = self.checkpointer.async_save(state, path, overwrite=True, process_group=self.process_group,
                                                        max_staging_bytes=self.config.max_staging_bytes)
        return self.last_future

    def _complete_pending(self) -> None:
        """Wait for the async save in flight; on success apply retention."""
        if self._pending_step is None:
            return
        step, self._pending_step = self._pending_step, None
        self.checkpointer.wait()  # raises the background error, if any
        self._retain(protect=step)

    def wait(self) -> None:
        """Block until any async save has committed (raises its error)."""
        self._complete_pending()

    def _retain(self, protect: int) -> None:
        """Delete checkpoints outside the retention policy (rank 0 only). Each deletion
        takes the checkpoint out of readers' sight first (see ``checkpoint_folder``)."""
        if resolve(self.process_group).rank != 0 or self.config.keep_last is None:
            return
        steps = self.steps()
        keep = set(steps[-self.config.keep_last:])
        if self.config.keep_every:
            keep |= {s for s in steps if s % self.config.keep_every == 0}
        keep.add(protect)
        if self._loaded_step is not None:
            keep.add(self._loaded_step)
        with self._open() as f:
            for s in steps:
                if s not in keep:
                    delete_checkpoint(f, step_name(s))

    # -- loading ----------------------------------------------------------------------
    def load(self, state: dict[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Load step ``step``, or the latest valid checkpoint when None (skipping incomplete
        or corrupt ones with a warning naming them). Returns the step loaded, or None when
        there is no checkpoint. Keys in ``exclude_from_loading`` are left untouched.

        Rank 0 chooses the candidates (its listing) and every rank follows, so ranks with
        different views of the folder (NFS attribute caches) never restore different
        steps; the load itself checks that every rank read the same manifest."""
        self._complete_pending()
        if step is None and self.config.load_step is not None:
            step = self.config.load_step
        comm = resolve(self.process_group)
        if step is not None:
            candidates = [step]
        else:
            mine = list(reversed(self.steps())) if comm.rank == 0 else None
            count = comm.broadcast_ints([len(mine)] if mine is not None else None, 1)[0]
            candidates = comm.broadcast_ints(mine, count) if count else []
        for s in candidates:
            try:
                self.checkpointer.load(state, self.path(s), strict=strict, process_group=self.process_group,
                                       exclude=self.config.exclude_from_loading)
            except (CorruptCheckpointError, CheckpointNotFoundError, FormatVersionError) as exc:
                if step is not None:
                    raise
                warnings.warn(f"skipping checkpoint {self.path(s)}: {exc}", stacklevel=2)
                continue
            self._loaded_step = s
            return s
        return None

    # -- final export -----------------------------------------------------------------
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
        out = Path(path) if path is not None else self.folder / "final"
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
        return out / first

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending work; the manager can no longer save afterwards."""
        if self._closed:
            return
        try:
            self._complete_pending()
        finally:
            self._closed = True
            if self._owns_checkpointer:
                self.checkpointer.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
