"""Parser limits (docs/format.md, "Limits"): hostile manifests and data-file headers end in
CorruptCheckpointError naming what is wrong, decided before any expensive work, never in a
RecursionError, ValueError, OverflowError, UnicodeEncodeError or minutes of CPU.

Each manifest case takes a real checkpoint, edits the manifest's JSON text and seals it
again with a valid integrity trailer, so only the parser's own rules can refuse it."""

from __future__ import annotations

import json
import math
import random
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardsafe
from format2 import as_format2
from shardsafe.errors import CorruptCheckpointError, UnsupportedValueError
from shardsafe.format import strict_json, values
from shardsafe.format.checksum import checksum
from shardsafe.format.datafile import (
    ChunkEntry,
    ClaimedChunk,
    HeaderEntry,
    build_header,
    check_chunks_against_header,
    parse_header,
    unique_chunk_names,
)
from shardsafe.format.dtypes import NAME_TO_TORCH, safetensors_code
from shardsafe.format.manifest import MANIFEST_NAME, MAX_CHECKSUM_BLOCK, Chunk, FileEntry, Manifest, TensorEntry
from shardsafe.format.values import MAX_DEPTH, MAX_INT_DIGITS, decode, encode_scalar, nesting_depth

TRAILER = b', "manifest_xxh3_64": "'
DATA = "data-r00000-00.safetensors"


# --------------------------------------------------------------------------- helpers


def make_ckpt(tmp_path: Path, state: dict | None = None, fmt: int = 3) -> Path:
    """A saved checkpoint (rewritten as format 2.0 with ``fmt=2``: file names are listed)."""
    path = tmp_path / "ck"
    shardsafe.save(state if state is not None else {
        "w": torch.arange(6.0).reshape(2, 3),
        "model": {"b": torch.arange(4, dtype=torch.int32)},
        "cfg": {"lr": 0.5, "name": "run"},
        "step": 7,
    }, path)
    if fmt == 2:
        as_format2(path)
    return path


def body_text(path: Path) -> str:
    """The manifest as compact JSON text, without its trailer."""
    body = json.loads((path / MANIFEST_NAME).read_bytes())
    body.pop("manifest_xxh3_64")
    return json.dumps(body, separators=(",", ":"))


def seal(path: Path, text: str) -> None:
    """Write the JSON object ``text`` as the manifest, with a valid trailer (docs/format.md)."""
    head = text.rstrip().encode("utf-8", "surrogatepass")
    assert head.endswith(b"}")
    head = head[:-1]
    (path / MANIFEST_NAME).write_bytes(head + TRAILER + checksum(head).encode() + b'"}\n')


def edit(path: Path, old: str, new: str) -> None:
    text = body_text(path)
    assert text.count(old) == 1, old
    seal(path, text.replace(old, new))


def refused(path: Path, *needles: str) -> str:
    """Both the manifest read and a full load raise CorruptCheckpointError naming the
    manifest and every needle; returns the message."""
    msg = ""
    for call in (shardsafe.read_manifest, shardsafe.load_full):
        with pytest.raises(CorruptCheckpointError) as ei:
            call(path)
        msg = str(ei.value)
        assert MANIFEST_NAME in msg
        for needle in needles:
            assert needle in msg, (needle, msg)
    return msg


def nested(depth: int, leaf: str = "1") -> str:
    return "[" * depth + leaf + "]" * depth


# --------------------------------------------------------------------------- 1. nesting


def test_100k_nested_arrays_in_tree_refused(tmp_path):
    path = make_ckpt(tmp_path)
    edit(path, '"step":7', '"step":' + nested(100_000))
    refused(path, "'tree'", "nests deeper than")


@pytest.mark.parametrize("member", ["writer", "extra", "rank_local"])
def test_deep_nesting_in_other_members_refused(tmp_path, member):
    path = make_ckpt(tmp_path)
    text = body_text(path)
    body = json.loads(text)
    seal(path, text.replace(f'"{member}":' + json.dumps(body[member], separators=(",", ":")),
                            f'"{member}":{{"deep":{nested(100_000)}}}'))
    refused(path, f"'{member}'")


