"""Hostile checkpoints: every class of docs/format.md's parsing rules and limits (and
more), each written as a manifest re-sealed with a valid integrity trailer (XXH3-64 of the
bytes before ``, "manifest_xxh3_64": "``), or as data-file headers re-sealed in the
manifest, or as non-regular files in place of the checkpoint's files.

Each case edits the working copy of one checkpoint; the campaign loads it on one process
(load, load_full, verify, read_manifest, a one-key load_full: peak RSS growth measured
for each) and on 4 ranks, then restores the copy."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shardsafe.format.checksum import checksum

from .common import BAD, LOADED, outcome
from .context import Context
from .damage import MANIFEST, Ckpt

TRAILER = b', "manifest_xxh3_64": "'
MARK = "@@HOSTILE@@"
CORRUPT = ["CorruptCheckpointError"]
VERSION = ["FormatVersionError"]
GONE = ["CorruptCheckpointError", "CheckpointNotFoundError"]
MISMATCH = ["ShapeMismatchError", "DtypeMismatchError", "KeyMismatchError"]


@dataclass
class Case:
    """One hostile checkpoint: ``make(ck)`` edits ``ck.work`` and returns the entries it
    touched; ``errors``: what counts as detection (empty: it must load); ``compare``: a
    successful load must equal the pristine checkpoint (False where the case changes
    values on purpose: it then only has to load); ``mismatch_ok``: the case changes a
    tensor's shape or dtype or the tree's shape, so a load into a destination may refuse it
    as a mismatch with the destination (matching comes first) instead of as corrupt."""

    name: str
    base: str
    make: Callable[[Ckpt], set[str]]
    errors: list[str] = field(default_factory=lambda: list(CORRUPT))
    compare: bool = True
    mismatch_ok: bool = False


# ----------------------------------------------------------------------------- manifest helpers


def body(ck: Ckpt) -> dict[str, Any]:
    """The pristine manifest, parsed (the trailer member removed)."""
    b = json.loads((ck.pristine / MANIFEST).read_bytes())
    b.pop("manifest_xxh3_64")
    return b


def dumps(b: Any) -> str:
    return json.dumps(b, separators=(",", ":"))


def seal(ck: Ckpt, text: str | bytes) -> set[str]:
    """Write the JSON object ``text`` as the working manifest with a valid trailer."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    raw = raw.rstrip()
    assert raw.endswith(b"}"), raw[-20:]
    head = raw[:-1]
    (ck.work / MANIFEST).write_bytes(head + TRAILER + checksum(head).encode() + b'"}\n')
    return {MANIFEST}


def raw_at(ck: Ckpt, setter: Callable[[dict[str, Any], str], None], raw: str | bytes) -> set[str]:
    """Seal the manifest with the value that ``setter(body, MARK)`` places replaced by the
    raw JSON text ``raw`` (tokens json.dumps would never write)."""
    b = body(ck)
    setter(b, MARK)
    text = dumps(b).encode()
    quoted = f'"{MARK}"'.encode()
    assert text.count(quoted) == 1, "marker must appear once"
    return seal(ck, text.replace(quoted, raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw))


def edited(ck: Ckpt, edit: Callable[[dict[str, Any]], Any]) -> set[str]:
    """Seal the manifest after ``edit(body)``."""
    b = body(ck)
    edit(b)
    return seal(ck, dumps(b))


def text_edit(ck: Ckpt, old: str, new: str) -> set[str]:
    """Seal the manifest with the first ``old`` replaced by ``new`` in its compact text."""
    text = dumps(body(ck))
    assert old in text, old
    return seal(ck, text.replace(old, new, 1))


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


def row(b: dict[str, Any], key: str) -> int:
    return b["tensors"][key]["chunks"][0]


def dims_at(b: dict[str, Any], key: str) -> int:
    pos = 0
    for k, t in b["tensors"].items():
        if k == key:
            return pos
        pos += len(t["shape"]) * t["chunks"][1]
    raise KeyError(key)


def values(b: dict[str, Any]) -> dict[str, Any]:
    """The single checkpoint's ``values`` dict in the tree."""
    return b["tree"]["values"]


def set_value(name: str) -> Callable[[dict[str, Any], str], None]:
    return lambda b, v: values(b).__setitem__(name, v)


# ----------------------------------------------------------------------------- data-file headers


def rewrite_header(ck: Ckpt, fname: str, edit: Callable[[str], str] | None = None, *, new_json: bytes | None = None,
                   length: int | None = None) -> set[str]:
    """Give data file ``fname`` a new safetensors header (``edit`` of its JSON text, or
    ``new_json``; ``length`` overrides the length prefix) and re-seal the manifest so that
    it agrees: file size, header size and checksum, chunk byte ranges shifted."""
    data = (ck.pristine / fname).read_bytes()
    hb = ck.header_bytes[fname]
    js = edit(data[8:hb].decode().rstrip()).encode("utf-8", "surrogatepass") if edit else new_json
    assert js is not None
    js += b" " * (-len(js) % 8)
    header = struct.pack("<Q", len(js) if length is None else length) + js
    (ck.work / fname).write_bytes(header + data[hb:])
    delta = len(header) - hb
    b = body(ck)
    idx = next(i for i, f in enumerate(b["files"]) if f["name"] == fname)
    entry = b["files"][idx]
    entry.update(bytes=entry["bytes"] + delta, header_bytes=len(header), header_x=checksum(header))
    table = b["chunks"]
    for c, f in enumerate(table["f"]):
        if f == idx:
            table["b"][2 * c] += delta
            table["b"][2 * c + 1] += delta
    seal(ck, dumps(b))
    return {MANIFEST, fname}


def header_json(ck: Ckpt, fname: str) -> dict[str, Any]:
    data = (ck.pristine / fname).read_bytes()
    return json.loads(data[8:ck.header_bytes[fname]])


def header_edit(fn: Callable[[dict[str, Any]], Any], fname: str = "data-r00000-00.safetensors"
                ) -> Callable[[Ckpt], set[str]]:
    def make(ck: Ckpt) -> set[str]:
        h = header_json(ck, fname)
        fn(h)
        return rewrite_header(ck, fname, new_json=json.dumps(h, separators=(",", ":")).encode())
    return make


