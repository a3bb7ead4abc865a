"""The legacy manifest readers: formats 1.x (chunks inline) and 2.x (one chunk table),
and the 2.x body of a manifest built from explicit chunk lists."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .checksum import ALGORITHM
from .chunk_table import Chunk, ChunkTable, table_json
from .manifest import FORMAT_NAME, KINDS, TABLE_VERSION, FileEntry, Manifest, TensorEntry
from .manifest_checks import _LIMIT, MAX_CREATED, _head_itemsize, _header_problem, _object_members
from .strict_json import _duplicate, _show


def decode_legacy(body: dict[str, Any], spans: Any, head: bytes, version: tuple[int, int], where: str) -> Manifest:
    """A format-1.x or 2.x manifest (its JSON parsed, its trailer verified)."""
    if not isinstance(body["files"], list):
        raise CorruptCheckpointError("inconsistent manifest: files is not a list")
    files = [FileEntry.from_json(f) for f in body["files"]]  # so every file is an object
    world_size = body["world_size"]
    extra = body.get("extra", {})
    problem = _header_problem(world_size, extra, body.get("writer", {}), body.get("rank_local", {}), files)
    if problem:
        raise CorruptCheckpointError(f"{where}: inconsistent manifest: {problem}")
    created = body.get("created", 0.0)
    if not (type(created) in (int, float) and 0 <= created < MAX_CREATED):  # NaN fails too
        raise CorruptCheckpointError(
            f"inconsistent manifest: created {_show(created)} is not a finite number of seconds in "
            f"[0, 2^35)")
    if version[0] == 1:
        tensors_json, chunks_json = _v1_to_v2(body["tensors"])
    else:
        tensors_json, chunks_json = body["tensors"], body["chunks"]
    tensors, members = _parse_tensors(tensors_json, chunks_json, files, extra["checksum_block"], where)
    if version[0] == 1 or members != spans.counted["tensors"] or \
            sum(map(len, body["files"])) != spans.counted["files"]:
        # Fewer members parsed than written: a duplicate key, or members of objects
        # not counted here (a newer minor's); a strict parse tells which.
        duplicate = _duplicate(head, spans)
        if duplicate:
            raise CorruptCheckpointError(f"manifest is not valid JSON: {duplicate}")
    return Manifest(
        tree=body["tree"],
        tensors=tensors,
        files=files,
        world_size=world_size,
        rank_local=body.get("rank_local", {}),
        created=created,
        writer=body.get("writer", {}),
        extra=extra,
        version=(version[0], version[1]),
    )


def encode_v2(m: Manifest) -> dict[str, Any]:
    """The body of a manifest built from explicit chunk lists (format 2: every chunk in one
    table; a parsed older manifest is upgraded)."""
    entries: dict[str, Any] = {}
    every: list[Chunk] = []
    for key, t in m.tensors.items():
        chunks = t.chunks
        d: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "kind": t.kind}
        if t.layout is not None:
            d["layout"] = t.layout
        d["chunks"] = [len(every), len(chunks)]
        entries[key] = d
        every.extend(chunks)
    body = {
        "format": FORMAT_NAME,
        # The layout written is always the current one; a parsed older manifest is upgraded.
        "version": list(m.version if m.version[0] >= TABLE_VERSION[0] else TABLE_VERSION),
        "checksum_algorithm": ALGORITHM,
        "created": m.created,
        "writer": m.writer,
        "world_size": m.world_size,
        "extra": m.extra,
        "files": [f.to_json() for f in m.files],
        "tensors": entries,
        "chunks": table_json(every),
        "rank_local": m.rank_local,
        "tree": m.tree,
    }
    return body


def _parse_tensors(tensors_json: Any, chunks_json: Any, files: list[FileEntry], block: int,
                   where: str) -> tuple[dict[str, TensorEntry], int]:
    """Tensor entries over a validated chunk table (the rules are in docs/format.md), and
    the number of object members in ``tensors_json`` (its own, its entries', their
    layouts'): fewer than its raw text holds means a duplicate key (see _parse_json)."""
    from .dtypes import name_itemsize

    if not isinstance(tensors_json, dict):
        raise CorruptCheckpointError("inconsistent manifest: tensors is not an object")
    keys = list(tensors_json)
    shapes: list[tuple[int, ...]] = []
    sizes: list[int] = []
    firsts = [0]
    heads: list[tuple[str, tuple[int, ...], str, Any]] = []
    members = len(tensors_json)
    known: dict[tuple[Any, tuple[Any, ...]], int] = {}  # (dtype, shape) -> itemsize, once validated
    dims: list[Any] = []
    first = 0
    for key, t in tensors_json.items():
        if type(t) is not dict:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}' is not an object")
        members += len(t)
        dtype, shape, kind, layout, span = t["dtype"], t["shape"], t.get("kind", "replicated"), t.get("layout"), \
            t["chunks"]
        if kind not in KINDS or not (layout is None or type(layout) is dict):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad kind or layout")
        if layout is not None:
            members += _object_members(layout)
        shape_t = tuple(shape) if type(shape) is list else ()
        try:
            size = known.get((dtype, shape_t)) if type(shape) is list else None
        except TypeError:  # unhashable: not a str dtype or int dims, refused just below
            size = None
        if size is None:  # the first entry of its dtype and shape: validate them
            size = known[(dtype, shape_t)] = _head_itemsize(key, dtype, shape, name_itemsize)
        dims.extend(shape)  # a hit is equal to a validated shape: only the dims' types are left to check
        if not (type(span) is list and len(span) == 2 and type(span[0]) is int and type(span[1]) is int
                and span[0] == first and first < _LIMIT and 1 <= span[1] < _LIMIT):
            raise CorruptCheckpointError(
                f"inconsistent manifest: tensor '{key}': chunk range {span!r} is not [first, count] with first "
                f"{first} (where the previous tensor's chunks end) and count >= 1")
        first += span[1]
        shapes.append(shape_t)
        sizes.append(size)
        firsts.append(first)
        heads.append((dtype, shape_t, kind, layout))
    if not set(map(type, dims)) <= {int}:  # 1.0 and True equal 1: find the entry that holds one
        key, t = next((k, t) for k, t in tensors_json.items() if any(type(d) is not int for d in t["shape"]))
        _head_itemsize(key, t["dtype"], t["shape"], name_itemsize)
    rows = chunks_json.get("f") if isinstance(chunks_json, dict) else None
    if not (isinstance(rows, list) and len(rows) == firsts[-1]):
        # Checked before anything is sized by the tensors' counts (a tiny manifest must
        # not make the reader allocate per claimed chunk).
        got = len(rows) if isinstance(rows, list) else type(rows).__name__
        raise CorruptCheckpointError(f"inconsistent manifest: the tensors claim {firsts[-1]} chunks, the chunk "
                                     f"table has {got}")
    first_arr = np.array(firsts, dtype=np.int64)
    ndim = np.repeat(np.array([len(s) for s in shapes], dtype=np.int64), np.diff(first_arr))
    table = ChunkTable.from_json(chunks_json, ndim, block, [f.rank for f in files])
    bad = table.problem(shapes, sizes, first_arr, np.array([f.header_bytes for f in files], dtype=np.int64),
                        np.array([f.nbytes for f in files], dtype=np.int64), [f.name for f in files])
    if bad is not None:
        c, what = bad
        if c < 0:
            raise CorruptCheckpointError(f"inconsistent manifest: chunk table: {what}")
        t = int(np.searchsorted(first_arr, c, side="right")) - 1
        t = min(max(t, 0), len(keys) - 1)
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{keys[t]}', chunk {c - firsts[t]}: {what}")
    in_table = TensorEntry.in_table
    return {key: in_table(*head, table, lo, hi) for key, head, lo, hi in zip(keys, heads, firsts, firsts[1:])}, \
        members