def test_deep_nesting_in_tensors_and_chunk_table_refused(tmp_path):
    path = make_ckpt(tmp_path)
    edit(path, '"kind":"replicated","chunks":[0,1]', f'"kind":"replicated","layout":{nested(50_000)},"chunks":[0,1]')
    refused(path, "'tensors'")
    path = make_ckpt(tmp_path / "2")
    edit(path, '"chunks":{"o":[', f'"chunks":{{"deep":{nested(50_000)},"o":[')
    refused(path, "'chunks'")


def test_nesting_over_the_limit_but_within_json_refused(tmp_path):
    # MAX_DEPTH levels in the tree parse; one more is refused although json could parse it.
    ok = make_ckpt(tmp_path / "ok")
    edit(ok, '"step":7', '"step":' + nested(MAX_DEPTH - 1))  # the tree object is the first level
    m = shardsafe.read_manifest(ok)
    assert nesting_depth(m.tree) == MAX_DEPTH
    out = decode(m.tree, lambda tag, key: key)
    assert out["step"] == json.loads(nested(MAX_DEPTH - 1))
    bad = make_ckpt(tmp_path / "bad")
    edit(bad, '"step":7', '"step":' + nested(MAX_DEPTH))
    refused(bad, "'tree'", f"nests {MAX_DEPTH + 1} arrays/objects deep (at most {MAX_DEPTH})")


def test_deep_column_in_chunk_table_refused(tmp_path):
    path = make_ckpt(tmp_path)
    text = body_text(path)
    start = text.index('"o":[') + 4
    end = text.index("]", start) + 1
    seal(path, text[:start] + nested(300, text[start + 1:end - 1]) + text[end:])
    refused(path, "'o'")