def header_raw(old: str, new: str, fname: str = "data-r00000-00.safetensors") -> Callable[[Ckpt], set[str]]:
    def make(ck: Ckpt) -> set[str]:
        def edit(text: str) -> str:
            assert old in text, old
            return text.replace(old, new, 1)
        return rewrite_header(ck, fname, edit)
    return make


# ----------------------------------------------------------------------------- files of other kinds


DATA0 = "data-r00000-00.safetensors"


def replace_with(kind: str, name: str) -> Callable[[Ckpt], set[str]]:
    """``name`` in the working copy becomes a ``kind``: a symlink to the pristine file
    (valid content), a FIFO, a folder, a unix socket, a character device, a hard link."""
    def make(ck: Ckpt) -> set[str]:
        target = ck.work / name
        target.unlink()
        if kind == "symlink":
            os.symlink(ck.pristine / name, target)
        elif kind == "dangling symlink":
            os.symlink(ck.work / "nowhere", target)
        elif kind == "symlink to /dev/zero":
            os.symlink("/dev/zero", target)
        elif kind == "fifo":
            os.mkfifo(target)
        elif kind == "folder":
            target.mkdir()
            (target / "x").write_bytes(b"{}")
        elif kind == "socket":
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                s.bind(str(target))
            finally:
                s.close()
        elif kind == "device":
            try:
                os.mknod(target, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
            except OSError:
                os.symlink("/dev/zero", target)
        elif kind == "hard link":
            os.link(ck.pristine / name, target)  # a regular file: it must load
        else:
            raise ValueError(kind)
        return {name}
    return make


# ----------------------------------------------------------------------------- the cases


def _s(name: str, make: Callable[[Ckpt], set[str]], errors: list[str] | None = None, compare: bool = True,
       base: str = "single", mismatch_ok: bool | None = None) -> Case:
    if mismatch_ok is None:
        mismatch_ok = name.startswith(("shape:", "dtype:"))
    return Case(name, base, make, list(CORRUPT) if errors is None else errors, compare, mismatch_ok)


def cases() -> list[Case]:  # noqa: PLR0915 - one long, flat list
    """Every hostile case (see the module docstring)."""
    out: list[Case] = []
    add = out.append

    # -- nesting (format.md: 200 levels in tree/rank-local values, 202 elsewhere)
    add(_s("nesting: tree 100k arrays", lambda ck: raw_at(ck, set_value("step"), nested(100_000))))
    add(_s("nesting: tree 1M arrays", lambda ck: raw_at(ck, set_value("step"), nested(1_000_000))))
    add(_s("nesting: tree 100k objects", lambda ck: raw_at(ck, set_value("step"),
                                                           '{"a":' * 100_000 + "1" + "}" * 100_000)))
    add(_s("nesting: tree 201 levels", lambda ck: raw_at(ck, set_value("step"), nested(199))))
    add(_s("nesting: tree exactly 200 levels (accepted)", lambda ck: raw_at(ck, set_value("step"), nested(198)),
           CORRUPT, compare=False))
    add(_s("nesting: tuple tags 101 deep", lambda ck: raw_at(ck, set_value("step"),
                                                             '{"$tuple":[' * 101 + "1" + "]}" * 101)))
    add(_s("nesting: $dict tags 70 deep", lambda ck: raw_at(ck, set_value("step"),
                                                            '{"$dict":[[1,' * 70 + "1" + "]]}" * 70)))
    for member in ("writer", "extra", "rank_local"):
        add(_s(f"nesting: {member} 100k", lambda ck, m=member: raw_at(
            ck, lambda b, v: b[m].__setitem__("deep", v), nested(100_000))))
    add(_s("nesting: rank-local value 250", lambda ck: raw_at(
        ck, lambda b, v: b["rank_local"]["rl"][0].__setitem__("deep", v), nested(250))))
    add(_s("nesting: tensor layout 50k", lambda ck: raw_at(
        ck, lambda b, v: b["tensors"]["big"].__setitem__("layout", v), nested(50_000))))
    add(_s("nesting: chunk table member 50k", lambda ck: raw_at(
        ck, lambda b, v: b["chunks"].__setitem__("deep", v), nested(50_000))))
    add(_s("nesting: chunk column 300", lambda ck: raw_at(
        ck, lambda b, v: b["chunks"].__setitem__("o", v), nested(300, "0"))))
    add(_s("nesting: file entry 100k", lambda ck: raw_at(
        ck, lambda b, v: b["files"][0].__setitem__("deep", v), nested(100_000))))
    add(_s("nesting: unknown top-level member 100k", lambda ck: raw_at(
        ck, lambda b, v: b.__setitem__("future", v), nested(100_000))))

    # -- integers
    add(_s("int: $int of 2M digits", lambda ck: raw_at(ck, set_value("step"), '{"$int":"' + "9" * 2_000_000 + '"}')))
    add(_s("int: $int of 20001 digits", lambda ck: raw_at(ck, set_value("step"), '{"$int":"' + "7" * 20_001 + '"}')))
    add(_s("int: $int of 20000 digits (accepted)", lambda ck: raw_at(
        ck, set_value("step"), '{"$int":"' + "7" * 20_000 + '"}'), CORRUPT, compare=False))
    for label, payload in (("empty", '""'), ("minus only", '"-"'), ("hex", '"0x10"'), ("exponent", '"1e5"'),
                           ("spaces", '" 5"'), ("underscore", '"1_000"'), ("not a string", "5"),
                           ("arabic-indic digits", '"\\u0661\\u0662\\u0663"'), ("fullwidth digits",
                                                                                 '"\\uff11\\uff12"'),
                           ("plus sign", '"+5"'), ("float text", '"1.0"')):
        add(_s(f"int: $int {label}", lambda ck, p=payload: raw_at(ck, set_value("step"), '{"$int":' + p + "}")))
    add(_s("int: plain literal of 5000 digits", lambda ck: raw_at(ck, set_value("step"), "9" * 5000)))
    add(_s("int: plain literal of 1M digits", lambda ck: raw_at(ck, set_value("step"), "9" * 1_000_000)))
    add(_s("int: literal above 2^53", lambda ck: raw_at(ck, set_value("step"), str(2 ** 60)), compare=False))
    add(_s("float: literal 1e400 (infinite)", lambda ck: raw_at(ck, set_value("lr"), "1e400")))
    add(_s("float: literal -1e400", lambda ck: raw_at(ck, set_value("lr"), "-1e400")))
    add(_s("float: $float bogus", lambda ck: raw_at(ck, set_value("nan"), '{"$float":"NaN"}')))
    add(_s("float: $float number text", lambda ck: raw_at(ck, set_value("nan"), '{"$float":"1.5"}')))

    # -- duplicate keys
    dup_top = ("world_size", '"world_size":1', '"world_size":1,"world_size":2')
    for label, old, new in (dup_top,
                            ("tensor entry", '"big":{"dtype":"float32"', '"big":{"dtype":"float32","dtype":"int32"'),
                            ("tensor key", '"scalar":{', '"scalar":{"dtype":"float32","shape":[],"kind":"replicated",'
                             '"chunks":[0,1]},"scalar":{'),
                            ("file entry", '"rank":0,', '"rank":0,"rank":0,'),
                            ("chunk column", '"chunks":{"o":[', '"chunks":{"f":[0],"o":['),
                            ("extra", '"checksum_block":1048576', '"checksum_block":1048576,"checksum_block":1'),
                            ("tree", '"step":12', '"step":12,"step":13'),
                            ("tree tag", '{"$int":"1208925819614629174706183"}',
                             '{"$int":"1208925819614629174706183","$int":"5"}'),
                            ("rank_local", '"seed":42', '"seed":42,"seed":43'),
                            ("writer", '"shardsafe":"', '"shardsafe":"9.9","shardsafe":"'),
                            ("format", '"format":"shardsafe"', '"format":"shardsafe","format":"shardsafe"')):
        add(_s(f"duplicate key: {label}", lambda ck, o=old, n=new: text_edit(ck, o, n)))

    # -- NaN / Infinity tokens
    for token in ("NaN", "Infinity", "-Infinity"):
        add(_s(f"{token}: created", lambda ck, t=token: raw_at(ck, lambda b, v: b.__setitem__("created", v), t)))
        add(_s(f"{token}: tree value", lambda ck, t=token: raw_at(ck, set_value("lr"), t)))
        add(_s(f"{token}: chunk column", lambda ck, t=token: raw_at(
            ck, lambda b, v: b["chunks"]["b"].__setitem__(1, v), t)))
        add(_s(f"{token}: world_size", lambda ck, t=token: raw_at(ck, lambda b, v: b.__setitem__("world_size", v),
                                                                   t)))

    # -- strings: lone surrogates, invalid UTF-8
    for sur in ("\\ud800", "\\udfff", "a\\ud83d", "\\ude00b"):
        add(_s(f"lone surrogate: tree key {sur}", lambda ck, s=sur: text_edit(ck, '"step":12', f'"step":12,"{s}":1')))
        for label, setter in (("tree string", set_value("name")),
                              ("writer version", lambda b, v: b["writer"].__setitem__("shardsafe", v)),
                              ("file name", lambda b, v: b["files"][0].__setitem__("name", v))):
            add(_s(f"lone surrogate: {label} {sur}", lambda ck, st=setter, s=sur: raw_at(ck, st, f'"{s}"')))
    add(_s("lone surrogate: tensor key", lambda ck: text_edit(ck, '"scalar":{"dtype"', '"scal\\udc00ar":{"dtype"')))
    add(_s("lone surrogate: chunk table member", lambda ck: text_edit(
        ck, '"chunks":{"o"', '"chunks":{"\\ud800":1,"o"')))
    add(_s("lone surrogate: raw CESU bytes", lambda ck: raw_at(ck, set_value("name"), b'"\xed\xa0\x80"')))
    add(_s("utf-8: invalid byte 0xff", lambda ck: raw_at(ck, set_value("name"), b'"a\xffb"')))
    add(_s("utf-8: overlong encoding", lambda ck: raw_at(ck, set_value("name"), b'"\xc0\xaf"')))
    add(_s("utf-8: truncated sequence", lambda ck: raw_at(ck, set_value("name"), b'"\xe4\xb8"')))
    add(_s("utf-8: byte order mark", lambda ck: seal(ck, b"\xef\xbb\xbf" + dumps(body(ck)).encode())))
    add(_s("utf-8: NUL in string (escaped, accepted)", lambda ck: raw_at(ck, set_value("name"), '"a\\u0000b"'),
           CORRUPT, compare=False))
    add(_s("json: raw control character in string", lambda ck: raw_at(ck, set_value("name"), '"a\nb"')))
    add(_s("json: single quotes", lambda ck: raw_at(ck, set_value("name"), "'x'")))
    add(_s("json: trailing comma", lambda ck: text_edit(ck, '"step":12', '"step":12,')))
    add(_s("json: comment", lambda ck: text_edit(ck, '"step":12', '"step":12/* c */')))

    # -- shapes and sizes
    for label, shape in (("2^62", [2 ** 62]), ("2^70", [2 ** 70]), ("negative", [-1]), ("float", [2.0]),
                         ("bool", [True]), ("string", ["4"]), ("product overflow", [2 ** 31, 2 ** 31, 2 ** 31]),
                         ("product 2^61 x 4", [2 ** 61, 4]), ("huge with zero", [0, 2 ** 70]),
                         ("10000 dims", [1] * 10_000), ("wrong rank", [655360, 1]), ("one more element", [655361]),
                         ("null", None), ("object", {"0": 1})):
        add(_s(f"shape: {label}", lambda ck, s=shape: edited(ck, lambda b: b["tensors"]["big"].__setitem__(
            "shape", s))))
    add(_s("shape: 1 TiB tensor claimed consistently", _terabyte))
    add(_s("size: file bytes 2^63", lambda ck: edited(ck, lambda b: b["files"][0].__setitem__("bytes", 2 ** 63))))
    add(_s("size: file bytes negative", lambda ck: edited(ck, lambda b: b["files"][0].__setitem__("bytes", -1))))
    add(_s("size: header_bytes 10^13", lambda ck: edited(
        ck, lambda b: b["files"][0].__setitem__("header_bytes", 10 ** 13))))
    add(_s("size: header_bytes 0", lambda ck: edited(ck, lambda b: b["files"][0].__setitem__("header_bytes", 0))))
    add(_s("size: world_size 2^62", lambda ck: edited(ck, lambda b: b.__setitem__("world_size", 2 ** 62))))
    add(_s("size: world_size 0", lambda ck: edited(ck, lambda b: b.__setitem__("world_size", 0))))
    add(_s("size: world_size string", lambda ck: edited(ck, lambda b: b.__setitem__("world_size", "1"))))
    add(_s("size: file rank 2^62", lambda ck: edited(ck, lambda b: b["files"][0].__setitem__("rank", 2 ** 62))))
    add(_s("size: file rank -1", lambda ck: edited(ck, lambda b: b["files"][0].__setitem__("rank", -1))))
    add(_s("size: created 2^40", lambda ck: edited(ck, lambda b: b.__setitem__("created", 2 ** 40))))
    add(_s("size: created negative", lambda ck: edited(ck, lambda b: b.__setitem__("created", -5))))
    add(_s("size: created string", lambda ck: edited(ck, lambda b: b.__setitem__("created", "now"))))

    # -- dtype against the data-file header
    for label, dt in (("float32 as int32 (same size)", "int32"), ("float32 as float64", "float64"),
                      ("float32 as bfloat16", "bfloat16"), ("unknown float128", "float128"), ("object", "object"),
                      ("empty", ""), ("not a string", 5), ("torch prefix", "torch.float32")):
        add(_s(f"dtype: {label}", lambda ck, d=dt: edited(ck, lambda b: b["tensors"]["big"].__setitem__("dtype", d))))
    add(_s("dtype: bool as uint8 (same size)", lambda ck: edited(
        ck, lambda b: b["tensors"]["mask"].__setitem__("dtype", "uint8"))))
    add(_s("dtype: int64 as float64 (same size)", lambda ck: edited(
        ck, lambda b: b["tensors"]["ints.i64"].__setitem__("dtype", "float64"))))
    add(_s("kind: unknown", lambda ck: edited(ck, lambda b: b["tensors"]["big"].__setitem__("kind", "weird"))))

    # -- checksum block
    for blk in (0, -1, 2 ** 70, (1 << 26) + 1, 1.5, True, "1048576", None, 1, 2 << 20, 4096):
        add(_s(f"checksum_block: {blk!r}", lambda ck, v=blk: edited(
            ck, lambda b: b["extra"].__setitem__("checksum_block", v))))
    add(_s("checksum_block: missing", lambda ck: edited(ck, lambda b: b["extra"].pop("checksum_block"))))
    add(_s("checksum_algorithm: md5", lambda ck: edited(ck, lambda b: b.__setitem__("checksum_algorithm", "md5"))))

    # -- the chunk table
    add(_s("chunks: tensor ranges overlap", lambda ck: edited(
        ck, lambda b: b["tensors"]["mat"].__setitem__("chunks", [0, 1]))))
    add(_s("chunks: hole between tensors", lambda ck: edited(
        ck, lambda b: b["tensors"]["f64"].__setitem__("chunks", [b["tensors"]["f64"]["chunks"][0] + 1, 1]))))
    add(_s("chunks: tensor with no chunk", lambda ck: edited(
        ck, lambda b: b["tensors"]["f64"].__setitem__("chunks", [b["tensors"]["f64"]["chunks"][0], 0]))))
    add(_s("chunks: count 2^64", lambda ck: edited(
        ck, lambda b: b["tensors"]["f64"].__setitem__("chunks", [row(b, "f64"), 2 ** 64]))))
    add(_s("chunks: count 50M", lambda ck: edited(
        ck, lambda b: b["tensors"]["f64"].__setitem__("chunks", [row(b, "f64"), 50_000_000]))))
    add(_s("chunks: range not a pair", lambda ck: edited(ck, lambda b: b["tensors"]["f64"].__setitem__("chunks", [2]))))
    add(_s("chunks: byte range aliases another tensor", _alias))
    add(_s("chunks: byte range in the header", lambda ck: edited(ck, lambda b: _set_b(b, "f64", [0, 8000]))))
    add(_s("chunks: byte range reversed", lambda ck: edited(ck, lambda b: _set_b(b, "f64", _b(b, "f64")[::-1]))))
    add(_s("chunks: byte range past the end", lambda ck: edited(
        ck, lambda b: _set_b(b, "f64", [b["files"][0]["bytes"] - 4000, b["files"][0]["bytes"] + 4000]))))
    add(_s("chunks: byte range shifted by one", lambda ck: edited(
        ck, lambda b: _set_b(b, "f64", [x + 1 for x in _b(b, "f64")]))))
    add(_s("chunks: box outside the shape", lambda ck: edited(ck, lambda b: _set_dims(b, "mat", "o", [1, 0]))))
    add(_s("chunks: negative box", lambda ck: edited(ck, lambda b: _set_dims(b, "mat", "n", [-129, 300]))))
    add(_s("chunks: column lengths differ", lambda ck: edited(ck, lambda b: b["chunks"]["n"].pop())))
    add(_s("chunks: odd byte column", lambda ck: edited(ck, lambda b: b["chunks"]["b"].pop())))
    add(_s("chunks: file index out of range", lambda ck: edited(ck, lambda b: _set_f(b, "f64", 7))))
    add(_s("chunks: file index negative", lambda ck: edited(ck, lambda b: _set_f(b, "f64", -1))))
    add(_s("chunks: float in a column", lambda ck: edited(
        ck, lambda b: b["chunks"]["b"].__setitem__(1, float(b["chunks"]["b"][1])))))
    add(_s("chunks: bool in a column", lambda ck: edited(ck, lambda b: b["chunks"]["f"].__setitem__(0, False))))
    add(_s("chunks: digests one short", lambda ck: edited(
        ck, lambda b: b["chunks"].__setitem__("x", b["chunks"]["x"][:-16]))))
    add(_s("chunks: digests odd length", lambda ck: edited(
        ck, lambda b: b["chunks"].__setitem__("x", b["chunks"]["x"][:-1]))))
    add(_s("chunks: digests not hex", lambda ck: edited(
        ck, lambda b: b["chunks"].__setitem__("x", "zz" + b["chunks"]["x"][2:]))))
    add(_s("chunks: digests uppercase", lambda ck: edited(
        ck, lambda b: b["chunks"].__setitem__("x", b["chunks"]["x"].upper()))))
    add(_s("chunks: digests as a list", lambda ck: edited(
        ck, lambda b: b["chunks"].__setitem__("x", [b["chunks"]["x"]]))))
    add(_s("chunks: table missing", lambda ck: edited(ck, lambda b: b.pop("chunks"))))
    add(_s("chunks: format-1 inline chunks in a 2.0 manifest", lambda ck: edited(
        ck, lambda b: b["tensors"]["f64"].__setitem__("chunks", [{"o": [0], "n": [1000], "f": 0, "b": _b(b, "f64"),
                                                                  "x": ["0" * 16], "r": 0}]))))
    # chunks of one tensor (the FSDP2 checkpoint: sharded tensors have 4)
    add(_s("chunks: boxes overlap (fsdp)", _fsdp_overlap, base="fsdp"))
    add(_s("chunks: boxes leave a hole (fsdp)", _fsdp_hole, base="fsdp"))
    add(_s("chunks: chunks out of order (fsdp)", _fsdp_swap_rows, base="fsdp"))
    add(_s("chunks: chunk moved to another rank's file (fsdp)", _fsdp_other_file, base="fsdp"))

    # -- file names
    for label, name in (("slash", "sub/" + DATA0), ("dot dot", ".."), ("dot", "."), ("empty", ""),
                        ("backslash", "a\\\\b"), ("absolute", "/etc/hostname"), ("parent escape", "../x"),
                        ("control char", "x\\u0001"), ("newline", "a\\nb"), ("C1 control", "c\\u0085"),
                        ("256 bytes", "d" * 256), ("the manifest", MANIFEST)):
        add(_s(f"file name: {label}", lambda ck, n=name: raw_at(
            ck, lambda b, v: b["files"][0].__setitem__("name", v), f'"{n}"')))
    add(_s("file name: listed twice", lambda ck: edited(ck, lambda b: b["files"].append(dict(b["files"][0])))))
    add(_s("files: not a list", lambda ck: edited(ck, lambda b: b.__setitem__("files", {}))))
    add(_s("files: header checksum wrong", lambda ck: edited(
        ck, lambda b: b["files"][0].__setitem__("header_x", "0" * 16))))

    # -- non-regular files in place of the checkpoint's files
    for kind in ("symlink", "dangling symlink", "symlink to /dev/zero", "fifo", "folder", "socket", "device"):
        add(_s(f"special file: data file is a {kind}", replace_with(kind, DATA0)))
        add(_s(f"special file: manifest is a {kind}", replace_with(kind, MANIFEST), GONE))
    add(_s("special file: data file is a hard link (accepted)", replace_with("hard link", DATA0), []))
    add(_s("special file: fsdp rank-3 data file is a fifo", replace_with("fifo", "data-r00003-00.safetensors"),
           base="fsdp"))

    # -- other members and typed-JSON tags
    add(_s("format: other name", lambda ck: edited(ck, lambda b: b.__setitem__("format", "dcp"))))
    add(_s("format: missing", lambda ck: edited(ck, lambda b: b.pop("format"))))
    add(_s("version: 4.0", lambda ck: edited(ck, lambda b: b.__setitem__("version", [4, 0])), VERSION))
    add(_s("version: 0.1", lambda ck: edited(ck, lambda b: b.__setitem__("version", [0, 1])), VERSION))
    add(_s("version: 2^70.0", lambda ck: edited(ck, lambda b: b.__setitem__("version", [2 ** 70, 0])), VERSION))
    for label, v in (("strings", ["2", "0"]), ("one number", [2]), ("floats", [2.0, 0.0]), ("bool", True),
                     ("three numbers", [2, 0, 0])):
        add(_s(f"version: {label}", lambda ck, x=v: edited(ck, lambda b: b.__setitem__("version", x))))
    add(_s("version: 2.9 (newer minor, accepted)", lambda ck: edited(ck, lambda b: b.__setitem__("version", [2, 9])),
           []))
    add(_s("members: unknown top-level member (accepted)", lambda ck: edited(
        ck, lambda b: b.__setitem__("future", {"a": [1, {"b": 2}]})), []))
    add(_s("members: whitespace and newlines (accepted)", lambda ck: seal(
        ck, json.dumps(body(ck), indent=2)), []))
    add(_s("members: 8 MiB of whitespace (accepted)", lambda ck: seal(
        ck, dumps(body(ck)).replace('"tree":', '"tree":' + " " * (8 << 20), 1)), []))
    add(_s("members: world_size disagrees with rank_local", lambda ck: edited(
        ck, lambda b: b.__setitem__("world_size", 2))))
    add(_s("members: rank_local with two values", lambda ck: edited(
        ck, lambda b: b["rank_local"]["rl"].append(b["rank_local"]["rl"][0]))))
    add(_s("members: rank_local not an object", lambda ck: edited(ck, lambda b: b.__setitem__("rank_local", [1]))))
    add(_s("members: tensors not an object", lambda ck: edited(ck, lambda b: b.__setitem__("tensors", []))))
    add(_s("members: tree missing", lambda ck: edited(ck, lambda b: b.pop("tree"))))
    add(_s("members: tree is a list (a valid value)", lambda ck: edited(ck, lambda b: b.__setitem__("tree", [1])),
           compare=False, mismatch_ok=True))
    add(_s("members: extra not an object", lambda ck: edited(ck, lambda b: b.__setitem__("extra", [1]))))
    add(_s("members: writer not an object", lambda ck: edited(ck, lambda b: b.__setitem__("writer", 5))))
    add(_s("tags: $tensor names a missing tensor", lambda ck: edited(
        ck, lambda b: b["tree"].__setitem__("big", {"$tensor": "nope"}))))
    add(_s("tags: $tensor names a rank-local tensor", lambda ck: edited(
        ck, lambda b: b["tree"].__setitem__("big", {"$tensor": "rl#rank0.gen"})), compare=False, mismatch_ok=True))
    add(_s("tags: $tensor not a string", lambda ck: edited(ck, lambda b: b["tree"].__setitem__("big", {"$tensor": 5}))))
    add(_s("tags: one tensor twice", lambda ck: edited(ck, lambda b: b["tree"].__setitem__("mat", {"$tensor": "big"})),
           compare=False, mismatch_ok=True))
    add(_s("tags: $rank_local names a missing key", lambda ck: edited(
        ck, lambda b: b["tree"].__setitem__("rl", {"$rank_local": "nope"}))))
    add(_s("tags: unknown tag", lambda ck: edited(ck, lambda b: values(b).__setitem__("step", {"$foo": 1}))))
    add(_s("tags: $ member in a plain dict", lambda ck: edited(
        ck, lambda b: values(b).__setitem__("step", {"$int": "5", "x": 1}))))
    add(_s("tags: $bytes not base64", lambda ck: edited(ck, lambda b: values(b).__setitem__("blob",
                                                                                            {"$bytes": "!!!"}))))
    add(_s("tags: $bytes with whitespace", lambda ck: edited(
        ck, lambda b: values(b).__setitem__("blob", {"$bytes": "AA EC"}))))
    add(_s("tags: $tuple not a list", lambda ck: edited(ck, lambda b: values(b).__setitem__("tup", {"$tuple": 5}))))
    add(_s("tags: $dict entry not a pair", lambda ck: edited(
        ck, lambda b: values(b).__setitem__("intkeys", {"$dict": [[1]]}))))
    add(_s("tags: $dict duplicate keys", lambda ck: edited(
        ck, lambda b: values(b).__setitem__("intkeys", {"$dict": [[1, "a"], [1, "b"]]}))))
    add(_s("tags: $dict unhashable key", lambda ck: edited(
        ck, lambda b: values(b).__setitem__("intkeys", {"$dict": [[[1], "a"]]}))))
    add(_s("tags: $dict of 200k pairs (accepted)", lambda ck: edited(
        ck, lambda b: values(b).__setitem__("intkeys", {"$dict": [[i, 0] for i in range(200_000)]})), CORRUPT,
           compare=False))

    # -- the integrity trailer
    add(_s("trailer: missing", _no_trailer))
    add(_s("trailer: wrong digest", _trailer_digest("0123456789abcdef")))
    add(_s("trailer: uppercase digest", _trailer_upper))
    add(_s("trailer: a second trailer after it", _trailer_twice))
    add(_s("trailer: junk after it", _trailer_junk))
    add(_s("trailer: only the trailer", lambda ck: seal(ck, "{}")))
    add(_s("manifest: empty file", lambda ck: _write_manifest(ck, b"")))
    add(_s("manifest: null", lambda ck: seal(ck, "null}")))
    add(_s("manifest: array", lambda ck: seal(ck, "[1]}")))

    # -- data-file headers (re-sealed in the manifest)
    add(_s("header: length prefix 2^63", lambda ck: rewrite_header(ck, DATA0, lambda t: t, length=2 ** 63)))
    add(_s("header: length prefix past the file", lambda ck: rewrite_header(ck, DATA0, lambda t: t, length=10 ** 9)))
    add(_s("header: length prefix 100,000,001", lambda ck: rewrite_header(
        ck, DATA0, lambda t: t, length=100_000_001)))
    add(_s("header: duplicate key", header_raw('"big":{', '"big":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'
                                                          '"big":{')))
    add(_s("header: NaN", header_raw('"format":"pt"', '"format":NaN')))
    add(_s("header: 100k nesting", header_raw('"format":"pt"', '"format":"pt","deep":' + nested(100_000))))
    add(_s("header: not an object", lambda ck: rewrite_header(ck, DATA0, new_json=b"[1,2]")))
    add(_s("header: dtype code differs", header_edit(lambda h: h["big"].__setitem__("dtype", "I32"))))
    add(_s("header: unknown dtype code", header_edit(lambda h: h["big"].__setitem__("dtype", "F128"))))
    add(_s("header: shape differs", header_edit(lambda h: h["mat"].__setitem__("shape", [300, 129]))))
    add(_s("header: offsets overlap", header_edit(lambda h: h["f64"].__setitem__(
        "data_offsets", [h["f64"]["data_offsets"][0] - 8, h["f64"]["data_offsets"][1] - 8]))))
    add(_s("header: extra member", header_edit(lambda h: h["big"].__setitem__("x", 1))))
    add(_s("header: metadata not strings", header_edit(lambda h: h["__metadata__"].__setitem__("format", 1))))
    add(_s("header: entry missing", header_edit(lambda h: h.pop("f64"))))
    add(_s("header: lone surrogate", header_raw('"format":"pt"', '"format":"\\ud800"')))
    add(_s("header: invalid UTF-8", lambda ck: rewrite_header(
        ck, DATA0, new_json=_header_bytes(ck)[:-1] + b',"\xff":"x"}')))
    add(_s("header: padded with NULs", lambda ck: rewrite_header(ck, DATA0, new_json=_header_bytes(ck) + b"\0" * 8)))
    add(_s("header: fsdp rank-2 dtype code differs", header_edit(
        lambda h: next(v for k, v in h.items() if k != "__metadata__" and v["dtype"] == "F32").__setitem__(
            "dtype", "I32"), "data-r00002-00.safetensors"), base="fsdp"))

    # -- the rule budget (format 3: the working copy becomes a crafted FSDP x TP checkpoint)
    huge = {"dtype": "uint8", "shape": [1 << 21, 1 << 21], "placements": [["SS", 0, 1 << 20], ["SS", 1, 1 << 20]],
            "world": 1 << 20}
    add(_s("rules: 2^42 boxes backed only by a stated index size of 2^40", _rules_case(**huge, index_bytes=1 << 40),
           mismatch_ok=True))
    add(_s("rules: 2^42 boxes, a lying index size of 2^50 (bounded read)", _rules_case(**huge, index_bytes=1 << 50),
           mismatch_ok=True))
    add(_s("rules: 2^24 boxes on a padded 1 MiB index", _rules_case(
        shape=[4096, 4096], placements=[["SS", 0, 2048], ["SS", 1, 2048]], world=1 << 20, pad_to=1 << 20),
           mismatch_ok=True))
    add(_s("rules: 360k boxes beyond the free allowance, a padded 2 MiB index's real rows", _rules_case(
        shape=[600, 600], placements=[["SS", 0, 512], ["SS", 1, 512]], world=1 << 20, pad_to=2 << 20),
           mismatch_ok=True))
    add(_s("index: rank false", _rules_case(index_edit=lambda raw: raw.replace(b'"rank":0,', b'"rank":false,', 1)),
           mismatch_ok=True))
    # -- bound arithmetic (issue 22: an int64 sum of block counts wrapped to 0 and an empty digest string passed)
    add(_s("blocks: 8 tensors of 2^61 bytes at checksum_block 1 (2^64 blocks, 0 mod 2^64), no digests",
           _wrapping_blocks, mismatch_ok=True))
    return out


ASSET3 = Path(__file__).resolve().parent.parent / "tests" / "assets" / "format3_0" / "fsdp_tp"
"""A committed format-3.0 FSDP x TP checkpoint: mesh [2, 2] (ranks 0-3), four files, rules."""
RULE_KEY = "model.blocks.0.down.weight"  # a rule tensor on mesh 0
INDEX0 = "data-r00000-00.index.json"


def craft_rules(path: Path, *, dtype: str = "float32", shape: list[int] | None = None,
                placements: list[list[Any]] | None = None, world: int | None = None, index_bytes: int | None = None,
                pad_to: int = 0, index_edit: Callable[[bytes], bytes] | None = None) -> set[str]:
    """Write :data:`ASSET3` into folder ``path`` with tensor RULE_KEY's dtype, shape and rule
    placements, the world size and the first index (its stated size, padding to ``pad_to``
    bytes, an edit) changed and the manifest re-sealed; returns the names written."""
    path.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(ASSET3):
        shutil.copyfile(ASSET3 / name, path / name)
    b = json.loads((path / MANIFEST).read_bytes())
    b.pop("manifest_xxh3_64")
    entry = b["tensors"][RULE_KEY]
    entry["dtype"] = dtype
    if shape is not None:
        entry["shape"] = shape
    if placements is not None:
        entry["rule"]["placements"] = placements
    if world is not None:
        b["world_size"] = world
    raw = (path / INDEX0).read_bytes()
    if index_edit is not None:
        raw = index_edit(raw)
    if pad_to:
        raw = raw[:-1] + b" " * (pad_to - len(raw)) + b"}"
    (path / INDEX0).write_bytes(raw)
    files = b["files"]
    files["index_bytes"][0] = len(raw) if index_bytes is None else index_bytes
    files["index_x"] = checksum(raw) + files["index_x"][16:]
    head = dumps(b).encode()[:-1]
    (path / MANIFEST).write_bytes(head + TRAILER + checksum(head).encode() + b'"}\n')
    return set(os.listdir(ASSET3))


def _rules_case(**craft: Any) -> Callable[[Ckpt], set[str]]:
    """The working copy replaced by :func:`craft_rules` (``restore`` puts it back)."""
    def make(ck: Ckpt) -> set[str]:
        old = set(os.listdir(ck.work))
        for name in old:
            (ck.work / name).unlink()
        return old | craft_rules(ck.work, **craft)
    return make


def _wrapping_blocks(ck: Ckpt) -> set[str]:
    """The working copy replaced by a format-3.1 checkpoint of eight uint8 tensors of 2^61
    elements, one chunk each (every value under the documented 2^62), with
    ``checksum_block`` 1: the chunks claim 2^64 checksum blocks, which an int64 sum wraps to
    0, and the index lists none (an empty ``x``). Manifest and index are sealed, so only the
    bound can refuse it."""
    import torch

    import shardsafe

    old = set(os.listdir(ck.work))
    for name in old:
        (ck.work / name).unlink()
    shardsafe.save({"t": torch.arange(16, dtype=torch.uint8)}, ck.work)
    n, size = 8, 1 << 61
    index = json.loads((ck.work / INDEX0).read_bytes())
    start = index["chunks"]["b"][0]
    index["chunks"] = {"t": list(range(n)), "o": [0] * n, "n": [size] * n, "b": [start, start + size] * n, "x": "",
                       "h": "0" * 32 * n}
    raw = dumps(index).encode()
    (ck.work / INDEX0).write_bytes(raw)
    b = json.loads((ck.work / MANIFEST).read_bytes())
    b.pop("manifest_xxh3_64")
    b["extra"]["checksum_block"] = 1
    b["tensors"] = {f"t{i}": {"dtype": "uint8", "shape": [size], "kind": "replicated", "chunks": [i, 1]}
                    for i in range(n)}
    b["tree"] = {f"t{i}": {"$tensor": f"t{i}"} for i in range(n)}
    b["chunks"] = {"o": [0] * n, "n": [size] * n, "f": [0] * n}
    b["files"].update(bytes=[start + size], index_bytes=[len(raw)], index_x=checksum(raw))
    seal(ck, dumps(b))
    return old | set(os.listdir(ck.work))


def _header_bytes(ck: Ckpt, fname: str = DATA0) -> bytes:
    """The JSON text of a pristine data file's header, without its padding."""
    return (ck.pristine / fname).read_bytes()[8:ck.header_bytes[fname]].rstrip()


def _b(b: dict[str, Any], key: str) -> list[int]:
    r = row(b, key)
    return b["chunks"]["b"][2 * r: 2 * r + 2]


def _set_b(b: dict[str, Any], key: str, value: list[int]) -> None:
    r = row(b, key)
    b["chunks"]["b"][2 * r: 2 * r + 2] = value


def _set_f(b: dict[str, Any], key: str, value: int) -> None:
    b["chunks"]["f"][row(b, key)] = value


def _set_dims(b: dict[str, Any], key: str, column: str, value: list[int]) -> None:
    d = dims_at(b, key)
    b["chunks"][column][d: d + len(value)] = value


def _alias(ck: Ckpt) -> set[str]:
    """layers.1.w's chunk points at layers.0.w's bytes (same dtype, shape and size)."""
    def edit(b: dict[str, Any]) -> None:
        _set_b(b, "layers.1.w", _b(b, "layers.0.w"))
    return edited(ck, edit)


def _terabyte(ck: Ckpt) -> set[str]:
    """A tensor of 2^38 float32 whose chunk, file size and digests all agree with the
    claim; the data file is not that big (nothing may be allocated by the claim)."""
    def edit(b: dict[str, Any]) -> None:
        n = 1 << 38
        t = b["tensors"]["big"]
        t["shape"] = [n]
        _set_dims(b, "big", "n", [n])
        lo, hi = _b(b, "big")
        new_hi = lo + 4 * n
        delta = new_hi - hi
        _set_b(b, "big", [lo, new_hi])
        for c in range(len(b["chunks"]["f"])):
            if c != row(b, "big"):
                b["chunks"]["b"][2 * c] += delta if b["chunks"]["b"][2 * c] >= hi else 0
                b["chunks"]["b"][2 * c + 1] += delta if b["chunks"]["b"][2 * c + 1] > hi else 0
        b["files"][0]["bytes"] += delta
        block = b["extra"]["checksum_block"]
        old_digests = -(-(hi - lo) // block)
        new_digests = -(-(4 * n) // block)
        x = b["chunks"]["x"]
        start = 16 * sum(_digests(b, k) for k in list(b["tensors"])[:list(b["tensors"]).index("big")])
        b["chunks"]["x"] = x[:start] + "0" * 16 * new_digests + x[start + 16 * old_digests:]
    return edited(ck, edit)


def _digests(b: dict[str, Any], key: str) -> int:
    first, count = b["tensors"][key]["chunks"]
    block = b["extra"]["checksum_block"]
    return sum(max(1, -(-(b["chunks"]["b"][2 * c + 1] - b["chunks"]["b"][2 * c]) // block))
               for c in range(first, first + count))


def _sharded_key(b: dict[str, Any]) -> str:
    return next(k for k, t in b["tensors"].items() if t["chunks"][1] == 4 and len(t["shape"]) == 2)


def _fsdp_overlap(ck: Ckpt) -> set[str]:
    """The second chunk of a 4-chunk tensor starts one row early (sizes still add up if the
    last chunk also moves: boxes overlap, a row is left out)."""
    def edit(b: dict[str, Any]) -> None:
        key = _sharded_key(b)
        d = dims_at(b, key)
        b["chunks"]["o"][d + 2] -= 1
    return edited(ck, edit)


def _fsdp_hole(ck: Ckpt) -> set[str]:
    def edit(b: dict[str, Any]) -> None:
        key = _sharded_key(b)
        d = dims_at(b, key)
        b["chunks"]["o"][d + 2] += 1
    return edited(ck, edit)


def _fsdp_swap_rows(ck: Ckpt) -> set[str]:
    """Rows 0 and 1 of a sharded tensor swapped in every column (sorted order broken)."""
    def edit(b: dict[str, Any]) -> None:
        key = _sharded_key(b)
        r = row(b, key)
        d = dims_at(b, key)
        t = b["chunks"]
        for col in ("o", "n"):
            t[col][d: d + 4] = t[col][d + 2: d + 4] + t[col][d: d + 2]
        t["f"][r], t["f"][r + 1] = t["f"][r + 1], t["f"][r]
        t["b"][2 * r: 2 * r + 4] = t["b"][2 * r + 2: 2 * r + 4] + t["b"][2 * r: 2 * r + 2]
        start = 16 * sum(_digests(b, k) for k in list(b["tensors"])[:list(b["tensors"]).index(key)])
        x = t["x"]
        t["x"] = x[:start] + x[start + 16: start + 32] + x[start: start + 16] + x[start + 32:]
    return edited(ck, edit)


def _fsdp_other_file(ck: Ckpt) -> set[str]:
    def edit(b: dict[str, Any]) -> None:
        key = _sharded_key(b)
        r = row(b, key)
        b["chunks"]["f"][r] = (b["chunks"]["f"][r] + 1) % len(b["files"])
    return edited(ck, edit)


def _write_manifest(ck: Ckpt, data: bytes) -> set[str]:
    (ck.work / MANIFEST).write_bytes(data)
    return {MANIFEST}


def _pristine_bytes(ck: Ckpt) -> bytes:
    return (ck.pristine / MANIFEST).read_bytes()


def _no_trailer(ck: Ckpt) -> set[str]:
    data = _pristine_bytes(ck)
    return _write_manifest(ck, data[:data.rfind(TRAILER)] + b"}\n")


def _trailer_digest(digest: str) -> Callable[[Ckpt], set[str]]:
    def make(ck: Ckpt) -> set[str]:
        data = _pristine_bytes(ck)
        cut = data.rfind(TRAILER) + len(TRAILER)
        return _write_manifest(ck, data[:cut] + digest.encode() + data[cut + 16:])
    return make


def _trailer_upper(ck: Ckpt) -> set[str]:
    data = _pristine_bytes(ck)
    cut = data.rfind(TRAILER) + len(TRAILER)
    return _write_manifest(ck, data[:cut] + data[cut: cut + 16].upper() + data[cut + 16:])


def _trailer_twice(ck: Ckpt) -> set[str]:
    data = _pristine_bytes(ck).rstrip()
    return _write_manifest(ck, data[:-1] + TRAILER + b"0" * 16 + b'"}\n')


def _trailer_junk(ck: Ckpt) -> set[str]:
    return _write_manifest(ck, _pristine_bytes(ck).rstrip() + b" {}\n")


# ----------------------------------------------------------------------------- running them


def run_hostile(ctx: Context, only: list[str] | None = None, limit: int | None = None,
                exact: bool = False) -> list[dict[str, Any]]:
    """Run every case (or those whose name contains one of ``only``, or equals one with
    ``exact``; at most ``limit``): returns per case its class per probe and the peak RSS
    growth of the worst probe."""
    ckpts = ctx.checkpoints()
    report = []
    t0 = time.perf_counter()
    chosen = [c for c in cases() if not only or (c.name in only if exact else any(o in c.name for o in only))]
    for case in chosen[:limit]:
        ck = ckpts[case.base]
        touched: set[str] = set()
        size = 0
        try:
            try:
                touched = case.make(ck)
            except Exception as exc:  # noqa: BLE001 - a broken case is reported, not fatal
                probes = [outcome("other_exc", "making the case", f"{type(exc).__name__}: {exc}")]
            else:
                m = ck.work / MANIFEST
                size = m.stat().st_size if m.is_file() and not m.is_symlink() else 0
                probes = ctx.probe(ck, case.errors, rss=True, extra=True, compare=case.compare,
                                   in_place=MISMATCH if case.mismatch_ok else [])
        finally:
            ck.restore(touched | {MANIFEST})
        rss = max((p.get("rss_kib", 0) for p in probes), default=0)
        cls = ctx.tally.add("hostile manifest / file", probes, case=case.name, rss_kib=rss)
        report.append({"case": case.name, "class": cls, "rss_kib": rss, "manifest_bytes": size, "errors": case.errors,
                       "probes": {p["method"]: p["cls"] for p in probes},
                       "detail": next((p["detail"] for p in probes if p["cls"] in BAD or p["cls"] != LOADED), "")})
    ctx.tally.seconds["hostile"] += time.perf_counter() - t0
    return report