def _v1_to_v2(tensors: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Format 1.x keeps each tensor's chunks inline as objects; rewrite them as the
    format-2 chunk table (the per-chunk rank, always the file's rank, is dropped)."""
    if not isinstance(tensors, dict):
        raise CorruptCheckpointError("inconsistent manifest: tensors is not an object")
    out: dict[str, Any] = {}
    o: list[Any] = []
    n: list[Any] = []
    f: list[Any] = []
    b: list[Any] = []
    x: list[str] = []
    count = 0
    for key, t in tensors.items():
        chunks = t["chunks"]
        if not isinstance(chunks, list):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': chunks is not a list")
        for c in chunks:
            if not isinstance(c, dict):
                raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': a chunk is not an object")
            if not (isinstance(c["o"], list) and isinstance(c["n"], list) and len(c["o"]) == len(c["n"])
                    == len(t["shape"])):
                raise CorruptCheckpointError(
                    f"inconsistent manifest: tensor '{key}', chunk at {c['o']!r}: box does not match the shape's rank")
            sums = c["x"]
            if not (isinstance(sums, list) and sums and all(isinstance(s, str) and len(s) == 16 for s in sums)):
                raise CorruptCheckpointError(
                    f"inconsistent manifest: tensor '{key}', chunk at {c['o']!r}: bad block checksums")
            o.extend(c["o"])
            n.extend(c["n"])
            f.append(c["f"])
            b.extend(c["b"] if isinstance(c["b"], list) and len(c["b"]) == 2 else [None, None])
            x.extend(sums)
        out[key] = {**{k: v for k, v in t.items() if k != "chunks"}, "chunks": [count, len(chunks)]}
        count += len(chunks)
    return out, {"o": o, "n": n, "f": f, "b": b, "x": "".join(x)}
