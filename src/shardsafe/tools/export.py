"""``shardsafe export``: write a checkpoint's tensors as one ``torch.save`` file, one
``.safetensors`` file, or a Hugging Face style folder of safetensors shards with an index.

Streaming: every output byte offset is known from the manifest before any data is read,
so tensors are read one at a time (one open ``CheckpointReader``), converted if asked, written to
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
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..engine.outputs import OutputFile, SafetensorsOutput, Slot, TorchSaveOutput
from ..errors import CheckpointError
from ..format.dtypes import torch_dtype
from ..format.manifest import Manifest
from ..format.values import decode
from ..hints import missing_tensor
from ..state.saved import children, select
from ..state.tree import join_key, saved_ref
from .common import Output, PathLike, UsageError, human_bytes, parse_size
from .progress import Progress

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


def expand_rank_local(tree: Any, manifest: Manifest, rank: int | None, skipped: list[str],
                      parts: tuple[str, ...] = ()) -> Any:
    """The saved tree with every rank-local value replaced by saving rank ``rank``'s copy
    (its tensors keep their manifest keys); with ``rank`` None (or a rank that has no
    copy) rank-local values are dropped and their keys added to ``skipped``."""
    ref = saved_ref(tree)
    if ref is not None and ref[0] == "$rank_local":
        per_rank = manifest.rank_local.get(ref[1]) or []
        if rank is None or not (0 <= rank < len(per_rank)) or per_rank[rank] is None:
            skipped.append(join_key(list(parts)) or "<root>")
            return _DROP
        return expand_rank_local(per_rank[rank], manifest, rank, skipped, parts)
    kids = children(tree)
    if kids is None:
        return tree
    kind, items = kids
    kept = [(k, expand_rank_local(v, manifest, rank, skipped, parts + (str(k),))) for k, v in items]
    if kind is dict:
        from ..format.values import encode_dict_key

        pairs = [(k, v) for k, v in kept if v is not _DROP]
        if isinstance(tree, dict) and "$dict" not in tree:
            return dict(pairs)
        return {"$dict": [[encode_dict_key(k, join_key(list(parts))), v] for k, v in pairs]}
    values = [None if v is _DROP else v for _, v in kept]
    return values if kind is list else {"$tuple": values}


@dataclass
class _Built:
    """The export's skeleton (nested values with Slots for tensors), its slots and values."""

    skeleton: Any = None
    slots: list[Slot] = field(default_factory=list)
    values: list[tuple[str, Any]] = field(default_factory=list)


def _build(node: Any, parts: list[str], manifest: Manifest, dtype: torch.dtype | None, out: _Built) -> Any:
    """Decode the selected tree into a skeleton whose tensors are Slots named by their path."""
    ref = saved_ref(node)
    if ref is not None and ref[0] == "$tensor":
        entry = manifest.tensors.get(ref[1])
        if entry is None:
            raise missing_tensor(manifest, ref[1])
        src = torch_dtype(entry.dtype)
        if src is None:
            raise UsageError(f"tensor '{ref[1]}': dtype {entry.dtype} is not supported by this torch")
        slot = Slot(ref[1], join_key(parts), dtype if (dtype is not None and src in CONVERTIBLE) else src,
                    tuple(entry.shape))
        out.slots.append(slot)
        return slot
    kids = children(node)
    if kids is not None and kids[1]:
        kind, items = kids
        built = [(k, _build(v, parts + [str(k)], manifest, dtype, out)) for k, v in items]
        if kind is dict:
            return dict(built)
        return kind(v for _, v in built)
    value = decode(node)
    out.values.append((join_key(parts), value))
    return value


def _strip(name: str, prefix: str | None) -> str:
    if prefix and name.startswith(prefix + "."):
        return name[len(prefix) + 1:]
    return name


def _descend(skeleton: Any, prefix: str | None) -> Any:
    """The part of a nested skeleton under the dotted ``prefix`` (``strip`` with --to torch)."""
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
    checkpointer: Checkpointer | None = None,
) -> ExportReport:
    """Export the checkpoint at ``path`` to ``out`` in format ``to`` (torch, safetensors,
    hf); see the module docstring. ``dtype`` converts float16/bfloat16/float32/float64
    tensors (others are kept as they are); ``strip`` removes a leading dotted prefix from
    the output names (with ``torch``: exports the subtree under it); a prefix that no
    exported name starts with is an error. The checkpoint is opened once and its tensors
    read one at a time."""
    t0 = time.perf_counter()
    if to not in FORMATS:
        raise UsageError(f"unknown export format {to!r}: choose one of {', '.join(FORMATS)}")
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype.removeprefix("torch.")]
    max_bytes = parse_size(max_shard_size)
    cp = checkpointer if checkpointer is not None else Checkpointer()
    try:
        with cp.open_reader(path, verify=verify) as reader:
            return _export(reader, path, out, to, keys, dtype, rank, max_bytes, strip, flat, overwrite, progress,
                           cp, t0)
    finally:
        if checkpointer is None:
            cp.close()


