"""``shardsafe export``: write a checkpoint's tensors as one ``torch.save`` file, one
``.safetensors`` file, or a Hugging Face style folder of safetensors shards with an index.

Streaming: every output byte offset is known from the manifest before any data is read,
so tensors are read one at a time (``TensorReader``), converted if asked, written to
their place and dropped. Peak memory is about the largest tensor (twice that while a
``--dtype`` conversion runs) plus a staging buffer, whatever the checkpoint's size.

Selection: ``keys`` prefixes pick parts of the state; sharded and replicated tensors
are exported whole; rank-local values (one copy per saving rank) are skipped with a
note unless ``rank`` names the saving rank whose copy to export (under its plain key,
without the ``#rank<r>`` marker). Formats:

- ``torch``: the nested state as ``load_full`` returns it, tensors and plain values
  (``flat=True``: one level of dotted keys); loads with ``torch.load(weights_only=True)``.
- ``safetensors``: tensors only, flat dotted keys; plain values are skipped (counted).
- ``hf``: ``model-00001-of-0000N.safetensors`` shards of at most ``max_shard_size``
  (a larger tensor gets a shard of its own) and ``model.safetensors.index.json`` with
  ``metadata.total_size`` and ``weight_map``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..format.manifest import Manifest
from ..format.values import decode
from ..state.tree import join_key, rank_local_key, saved_items, saved_ref
from ..storage.local import write_small_file
from .common import PathLike, UsageError, human_bytes, matches, parse_size, prepare_output, publish, remove, temp_path
from .progress import Progress
from .reading import TensorReader, open_checkpoint
from .writers import SafetensorsWriter, Slot, TorchSaveWriter

FORMATS = ("torch", "safetensors", "hf")
CONVERTIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
INDEX_NAME = "model.safetensors.index.json"
_DROP = object()


@dataclass
class ExportReport:
    """What ``export_checkpoint`` wrote."""

    out: str
    format: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    values: int = 0  # plain values written (torch format)
    skipped_values: int = 0  # plain values not written (safetensors / hf hold tensors only)
    skipped_rank_local: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dict(self.__dict__)

    def to_text(self) -> str:
        """A summary and the notes about what was left out."""
        rate = f", {human_bytes(self.bytes / self.seconds)}/s" if self.seconds > 0 else ""
        lines = [f"exported {self.tensors} tensors ({human_bytes(self.bytes)}) to {self.out} as {self.format} "
                 f"in {len(self.files)} file(s), {self.seconds:.2f} s{rate}"]
        if self.skipped_values:
            lines.append(f"note: {self.skipped_values} non-tensor values skipped ({self.format} holds tensors only;"
                         " use --to torch to keep them)")
        if self.skipped_rank_local:
            shown = ", ".join(self.skipped_rank_local[:5]) + (" ..." if len(self.skipped_rank_local) > 5 else "")
            lines.append(f"note: rank-local values skipped: {shown} (pass --rank R to export saving rank R's copy)")
        return "\n".join(lines)


class _Selection:
    """Walks the saved tree: the skeleton (nested values with Slots for tensors) and the slots."""

    def __init__(self, manifest: Manifest, keys: list[str] | None, rank: int | None,
                 dtype: torch.dtype | None, report: ExportReport) -> None:
        self.manifest = manifest
        self.keys = keys
        self.rank = rank
        self.dtype = dtype
        self.report = report
        self.slots: list[Slot] = []
        self.values: list[tuple[str, Any]] = []
        self.used: set[str] = set()

    def slot(self, key: str, plain: str) -> Slot:
        entry = self.manifest.tensors.get(key)
        if entry is None:
            from .reading import missing_tensor

            raise missing_tensor(self.manifest, key)
        from ..format.dtypes import torch_dtype

        src = torch_dtype(entry.dtype)
        if src is None:
            raise UsageError(f"tensor '{key}': dtype {entry.dtype} is not supported by this torch")
        out = self.dtype if (self.dtype is not None and src in CONVERTIBLE) else src
        s = Slot(key, plain, out, tuple(entry.shape))
        self.slots.append(s)
        return s

    def build(self, node: Any, keyparts: list[str], plain: list[str]) -> Any:
        pkey = join_key(plain)
        ref = saved_ref(node)
        if ref is not None and ref[0] == "$tensor":
            if not matches(pkey, self.keys):
                return _DROP
            self.used.add(pkey)
            return self.slot(ref[1], pkey)
        if ref is not None:
            if not (matches(pkey, self.keys) or any(k.startswith(pkey + ".") for k in self.keys or [])):
                return _DROP
            per_rank = self.manifest.rank_local.get(ref[1]) or []
            if self.rank is None or not (0 <= self.rank < len(per_rank)) or per_rank[self.rank] is None:
                self.report.skipped_rank_local.append(pkey or "<root>")
                return _DROP
            return self.build(per_rank[self.rank], [rank_local_key(ref[1], self.rank)], plain)
        kids = self._children(node)
        if kids is not None:
            kind, items = kids
            if not items:
                if not matches(pkey, self.keys):
                    return _DROP
                self.used.add(pkey)
                self.values.append((pkey, decode(node)))
                return decode(node)
            kept = [(k, v) for k, v in ((k, self.build(v, keyparts + [str(k)], plain + [str(k)])) for k, v in items)
                    if v is not _DROP]
            if not kept:
                return _DROP
            if kind is dict:
                return dict(kept)
            return kind(v for _, v in kept)
        if not matches(pkey, self.keys):
            return _DROP
        self.used.add(pkey)
        value = decode(node)
        self.values.append((pkey, value))
        return value

    @staticmethod
    def _children(node: Any) -> tuple[type, list[tuple[Any, Any]]] | None:
        if isinstance(node, list):
            return list, list(enumerate(node))
        if isinstance(node, dict):
            if len(node) == 1 and "$tuple" in node:
                return tuple, list(enumerate(node["$tuple"]))
            items = saved_items(node)
            if items is not None:
                return dict, items
        return None


def _strip(name: str, prefix: str | None) -> str:
    if prefix and name.startswith(prefix + "."):
        return name[len(prefix) + 1:]
    return name


def _descend(skeleton: Any, prefix: str | None) -> Any:
    """The part of a nested skeleton under the dotted ``prefix`` (for ``strip`` with --to torch)."""
    if not prefix:
        return skeleton
    node = skeleton
    for part in prefix.split("."):
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, dict) and part.lstrip("-").isdigit() and int(part) in node:
            node = node[int(part)]
        elif isinstance(node, (list, tuple)) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise UsageError(f"--strip {prefix!r}: no such key in the exported state")
    return node


def plan_shards(slots: list[Slot], max_bytes: int) -> list[list[Slot]]:
    """Consecutive groups of slots of at most ``max_bytes`` each (a larger slot alone)."""
    shards: list[list[Slot]] = []
    size = 0
    for s in slots:
        if shards and shards[-1] and size + s.nbytes <= max_bytes:
            shards[-1].append(s)
            size += s.nbytes
        else:
            shards.append([s])
            size = s.nbytes
    return shards


def export_checkpoint(
    path: PathLike,
    out: PathLike,
    to: str,
    *,
    keys: list[str] | None = None,
    dtype: str | torch.dtype | None = None,
    rank: int | None = None,
    max_shard_size: str | int = "5GB",
    strip: str | None = None,
    flat: bool = False,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool | None = None,
) -> ExportReport:
    """Export the checkpoint at ``path`` to ``out`` in format ``to`` (torch, safetensors,
    hf); see the module docstring. ``dtype`` converts float16/bfloat16/float32/float64
    tensors (others are kept as they are); ``strip`` removes a leading dotted prefix from
    the output names (with ``torch``: exports the subtree under it)."""
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise UsageError(f"unknown export format {to!r}: choose one of {', '.join(FORMATS)}")
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype.removeprefix("torch.")]
    max_bytes = parse_size(max_shard_size)
    root, manifest = open_checkpoint(path)
    out = Path(out)
    prepare_output(out, overwrite, "output path")
    report = ExportReport(str(out), to)
    sel = _Selection(manifest, keys, rank, dtype, report)
    skeleton = sel.build(manifest.tree, [], [])
    for k in keys or []:
        if not any(matches(u, [k]) for u in sel.used) and not any(
                s == k or s.startswith(k + ".") for s in report.skipped_rank_local):
            raise UsageError(f"--keys {k!r} selects nothing in {root} (see `shardsafe inspect`)")
    if not sel.slots and to != "torch":
        raise UsageError(f"nothing to export from {root}: no tensors selected")
    slots = [Slot(s.key, _strip(s.name, strip), s.dtype, s.shape) for s in sel.slots]
    if to != "torch" or flat:
        seen: set[str] = set()
        dup = next((s.name for s in slots if s.name in seen or seen.add(s.name)), None)
        if dup is not None:
            raise UsageError(f"two tensors would be exported as {dup!r}; choose --keys/--strip so names differ")
    if to != "torch":
        report.skipped_values = len(sel.values)
    reader = TensorReader(root, manifest, verify=verify)
    tmp = temp_path(out)
    try:
        if to == "torch":
            by_key = {s.key: s for s in slots}
            if flat:
                tree: Any = {_strip(k, strip): v for k, v in sel.values}
                tree.update({s.name: s for s in slots})
            else:
                tree = {} if skeleton is _DROP else _descend(_renamed(skeleton, by_key), strip)
            report.values = len(sel.values)
            skeleton_writer = TorchSaveWriter(tmp, tree)
            groups: list[tuple[Callable[[], Any], list[Slot]]] = [(lambda: skeleton_writer, slots)]
            report.files = [out.name]
        elif to == "safetensors":
            groups = [(partial(SafetensorsWriter, tmp, slots), slots)]
            report.files = [out.name]
        else:
            tmp.mkdir()
            shards = plan_shards(slots, max_bytes)
            names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
            groups = [(partial(SafetensorsWriter, tmp / name, shard), shard) for name, shard in zip(names, shards)]
            weight_map = {s.name: name for name, shard in zip(names, shards) for s in shard}
            index = {"metadata": {"total_size": sum(s.nbytes for s in slots)},
                     "weight_map": dict(sorted(weight_map.items()))}
            write_small_file(tmp / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
            report.files = [*names, INDEX_NAME]
        total = sum(s.nbytes for s in slots)
        with Progress("export", total, enabled=progress) as bar:
            for open_writer, group in groups:
                writer = open_writer()  # one output file open at a time
                try:
                    for s in group:
                        t = reader.read(s.key)
                        if t.dtype != s.dtype:
                            t = t.to(s.dtype)
                        writer.write(s, t)
                        del t
                        bar.advance(s.nbytes)
                finally:
                    writer.close()
        if to == "hf":
            fd = os.open(tmp, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        publish(tmp, out)
    except BaseException:
        remove(tmp)
        raise
    report.tensors = len(slots)
    report.bytes = sum(s.nbytes for s in slots)
    report.seconds = time.perf_counter() - t0
    return report


def _renamed(skeleton: Any, by_key: dict[str, Slot]) -> Any:
    """The skeleton with each Slot replaced by its renamed (stripped) Slot."""
    if isinstance(skeleton, Slot):
        return by_key[skeleton.key]
    if isinstance(skeleton, dict):
        return {k: _renamed(v, by_key) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_renamed(v, by_key) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_renamed(v, by_key) for v in skeleton)
    return skeleton