def test_decode_refuses_deep_values_without_recursion_error():
    deep: object = 1
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(CorruptCheckpointError, match="nests deeper"):
        decode(deep)
    # Tags count as JSON levels: a tuple is two ({"$tuple": [...]}), a non-str-keyed dict three.
    tup: object = 1
    for _ in range(MAX_DEPTH // 2):
        tup = {"$tuple": [tup]}
    assert nesting_depth(tup) == MAX_DEPTH
    assert decode(tup) is not None
    with pytest.raises(CorruptCheckpointError, match="nests deeper"):
        decode([tup])
    d: object = 1
    for _ in range(MAX_DEPTH // 3 + 1):
        d = {"$dict": [[1, d]]}
    with pytest.raises(CorruptCheckpointError, match="nests deeper"):
        decode(d)


def test_nesting_depth():
    assert nesting_depth(5) == 0
    assert nesting_depth([]) == 1
    assert nesting_depth({"a": [1, {"b": []}], "c": 2}) == 4
    deep: object = "x"
    for _ in range(50_000):
        deep = {"k": deep}
    assert nesting_depth(deep) == 50_000


# --------------------------------------------------------------------------- 2. big ints


def count_conversions(monkeypatch) -> list[int]:
    """The digit counts of every call of ``values._digits_to_int`` (the decimal -> int
    conversion, recursive through the module global, so every split is recorded)."""
    sizes: list[int] = []
    real = values._digits_to_int

    def counted(digits: str) -> int:
        sizes.append(len(digits))
        return real(digits)

    monkeypatch.setattr(values, "_digits_to_int", counted)
    return sizes


def test_huge_int_payload_refused_quickly(tmp_path, monkeypatch):
    path = make_ckpt(tmp_path)
    edit(path, '"step":7', '"step":{"$int":"' + "9" * 2_000_000 + '"}')
    sizes = count_conversions(monkeypatch)
    with pytest.raises(CorruptCheckpointError, match=f"more than {MAX_INT_DIGITS} digits") as ei:
        shardsafe.load_full(path)
    # Refused on its length, before any conversion: not one digit was converted (converting
    # the 2,000,000 digits, as the old piecewise loop did, took minutes).
    assert sizes == []
    assert "manifest" in str(ei.value)
    assert len(str(ei.value)) < 1000  # the payload is not echoed
    # Typed-JSON payloads are checked when decoded: reading the manifest costs nothing more.
    assert shardsafe.read_manifest(path).tree["step"]["$int"][:3] == "999"


def test_int_digit_limit_on_both_sides(monkeypatch):
    biggest = 10**MAX_INT_DIGITS - 1
    sizes = count_conversions(monkeypatch)
    n, leaf = MAX_INT_DIGITS, values._DIGITS
    for value in (biggest, -biggest):
        enc = {"$int": str(value) if abs(value) < 10**4000 else values._int_to_decimal(value)}  # old writers
        sizes.clear()
        assert decode(json.loads(json.dumps(enc))) == value
        # The work at the limit is bounded, not timed. Python's int() only ever sees pieces
        # of at most 512 digits (below its 4300-digit limit), each digit exactly once:
        pieces = [s for s in sizes if s <= leaf]
        assert sum(pieces) == n and len(pieces) == math.ceil(n / leaf) == 40
        # one split (one big multiplication) per internal node of a binary tree:
        assert len(sizes) == 2 * len(pieces) - 1
        # and the digits of all the splits' parts, a bound on the multiplications' operands,
        # total at most n per level of a tree ceil(log2(40)) + 1 = 7 levels deep: 140,000
        # (132,768 measured). Peeling 512 digits at a time, as the old loop did
        # (acc = acc * 10**512 + int(piece)), multiplies a value growing to n digits:
        # 512 * (1 + ... + 40) = 419,840 digits, quadratic in n, three times this bound
        # (and a conversion that bypasses _digits_to_int records no pieces at all).
        assert sum(sizes) <= n * (math.ceil(math.log2(n / leaf)) + 1)
    for value in (biggest + 1, -biggest - 1, 7**40000, 2**2039):  # writers stop at 2039 bits and a sign
        with pytest.raises(UnsupportedValueError, match=r"'opt\.seed'.*at most 2039 bits"):
            encode_scalar(value, "opt.seed")
    with pytest.raises(CorruptCheckpointError, match="digits"):
        decode({"$int": "-" + "1" * (MAX_INT_DIGITS + 1)})
    assert decode({"$int": "-" + "1" * MAX_INT_DIGITS}) == -(10**MAX_INT_DIGITS - 1) // 9


def test_save_refuses_an_unreadable_int(tmp_path):
    with pytest.raises(UnsupportedValueError, match="big"):
        shardsafe.save({"big": 10**MAX_INT_DIGITS}, tmp_path / "ck")


# --------------------------------------------------------------------------- 3. duplicate keys


DUPLICATES = {
    # (text to find, replacement, the key named in the error)
    "top_level": ('"world_size":1', '"world_size":1,"world_size":2', "'world_size'"),
    "tensor_key": ('"w":{"dtype":"float32","shape":[2,3],"kind":"replicated","chunks":[1,1]}',
                   '"w":{"dtype":"float32","shape":[2,3],"kind":"replicated","chunks":[1,1]},'
                   '"w":{"dtype":"float32","shape":[2,3],"kind":"replicated","chunks":[1,1]}', "'w'"),
    # Same itemsize: after "last one wins" everything adds up and the bytes would be reinterpreted.
    "tensor_dtype": ('"w":{"dtype":"float32"', '"w":{"dtype":"float32","dtype":"int32"', "'dtype'"),
    "tensor_layout": ('"shape":[2,3],"kind":"replicated"', '"shape":[2,3],"kind":"replicated",'
                      '"layout":{"mesh_shape":[1],"mesh_shape":[2]}', "'mesh_shape'"),
    "chunk_column": ('"chunks":{"o":[', '"chunks":{"f":[0,0],"o":[', "'f'"),
    "file_entry": ('"rank":[0],', '"rank":[0],"rank":[0],', "'rank'"),
    "tree": ('"lr":0.5', '"lr":0.5,"lr":0.25', "'lr'"),
    "extra": ('"checksum_block":1048576', '"checksum_block":1048576,"checksum_block":1048576', "'checksum_block'"),
}


@pytest.mark.parametrize("case", list(DUPLICATES))
def test_duplicate_keys_refused(tmp_path, case):
    old, new, key = DUPLICATES[case]
    path = make_ckpt(tmp_path)
    edit(path, old, new)
    refused(path, "duplicate key", key)


def test_newer_minor_members_with_objects_still_parse(tmp_path):
    # Members a newer minor may add (objects inside tensor entries included) are ignored;
    # they make the counted members differ, which a strict parse then clears.
    path = make_ckpt(tmp_path)
    edit(path, '"kind":"replicated","chunks":[0,1]',
         '"kind":"replicated","chunks":[0,1],"future":{"a":{"b":1},"c":[{"d":2}]}')
    assert shardsafe.load_full(path)["cfg"]["lr"] == 0.5


def test_keys_with_quotes_colons_brackets_and_escapes_round_trip(tmp_path):
    keys = ['a:b', 'q"uote', 'back\\slash', '{[brace]}:', 'é中', 'emoji\U0001F600', '"":""', '\\"', 'tab\tnl\n']
    state = {k: torch.full((2,), float(i)) for i, k in enumerate(keys)}
    state["cfg"] = {k: [k, {"x:": "]}"}] for k in keys}
    path = make_ckpt(tmp_path, state)
    m = shardsafe.read_manifest(path)
    assert set(m.tensors) == set(keys)
    out = shardsafe.load_full(path)
    assert out["cfg"] == state["cfg"]
    assert all(torch.equal(out[k], state[k]) for k in keys)


# --------------------------------------------------------------------------- 4. NaN, Infinity, created


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_non_standard_numbers_refused_anywhere(tmp_path, token):
    path = make_ckpt(tmp_path)
    created = json.loads(body_text(path))["created"]
    edit(path, f'"created":{created!r}', f'"created":{token}')
    refused(path, token, "not a JSON number", "'created'")
    path = make_ckpt(tmp_path / "2")
    edit(path, '"lr":0.5', f'"lr":{token}')
    refused(path, token, "'tree'")


@pytest.mark.parametrize("value", ['"yesterday"', "true", "null", "1e999", "-5", str(2**40), "[1]", "{}"])
def test_bad_created_refused(tmp_path, value):
    path = make_ckpt(tmp_path)
    created = json.loads(body_text(path))["created"]
    edit(path, f'"created":{created!r}', f'"created":{value}')
    refused(path, "created")


def test_integer_created_accepted(tmp_path):
    path = make_ckpt(tmp_path)
    created = json.loads(body_text(path))["created"]
    edit(path, f'"created":{created!r}', '"created":1700000000')
    assert shardsafe.read_manifest(path).created == 1700000000


# --------------------------------------------------------------------------- 5. names and surrogates


@pytest.mark.parametrize("name, needle", [
    ("\\ud800", "lone surrogate"),
    ("data\\udc00.safetensors", "lone surrogate"),
    ("x\\u0001", "not a plain file name"),
    ("line\\nbreak", "not a plain file name"),
    ("c1\\u0085", "not a plain file name"),
    ("d" * 256, "at most 255 bytes"),
    ("é" * 128, "at most 255 bytes"),  # 256 bytes in UTF-8
    ("sub/" + DATA, "not a plain file name"),
    ("..", "not a plain file name"),
])
def test_bad_file_names_refused(tmp_path, name, needle):
    path = make_ckpt(tmp_path, fmt=2)
    edit(path, f'"name":"{DATA}"', f'"name":"{name}"')
    refused(path, needle)


def test_duplicate_file_names_refused(tmp_path):
    path = make_ckpt(tmp_path, fmt=2)
    text = body_text(path)
    files = json.loads(text)["files"]
    old = json.dumps(files, separators=(",", ":"))
    seal(path, text.replace(old, json.dumps(files * 2, separators=(",", ":"))))
    refused(path, "listed twice")


def test_longest_and_non_ascii_file_names_load(tmp_path):
    for name in ("n" * 243 + ".safetensors", "é" * 121 + ".safetensors"):  # 255 and 254 bytes
        path = make_ckpt(tmp_path / str(len(name)), fmt=2)
        (path / DATA).rename(path / name)
        edit(path, f'"name":"{DATA}"', f'"name":{json.dumps(name)}')
        assert torch.equal(shardsafe.load_full(path)["w"], torch.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("where, old, new", [
    ("tensors", '"model.b":{', '"model.b\\udfff":{'),
    ("tree", '"name":"run"', '"name":"r\\ud83dn"'),
    ("tree", '"name":"run"', '"\\\\\\ud83d":"run"'),  # an escaped backslash, then a lone surrogate
    ("chunks", '"chunks":{"o"', '"chunks":{"\\udc00":1,"o"'),
])
def test_lone_surrogates_refused(tmp_path, where, old, new):
    path = make_ckpt(tmp_path)
    edit(path, old, new)
    refused(path, "lone surrogate", f"'{where}'")


def test_surrogate_pairs_and_escaped_backslashes_accepted(tmp_path):
    path = make_ckpt(tmp_path)
    edit(path, '"name":"run"', '"name":"\\ud83d\\ude00 \\\\ud800 \\\\\\\\udc00"')
    assert shardsafe.load_full(path)["cfg"]["name"] == "\U0001F600 \\ud800 \\\\udc00"


def test_save_refuses_lone_surrogate_strings(tmp_path):
    with pytest.raises(UnsupportedValueError, match="cfg.name.*lone surrogate"):
        encode_scalar("a\ud800", "cfg.name")
    with pytest.raises(UnsupportedValueError, match="lone surrogate"):
        shardsafe.save({"cfg": {"name": "a\udc00"}}, tmp_path / "ck")


# --------------------------------------------------------------------------- 6. checksum block


@pytest.mark.parametrize("block", [2**61, 2**70, MAX_CHECKSUM_BLOCK + 1, 0, -1, "1048576", 1.5, True])
def test_bad_checksum_block_refused(tmp_path, block):
    path = make_ckpt(tmp_path)
    edit(path, '"checksum_block":1048576', f'"checksum_block":{json.dumps(block)}')
    refused(path, "extra.checksum_block", "from 1 to")


@pytest.mark.parametrize("block", [1, 64, 4096, 1 << 20, MAX_CHECKSUM_BLOCK])
def test_checksum_block_range_accepted(block):
    nbytes = 100
    sums = [f"{i:016x}" for i in range(max(1, -(-nbytes // block)))]
    m = Manifest(tree={"t": {"$tensor": "t"}},
                 tensors={"t": TensorEntry("float32", (25,), "replicated", [Chunk((0,), (25,), 0, 8, 108, sums, 0)])},
                 files=[FileEntry(DATA, 108, 0, 8, "0" * 16)], extra={"checksum_block": block})
    assert Manifest.from_bytes(m.to_bytes()).extra["checksum_block"] == block


# --------------------------------------------------------------------------- strict JSON internals


json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6), st.floats(allow_nan=False,
                         allow_infinity=False), st.text(alphabet='ab:"\\[]{}é\n\U0001F600', max_size=6))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(alphabet='k:"\\[{}', max_size=4), inner, max_size=4)),
    max_leaves=30)


def _reference(value: object) -> tuple[int, int]:
    members = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            members += len(v)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return nesting_depth(value), members


@settings(max_examples=300, deadline=None)
@given(value=json_values, ascii_only=st.booleans(), indent=st.sampled_from([None, 1]))
def test_raw_nesting_and_member_count_match_the_parsed_value(value, ascii_only, indent):
    text = json.dumps(value, ensure_ascii=ascii_only, indent=indent)
    assert strict_json._nesting(text.encode("utf-8")) == _reference(value)


def test_big_manifest_parses_with_every_check():
    # 3000 tensors, one chunk each, keys needing escapes: the counted path, no strict re-parse.
    keys = [f'layer.{i}.w:"{i % 7}"\\é' for i in range(3000)]
    tensors, pos = {}, 8
    for k in keys:
        tensors[k] = TensorEntry("float32", (4,), "replicated", [Chunk((0,), (4,), 0, pos, pos + 16, ["0" * 16], 0)])
        pos += 16
    m = Manifest(tree={k: {"$tensor": k} for k in keys}, tensors=tensors, files=[FileEntry(DATA, pos, 0, 8, "0" * 16)],
                 extra={"checksum_block": 1 << 20})
    data = m.to_bytes()
    tensors_at = data.decode().index('"tensors":') + len('"tensors":')
    calls = []
    strict = strict_json._STRICT
    strict_json._STRICT = lambda text, pos: calls.append(pos) or strict(text, pos)
    try:
        parsed = Manifest.from_bytes(data)
    finally:
        strict_json._STRICT = strict
    assert list(parsed.tensors) == keys
    assert calls and tensors_at not in calls  # the other members only: the tensors are counted, not re-parsed


# --------------------------------------------------------------------------- 7. data file headers


def header_of(path: Path) -> tuple[bytes, int]:
    data = (path / DATA).read_bytes()
    return data, struct.unpack("<Q", data[:8])[0] + 8


def claims(path: Path) -> list[ClaimedChunk]:
    m = shardsafe.read_manifest(path)
    return [ClaimedChunk(safetensors_code(NAME_TO_TORCH[t.dtype]), c.lengths, c.start, c.end, key)
            for key, t in m.tensors.items() for c in t.chunks]


def test_parse_header_of_a_saved_file_matches_its_manifest(tmp_path):
    path = make_ckpt(tmp_path)
    data, hlen = header_of(path)
    entries = parse_header(data, DATA, file_bytes=len(data))
    assert {k: (e.code, e.shape, e.end - e.begin) for k, e in entries.items()} == {
        "w": ("F32", (2, 3), 24), "model.b": ("I32", (4,), 16)}
    assert parse_header(data[:hlen], DATA) == entries  # the header alone is enough
    check_chunks_against_header(entries, hlen, claims(path), DATA)


def test_manifest_dtype_contradicting_the_header_is_caught(tmp_path):
    path = make_ckpt(tmp_path)
    edit(path, '"w":{"dtype":"float32"', '"w":{"dtype":"int32"')  # same size: the manifest alone cannot tell
    data, hlen = header_of(path)
    entries = parse_header(data, DATA, file_bytes=len(data))
    with pytest.raises(CorruptCheckpointError, match=r"'w' \(I32 \[2, 3\]\).*has F32 \[2, 3\] there") as ei:
        check_chunks_against_header(entries, hlen, claims(path), DATA)
    assert DATA in str(ei.value)


def test_claims_checked_by_range_shape_and_code():
    entries = {"a": HeaderEntry("F32", (2,), 0, 8), "b~1": HeaderEntry("U8", (0,), 8, 8),
               "c": HeaderEntry("U8", (0, 3), 8, 8), "d": HeaderEntry("F16", (2, 2), 8, 16)}
    ok = [("F32", (2,), 24, 32, "a"), ("U8", (0,), 32, 32, "b"), ("U8", (0, 3), 32, 32, "c"),
          ("F16", (2, 2), 32, 40, "d")]
    check_chunks_against_header(entries, 24, ok, "f")
    for bad, needle in [
        (("F32", (2,), 25, 33, "a"), "no tensor"),
        (("F16", (4,), 32, 40, "d"), "F16 [2, 2]"),
        (("BF16", (2, 2), 32, 40, "d"), "F16 [2, 2]"),
        (("U8", (3, 0), 32, 32, "c"), "has U8 [0], U8 [0, 3] there"),
    ]:
        with pytest.raises(CorruptCheckpointError, match=re.escape(needle)):
            check_chunks_against_header(entries, 24, [bad], "f")
    with pytest.raises(CorruptCheckpointError, match="'b'"):  # one header tensor answers one claim
        check_chunks_against_header(entries, 24, ok + [("U8", (0,), 32, 32, "b")], "f")


def raw_header(obj: object | str, pad: bytes = b"") -> bytes:
    text = (obj if isinstance(obj, str) else json.dumps(obj)).encode() + pad
    return struct.pack("<Q", len(text)) + text


GOOD = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "I64", "shape": [], "data_offsets": [8, 16]}}


