"""``shardsafe import``: make a shardsafe checkpoint from a ``torch.save`` file, a
safetensors file, a Hugging Face folder (safetensors shards, with or without index), or a
``torch.distributed.checkpoint`` (DCP) folder.

- torch.save files are loaded with ``torch.load(weights_only=True)`` (memory-mapped when
  the file is in the zip format), so no code in them runs.
- safetensors files are parsed here (JSON header) and memory-mapped; nothing is copied
  before shardsafe writes it. Keys stay flat (``prefix`` nests them under one key).
- Hugging Face folders: the files the index names (else every ``*.safetensors`` file). With
  a config.json whose model ties its word embeddings, the tied weights the folder leaves out
  (GPT-2's ``lm_head.weight``) are restored as copies of their source, so the checkpoint
  matches the model's ``state_dict()``; with ``prefix``, config.json and
  generation_config.json are stored beside it (keys ``hf_config``, ``hf_generation_config``)
  so that ``shardsafe export --to hf`` writes them back.
- DCP stores its ``.metadata`` as a pickle: reading it runs code from the file, so it is
  refused unless ``trust_pickle`` is given. The tensors are then read with DCP itself,
  without a process group (``_load_state_dict(..., no_dist=True)`` with
  ``_EmptyStateDictLoadPlanner``, as ``torch.distributed.checkpoint.format_utils`` does),
  which materializes the whole state in memory.
"""

from __future__ import annotations

import json
import struct
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import hf_folder
from ..api import save
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.dtypes import TORCH_TO_CODE, itemsize
from ..format.manifest import MANIFEST_NAME
from ..storage.base import Folder
from .common import DCP_EMPTY_DICTS, PathLike, UsageError, human_bytes
from .progress import Progress

SOURCES = ("torch", "safetensors", "hf", "dcp")
CODE_TO_TORCH = {code: dt for dt, code in TORCH_TO_CODE.items()}
PICKLE_WHY = ("a DCP checkpoint's .metadata is a pickle, and loading a pickle runs code from the file; "
              "pass --trust-pickle only for checkpoints you trust")


@dataclass
class ImportReport:
    """What ``import_checkpoint`` wrote."""

    src: str
    source: str
    out: str
    tensors: int
    bytes: int
    seconds: float
    tied: dict[str, str] = field(default_factory=dict)  # hf: tied weights restored -> their source
    config_keys: list[str] = field(default_factory=list)  # hf: keys the configs were stored under

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dict(self.__dict__)

    def to_text(self) -> str:
        """A summary, and what was added for Hugging Face sources."""
        lines = [f"imported {self.tensors} tensors ({human_bytes(self.bytes)}) from {self.source} {self.src} "
                 f"into {self.out} in {self.seconds:.2f} s"]
        lines += [f"note: {t} restored as a copy of {s} (tied weights)" for t, s in self.tied.items()]
        if self.config_keys:
            lines.append(f"note: config stored under {', '.join(self.config_keys)} (export --to hf writes it back)")
        return "\n".join(lines)


def _entry(src: Path) -> tuple[Folder, str]:
    """The folder holding ``src`` and its name there (through the storage seam)."""
    from ..storage.urls import local_backend

    backend = local_backend()
    parent, name = backend.split(str(src))
    try:
        return backend.open(parent), name
    except CheckpointNotFoundError:
        raise CheckpointNotFoundError(f"no file or folder at {src}") from None


def detect(src: Path) -> str:
    """The kind of ``src``: torch, safetensors, hf or dcp."""
    parent, name = _entry(src)
    with parent:
        kind = parent.kind(name)
        if kind is None:
            raise CheckpointNotFoundError(f"no file or folder at {src}")
        if kind == "dir":
            with parent.open_folder(name) as folder:
                names = folder.names()
            if MANIFEST_NAME in names:
                raise UsageError(f"{src} is already a shardsafe checkpoint")
            if ".metadata" in names:
                return "dcp"
            if any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
                return "hf"
            raise UsageError(f"{src}: a folder without .metadata (DCP) or *.safetensors files (Hugging Face); "
                             "pass --from to say what it is")
        head = _head(parent, name, 9)
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "torch"  # the legacy (non-zip) torch.save format


