"""The current manifest codec, format 3.x: layouts as rules or explicit boxes, files as
columns, byte ranges and checksums in the per-file indexes (docs/format.md)."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .checksum import ALGORITHM
from .chunk_table import HEX
from .file_index import data_name
from .manifest import FORMAT_NAME, MANIFEST_NAME, FileEntry, Manifest, TensorEntry
from .manifest_checks import _LIMIT, MAX_CREATED, _head_itemsize, _header_problem, _object_members
from .refs import parse_refs, refs_json
from .rules import (
    FREE_BOXES,
    INDEX_BYTES_PER_ROW,
    RULE_SLACK,
    Backing,
    Mesh,
    Rule,
    allowance,
    free_boxes,
    parse_placement,
)
from .strict_json import _count, _duplicate, _show

MAX_WORLD = 1 << 20
"""Largest ``world_size`` of a format-3 manifest (tools list per-rank values by rank)."""

_FILE_ID = re.compile(r"(\.[0-9a-z]{1,64})?")


def decode_v3(body: dict[str, Any], spans: Any, head: bytes, version: tuple[int, int], where: str) -> Manifest:
    """A format-3 manifest (docs/format.md): validated before anything is sized by it."""
    world_size, extra, writer = body["world_size"], body.get("extra", {}), body.get("writer", {})
    problem = _header_problem(world_size, extra, writer, {}, [])
    if problem:
        raise CorruptCheckpointError(f"inconsistent manifest: {problem}")
    created = body.get("created", 0.0)
    if not (type(created) in (int, float) and 0 <= created < MAX_CREATED):
        raise CorruptCheckpointError(f"inconsistent manifest: created {_show(created)} is not a finite number of "
                                     "seconds in [0, 2^35)")
    meshes_json = body["meshes"]
    if type(meshes_json) is not list:
        raise CorruptCheckpointError("inconsistent manifest: meshes is not a list")
    meshes = []
    for i, m in enumerate(meshes_json):
        try:
            meshes.append(Mesh.from_json(m, world_size))
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"inconsistent manifest: mesh {i}: {exc}") from None
    if world_size > MAX_WORLD:
        raise CorruptCheckpointError(f"inconsistent manifest: world_size {world_size} is above {MAX_WORLD}")
    files, file_id = _files_v3(body["files"], world_size)
    rank_local = body["rank_local"]
    if not (type(rank_local) is list and all(type(k) is str for k in rank_local)
            and len(set(rank_local)) == len(rank_local)):
        raise CorruptCheckpointError("inconsistent manifest: rank_local is not a list of distinct keys")
    tensors_json = body["tensors"]
    # The rule budget (docs/format.md, limits): the rules' bounds, summed over distinct
    # rules, within an allowance (2^16 + 512 per distinct rule) plus the rows the indexes
    # list. Refused here, before anything is cut, when even the stated index sizes could
    # not list them; rules beyond the work pool (2^16 + 16 per manifest byte) are cut only
    # once the real indexes (read and verified, each read bounded by its stated size) have
    # been counted, and every reader that reads all indexes counts them too.
    listable = sum(f.index_bytes for f in files) // INDEX_BYTES_PER_ROW
    tensors, members, rules = _tensors_v3(tensors_json, body["chunks"], meshes, len(files), world_size,
                                          FREE_BOXES + listable)
    if members != spans.counted.get("tensors"):
        duplicate = _duplicate(head, spans)
        if duplicate:
            raise CorruptCheckpointError(f"manifest is not valid JSON: {duplicate}")
    refs = parse_refs(body["refs"]) if "refs" in body else []
    own = {MANIFEST_NAME} | {f.name for f in files} | {f.index_name for f in files}
    if any(r.checkpoint == "" and r.name in own for r in refs):
        raise CorruptCheckpointError("inconsistent manifest: a referenced file of this checkpoint's own folder has the "
                                     "name of its manifest, a data file or an index")
    manifest = Manifest(tree=body["tree"], tensors=tensors, files=files, world_size=world_size,
                        rank_local=rank_local, created=created, writer=writer, extra=extra, version=version,
                        meshes=meshes, file_id=file_id, refs=refs, requires=list(body.get("requires", [])))
    if rules:
        claimed = sum(r.count_bound() for r in rules)
        manifest.backing = Backing(claimed, allowance(len(rules)), manifest.listed_rows)
        if claimed > free_boxes(len(head)):
            manifest.backing.armed = True
            for r in rules:
                r.backing = manifest.backing
    return manifest


def _files_v3(d: Any, world: int) -> tuple[list[FileEntry], str]:
    """The files table: one data file (and its index) per listed saving rank."""
    if type(d) is not dict:
        raise CorruptCheckpointError("inconsistent manifest: files is not an object")
    file_id = d.get("id")
    if not (type(file_id) is str and _FILE_ID.fullmatch(file_id)):
        raise CorruptCheckpointError(f"inconsistent manifest: files id {_show(file_id)} is not \"\" or \".\" and up "
                                     "to 64 lowercase letters and digits")
    ranks, sizes, isizes, sums = d.get("rank"), d.get("bytes"), d.get("index_bytes"), d.get("index_x")
    count = len(ranks) if type(ranks) is list else -1
    for name, col in (("rank", ranks), ("bytes", sizes), ("index_bytes", isizes)):
        if not (type(col) is list and len(col) == count and all(type(v) is int and 0 <= v < _LIMIT for v in col)):
            raise CorruptCheckpointError(f"inconsistent manifest: files '{name}' is not a list of {max(count, 0)} "
                                         "sizes")
    if any(a >= b for a, b in zip(ranks, ranks[1:])) or (ranks and ranks[-1] >= world):
        raise CorruptCheckpointError(f"inconsistent manifest: file ranks are not increasing ranks below {world}")
    if any(n < 8 for n in sizes):
        raise CorruptCheckpointError("inconsistent manifest: a data file of fewer than 8 bytes")
    if not (type(sums) is str and len(sums) == HEX * count and _hex_lower(sums)):
        raise CorruptCheckpointError("inconsistent manifest: files 'index_x' is not one 16-hex digest per file")
    files = [FileEntry(data_name(r, file_id), n, r, 0, "", i, sums[HEX * k: HEX * (k + 1)])
             for k, (r, n, i) in enumerate(zip(ranks, sizes, isizes))]
    return files, file_id


def _hex_lower(s: str) -> bool:
    try:
        return 2 * len(bytes.fromhex(s)) == len(s) and s == s.lower()
    except ValueError:
        return False


def _tensors_v3(tensors_json: Any, chunks_json: Any, meshes: list[Mesh], nfiles: int, world: int,
                box_budget: int) -> tuple[dict[str, TensorEntry], int, list[Rule]]:
    """Tensor entries: by rule, or by explicit boxes (rows of the geometry table), the
    object members of ``tensors_json`` (fewer than its raw text holds: a duplicate key) and
    the distinct rules (their bounds summed at most ``box_budget`` plus RULE_SLACK per
    distinct rule, nothing cut).

    A first pass checks the boxes and dims of all tensors at once (numpy) and gives up at
    the first doubt; a second pass, one tensor at a time, then raises the error that
    names the first bad tensor (the same error for every manifest)."""
    try:
        found = _tensors_v3_pass(tensors_json, chunks_json, meshes, nfiles, world, box_budget, True)
    except Exception:  # noqa: BLE001 - the exact error comes from the careful pass below
        found = None
    if found is None:
        found = _tensors_v3_pass(tensors_json, chunks_json, meshes, nfiles, world, box_budget, False)
    return found


_INT = frozenset([int])


class _Pass:
    """One pass of :func:`_tensors_v3` over the tensors (see :func:`_tensors_v3_pass`)."""

    def __init__(self, chunks_json: Any, meshes: list[Mesh], nfiles: int, world: int, box_budget: int,
                 batched: bool) -> None:
        if type(chunks_json) is not dict:
            raise CorruptCheckpointError("inconsistent manifest: chunks is not an object")
        o, n, f = chunks_json.get("o"), chunks_json.get("n"), chunks_json.get("f")
        if not (type(o) is list and type(n) is list and type(f) is list and len(o) == len(n)
                and all(set(map(type, col)) <= _INT for col in (o, n, f))):
            raise CorruptCheckpointError("inconsistent manifest: chunks 'o', 'n', 'f' are not lists of integers")
        self.o, self.n, self.f = o, n, f
        self.meshes, self.nfiles, self.world, self.box_budget, self.batched = meshes, nfiles, world, box_budget, batched
        self.row = self.dim = 0
        self.known: set[tuple[Any, tuple[Any, ...]]] = set()  # (dtype, shape) validated
        self.rules: dict[tuple, Rule] = {}
        self.dims: list[Any] = []  # batched: every dim of every tensor, their types checked at the end
        self.bounds: list[int] = []  # batched: each box dim's bound (its tensor's dim)
        from .dtypes import name_itemsize

        self.itemsize = name_itemsize

    def head(self, key: str, dtype: Any, shape: Any, shape_t: tuple[Any, ...]) -> None:
        """Check a tensor's dtype and shape (once per distinct pair; batched: the dims' types
        of a pair seen before are checked at the end)."""
        if self.batched:
            try:
                seen = (dtype, shape_t) in self.known and type(shape) is list
            except TypeError:
                seen = False
            if seen:
                self.dims.extend(shape)
        else:
            try:
                seen = (dtype, shape_t) in self.known and set(map(type, shape)) <= _INT
            except TypeError:
                seen = False
        if not seen:
            _head_itemsize(key, dtype, shape, self.itemsize)
            self.known.add((dtype, shape_t))

    def by_rule(self, key: str, rule: Any, dtype: str, shape_t: tuple[int, ...], kind: str) -> TensorEntry:
        """The entry of a rule tensor (one Rule per geometry, its bound charged once)."""
        if not (type(rule) is dict and set(rule) == {"mesh", "placements", "salt"}):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': rule is not mesh, placements "
                                         "and salt")
        m, placements, salt = rule["mesh"], rule["placements"], rule["salt"]
        if not (type(m) is int and 0 <= m < len(self.meshes) and type(placements) is list and _count(salt)
                and salt < _LIMIT):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad rule mesh or salt")
        if not shape_t or 0 in shape_t:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': a rule needs a shape of "
                                         "non-zero dims")
        try:
            parsed = tuple(parse_placement(p, len(shape_t), self.world) for p in placements)
            rule_key = (shape_t, m, parsed, salt)
            rule_obj = self.rules.get(rule_key)  # one Rule per geometry: its boxes are computed once
            if rule_obj is None:
                rule_obj = self.rules[rule_key] = Rule(shape_t, self.meshes[m], parsed, salt)
                self.box_budget += RULE_SLACK - rule_obj.count_bound()
                if self.box_budget < 0:
                    raise CorruptCheckpointError("its rules claim more chunks than the manifest allows and the "
                                                 "file indexes can list")
            return TensorEntry.by_rule(dtype, shape_t, kind, rule_obj)
        except CorruptCheckpointError as exc:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': {exc}") from None

    def by_boxes(self, key: str, span: Any, dtype: str, shape_t: tuple[int, ...], kind: str,
                 layout: Any) -> TensorEntry:
        """The entry of a tensor with explicit boxes: rows ``span`` of the geometry table
        (checked one by one, or batched: at the end)."""
        o, n, f, row, dim = self.o, self.n, self.f, self.row, self.dim
        if not (type(span) is list and len(span) == 2 and type(span[0]) is int and span[0] == row
                and type(span[1]) is int and 1 <= span[1] <= len(f) - row):
            raise CorruptCheckpointError(
                f"inconsistent manifest: tensor '{key}': chunk range {_show(span)} is not [first, count] with first "
                f"{row} (where the previous tensor's chunks end), count >= 1, inside the table")
        nd = len(shape_t)
        count = span[1]
        if self.batched:  # the boxes are checked at the end, all at once
            if count == 1:
                boxes = [(tuple(o[dim: dim + nd]), tuple(n[dim: dim + nd]), f[row])]
            else:
                boxes = [(tuple(o[d: d + nd]), tuple(n[d: d + nd]), f[r])
                         for r, d in zip(range(row, row + count), range(dim, dim + count * nd, nd))]
            self.bounds.extend(shape_t * count)
        else:
            boxes = [self._box(key, r, row, dim + (r - row) * nd, nd, shape_t) for r in range(row, row + count)]
        self.dim = dim + count * nd
        self.row = row + count
        return TensorEntry.by_boxes(dtype, shape_t, kind, boxes, layout)

    def _box(self, key: str, r: int, first: int, d: int, nd: int, shape_t: tuple[int, ...]
             ) -> tuple[tuple[int, ...], tuple[int, ...], int]:
        """Row ``r`` of the geometry table, checked (the careful pass)."""
        bo, bn = tuple(self.o[d: d + nd]), tuple(self.n[d: d + nd])
        if len(bn) != nd or not all(0 <= a and 0 <= b and a + b <= s for a, b, s in zip(bo, bn, shape_t)):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}', chunk {r - first}: box "
                                         f"{list(bo)}+{list(bn)} is not inside shape {list(shape_t)}")
        if not 0 <= self.f[r] < self.nfiles:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}', chunk {r - first}: file "
                                         f"index {self.f[r]} is out of range")
        return bo, bn, self.f[r]

    def batched_ok(self) -> bool:
        """The batched pass's checks of every box and dim at once (False: a doubt)."""
        if not set(map(type, self.dims)) <= _INT:
            return False
        if self.o:
            bo_, bn_, bound = (np.array(col, dtype=np.int64) for col in (self.o, self.n, self.bounds))  # OverflowError
            if not ((bo_ >= 0) & (bn_ >= 0) & (bo_ <= bound) & (bn_ <= bound - bo_)).all():
                return False
        if self.f:
            files = np.array(self.f, dtype=np.int64)
            if not ((files >= 0) & (files < self.nfiles)).all():
                return False
        return True