@pytest.mark.parametrize("header, needle", [
    (raw_header('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"a":{"dtype":"F32","shape":[2],'
                '"data_offsets":[0,8]}}'), "duplicate key 'a'"),
    (raw_header({**GOOD, "a": {"dtype": "F33", "shape": [2], "data_offsets": [0, 8]}}), "unknown dtype"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}}), "bad shape"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}), "bad shape"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 8]}}), "bad shape"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}), "12 bytes"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}}), "bad data_offsets"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 2**70]}}), "bad data_offsets"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}), "exactly"),
    (raw_header({**GOOD, "a": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}), "gap"),
    (raw_header({**GOOD, "b": {"dtype": "I64", "shape": [], "data_offsets": [4, 12]}}), "overlap"),
    (raw_header({**GOOD, "__metadata__": {"format": 1}}), "__metadata__"),
    (raw_header([1, 2]), "not a JSON object"),
    (raw_header('{"a": NaN}'), "NaN"),
    (raw_header(GOOD, pad=b"  x"), "followed by"),
    (raw_header(GOOD, pad=b"\xff"), "not valid JSON"),
    (raw_header("[" * 100_000 + "]" * 100_000), "not valid JSON"),
    (struct.pack("<Q", 2**63) + b"{}", "claims"),
    (struct.pack("<Q", 100) + b"{}", "only 2 follow"),
    (b"\x01\x00", "shorter than"),
])
def test_parse_header_refuses(header, needle):
    with pytest.raises(CorruptCheckpointError, match=needle) as ei:
        parse_header(header, "data-r00003-00.safetensors")
    assert "data-r00003-00.safetensors" in str(ei.value)


