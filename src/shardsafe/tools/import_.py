"""``shardsafe import``: make a shardsafe checkpoint from a ``torch.save`` file, a
safetensors file, a Hugging Face folder (safetensors shards, with or without index), or a
``torch.distributed.checkpoint`` (DCP) folder.

- torch.save files are loaded with ``torch.load(weights_only=True)`` (memory-mapped when
  the file is in the zip format), so no code in them runs.
- safetensors files are parsed here (JSON header) and memory-mapped; nothing is copied
  before shardsafe writes it. Keys stay flat (``prefix`` nests them under one key).
- DCP stores its ``.metadata`` as a pickle: reading it runs code from the file, so it is
  refused unless ``trust_pickle`` is given. The tensors are then read with DCP itself,
  without a process group (``_load_state_dict(..., no_dist=True)`` with
  ``_EmptyStateDictLoadPlanner``, as ``torch.distributed.checkpoint.format_utils`` does),
  which materializes the whole state in memory.
"""

from __future__ import annotations

import json
import mmap
import struct
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..api import save
from ..errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.dtypes import TORCH_TO_CODE, itemsize
from ..format.manifest import MANIFEST_NAME
from .common import PathLike, UsageError, human_bytes
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

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dict(self.__dict__)

    def to_text(self) -> str:
        """A one-line summary."""
        return (f"imported {self.tensors} tensors ({human_bytes(self.bytes)}) from {self.source} {self.src} "
                f"into {self.out} in {self.seconds:.2f} s")


def detect(src: Path) -> str:
    """The kind of ``src``: torch, safetensors, hf or dcp."""
    if src.is_dir():
        if (src / MANIFEST_NAME).is_file():
            raise UsageError(f"{src} is already a shardsafe checkpoint")
        if (src / ".metadata").is_file():
            return "dcp"
        if any(src.glob("*.safetensors.index.json")) or any(src.glob("*.safetensors")):
            return "hf"
        raise UsageError(f"{src}: a folder without .metadata (DCP) or *.safetensors files (Hugging Face); "
                         "pass --from to say what it is")
    if not src.exists():
        raise CheckpointNotFoundError(f"no file or folder at {src}")
    with open(src, "rb") as f:
        head = f.read(9)
    if head[:4] == b"PK\x03\x04":
        return "torch"
    if len(head) == 9 and head[8:9] == b"{":
        return "safetensors"
    return "torch"  # the legacy (non-zip) torch.save format


def load_torch(src: Path) -> Any:
    """The object in a torch.save file, loaded with ``weights_only=True`` (memory-mapped when possible)."""
    with open(src, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"
    try:
        return torch.load(src, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as exc:  # noqa: BLE001 - torch raises many kinds; report one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{src}: torch.load(weights_only=True) refused it: {first}") from exc


def load_safetensors(src: Path, into: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, memory-mapped (copy-on-write), by name."""
    out = {} if into is None else into
    with open(src, "rb") as f:
        size = f.seek(0, 2)
        f.seek(0)
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CorruptCheckpointError(f"{src}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", prefix)
        if n > min(size - 8, 100 << 20):
            raise CorruptCheckpointError(f"{src}: bad safetensors header length {n}")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CorruptCheckpointError(f"{src}: the safetensors header is not JSON: {exc}") from None
        base = 8 + n
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size > base else None
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{src}: the safetensors header is not an object")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            code, shape, (begin, end) = info["dtype"], [int(s) for s in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise CorruptCheckpointError(f"{src}: bad header entry for {name!r}") from None
        dtype = CODE_TO_TORCH.get(code)
        if dtype is None:
            raise CheckpointError(f"{src}: tensor {name!r} has dtype {code}, which shardsafe cannot store")
        numel = 1
        for s in shape:
            numel *= s
        if not (0 <= begin <= end <= size - base) or end - begin != numel * itemsize(dtype):
            raise CorruptCheckpointError(f"{src}: tensor {name!r} has a bad byte range {begin}-{end}")
        if name in out:
            raise CheckpointError(f"{src}: tensor {name!r} appears in more than one file")
        if numel == 0 or mm is None:
            out[name] = torch.empty(shape, dtype=dtype)
            continue
        t = torch.frombuffer(mm, dtype=dtype, count=numel, offset=base + begin).view(shape)
        if (base + begin) % itemsize(dtype):
            t = t.clone()  # keep tensors aligned
        out[name] = t
    return out


def load_hf(src: Path) -> dict[str, torch.Tensor]:
    """The tensors of a Hugging Face folder: the files its index names, else every *.safetensors file."""
    indexes = sorted(src.glob("*.safetensors.index.json"))
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CorruptCheckpointError(f"{indexes[0]}: not a safetensors index ({exc})") from None
        files = list(dict.fromkeys(weight_map.values()))
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name in files:
        path = src / name
        if not path.is_file():
            raise CorruptCheckpointError(f"{src}: the index names {name}, which is missing")
        load_safetensors(path, out)
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
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _load_state_dict(state, storage_reader=FileSystemReader(str(src)), planner=_EmptyStateDictLoadPlanner(),
                         no_dist=True)
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


def import_checkpoint(src: PathLike, out: PathLike, *, source: str | None = None, trust_pickle: bool = False,
                      prefix: str | None = None, overwrite: bool = False,
                      progress: bool | None = None) -> ImportReport:
    """Read ``src`` (kind ``source``, detected when None) and save it with
    ``shardsafe.save`` at ``out``. ``prefix`` nests the imported state under that key
    (for example ``model``, to load it with ``shardsafe.load({"model": ...})``)."""
    t0 = time.perf_counter()
    src = Path(src)
    if not src.exists():
        raise CheckpointNotFoundError(f"no file or folder at {src}")
    kind = source or detect(src)
    if kind not in SOURCES:
        raise UsageError(f"unknown import source {kind!r}: choose one of {', '.join(SOURCES)}")
    if kind == "dcp" and not trust_pickle:
        raise UsageError(f"refusing to import {src}: {PICKLE_WHY}")
    if (Path(out) / MANIFEST_NAME).is_file() and not overwrite:
        raise UsageError(f"a checkpoint already exists at {out}; pass --overwrite to replace it")
    with Progress(f"import: reading {kind} {src.name}", None, enabled=progress) as bar:
        bar.status(f"import: reading {kind} {src.name} ...")
        if kind == "torch":
            state = load_torch(src)
        elif kind == "safetensors":
            state = load_safetensors(src)
        elif kind == "hf":
            if not src.is_dir():
                raise UsageError(f"{src}: --from hf needs a folder")
            state = load_hf(src)
        else:
            state = load_dcp(src, trust_pickle)
        if prefix:
            state = {prefix: state}
        if not isinstance(state, dict):
            raise UsageError(f"{src} holds a {type(state).__name__}, not a dict; pass --prefix NAME to store it "
                             "under a key")
        tensors, nbytes = _count(state)
        bar.status(f"import: saving {tensors} tensors ({human_bytes(nbytes)}) to {Path(out).name} ...")
        save(state, out, overwrite=overwrite)
    return ImportReport(str(src), kind, str(out), tensors, nbytes, time.perf_counter() - t0)