def _export(reader: Any, path: PathLike, out: PathLike, to: str, keys: list[str] | None, dtype: torch.dtype | None,
            rank: int | None, max_bytes: int, strip: str | None, flat: bool, overwrite: bool,
            progress: bool | None, cp: Checkpointer, t0: float) -> ExportReport:
    manifest = reader.manifest
    skipped: list[str] = []
    tree = expand_rank_local(manifest.tree, manifest, rank, skipped)
    if tree is _DROP:
        tree = {}
    wanted = [k for k in keys or [] if not any(s == k or s.startswith(k + ".") or k.startswith(s + ".")
                                               for s in skipped)]
    if keys:
        try:
            tree = select(tree, wanted) if wanted else {}
        except CheckpointError as exc:
            raise UsageError(f"--keys: {exc} at {path} (see `shardsafe inspect`)") from None
    built = _Built()
    built.skeleton = _build(tree, [], manifest, dtype, built)
    report = ExportReport(str(out), to)
    report.skipped_rank_local = [k for k in skipped if keys is None or any(
        k == p or k.startswith(p + ".") or p.startswith(k + ".") for p in keys)]
    if not built.slots and to != "torch":
        raise UsageError(f"nothing to export from {path}: no tensors selected")
    slots = [Slot(s.key, _strip(s.name, strip), s.dtype, s.shape) for s in built.slots]
    if strip and to != "torch" and not any(s.name.startswith(strip + ".") for s in built.slots):
        raise UsageError(f"--strip {strip!r} matches no exported name (names start like "
                         f"{built.slots[0].name!r}; see `shardsafe inspect`)")
    if to != "torch" or flat:
        seen: set[str] = set()
        dup = next((s.name for s in slots if s.name in seen or seen.add(s.name)), None)
        if dup is not None:
            raise UsageError(f"two tensors would be exported as {dup!r}; choose --keys/--strip so names differ")
    if to != "torch":
        report.skipped_values = len(built.values)
    target = Output(cp, out, overwrite, "output path")
    try:
        total = sum(s.nbytes for s in slots)
        with Progress("export", total, enabled=progress) as bar:
            if to == "torch":
                by_key = {s.key: s for s in slots}
                if flat:
                    skeleton: Any = {_strip(k, strip): v for k, v in built.values}
                    skeleton.update({s.name: s for s in slots})
                else:
                    skeleton = _descend(_renamed(built.skeleton, by_key), strip)
                report.values = len(built.values)
                _write_file(lambda: TorchSaveOutput(target.parent, target.tmp, skeleton), slots, reader, bar)
                report.files = [target.name]
            elif to == "safetensors":
                _write_file(lambda: SafetensorsOutput(target.parent, target.tmp, slots), slots, reader, bar)
                report.files = [target.name]
            else:
                with target.folder() as folder:
                    shards = plan_shards(slots, max_bytes)
                    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
                    for name, shard in zip(names, shards):
                        _write_file(lambda n=name, sh=shard: SafetensorsOutput(folder, n, sh), shard, reader, bar)
                    weight_map = {s.name: name for name, shard in zip(names, shards) for s in shard}
                    index = {"metadata": {"total_size": sum(s.nbytes for s in slots)},
                             "weight_map": dict(sorted(weight_map.items()))}
                    folder.write_bytes(INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
                    folder.sync()
                    report.files = [*names, INDEX_NAME]
        target.publish()
    except BaseException:
        target.abort()
        raise
    finally:
        target.close()
    report.tensors = len(slots)
    report.bytes = sum(s.nbytes for s in slots)
    report.seconds = time.perf_counter() - t0
    return report


def _write_file(open_output: Any, slots: list[Slot], reader: Any, bar: Progress) -> None:
    """Open one output file, read each slot's tensor (converted if asked) and write it."""
    out: OutputFile = open_output()
    try:
        for s in slots:
            t = reader.read(s.key)
            if t.dtype != s.dtype:
                t = t.to(s.dtype)
            out.write(s, t)
            del t
            bar.advance(s.nbytes)
        out.close()
    except BaseException:
        out.abort()
        raise