def _tensors_v3_pass(tensors_json: Any, chunks_json: Any, meshes: list[Mesh], nfiles: int, world: int,
                     box_budget: int, batched: bool) -> tuple[dict[str, TensorEntry], int, list[Rule]] | None:
    """:func:`_tensors_v3`, checking each box as it comes (``batched`` False), or all boxes
    and dims at once at the end (``batched``: None when any check fails, with no error)."""
    if type(tensors_json) is not dict:
        raise CorruptCheckpointError("inconsistent manifest: tensors is not an object")
    p = _Pass(chunks_json, meshes, nfiles, world, box_budget, batched)
    out: dict[str, TensorEntry] = {}
    members = len(tensors_json)
    for key, t in tensors_json.items():
        if type(t) is not dict:
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}' is not an object")
        members += len(t)
        dtype, shape, kind = t["dtype"], t["shape"], t.get("kind", "replicated")
        shape_t = tuple(shape) if type(shape) is list else ()
        p.head(key, dtype, shape, shape_t)
        if kind not in ("replicated", "sharded"):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': kind {_show(kind)} (rank-local "
                                         "tensors are listed in the file indexes)")
        rule = t.get("rule")
        if rule is not None:
            if batched and not set(map(type, shape_t)) <= _INT:
                return None  # the careful pass names the bad dim before the rule uses it
            members += len(rule) if type(rule) is dict and set(rule) == {"mesh", "placements", "salt"} else 0
            out[key] = p.by_rule(key, rule, dtype, shape_t, kind)
            continue
        layout = t.get("layout")
        if not (layout is None or type(layout) is dict):
            raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad layout")
        if layout is not None:
            members += _object_members(layout)
        out[key] = p.by_boxes(key, t.get("chunks"), dtype, shape_t, kind, layout)
    if p.row != len(p.f) or p.dim != len(p.o):
        raise CorruptCheckpointError(f"inconsistent manifest: the tensors claim {p.row} chunks, the chunk table has "
                                     f"{len(p.f)}")
    if batched and not p.batched_ok():
        return None
    return out, members, list(p.rules.values())