def _head(folder: Folder, name: str, n: int) -> bytes:
    with folder.open_read(name) as h:
        buf = bytearray(min(n, h.size))
        h.read_into([memoryview(buf)], 0)
        return bytes(buf)


def load_torch(src: Path) -> Any:
    """The object in a torch.save file, loaded with ``weights_only=True`` (memory-mapped when possible)."""
    parent, name = _entry(src)
    with parent:
        zipped = _head(parent, name, 4) == b"PK\x03\x04"
    try:
        return torch.load(src, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; report one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{src}: torch.load(weights_only=True) refused it: {first}") from exc


def load_safetensors(src: Path, into: dict[str, torch.Tensor] | None = None,
                     folder: Folder | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, memory-mapped (copy-on-write) where the storage
    allows, by name. ``folder``: the folder holding it (default: its parent)."""
    from ..format.datafile import parse_header

    out = {} if into is None else into
    own = folder is None
    if folder is None:
        folder, name = _entry(src)
    else:
        name = src.name
    try:
        data = folder.map_read(name)
        if data is None:
            data = memoryview(folder.read_bytes(name, 1 << 62))
    finally:
        if own:
            folder.close()
    if len(data) < 8:
        raise CorruptCheckpointError(f"{src}: too short for a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > min(len(data) - 8, 100 << 20):
        raise CorruptCheckpointError(f"{src}: bad safetensors header length {n}")
    header = parse_header(bytes(data[: 8 + n]), str(src), file_bytes=len(data))
    base = 8 + n
    for key, entry in header.items():
        dtype = CODE_TO_TORCH.get(entry.code)
        if dtype is None:
            raise CheckpointError(f"{src}: tensor {key!r} has dtype {entry.code}, which shardsafe cannot store")
        if key in out:
            raise CheckpointError(f"{src}: tensor {key!r} appears in more than one file")
        numel = 1
        for d in entry.shape:
            numel *= d
        if numel == 0:
            out[key] = torch.empty(entry.shape, dtype=dtype)
            continue
        t = torch.frombuffer(data, dtype=dtype, count=numel, offset=base + entry.begin).view(entry.shape)
        if (base + entry.begin) % itemsize(dtype):
            t = t.clone()  # keep tensors aligned
        out[key] = t
    return out


def load_hf_configs(src: Path) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(config.json, generation_config.json) of a Hugging Face folder, None where absent."""
    from ..storage.urls import local_backend

    backend = local_backend()
    with backend.open(str(src)) as folder:
        if folder.kind(hf_folder.CONFIG_NAME) != "file":
            return None, None
    return hf_folder.read_config(backend, str(src))


def load_hf(src: Path) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder: the files its index names, else every *.safetensors file."""
    parent, name = _entry(src)
    with parent, parent.open_folder(name) as folder:
        names = sorted(folder.names())
        indexes = [n for n in names if n.endswith(".safetensors.index.json")]
        if indexes:
            try:
                weight_map = json.loads(folder.read_bytes(indexes[0], 64 << 20))["weight_map"]
                files = list(dict.fromkeys(weight_map.values()))
                if not all(isinstance(f, str) for f in files):
                    raise TypeError("file names are not strings")
            except (ValueError, KeyError, TypeError) as exc:
                raise CorruptCheckpointError(f"{src / indexes[0]}: not a safetensors index ({exc})") from None
        else:
            files = [n for n in names if n.endswith(".safetensors")]
        out: dict[str, torch.Tensor] = {}
        for file in files:
            if folder.kind(file) != "file":
                raise CorruptCheckpointError(f"{src}: the index names {file}, which is missing")
            load_safetensors(src / file, out, folder)
    if indexes:
        missing = [k for k in weight_map if k not in out]
        if missing:
            raise CorruptCheckpointError(f"{src}: tensor {missing[0]!r} is in the index but in none of its files")
    return out


def load_dcp(src: Path, trust_pickle: bool) -> dict[str, Any]:
    """The full state of a DCP checkpoint folder (needs ``trust_pickle``: its metadata is a pickle)."""
    if not trust_pickle:
        raise UsageError(f"refusing to import {src}: {PICKLE_WHY}")
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import set_element
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    reader = FileSystemReader(str(src))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(state, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
        planner_data = reader.read_metadata().planner_data
    for path in (planner_data or {}).get(DCP_EMPTY_DICTS, ()):  # a shardsafe export's empty dicts
        set_element(state, tuple(path), {})
    return state


def _count(obj: Any) -> tuple[int, int]:
    if isinstance(obj, torch.Tensor):
        return 1, obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        items = list(obj.values())
    elif isinstance(obj, (list, tuple)):
        items = list(obj)
    else:
        return 0, 0
    n = b = 0
    for v in items:
        x, y = _count(v)
        n += x
        b += y
    return n, b


def _committed(out: PathLike) -> bool:
    from ..checkpoint_folder import is_committed
    from ..storage.urls import local_backend

    backend = local_backend()
    parent, name = backend.split(str(out))
    try:
        with backend.open(parent) as folder:
            return is_committed(folder, name)
    except CheckpointError:
        return False


def import_checkpoint(src: PathLike, out: PathLike, *, source: str | None = None, trust_pickle: bool = False,
                      prefix: str | None = None, overwrite: bool = False,
                      progress: bool | None = None) -> ImportReport:
    """Read ``src`` (kind ``source``, detected when None) and save it with
    ``shardsafe.save`` at ``out``. ``prefix`` nests the imported state under that key
    (for example ``model``, to load it with ``shardsafe.load({"model": ...})``). A Hugging
    Face folder's left-out tied weights are restored, and with ``prefix`` its configs are
    stored beside the state (see the module docstring)."""
    t0 = time.perf_counter()
    src = Path(src)
    parent, name = _entry(src)
    with parent:
        src_kind = parent.kind(name)
    if src_kind is None:
        raise CheckpointNotFoundError(f"no file or folder at {src}")
    kind = source or detect(src)
    if kind not in SOURCES:
        raise UsageError(f"unknown import source {kind!r}: choose one of {', '.join(SOURCES)}")
    if kind == "dcp" and not trust_pickle:
        raise UsageError(f"refusing to import {src}: {PICKLE_WHY}")
    if not overwrite and _committed(out):
        raise UsageError(f"a checkpoint already exists at {out}; pass --overwrite to replace it")
    tied: dict[str, str] = {}
    config_keys: list[str] = []
    with Progress(f"import: reading {kind} {src.name}", None, enabled=progress) as bar:
        bar.status(f"import: reading {kind} {src.name} ...")
        if kind == "torch":
            state = load_torch(src)
        elif kind == "safetensors":
            state = load_safetensors(src)
        elif kind == "hf":
            if src_kind != "dir":
                raise UsageError(f"{src}: --from hf needs a folder")
            state = load_hf(src)
            config, generation = load_hf_configs(src)
            tied = hf_folder.missing_ties(config, state)
            for target, source in tied.items():
                state[target] = state[source]
        else:
            state = load_dcp(src, trust_pickle)
        if prefix:
            state = {prefix: state}
            if kind == "hf" and config is not None:
                extra = {hf_folder.CONFIG_KEY: config, hf_folder.GENERATION_CONFIG_KEY: generation}
                config_keys = [k for k, v in extra.items() if v is not None and k != prefix]
                state.update({k: extra[k] for k in config_keys})
        if not isinstance(state, dict):
            raise UsageError(f"{src} holds a {type(state).__name__}, not a dict; pass --prefix NAME to store it "
                             "under a key")
        tensors, nbytes = _count(state)
        bar.status(f"import: saving {tensors} tensors ({human_bytes(nbytes)}) to {Path(out).name} ...")
        save(state, out, overwrite=overwrite)
    return ImportReport(str(src), kind, str(out), tensors, nbytes, time.perf_counter() - t0, tied, config_keys)
