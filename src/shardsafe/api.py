"""save / load / load_full: wire the layers together."""

from __future__ import annotations

import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import __version__
from .engine.reader import execute_reads
from .engine.writer import write_data_file
from .errors import CheckpointError, MissingKeysError
from .format.dtypes import dtype_name
from .format.manifest import MANIFEST_NAME, Chunk, FileEntry, Manifest, TensorEntry
from .plan.load_plan import plan_reads
from .plan.save_plan import plan_local
from .state.match import Matcher
from .state.tree import flatten, join_key, saved_items
from .storage import local

CHECKSUM_BLOCK = 1 << 20
PathLike = str | os.PathLike


@dataclass
class SaveInfo:
    """What a save did."""

    path: Path
    bytes_written: int
    files: int
    tensors: int
    seconds: float


@dataclass
class LoadInfo:
    """What a load did."""

    path: Path
    bytes_read: int
    tensors: int
    seconds: float


def save(state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False) -> SaveInfo:
    """Save ``state_dict`` as a checkpoint directory at ``path``, crash-safely.

    The checkpoint becomes visible only once complete; an existing checkpoint at
    ``path`` is replaced only with ``overwrite=True`` and stays intact until the new one
    is committed. Values that cannot be saved without pickle raise
    UnsupportedValueError naming their key before anything is written."""
    t0 = time.perf_counter()
    path = Path(path)
    local.check_target(path, overwrite)
    flat = flatten(state_dict)
    tensors: dict[str, TensorEntry] = {}
    for key, t in flat.tensors.items():
        tensors[key] = TensorEntry(dtype_name(t.dtype, key), tuple(t.shape), "replicated")
    plans = plan_local(flat.tensors)
    for old in local.stale_siblings(path):
        if local.TMP_MARK in old.name:
            shutil.rmtree(old, ignore_errors=True)
    tmp = local.temp_sibling(path)
    try:
        files: list[FileEntry] = []
        with ThreadPoolExecutor(1) as pool:
            for plan in plans:
                entry, written = write_data_file(tmp, plan, CHECKSUM_BLOCK, pool)
                index = len(files)
                files.append(entry)
                for w in written:
                    tensors[w.item.key].chunks.append(
                        Chunk(w.item.box.offsets, w.item.box.lengths, index, w.start, w.end, w.checksums, plan.rank)
                    )
        for key in tensors:
            if "#rank" in key:
                tensors[key].kind = "rank_local"
        manifest = Manifest(
            tree=flat.tree,
            tensors=tensors,
            files=files,
            world_size=1,
            rank_local={k: [v] for k, v in flat.rank_local.items()},
            writer={"shardsafe": __version__, "torch": torch.__version__},
            extra={"checksum_block": CHECKSUM_BLOCK},
        )
        local.write_small_file(tmp / MANIFEST_NAME, manifest.to_bytes())
        local.commit(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    total = sum(f.nbytes for f in files)
    return SaveInfo(path, total, len(files), len(tensors), time.perf_counter() - t0)


def read_manifest(path: PathLike) -> Manifest:
    """Parse and verify the manifest of the committed checkpoint at ``path``."""
    path = Path(path)
    mpath = local.require_checkpoint(path)
    return Manifest.from_bytes(mpath.read_bytes(), str(mpath))


def _block(manifest: Manifest) -> int:
    block = manifest.extra.get("checksum_block")
    if not isinstance(block, int) or block <= 0:
        raise CheckpointError("manifest: missing or bad extra.checksum_block")
    return block


def load(state_dict: dict[str, Any], path: PathLike, *, strict: bool = True, verify: bool = True) -> LoadInfo:
    """Load the checkpoint at ``path`` into ``state_dict`` in place.

    Tensors are filled in place, Statefuls get ``load_state_dict`` with their filled
    tree, other values are replaced. Keys, shapes and dtypes are validated — and with
    ``verify`` the checksums of every needed block — before any destination byte is
    written, so a failed load leaves the destination untouched."""
    t0 = time.perf_counter()
    path = Path(path)
    manifest = read_manifest(path)
    matcher = Matcher(manifest, rank=0, strict=strict)
    matcher.match(state_dict, manifest.tree, [], top=True)
    result = matcher.result
    result.raise_errors()
    ops = plan_reads(manifest, result.fills)
    nbytes = execute_reads(path, manifest, ops, verify=verify, block=_block(manifest))
    for assign in result.assigns:
        assign()
    for obj, get in result.statefuls:
        obj.load_state_dict(get())
    return LoadInfo(path, nbytes, len({f.key for f in result.fills}), time.perf_counter() - t0)


def load_full(path: PathLike, keys: list[str] | str | None = None, *, verify: bool = True) -> dict[str, Any]:
    """A fresh tree of CPU tensors and values from the checkpoint at ``path``.

    ``keys`` restricts the result to the given dotted keys or key prefixes (for example
    ``"model"`` or ``"model.layers.0.weight"``); a key that matches nothing raises
    MissingKeysError."""
    path = Path(path)
    manifest = read_manifest(path)
    tree = manifest.tree
    if keys is not None:
        tree = _prune(tree, [keys] if isinstance(keys, str) else list(keys))
    matcher = Matcher(manifest, rank=0)
    value = matcher.materialize(tree)
    matcher.result.raise_errors()
    ops = plan_reads(manifest, matcher.result.fills)
    execute_reads(path, manifest, ops, verify=verify, block=_block(manifest))
    return value


def _prune(tree: Any, wanted: list[str]) -> Any:
    """Keep only the parts of a saved dict tree under the wanted dotted prefixes."""
    found = {w: False for w in wanted}

    def walk(node: Any, parts: list[str]) -> Any:
        key = join_key(parts)
        hits = [w for w in wanted if key == w or key.startswith(w + ".")]
        if hits:
            for w in hits:
                found[w] = True
            return node
        if parts and not any(w.startswith(key + ".") for w in wanted):
            return _DROP
        items = saved_items(node)
        if items is None:
            return _DROP
        kept = {}
        for k, v in items:
            sub = walk(v, parts + [str(k)])
            if sub is not _DROP:
                kept[k] = sub
        if not kept:
            return _DROP
        if isinstance(node, dict) and "$dict" in node:
            from .format.values import encode_dict_key

            return {"$dict": [[encode_dict_key(k, key), v] for k, v in kept.items()]}
        return kept

    out = walk(tree, [])
    missing = [w for w, ok in found.items() if not ok]
    if missing:
        raise MissingKeysError(f"no key or key prefix {missing[0]!r} in the checkpoint")
    return {} if out is _DROP else out


_DROP = object()