def encode_v3(m: Manifest) -> dict[str, Any]:
    """The format-3 manifest: rules, explicit boxes, files as columns (docs/format.md)."""
    mesh_index = {m: i for i, m in enumerate(m.meshes)}
    keys = list(m.own_tensors())  # rank-local tensors live in the file indexes
    entries: dict[str, Any] = {}
    o: list[int] = []
    n: list[int] = []
    f: list[int] = []
    rows = 0
    for key in keys:
        t = m.tensors[key]
        d: dict[str, Any] = {"dtype": t.dtype, "shape": list(t.shape), "kind": t.kind}
        if t.rule is not None:
            d["rule"] = t.rule.to_json(mesh_index[t.rule.mesh])
        else:
            if t.layout is not None:
                d["layout"] = t.layout
            boxes = t.boxes()
            d["chunks"] = [rows, len(boxes)]
            rows += len(boxes)
            for bo, bn, bf in boxes:
                o.extend(bo)
                n.extend(bn)
                f.append(bf)
        entries[key] = d
    files = m.files
    return {
        "format": FORMAT_NAME,
        "version": list(m.version),
        **({"requires": list(m.requires)} if m.requires else {}),
        "checksum_algorithm": ALGORITHM,
        "created": m.created,
        "writer": m.writer,
        "world_size": m.world_size,
        "extra": m.extra,
        "meshes": [m.to_json() for m in m.meshes],
        "files": {"id": m.file_id, "rank": [e.rank for e in files], "bytes": [e.nbytes for e in files],
                  "index_bytes": [e.index_bytes for e in files],
                  "index_x": "".join(e.index_checksum for e in files)},
        "tensors": entries,
        "chunks": {"o": o, "n": n, "f": f},
        "rank_local": sorted(m.rank_local),
        **({"refs": refs_json(m.refs)} if m.refs else {}),
        "tree": m.tree,
    }
