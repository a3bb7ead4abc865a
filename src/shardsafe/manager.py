"""CheckpointManager: a folder of step checkpoints with an interval, retention, resume
from the latest valid checkpoint, async saves and a final model-only export.

Layout: ``FOLDER/step-00000500/`` (one shardsafe checkpoint per step, 8-digit zero padded;
larger steps simply use more digits). Retention runs on rank 0 after a newer checkpoint
has committed: it keeps the ``keep_last`` newest steps and every step divisible by
``keep_every``, and never deletes the checkpoint being written or the one last loaded.
"""

from __future__ import annotations

import re
import shutil
import tomllib
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from .api import PathLike, load, read_manifest, save
from .async_save import AsyncSaver, SaveFuture
from .comm import resolve
from .errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, FormatVersionError
from .storage import local

STEP_RE = re.compile(r"^step-(\d{8,})$")
ASYNC_MODES = ("disabled", "async", "async_pinned")


def step_dir(folder: PathLike, step: int) -> Path:
    """The folder of ``step``: ``FOLDER/step-00000500``."""
    return Path(folder) / f"step-{step:08d}"


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
    export_dtype: str = "float32"

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
    """Step checkpoints in one folder; every rank of the job calls every method."""

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
    ) -> None:
        self.config = CheckpointConfig(str(folder), True, interval, keep_last, keep_every, async_mode,
                                       max_staging_bytes, None, list(exclude_from_loading))
        self.folder = Path(folder)
        self.process_group = process_group
        self._saver = AsyncSaver(pin_memory=async_mode == "async_pinned") if async_mode != "disabled" else None
        self._pending_step: int | None = None
        self._loaded_step: int | None = None
        self.last_future: SaveFuture | None = None
        self.folder.mkdir(parents=True, exist_ok=True)

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

    # -- listing ----------------------------------------------------------------------
    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present), ascending."""
        out = []
        if self.folder.is_dir():
            for p in self.folder.iterdir():
                m = STEP_RE.match(p.name)
                if m and p.is_dir() and local.is_committed(p):
                    out.append(int(m.group(1)))
        return sorted(out)

    def path(self, step: int) -> Path:
        """The folder of ``step`` in this manager's folder."""
        return step_dir(self.folder, step)

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
        if self._saver is None:
            save(state, path, overwrite=True, process_group=self.process_group)
            self._retain(protect=step)
            return None
        self._pending_step = step
        self.last_future = self._saver.save(state, path, overwrite=True, process_group=self.process_group,
                                            max_staging_bytes=self.config.max_staging_bytes)
        return self.last_future

    def _complete_pending(self) -> None:
        """Wait for the async save in flight; on success apply retention."""
        if self._saver is None or self._pending_step is None:
            return
        step, self._pending_step = self._pending_step, None
        self._saver.wait()  # raises the background error, if any
        self._retain(protect=step)

    def wait(self) -> None:
        """Block until any async save has committed (raises its error)."""
        self._complete_pending()

    def _retain(self, protect: int) -> None:
        """Delete checkpoints outside the retention policy (rank 0 only)."""
        if resolve(self.process_group).rank != 0 or self.config.keep_last is None:
            return
        steps = self.steps()
        keep = set(steps[-self.config.keep_last:])
        if self.config.keep_every:
            keep |= {s for s in steps if s % self.config.keep_every == 0}
        keep.add(protect)
        if self._loaded_step is not None:
            keep.add(self._loaded_step)
        for s in steps:
            if s not in keep:
                shutil.rmtree(self.path(s), ignore_errors=True)

    # -- loading ----------------------------------------------------------------------
    def load(self, state: dict[str, Any], step: int | None = None, *, strict: bool = True) -> int | None:
        """Load step ``step``, or the latest valid checkpoint when None (skipping incomplete
        or corrupt ones with a warning naming them). Returns the step loaded, or None when
        there is no checkpoint. Keys in ``exclude_from_loading`` are left untouched."""
        self._complete_pending()
        if step is None and self.config.load_step is not None:
            step = self.config.load_step
        candidates = [step] if step is not None else list(reversed(self.steps()))
        for s in candidates:
            try:
                load(state, self.path(s), strict=strict, process_group=self.process_group,
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
                   dtype: torch.dtype | str | None = None) -> Path:
        """Export the model's full weights as one ``model.safetensors`` file (rank 0 writes)."""
        from safetensors.torch import save_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self._complete_pending()
        out = Path(path) if path is not None else self.folder / "final"
        comm = resolve(self.process_group)
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dtype is None and self.config.export_dtype != "float32":
            dtype = self.config.export_dtype
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if comm.rank == 0:
            tensors = {}
            seen: set[int] = set()
            for k, v in sd.items():
                v = v.detach()
                if dtype is not None and v.is_floating_point():
                    v = v.to(dtype)
                v = v.contiguous()
                ptr = v.untyped_storage().data_ptr()
                if v.numel() and ptr in seen:
                    v = v.clone()  # tied weights: safetensors files hold no shared memory
                seen.add(ptr)
                tensors[k] = v
            out.mkdir(parents=True, exist_ok=True)
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "producer": "shardsafe"})
        if comm.distributed:
            import torch.distributed as dist

            dist.barrier(group=comm.group)
        return out / "model.safetensors"

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending work; the manager can no longer save afterwards."""
        self._complete_pending()
        self._saver = None

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def latest_step(folder: PathLike) -> int | None:
    """The newest step folder whose manifest parses and verifies (no data hashing)."""
    folder = Path(folder)
    found = []
    if folder.is_dir():
        for p in folder.iterdir():
            m = STEP_RE.match(p.name)
            if m and local.is_committed(p):
                found.append(int(m.group(1)))
    for s in sorted(found, reverse=True):
        try:
            read_manifest(step_dir(folder, s))
            return s
        except CheckpointError:
            continue
    return None
