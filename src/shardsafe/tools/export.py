"""``shardsafe export``: write a checkpoint's tensors as one ``torch.save`` file, one
``.safetensors`` file, a Hugging Face model folder, or a ``torch.distributed.checkpoint``
(DCP) folder.

Streaming: every output byte offset is known from the manifest before any data is read,
so tensors are read in order (one open ``CheckpointReader``), converted if asked, written to
their place and dropped. Small tensors are read together, in consecutive batches of at most
``BATCH_BYTES`` (one plan, one verification, one landing per batch, as ``load_full`` reads);
a larger tensor is read alone. Peak memory is about the larger of the largest tensor and
``BATCH_BYTES`` (plus one converted tensor while a ``--dtype`` conversion runs) plus a
staging buffer, whatever the checkpoint's size.

Selection: ``keys`` prefixes pick parts of the state (``strip`` alone picks the subtree
it strips); sharded and replicated tensors are exported whole; rank-local values (one copy
per saving rank) are skipped with a note unless ``rank`` names the saving rank whose copy
to export (under its plain key, without the ``#rank<r>`` marker). Formats:

- ``torch``: the nested state as ``load_full`` returns it, tensors and plain values
  (``flat=True``: one level of dotted keys); loads with ``torch.load(weights_only=True)``.
- ``safetensors``: tensors only, flat dotted keys; plain values are skipped (counted).
- ``hf``: a folder ``from_pretrained`` loads (see :mod:`shardsafe.hf_folder`): shards of at
  most ``max_shard_size`` and ``model.safetensors.index.json``, config.json and
  generation_config.json (from ``config`` or found in the checkpoint), tied weights once.
- ``dcp``: written by ``torch.distributed.checkpoint.save`` itself (no process group),
  tensors and plain values with the same nesting as ``torch``; one ``.distcp`` file per
  batch (consecutive tensors of at most ``BATCH_BYTES``, a larger tensor alone), since DCP's
  writer holds every tensor of a file until the file is closed.

``rename`` renames the flat output names (safetensors, hf, and torch / dcp with ``flat``).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import hf_folder
from ..checkpointer import Checkpointer
from ..engine.outputs import SafetensorsOutput, Slot, TorchSaveOutput
from ..errors import CheckpointError, CorruptCheckpointError, UnsupportedValueError
from ..format.dtypes import torch_dtype
from ..format.manifest import Manifest
from ..format.values import PICKLE_INT_BOUND, RANK_LOCAL_TAG, TENSOR_TAG, decode
from ..gcpause import gc_paused
from ..hints import as_keys, missing_tensor
from ..knobs import EXPORT_BATCH
from ..ops.reader import CheckpointReader
from ..state.saved import children, select, walk
from ..state.tree import join_key, saved_ref
from .common import Output, PathLike, UsageError, human_bytes, locate, no_match, parse_size
from .export_targets import Fetcher, write_dcp, write_file
from .progress import Progress

FORMATS = ("torch", "safetensors", "hf", "dcp")
CONVERTIBLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
INDEX_NAME = hf_folder.INDEX_NAME
BATCH_BYTES = EXPORT_BATCH
"""Consecutive small tensors are read (and, for ``dcp``, written to one file) together, up to
this many bytes per batch; a larger tensor is a batch of its own (knobs.EXPORT_BATCH)."""
_DROP = object()


@dataclass
class ExportReport:
    """What ``export_checkpoint`` wrote."""

    out: str
    format: str
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    bytes: int = 0
    values: int = 0  # plain values written (torch, dcp)
    skipped_values: int = 0  # plain values not written (safetensors / hf hold tensors only)
    skipped_rank_local: list[str] = field(default_factory=list)
    tied: dict[str, str] = field(default_factory=dict)  # hf: names left out as tied -> the name they are tied to
    config: str | None = None  # hf: where config.json came from (None: no config.json written)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dict(self.__dict__)

    def to_text(self) -> str:
        """A summary and the notes about what was left out."""
        rate = f", {human_bytes(self.bytes / self.seconds)}/s" if self.seconds > 0 else ""
        lines = [f"exported {self.tensors} tensors ({human_bytes(self.bytes)}) to {self.out} as {self.format} "
                 f"in {len(self.files)} file(s), {self.seconds:.2f} s{rate}"]
        if self.format == "hf":
            lines.append(f"config.json from {self.config}" if self.config else
                         "note: no config.json written (from_pretrained needs one): pass --config FILE_OR_HF_FOLDER, "
                         f"or save the config in the checkpoint under the key {hf_folder.CONFIG_KEY!r}")
        for name, source in self.tied.items():
            lines.append(f"note: {name} left out: tied to {source} (from_pretrained ties it again)")
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
    if ref is not None and ref[0] == RANK_LOCAL_TAG:
        if ref[1] not in manifest.rank_local:
            raise CorruptCheckpointError(
                f"the state at '{join_key(list(parts)) or '<root>'}' is rank-local value {ref[1]!r}, which the "
                "manifest does not list (a dangling $rank_local)")
        per_rank = manifest.rank_local[ref[1]]
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


def tree_keys(tree: Any) -> list[str]:
    """The dotted key of every node of a saved tree (containers and leaves), root left out."""
    return [join_key(list(parts)) for parts, _, _ in walk(tree) if parts]


@dataclass
class _Built:
    """The export's skeleton (nested values with Slots for tensors), its slots and values."""

    skeleton: Any = None
    slots: list[Slot] = field(default_factory=list)
    values: list[tuple[str, Any]] = field(default_factory=list)


