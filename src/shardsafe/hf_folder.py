"""Hugging Face model folders: what ``transformers``' ``from_pretrained(folder)`` loads as is.

One module for every writer of such a folder (``shardsafe export --to hf`` and
``CheckpointManager.save_final``), all through the storage seam:

- weights as safetensors files (``{"format": "pt"}`` metadata, as Hugging Face writes):
  ``model.safetensors``, or ``model-0000i-of-0000N.safetensors`` shards of at most
  ``max_shard_size`` with ``model.safetensors.index.json`` (``metadata``, which
  ``transformers`` requires, with ``total_size`` in bytes and ``total_parameters``; and
  ``weight_map``, name -> shard, sorted by name); each tensor is fetched only when its turn
  comes, so memory stays about one tensor;
- ``config.json`` (its ``dtype`` set to the dtype of the floating weights written) and
  ``generation_config.json`` when given;
- tied weights written once, as ``save_pretrained`` does: when the config ties word
  embeddings (``tie_word_embeddings``, true unless set false), the tie targets of the model
  class (``_tied_weights_keys``, e.g. GPT-2's ``lm_head.weight`` -> ``transformer.wte.weight``)
  are left out when their source is written; ``from_pretrained`` ties them again;
- renaming rules for models whose names differ from the Hugging Face class's.

The config can travel inside a checkpoint as plain JSON: save
``{**state, **config_state(model)}`` (the keys ``hf_config`` and ``hf_generation_config``)
and ``shardsafe export --to hf`` finds it. ``transformers`` is imported only to find a model
class's tied weights (and never by ``import shardsafe``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from .checkpoint_folder import TMP_MARK, hidden_name, publish
from .errors import CheckpointError, CheckpointNotFoundError
from .hints import nearest
from .storage.base import Backend, Folder

if TYPE_CHECKING:  # torch is imported only by the functions that write tensors
    import torch

    from .engine.outputs import Slot

SINGLE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
CONFIG_KEY = "hf_config"  # where a checkpoint keeps config.json (a plain JSON dict)
GENERATION_CONFIG_KEY = "hf_generation_config"  # ... and generation_config.json
MAX_CONFIG_BYTES = 64 << 20

# A renaming: a callable name -> new name, a mapping old -> new (other names kept), or
# rules applied in order, each "REGEX=REPLACEMENT" or (regex, replacement).
Rename = Callable[[str], str] | Mapping[str, str] | Sequence[str | tuple[str, str]]


class HFFolderError(CheckpointError, ValueError):
    """A request to write a Hugging Face folder is wrong (bad rule, clashing names, bad config)."""


_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
    "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"`` (10**9, as Hugging Face), ``"200MiB"`` (2**20), ``"64M"``
    (2**20) or a plain number of bytes; HFFolderError for anything else or a size below 1."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.fullmatch(text)
        unit = m.group(2).upper() if m else ""
        if not m or unit not in _UNITS:
            raise HFFolderError(f"cannot read size {text!r}: write it like 5GB, 200MB, 512MiB or 1000000")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise HFFolderError(f"size {text!r} must be positive")
    return value


# -- configs ------------------------------------------------------------------------------
def config_dict(config: Any) -> dict[str, Any]:
    """``config`` (a dict, a ``transformers`` config or generation config) as a plain JSON
    dict, as ``save_pretrained`` would write it."""
    if isinstance(config, Mapping):
        try:
            out = json.loads(json.dumps(dict(config)))
        except (TypeError, ValueError) as exc:
            raise HFFolderError(f"the Hugging Face config is not plain JSON: {exc}") from None
        return out
    if hasattr(config, "to_json_string"):
        return json.loads(config.to_json_string(use_diff=True))
    if hasattr(config, "to_dict"):
        return json.loads(json.dumps(config.to_dict(), default=str))
    raise HFFolderError(f"cannot use a {type(config).__name__} as a Hugging Face config (a dict or a "
                        "transformers config is needed)")


def unwrap_model(model: Any) -> Any:
    """The user's module inside DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers."""
    for _ in range(8):
        inner = getattr(model, "_orig_mod", None) or (
            getattr(model, "module", None) if type(model).__name__ == "DistributedDataParallel" else None)
        if inner is None:
            return model
        model = inner
    return model


def model_class(model: Any) -> type:
    """The class of ``model`` as its author wrote it (FSDP2's ``FSDP<Name>`` subclass undone)."""
    cls = type(unwrap_model(model))
    if cls.__name__.startswith("FSDP"):
        for base in cls.__mro__[1:]:
            if base.__name__ == cls.__name__[4:]:
                return base
    return cls