def test_parse_header_checks_the_file_size():
    header = raw_header(GOOD, pad=b"   ")
    assert parse_header(header, "f", file_bytes=len(header) + 16)["b"] == HeaderEntry("I64", (), 8, 16)
    for size in (len(header) + 15, len(header) + 17, 4):
        with pytest.raises(CorruptCheckpointError):
            parse_header(header, "f", file_bytes=size)


# --------------------------------------------------------------------------- 8. chunk names


def test_unique_chunk_names():
    assert unique_chunk_names(["a", "b"]) == ["a", "b"]
    assert unique_chunk_names(["a@0", "a@0", "a@0"]) == ["a@0", "a@0~1", "a@0~2"]
    assert unique_chunk_names(["a", "a", "a~1"]) == ["a", "a~2", "a~1"]  # never a name the list holds
    assert unique_chunk_names(["__metadata__", "x"]) == ["__metadata__~1", "x"]
    rng = random.Random(0)
    names = [rng.choice(["a", "a~1", "a~2", "b", "a@0", "__metadata__"]) for _ in range(200)]
    out = unique_chunk_names(names)
    assert len(set(out)) == len(out) == len(names) and "__metadata__" not in out
    assert out == unique_chunk_names(list(names))
    assert all(o == n or o.startswith(n + "~") for o, n in zip(out, names))


def test_colliding_chunk_names_give_a_valid_header():
    # Tensor "a@0" saved whole and a chunk of tensor "a" at offset 0 in one file.
    entries = [ChunkEntry("a@0", "F32", (2,), 8), ChunkEntry("a@0", "F32", (1,), 4),
               ChunkEntry("__metadata__", "U8", (3,), 3)]
    header, ranges = build_header(entries)
    parsed = parse_header(header, "f", file_bytes=len(header) + 15)
    assert list(parsed) == ["a@0", "a@0~1", "__metadata__~1"]
    assert [(len(header) + e.begin, len(header) + e.end) for e in parsed.values()] == ranges
