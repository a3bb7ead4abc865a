"""CheckpointConfig: the CheckpointManager's settings as torchtitan's ``[checkpoint]``
section spells them (aliases, its TOML file, the settings only its trainer can apply)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .hints import as_keys

PathLike = str | os.PathLike
ASYNC_MODES = ("disabled", "async", "async_pinned")
# torchtitan settings that need its trainer (model parts, HF state-dict adapter): refused by
# a plain CheckpointManager, honoured by shardsafe.integrations.torchtitan.
TORCHTITAN_ONLY = ("initial_load_path", "initial_load_in_hf", "initial_load_in_hf_quantized", "last_save_in_hf",
                   "create_seed_checkpoint")


@dataclass
class CheckpointConfig:
    """The manager's settings, mirroring torchtitan's ``[checkpoint]`` section.

    ``CheckpointConfig.from_dict(d)`` / ``from_toml(path, section="checkpoint")`` accept
    every key of torchtitan 0.3.0's section: ``keep_latest_k`` (= keep_last), ``load_step``
    (-1 = latest), ``last_save_model_only`` / ``export_dtype`` for the final export,
    ``load_only``, ``enable_first_step_checkpoint``; the keys in :data:`TORCHTITAN_ONLY`
    (initial loads, HF formats, seed checkpoints) are parsed here but need torchtitan's
    trainer: :meth:`CheckpointManager.from_config` refuses them when set, naming them, and
    ``shardsafe.integrations.torchtitan`` honours them. ``keep_best`` / ``metric`` /
    ``mode`` keep the best checkpoints by a reported metric (shardsafe's own)."""

    folder: str = "checkpoints"
    enable: bool = True
    interval: int = 500
    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    metric: str = "metric"
    mode: str = "min"
    async_mode: str = "disabled"
    max_staging_bytes: int | None = None
    load_step: int | None = None
    exclude_from_loading: list[str] = field(default_factory=list)
    cast_dtype: bool = False  # load a checkpoint saved in another dtype, converting (shardsafe's own)
    last_save_model_only: bool = True
    export_dtype: str | None = None  # None: export in the training dtype
    load_only: bool = False
    incremental: bool = False  # shardsafe's own: refer to unchanged chunks of the newest checkpoint
    full_every: int = 10  # with incremental: every full_every-th save in a chain is a full checkpoint
    version_skip: bool = False  # with incremental: trust tensors' _version counters (see shardsafe.save)
    compression: str = "off"  # shardsafe's own: "off", "auto", "zstd" or "lz4" (see shardsafe.save)
    enable_first_step_checkpoint: bool = False
    initial_load_path: str | None = None
    initial_load_model_only: bool = True
    initial_load_in_hf: bool = False
    initial_load_in_hf_quantized: bool = False
    last_save_in_hf: bool = False
    create_seed_checkpoint: bool = False

    _ALIASES = {"keep_latest_k": "keep_last", "enable_checkpoint": "enable"}

    def __post_init__(self) -> None:
        if self.mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', not {self.mode!r}")
        if self.keep_best is not None and self.keep_best <= 0:
            raise ValueError(f"keep_best must be positive (or None), not {self.keep_best}")
        self.async_mode = {"async_with_pinned_mem": "async_pinned"}.get(self.async_mode, self.async_mode)
        if self.async_mode not in ASYNC_MODES:
            raise ValueError(f"async_mode must be one of {ASYNC_MODES}, not {self.async_mode!r}")
        if self.interval <= 0:
            raise ValueError(f"interval must be positive, not {self.interval}")
        if self.compression not in ("off", "auto", "zstd", "lz4"):
            raise ValueError(f"compression must be 'off', 'auto', 'zstd' or 'lz4', not {self.compression!r}")
        if self.full_every < 1:
            raise ValueError(f"full_every must be at least 1 (1: every save is full), not {self.full_every}")
        if self.keep_last is not None and self.keep_last <= 0:
            self.keep_last = None  # torchtitan: 0 keeps everything
        if self.load_step is not None and self.load_step < 0:
            self.load_step = None
        self.exclude_from_loading = list(as_keys(self.exclude_from_loading, "exclude_from_loading") or ())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CheckpointConfig:
        """Build from a dict; an unknown key raises ValueError naming it and listing the
        known names and their aliases."""
        names = {f.name for f in fields(cls) if not f.name.startswith("_")}
        out: dict[str, Any] = {}
        for k, v in d.items():
            name = cls._ALIASES.get(k, k)
            if name not in names:
                aliases = ", ".join(f"{a} (= {n})" for a, n in sorted(cls._ALIASES.items()))
                raise ValueError(f"unknown checkpoint setting {k!r} (known: {', '.join(sorted(names))}; "
                                 f"aliases: {aliases})")
            out[name] = v
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


def refuse_torchtitan_only(config: CheckpointConfig) -> None:
    """Raise ValueError naming the first setting of :data:`TORCHTITAN_ONLY` that ``config``
    sets: a plain CheckpointManager cannot apply it."""
    for name in TORCHTITAN_ONLY:
        if getattr(config, name):
            raise ValueError(
                f"checkpoint setting {name}={getattr(config, name)!r} needs torchtitan's trainer (model parts, "
                "Hugging Face state-dict adapter); a plain CheckpointManager cannot apply it. Use "
                "shardsafe.integrations.torchtitan, or unset it.")