def _build(node: Any, parts: list[str], manifest: Manifest, dtype: torch.dtype | None, out: _Built) -> Any:
    """Decode the selected tree into a skeleton whose tensors are Slots named by their path."""
    ref = saved_ref(node)
    if ref is not None and ref[0] == TENSOR_TAG:
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


def _check_loadable(key: str, value: Any, to: str) -> None:
    """Refuse, naming ``key``, a plain value that ``torch.load(weights_only=True)`` could not
    read back: an int beyond pickle's LONG1 opcode (a checkpoint written before ``save``
    refused them; see ``format.values.PICKLE_INT_BOUND``)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, int) and not -PICKLE_INT_BOUND <= v < PICKLE_INT_BOUND:
            raise UnsupportedValueError(
                f"cannot export '{key}' to {to}: it holds an int of {v.bit_length()} bits, and "
                "torch.load(weights_only=True) reads at most 2039 bits and a sign (export it with --to "
                "safetensors or hf, which leave plain values out, or select the other keys with --keys)")


def _strip(name: str, prefix: str | None) -> str:
    if prefix and name.startswith(prefix + "."):
        return name[len(prefix) + 1:]
    return name


def _descend(skeleton: Any, prefix: str | None) -> Any:
    """The part of a nested skeleton under the dotted ``prefix`` (``strip`` with nested output)."""
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


plan_shards = hf_folder.plan_shards


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
    rename: hf_folder.Rename | None = None,
    config: Any = None,
    generation_config: Any = None,
    config_key: str | None = None,
    flat: bool = False,
    overwrite: bool = False,
    verify: bool = True,
    progress: bool | None = None,
    checkpointer: Checkpointer | None = None,
) -> ExportReport:
    """Export the checkpoint at ``path`` to ``out`` in format ``to`` (torch, safetensors,
    hf, dcp); see the module docstring. ``keys`` selects dotted prefixes; ``dtype``
    converts float16/bfloat16/float32/float64 tensors (others are kept as they are);
    ``strip`` removes a leading dotted prefix from the output names and, without ``keys``,
    exports only what lies under it (nested outputs: that subtree); ``rename`` renames
    the flat names after that (``shardsafe.hf_folder.rename_names``). A ``keys`` or
    ``strip`` prefix that selects nothing is an error that suggests keys. ``hf`` only:
    ``config`` / ``generation_config`` (paths of config.json or a Hugging Face folder,
    dicts or transformers configs; default: the checkpoint's ``hf_config`` value, or the
    one at ``config_key``). The checkpoint is opened once and its tensors read one at a
    time; the output appears atomically."""
    t0 = time.perf_counter()
    keys = list(as_keys(keys, "keys")) if keys is not None else None
    if strip is not None and not isinstance(strip, str):
        raise TypeError(f"strip takes one dotted prefix (str), not {type(strip).__name__}")
    if to not in FORMATS:
        raise UsageError(f"unknown export format {to!r}: choose one of {', '.join(FORMATS)}")
    if to != "hf" and (config is not None or generation_config is not None or config_key is not None):
        raise UsageError("--config, --generation-config and --config-key are for --to hf")
    if rename is not None and (to in ("torch", "dcp") and not flat):
        raise UsageError(f"--rename renames flat names: add --flat to rename the keys of a {to} export")
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.") not in DTYPES:
            raise UsageError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype.removeprefix("torch.")]
    max_bytes = parse_size(max_shard_size)
    cp = checkpointer if checkpointer is not None else Checkpointer()
    try:
        # no automatic GC passes: they would walk the manifest's, the skeleton's and DCP's
        # plans' objects again and again (none of them garbage); tensors are freed by
        # reference counting as they are written (see shardsafe.gcpause)
        with gc_paused(), cp.open_reader(path, verify=verify) as reader:
            job = _Job(reader, cp, path, out, to, progress, overwrite)
            return job.run(keys, dtype, rank, max_bytes, strip, rename, flat, config, generation_config, config_key,
                           t0)
    finally:
        if checkpointer is None:
            cp.close()


def read_tensors(reader: CheckpointReader, keys: list[str]) -> list[torch.Tensor]:
    """The full tensors ``keys`` as fresh CPU tensors, read together (one plan, every
    checksum verified): :meth:`CheckpointReader.read_many`."""
    return reader.read_many(keys)


@dataclass
class _Job:
    """One export: the open reader and where the output goes."""

    reader: Any
    cp: Checkpointer
    path: PathLike
    out: PathLike
    to: str
    progress: bool | None
    overwrite: bool

    def run(self, keys: list[str] | None, dtype: torch.dtype | None, rank: int | None, max_bytes: int,
            strip: str | None, rename: hf_folder.Rename | None, flat: bool, config: Any, generation_config: Any,
            config_key: str | None, t0: float) -> ExportReport:
        manifest = self.reader.manifest
        skipped: list[str] = []
        if manifest.rank_local:  # format 3: each saving rank's values are in its file's index
            self.reader.fetch_indexes(range(len(manifest.files)))
            tree = expand_rank_local(manifest.tree, manifest, rank, skipped)
            all_keys = tree_keys(tree)
        else:  # the tree as saved, where any $rank_local is dangling (one walk, no copy)
            tree = manifest.tree
            all_keys = []
            for parts, node, _ in walk(tree):
                if parts:
                    all_keys.append(join_key(list(parts)))
                ref = saved_ref(node)
                if ref is not None and ref[0] == RANK_LOCAL_TAG:
                    expand_rank_local(node, manifest, rank, skipped, tuple(parts))  # raises, naming the key
        if tree is _DROP:
            tree = {}
        top = [str(k) for k, _ in (children(tree) or (dict, []))[1]]
        if keys is None and strip:
            keys = [strip]  # --strip alone: export what it strips
        wanted = [k for k in keys or [] if not any(s == k or s.startswith(k + ".") or k.startswith(s + ".")
                                                   for s in skipped)]
        for k in keys or []:
            if k in wanted and not any(n == k or n.startswith(k + ".") for n in all_keys):
                raise no_match("--keys" if k != strip else "--strip", k, all_keys, top)
        if keys:
            try:
                tree = select(tree, wanted) if wanted else {}
            except CheckpointError as exc:
                raise UsageError(f"--keys: {exc} at {self.path} (see `shardsafe inspect`)") from None
        # Every index is read, verified and parsed before any output is laid out: a hostile
        # index (say chunks claiming 2^64 checksum blocks) is a CorruptCheckpointError here,
        # never a failure of the output's writer on absurd sizes.
        self.reader.fetch_indexes(range(len(manifest.files)))
        built = _Built()
        built.skeleton = _build(tree, [], manifest, dtype, built)
        report = ExportReport(str(self.out), self.to)
        report.skipped_rank_local = [k for k in skipped if keys is None or any(
            k == p or k.startswith(p + ".") or p.startswith(k + ".") for p in keys)]
        nested = self.to in ("torch", "dcp") and not flat
        if not built.slots and not nested:
            raise UsageError(f"nothing to export from {self.path}: no tensors selected")
        exported = [s.name for s in built.slots] + ([k for k, _ in built.values] if self.to in ("torch", "dcp") else [])
        if strip and not any(n.startswith(strip + ".") for n in exported):
            raise no_match("--strip", strip, all_keys, top)
        stripped = [_strip(s.name, strip) for s in built.slots]
        names = stripped if nested else hf_folder.rename_names(stripped, rename)  # flat names must differ
        slots = [Slot(s.key, n, s.dtype, s.shape) for s, n in zip(built.slots, names)]
        if nested:
            skeleton = _descend(_renamed(built.skeleton, {s.key: s for s in slots}), strip)
        else:
            skeleton = {_strip(k, strip): v for k, v in built.values} if self.to in ("torch", "dcp") else {}
            skeleton.update({s.name: s for s in slots})
        if self.to in ("torch", "dcp"):
            for key, value in built.values:
                _check_loadable(key, value, self.to)
            report.values = len(built.values)
        else:
            report.skipped_values = len(built.values)
        cfg = gen = None
        if self.to == "hf":
            cfg, gen, report.config = self._configs(config, generation_config, config_key)
            report.tied = hf_folder.tied_targets(cfg, [s.name for s in slots])
            slots = [s for s in slots if s.name not in report.tied]
        self._write(skeleton, slots, max_bytes, cfg, gen, report)
        report.tensors = len(slots)
        report.bytes = sum(s.nbytes for s in slots)
        report.seconds = time.perf_counter() - t0
        return report

    def _configs(self, config: Any, generation_config: Any, config_key: str | None
                 ) -> tuple[dict[str, Any] | None, dict[str, Any] | None, str | None]:
        """(config, generation config, where the config came from) for an hf export."""
        cfg, gen = hf_folder.resolve_configs(config, generation_config, lambda p: locate(p, self.cp))
        where = None
        if config is not None:
            where = str(config) if isinstance(config, (str, os.PathLike)) else "the config given"
        if cfg is None:
            key, cfg = self._stored_config(config_key)
            if key is not None:
                where = f"the checkpoint's {key!r}"
                parent = key.rpartition(".")[0]
                if gen is None:
                    gen = self._stored_value(f"{parent}.{hf_folder.GENERATION_CONFIG_KEY}" if parent
                                             else hf_folder.GENERATION_CONFIG_KEY)
        return cfg, gen, where

    def _stored_config(self, config_key: str | None) -> tuple[str | None, dict[str, Any] | None]:
        """(key, value) of the config saved in the checkpoint: at ``config_key``, else the one
        key named ``hf_config``; (None, None) when there is none."""
        if config_key is not None:
            value = self._stored_value(config_key)
            if value is None:
                tree = self.reader.manifest.tree
                raise no_match("--config-key", config_key, tree_keys(tree),
                               [str(k) for k, _ in (children(tree) or (dict, []))[1]])
            return config_key, value
        found = [join_key(list(parts)) for parts, _, is_container in walk(self.reader.manifest.tree)
                 if parts and parts[-1] == hf_folder.CONFIG_KEY and is_container]
        if len(found) > 1:
            raise UsageError(f"the checkpoint holds several configs ({', '.join(found)}): choose one with --config-key")
        return (found[0], self._stored_value(found[0])) if found else (None, None)

    def _stored_value(self, key: str) -> dict[str, Any] | None:
        """The plain JSON object saved at ``key`` (None when there is none)."""
        for parts, node, _ in walk(self.reader.manifest.tree):
            if join_key(list(parts)) == key:
                try:
                    value = decode(node)
                except CheckpointError as exc:
                    raise UsageError(f"{key!r} is not a plain JSON config: {exc}") from None
                if not isinstance(value, dict):
                    raise UsageError(f"{key!r} holds a {type(value).__name__}, not a config dict")
                return hf_folder.config_dict(value)
        return None

    def _write(self, skeleton: Any, slots: list[Slot], max_bytes: int, cfg: dict[str, Any] | None,
               gen: dict[str, Any] | None, report: ExportReport) -> None:
        """Write the output under a temporary name and publish it."""
        target = Output(self.cp, self.out, self.overwrite, "output path")
        try:
            with Progress("export", sum(s.nbytes for s in slots), enabled=self.progress) as bar:
                fetch = Fetcher(self.reader, read_tensors, BATCH_BYTES, bar.advance)
                if self.to != "dcp":
                    fetch.plan([slots])  # in the order they are written
                if self.to == "torch":
                    write_file(lambda: TorchSaveOutput(target.parent, target.tmp, skeleton), slots, fetch)
                    report.files = [target.name]
                elif self.to == "safetensors":
                    write_file(lambda: SafetensorsOutput(target.parent, target.tmp, slots), slots, fetch)
                    report.files = [target.name]
                elif self.to == "hf":
                    with target.folder() as folder:
                        report.files = hf_folder.write_weights_and_configs(
                            folder, slots, fetch, max_shard_size=max_bytes, config=cfg, generation_config=gen)
                else:
                    report.files = write_dcp(target, skeleton, fetch)
            target.publish()
        except BaseException:
            target.abort()
            raise
        finally:
            target.close()