def config_state(model_or_config: Any) -> dict[str, Any]:
    """``{"hf_config": {...}, "hf_generation_config": {...}}``: a model's (or a config's)
    Hugging Face configs as plain JSON, to save beside the training state, e.g.
    ``mgr.save(step, {"train": train, **config_state(model)})``; ``shardsafe export --to hf``
    then writes them as config.json and generation_config.json without ``--config``.
    ``architectures`` is filled from the model's class when the config has none."""
    config = getattr(model_or_config, "config", model_or_config)
    out: dict[str, Any] = {CONFIG_KEY: config_dict(config)}
    if config is not model_or_config and not out[CONFIG_KEY].get("architectures"):
        out[CONFIG_KEY]["architectures"] = [model_class(model_or_config).__name__]
    generation = getattr(model_or_config, "generation_config", None)
    if generation is not None:
        out[GENERATION_CONFIG_KEY] = config_dict(generation)
    return out


def _read_json(folder: Folder, name: str) -> dict[str, Any]:
    data = folder.read_bytes(name, MAX_CONFIG_BYTES)
    try:
        value = json.loads(data)
    except ValueError as exc:
        raise HFFolderError(f"{folder.where(name)} is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise HFFolderError(f"{folder.where(name)} does not hold a JSON object")
    return value


def read_config(backend: Backend, location: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(config, generation config or None) from ``location``: a config.json file, or a
    Hugging Face folder (its config.json, and generation_config.json when present)."""
    parent_location, name = backend.split(location)
    try:
        parent = backend.open(parent_location)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"no config file or folder at {location}") from None
    with parent:
        kind = parent.kind(name)
        if kind is None:
            raise CheckpointNotFoundError(f"no config file or folder at {location}")
        if kind != "dir":
            return _read_json(parent, name), None
        with parent.open_folder(name) as folder:
            if folder.kind(CONFIG_NAME) != "file":
                raise HFFolderError(f"{location} has no {CONFIG_NAME}")
            generation = None
            if folder.kind(GENERATION_CONFIG_NAME) == "file":
                generation = _read_json(folder, GENERATION_CONFIG_NAME)
            return _read_json(folder, CONFIG_NAME), generation


def read_json_file(backend: Backend, location: str) -> dict[str, Any]:
    """The JSON object in the file at ``location`` (a generation_config.json, ...)."""
    parent_location, name = backend.split(location)
    try:
        parent = backend.open(parent_location)
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"no file at {location}") from None
    with parent:
        if parent.kind(name) != "file":
            raise CheckpointNotFoundError(f"no file at {location}")
        return _read_json(parent, name)


def resolve_configs(config: Any, generation_config: Any, locate: Callable[[Any], tuple[Backend, str]],
                    model: Any = None) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(config, generation config) as plain JSON dicts, from dicts, ``transformers`` configs
    or paths (``config``: a config.json or a Hugging Face folder, whose
    generation_config.json is used unless ``generation_config`` is given;
    ``generation_config``: a generation_config.json); what is not given comes from
    ``model``'s own ``config`` / ``generation_config`` when it has them, else is None.
    ``locate`` maps a path to (backend, location)."""
    folder_generation = None
    if isinstance(config, (str, os.PathLike)):
        cfg: dict[str, Any] | None
        cfg, folder_generation = read_config(*locate(config))
    elif config is not None:
        cfg = config_dict(config)
    else:
        inner = unwrap_model(model) if model is not None else None
        cfg = config_state(inner)[CONFIG_KEY] if getattr(inner, "config", None) is not None else None
    if isinstance(generation_config, (str, os.PathLike)):
        gen = read_json_file(*locate(generation_config))
    elif generation_config is not None:
        gen = config_dict(generation_config)
    elif folder_generation is not None:
        gen = folder_generation
    else:
        own = getattr(unwrap_model(model), "generation_config", None) if model is not None else None
        gen = config_dict(own) if own is not None else None
    return cfg, gen


def _weights_dtype(slots: Sequence[Slot]) -> str | None:
    """The name of the floating dtype holding most of the floating weights' bytes."""
    by_dtype: dict[Any, int] = {}
    for s in slots:
        if s.dtype.is_floating_point:
            by_dtype[s.dtype] = by_dtype.get(s.dtype, 0) + s.nbytes
    if not by_dtype:
        return None
    return str(max(by_dtype, key=lambda d: by_dtype[d])).removeprefix("torch.")


def config_for(config: Mapping[str, Any], slots: Sequence[Slot]) -> dict[str, Any]:
    """``config`` with ``dtype`` (and the older ``torch_dtype``, when present) set to the
    dtype of the floating weights, as ``save_pretrained`` does."""
    out = dict(config)
    dtype = _weights_dtype(slots)
    if dtype is not None:
        out["dtype"] = dtype
        if "torch_dtype" in out:
            out["torch_dtype"] = dtype
    return out


# -- tied weights -------------------------------------------------------------------------
def hf_model_class(config: Mapping[str, Any]) -> type | None:
    """The ``transformers`` class of a config (its ``architectures``, else the causal LM
    class of its ``model_type``); None when transformers or the class is not available."""
    try:
        import transformers
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return None
    names = [n for n in config.get("architectures") or [] if isinstance(n, str)]
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        names.append(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
    for name in names:
        with contextlib.suppress(Exception):  # transformers imports model modules lazily; any may fail
            cls = getattr(transformers, name, None)
            if isinstance(cls, type):
                return cls
    return None


def _ties(config: Mapping[str, Any] | None, cls: type | None) -> dict[str, str]:
    """target -> source of the model class's tied weights, when the config ties word
    embeddings (``tie_word_embeddings``, true unless set false); empty without a config."""
    if not config or not config.get("tie_word_embeddings", True):
        return {}
    if cls is None:
        cls = hf_model_class(config)
    ties = getattr(cls, "_tied_weights_keys", None)
    if not isinstance(ties, Mapping):
        return {}
    return {t: s for t, s in ties.items() if isinstance(t, str) and isinstance(s, str) and t != s}


def tied_targets(config: Mapping[str, Any] | None, names: Collection[str],
                 cls: type | None = None) -> dict[str, str]:
    """target -> source for the tied weights to leave out of a folder of ``names`` (as
    ``save_pretrained`` does): the ties of the model class (``cls``, else found from the
    config) whose target and source are both among ``names``, when the config ties word
    embeddings. Empty without a config."""
    present = set(names)
    return {t: s for t, s in _ties(config, cls).items() if t in present and s in present}


def missing_ties(config: Mapping[str, Any] | None, names: Collection[str],
                 cls: type | None = None) -> dict[str, str]:
    """target -> source for the tied weights a Hugging Face folder of ``names`` left out
    (the source is there, the target is not), so that a reader can restore the full
    ``state_dict()`` of the model."""
    present = set(names)
    return {t: s for t, s in _ties(config, cls).items() if t not in present and s in present}


# -- renaming -----------------------------------------------------------------------------
def parse_rule(rule: str | tuple[str, str]) -> tuple[re.Pattern[str], str]:
    """A compiled ``(regex, replacement)`` from ``"REGEX=REPLACEMENT"`` (split at the last
    ``=``, so the regex may hold one) or from a pair."""
    if isinstance(rule, str):
        pattern, sep, replacement = rule.rpartition("=")
        if not sep or not pattern:
            raise HFFolderError(f"--rename {rule!r}: write a rule as REGEX=REPLACEMENT, e.g. "
                                r"'^layers\.(\d+)\.attention\.wq\.=model.layers.\1.self_attn.q_proj.'")
    else:
        pattern, replacement = rule
    try:
        return re.compile(pattern), replacement
    except re.error as exc:
        raise HFFolderError(f"--rename {pattern!r}: not a regular expression: {exc}") from None


def rename_names(names: Sequence[str], rename: Rename | None) -> list[str]:
    """``names`` renamed: by a callable, by a mapping (names it lacks are kept), or by rules
    applied in order, each to the result of the ones before (``re.sub``: every match of the
    regex replaced; ``\\1`` refers to a group); a ``str`` is one rule. A rule that matches
    no name, a mapping key that is no name (with the closest names), an empty result and
    two names renamed alike are errors."""
    if isinstance(rename, str):
        rename = [rename]
    if rename is None:
        out = list(names)
    elif callable(rename):
        out = [rename(n) for n in names]
    elif isinstance(rename, Mapping):
        unknown = [k for k in rename if k not in set(names)]
        if unknown:
            near = nearest(str(unknown[0]), names)
            hint = f"; did you mean {', '.join(repr(n) for n in near)}?" if near else \
                f" (names look like {', '.join(repr(n) for n in names[:3])})"
            raise HFFolderError(f"rename: {unknown[0]!r} is not one of the exported names{hint}")
        out = [rename.get(n, n) for n in names]
    else:
        rules = [parse_rule(r) for r in rename]
        used = [False] * len(rules)
        out = []
        for name in names:
            for i, (pattern, replacement) in enumerate(rules):
                if pattern.search(name):
                    used[i] = True
                    try:
                        name = pattern.sub(replacement, name)
                    except (re.error, IndexError) as exc:
                        raise HFFolderError(f"--rename {pattern.pattern!r}={replacement!r}: {exc}") from None
            out.append(name)
        for (pattern, _), ok in zip(rules, used):
            if not ok:
                shown = ", ".join(repr(n) for n in names[:3])
                raise HFFolderError(f"--rename rule {pattern.pattern!r} matches no name (names look like {shown})")
    seen: dict[str, str] = {}
    for old, new in zip(names, out):
        if not isinstance(new, str) or not new:
            raise HFFolderError(f"renaming {old!r} gave {new!r}, not a name")
        if new in seen:
            raise HFFolderError(f"{seen[new]!r} and {old!r} would both be named {new!r}; choose names that differ "
                                "(--keys, --strip, --rename)")
        seen[new] = old
    return out


# -- writing ------------------------------------------------------------------------------
def plan_shards(slots: Sequence[Slot], max_bytes: int) -> list[list[Slot]]:
    """Consecutive groups of slots of at most ``max_bytes`` each (a larger slot alone)."""
    shards: list[list[Slot]] = []
    size = 0
    for s in slots:
        if shards and size + s.nbytes <= max_bytes:
            shards[-1].append(s)
            size += s.nbytes
        else:
            shards.append([s])
            size = s.nbytes
    return shards


def write_weights_and_configs(folder: Folder, slots: Sequence[Slot], fetch: Callable[[Slot], torch.Tensor], *,
                              max_shard_size: int, config: Mapping[str, Any] | None = None,
                              generation_config: Mapping[str, Any] | None = None, always_index: bool = True,
                              advance: Callable[[int], None] | None = None) -> list[str]:
    """Write a Hugging Face folder's files into ``folder``: each slot's tensor (``fetch(slot)``,
    of the slot's dtype and shape, written and dropped one at a time) under the slot's name,
    in shards of at most ``max_shard_size`` bytes (one ``model.safetensors`` when everything
    fits and ``always_index`` is false), the index, config.json (see :func:`config_for`) and
    generation_config.json; then sync the folder. Returns the names of the files written."""
    from .engine.outputs import SafetensorsOutput

    shards = plan_shards(slots, max_shard_size) or [[]]
    single = len(shards) == 1 and not always_index
    names = [SINGLE_NAME] if single else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                          for i in range(len(shards))]
    for name, shard in zip(names, shards):
        out = SafetensorsOutput(folder, name, shard, {"format": "pt"})
        try:
            for s in shard:
                t = fetch(s)
                out.write(s, t)
                del t
                if advance is not None:
                    advance(s.nbytes)
            out.close()
        except BaseException:
            out.abort()
            raise
    files = list(names)
    if not single:
        weight_map = {s.name: name for name, shard in zip(names, shards) for s in shard}
        numel = sum(s.nbytes // max(1, s.dtype.itemsize) for s in slots)
        index = {"metadata": {"total_parameters": numel, "total_size": sum(s.nbytes for s in slots)},
                 "weight_map": dict(sorted(weight_map.items()))}
        folder.write_bytes(INDEX_NAME, _json_bytes(index))
        files.append(INDEX_NAME)
    if config is not None:
        folder.write_bytes(CONFIG_NAME, _json_bytes(config_for(config, slots), sort_keys=True))
        files.append(CONFIG_NAME)
    if generation_config is not None:
        folder.write_bytes(GENERATION_CONFIG_NAME, _json_bytes(dict(generation_config), sort_keys=True))
        files.append(GENERATION_CONFIG_NAME)
    folder.sync()
    return files


def _json_bytes(value: Any, sort_keys: bool = False) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=sort_keys) + "\n").encode()


def save_model_folder(backend: Backend, location: str, tensors: Mapping[str, torch.Tensor], *,
                      max_shard_size: int, config: Mapping[str, Any] | None = None,
                      generation_config: Mapping[str, Any] | None = None, rename: Rename | None = None,
                      cls: type | None = None) -> tuple[str, list[str]]:
    """Write ``tensors`` (full CPU tensors by name) as the Hugging Face folder at ``location``,
    laid out as ``save_pretrained`` does (one ``model.safetensors`` when it fits in
    ``max_shard_size``, else shards and index), with the configs; names renamed by
    ``rename``, tied weights written once (``cls``: the model class, for its ties). The
    folder is built beside ``location`` and put in its place atomically, replacing what was
    there. Returns (the weights file ``from_pretrained`` reads first, names left out as tied)."""
    from .engine.outputs import Slot

    names = rename_names(list(tensors), rename)
    by_name = dict(zip(names, tensors.values()))
    ties = tied_targets(config, names, cls)
    slots = [Slot(n, n, t.dtype, tuple(t.shape)) for n, t in by_name.items() if n not in ties]
    parent_location, name = backend.split(location)
    with backend.open(parent_location, create=True) as parent:
        tmp = hidden_name(name, TMP_MARK)
        try:
            with parent.open_folder(tmp, create=True) as folder:
                files = write_weights_and_configs(folder, slots, lambda s: by_name[s.key],
                                                  max_shard_size=max_shard_size, config=config,
                                                  generation_config=generation_config, always_index=False)
            publish(parent, tmp, name)
        except BaseException:
            with contextlib.suppress(Exception):
                parent.remove_tree(tmp)
            raise
    return (SINGLE_NAME if SINGLE_NAME in files else INDEX_NAME), sorted(ties)
