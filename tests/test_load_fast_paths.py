"""The short ways of the load path (issue 22, section 4) against the long ways they stand
for: the manifest's batched box check against the tensor-by-tensor one (same entries,
same error), the header check built from the index's columns against the
ChunkEntry/build_header construction, plain tensors matched without the general walk
(same fills, same messages), and many small tensors landed in batches (bitwise, and
untouched when one block is corrupt)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardsafe
from bitwise import assert_bitwise
from shardsafe.errors import CorruptCheckpointError, DtypeMismatchError, ShapeMismatchError
from shardsafe.format import strict_json
from shardsafe.format.checksum import checksum
from shardsafe.format.datafile import ChunkEntry, build_header, chunk_name
from shardsafe.format.dtypes import safetensors_code, torch_dtype
from shardsafe.format.manifest import MANIFEST_NAME, Manifest
from shardsafe.format.manifest_v3 import _tensors_v3, _tensors_v3_pass

TRAILER = b', "manifest_xxh3_64": "'


def body_of(path: Path) -> dict:
    data = (path / MANIFEST_NAME).read_bytes()
    cut = data.rfind(TRAILER)
    body, _ = strict_json._parse_json(data[:cut] + b"}", "m")
    return body


def v3_args(body: dict) -> tuple:
    return (body["tensors"], body["chunks"], [], len(body["files"]["rank"]), body["world_size"], 1 << 40)


def entries_of(found: tuple) -> list:
    tensors, members, rules = found
    return [(k, e.dtype, e.shape, e.kind, e.layout, e._geom) for k, e in tensors.items()], members, len(rules)


def careful(args: tuple):
    """The tensor-by-tensor pass: its result, or the message of the error it raises."""
    try:
        return entries_of(_tensors_v3_pass(*args, False))
    except CorruptCheckpointError as exc:
        return str(exc)


def quick(args: tuple):
    try:
        return entries_of(_tensors_v3(*args))
    except CorruptCheckpointError as exc:
        return str(exc)


@pytest.fixture
def many(tmp_path):
    state = {f"t{i:03d}": torch.arange(i + 1, dtype=torch.float32) for i in range(40)}
    state["m"] = torch.arange(12.0).reshape(3, 4)
    state["nested"] = {"x": torch.arange(5, dtype=torch.int16), "s": torch.tensor(2.5)}
    shardsafe.save(state, tmp_path / "ck")
    return tmp_path / "ck", state


def test_batched_box_check_gives_the_same_entries(many):
    path, _ = many
    args = v3_args(body_of(path))
    assert _tensors_v3_pass(*args, True) is not None  # the batched pass accepted it by itself
    assert quick(args) == careful(args)


@pytest.mark.parametrize("edit", [
    ("o", 5, -1), ("o", 5, 1 << 70), ("o", 41, 3), ("n", 5, 99), ("n", 5, -3), ("n", 41, 1 << 63),
    ("f", 3, 1), ("f", 3, -1), ("o", 0, True), ("n", 2, 1.0), ("shape", "t003", [4.0]),
    ("shape", "t003", [True]), ("shape", "t004", [4.0]), ("shape", "t002", [True, 3]),
    ("shape", "m", [3, 4.0]), ("shape", "m", [3, "4"]), ("count", "t004", 2),
    ("drop", "o", None), ("append", "n", 1),
])
def test_batched_box_check_names_the_same_problem(many, edit):
    path, _ = many
    body = json.loads(json.dumps(body_of(path)))
    what, at, value = edit
    if what in ("o", "n", "f"):
        body["chunks"][what][at] = value
    elif what == "shape":
        body["tensors"][at]["shape"] = value
    elif what == "count":
        body["tensors"][at]["chunks"][1] = value
    elif what == "drop":
        body["chunks"][at].pop()
    else:
        body["chunks"][at].append(value)
    args = v3_args(body)
    expected = careful(args)
    assert isinstance(expected, str), "the edit should make the manifest corrupt"
    assert quick(args) == expected


def reference_canonical(header: bytes, manifest: Manifest, index: int) -> bool:
    """The header check as ChunkEntry and build_header spell it (the writer's own construction)."""
    fi = manifest.index(index)
    table = fi.table
    starts, ends = table.start.tolist(), table.end.tolist()
    offs, lens, dims = table.offsets.tolist(), table.lengths.tolist(), table.dims.tolist()
    rows = sorted(range(len(fi.ordinals)), key=starts.__getitem__)
    entries = []
    for r in rows:
        key = manifest.key_in_file(index, fi.ordinals[r])
        entry = manifest.tensors[key]
        code = safetensors_code(torch_dtype(entry.dtype))
        o, n = offs[dims[r]: dims[r + 1]], lens[dims[r]: dims[r + 1]]
        whole = not any(o) and tuple(n) == tuple(entry.shape)
        entries.append(ChunkEntry(chunk_name(key, o, whole), code, tuple(n), ends[r] - starts[r]))
    expected, ranges = build_header(entries)
    return expected == header and all(rg == (starts[r], ends[r]) for rg, r in zip(ranges, rows))


def header_and_manifest(path: Path) -> tuple[bytes, Manifest]:
    manifest = shardsafe.read_manifest(path)
    size = manifest.files[0].header_bytes
    return (path / manifest.files[0].name).read_bytes()[:size], manifest


@pytest.mark.parametrize("state", [
    {"a": torch.arange(3.0), "b": {"c": torch.zeros(2, 2, dtype=torch.bfloat16)}},
    {"__metadata__": torch.ones(2), "a@0": torch.arange(4), 'q"u\\o\u00e9\u4e2d': torch.ones(1, dtype=torch.bool)},
    {"empty": torch.zeros(0, 3), "also": torch.zeros(0), "s": torch.tensor(1.0), "x": torch.arange(7)},
    {"rl": shardsafe.rank_local(torch.arange(3)), "w": torch.arange(5.0)},
])
def test_header_check_agrees_with_the_writers_construction(tmp_path, state):
    from shardsafe.engine.reader import _is_canonical_header

    shardsafe.save(state, tmp_path / "ck")
    header, manifest = header_and_manifest(tmp_path / "ck")
    assert _is_canonical_header(header, manifest, 0) is True
    assert reference_canonical(header, manifest, 0) is True
    # Changed headers: a byte of a shape, a name, the padding, the length prefix.
    text = header[8:]
    for changed in (header.replace(b'"shape":[', b'"shape": [', 1)[: len(header)],
                    header[:8] + text.replace(b'"dtype":"', b'"dtype" :"', 1)[: len(text)],
                    header[:-1] + b"x", header[:8] + b"{" + text[1:].replace(b'"', b"'", 1),
                    (len(text) + 8).to_bytes(8, "little") + text):
        assert _is_canonical_header(changed, manifest, 0) is reference_canonical(changed, manifest, 0) is False


def test_header_check_of_a_moved_chunk_is_false(tmp_path):
    from shardsafe.engine.reader import _is_canonical_header

    shardsafe.save({"a": torch.arange(3.0), "b": torch.arange(2.0)}, tmp_path / "ck")
    header, manifest = header_and_manifest(tmp_path / "ck")
    table = manifest.index(0).table
    table.start[0] += 4  # the index says the first chunk starts 4 bytes later
    table.end[0] += 4
    assert _is_canonical_header(header, manifest, 0) is reference_canonical(header, manifest, 0) is False


def test_plain_tensor_problems_name_their_dotted_keys(tmp_path):
    shardsafe.save({"m": {"w": torch.zeros(2, 3), "b": torch.zeros(3)}, "t": torch.zeros(4)}, tmp_path / "ck")
    dest = {"m": {"w": torch.ones(3, 2), "b": torch.ones(3, dtype=torch.float64)}, "t": torch.ones(4)}
    with pytest.raises(ShapeMismatchError) as ei:
        shardsafe.load(dest, tmp_path / "ck")
    msg = str(ei.value)
    assert "key 'm.w': saved shape [2, 3], destination shape [3, 2]" in msg
    assert "key 'm.b': saved dtype float32, destination dtype float64" in msg
    assert all(bool((t == 1).all()) for t in (dest["m"]["w"], dest["m"]["b"], dest["t"]))
    with pytest.raises(DtypeMismatchError, match=r"key 'm\.b'"):
        shardsafe.load({"m": {"b": torch.ones(3, dtype=torch.float64)}}, tmp_path / "ck")
    with pytest.raises(Exception, match=r"key 'e'.*overlapping memory"):
        shardsafe.save({"e": torch.zeros(4)}, tmp_path / "e")
        shardsafe.load({"e": torch.zeros(1).expand(4)}, tmp_path / "e")


def test_parameters_dtensor_free_subclasses_and_plain_tensors_fill_alike(tmp_path):
    torch.manual_seed(0)
    state = {"p": torch.randn(3), "q": torch.randn(2, 2), "r": torch.randn(5)}
    shardsafe.save(state, tmp_path / "ck")
    param = torch.nn.Parameter(torch.zeros(3))
    dest = {"p": param, "q": torch.zeros(4, 2)[::2], "r": torch.zeros(5)}
    shardsafe.load(dest, tmp_path / "ck")
    assert dest["p"] is param and param.requires_grad
    assert_bitwise(param.detach(), state["p"])
    assert_bitwise(dest["q"], state["q"])
    assert_bitwise(dest["r"], state["r"])


def many_small(n: int = 600) -> dict:
    g = torch.Generator().manual_seed(1)
    dtypes = (torch.float32, torch.bfloat16, torch.int64, torch.float16)
    return {f"layer{i // 7}.p{i % 7}": (torch.randn(1 + i % 13, 3, generator=g) * 100).to(dtypes[i % 4])
            for i in range(n)}


def test_many_small_tensors_land_bitwise(tmp_path):
    state = many_small()
    shardsafe.save(state, tmp_path / "ck")
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    info = shardsafe.load(dest, tmp_path / "ck")
    assert info.tensors == len(state)
    assert_bitwise(dest, state)
    assert_bitwise(shardsafe.load_full(tmp_path / "ck"), state)


@pytest.mark.parametrize("which", [0, 301, 599])
def test_one_corrupt_small_tensor_leaves_every_destination_untouched(tmp_path, which):
    state = many_small()
    path = tmp_path / "ck"
    shardsafe.save(state, path)
    manifest = shardsafe.read_manifest(path)
    key = list(state)[which]
    chunk = manifest.tensors[key].chunks[0]
    data = path / manifest.files[chunk.file].name
    raw = bytearray(data.read_bytes())
    raw[chunk.start] ^= 0x01
    data.write_bytes(bytes(raw))
    dest = {k: torch.full_like(v, 7) for k, v in state.items()}
    with pytest.raises(CorruptCheckpointError, match=f"tensor '{key}'"):
        shardsafe.load(dest, path)
    assert all(bool((t == 7).all()) for t in dest.values()), "a failed load wrote into the destination"


def test_manifest_checksum_still_guards_the_batched_pass(many):
    path, _ = many
    data = (path / MANIFEST_NAME).read_bytes()
    cut = data.rfind(TRAILER)
    head = data[:cut].replace(b'"o":[0', b'"o":[1', 1)
    (path / MANIFEST_NAME).write_bytes(head + TRAILER + checksum(head).encode() + b'"}\n')
    with pytest.raises(CorruptCheckpointError, match="is not inside shape"):
        shardsafe.read_manifest(path)


def test_borrowed_sources_of_every_layout_save_bitwise(tmp_path):
    # The writer borrows dense CPU sources through their memory address (no numpy view):
    # offsets into a bigger storage, one-element strides, empty tensors, bool and complex.
    base = torch.arange(40.0)
    state = {"offset": base[7:19], "strided_one": torch.arange(8.0)[::8], "empty": torch.zeros(0, 5),
             "bool": torch.tensor([True, False, True]), "complex": torch.randn(3, dtype=torch.complex64),
             "conj": torch.randn(4, dtype=torch.complex64).conj(), "rows": base.view(8, 5)[2:6],
             "scalar": torch.tensor(3.5, dtype=torch.float64)}
    shardsafe.save(state, tmp_path / "ck")
    assert_bitwise(shardsafe.load_full(tmp_path / "ck"), state)
