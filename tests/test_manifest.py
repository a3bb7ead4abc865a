"""The manifest's chunk table (format 2): round trips, lazy chunks, and the vectorized
overlap search against a brute-force one."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardsafe import CorruptCheckpointError
from shardsafe.format.manifest import Chunk, FileEntry, Manifest, TensorEntry
from shardsafe.layout import Box, split_rows

BLOCK = 64


def _sum(i: int) -> str:
    return f"{(i * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF:016x}"


def build(shapes: dict[str, tuple[int, ...]], pieces: dict[str, int], itemsize: int = 4) -> Manifest:
    """A manifest whose tensors are cut into row ranges, chunks spread over 3 files."""
    files = [FileEntry(f"data-r{r:05d}-00.safetensors", 0, r, 16, _sum(r)) for r in range(3)]
    pos = [16, 16, 16]
    tensors = {}
    n = 0
    for key, shape in shapes.items():
        boxes = split_rows(shape, pieces[key]) if shape else [Box((), ())]
        chunks = []
        for i, box in enumerate(boxes):
            f = (n + i) % 3
            nbytes = box.numel * itemsize
            sums = [_sum(n + i + j) for j in range(max(1, -(-nbytes // BLOCK)))]
            chunks.append(Chunk(box.offsets, box.lengths, f, pos[f], pos[f] + nbytes, sums, f))
            pos[f] += nbytes
        n += len(boxes)
        tensors[key] = TensorEntry("float32", shape, "sharded" if len(boxes) > 1 else "replicated", chunks)
    for f, p in zip(files, pos):
        f.nbytes = p
    return Manifest(tree={k: {"$tensor": k} for k in shapes}, tensors=tensors, files=files,
                    extra={"checksum_block": BLOCK})


shapes_st = st.dictionaries(
    st.sampled_from([f"t{i}" for i in range(12)]),
    st.one_of(st.just(()), st.tuples(st.integers(0, 200)), st.tuples(st.integers(0, 200), st.integers(0, 4)),
              st.tuples(st.integers(0, 150), st.integers(0, 3), st.integers(1, 3))),
    min_size=1, max_size=8,
)


@settings(max_examples=150, deadline=None)
@given(shapes=shapes_st, data=st.data())
def test_round_trip_and_overlap_search(shapes, data):
    pieces = {k: data.draw(st.integers(1, max(1, s[0] if s else 1))) for k, s in shapes.items()}
    m = build(shapes, pieces)
    parsed = Manifest.from_bytes(m.to_bytes())
    assert list(parsed.tensors) == list(m.tensors)
    for key, entry in m.tensors.items():
        got = parsed.tensors[key]
        assert (got.dtype, got.shape, got.kind, got.chunk_count) == (entry.dtype, entry.shape, entry.kind,
                                                                     len(entry.chunks))
        # Every query box: the table's answer (vectorized above 64 chunks) equals brute force.
        for _ in range(3):
            offsets = tuple(data.draw(st.integers(0, max(0, s - 1))) for s in entry.shape)
            lengths = tuple(data.draw(st.integers(1 if s else 0, max(1, s - o))) for o, s in zip(offsets,
                                                                                                  entry.shape))
            want = [c for c in entry.chunks
                    if all(co < o + n and co + cn > o and cn > 0
                           for co, cn, o, n in zip(c.offsets, c.lengths, offsets, lengths))]
            fresh = Manifest.from_bytes(m.to_bytes()).tensors[key]  # chunks not built yet
            assert fresh.chunks_meeting(offsets, lengths) == want
        assert got.chunks == entry.chunks  # lazily built, equal field by field


def test_vectorized_path_is_taken_for_many_chunks():
    m = Manifest.from_bytes(build({"w": (300, 2)}, {"w": 300}).to_bytes())
    entry = m.tensors["w"]
    hits = entry.chunks_meeting((150, 0), (3, 2))
    assert [c.offsets for c in hits] == [(150, 0), (151, 0), (152, 0)]
    assert entry._chunks is None, "the overlap search built every chunk"


def test_writing_rank_is_the_files_rank():
    m = Manifest.from_bytes(build({"w": (6, 2)}, {"w": 6}).to_bytes())
    assert [c.rank for c in m.tensors["w"].chunks] == [c.file for c in m.tensors["w"].chunks] == [0, 1, 2, 0, 1, 2]


def test_manifest_size_per_chunk_is_small():
    """Column-wise chunks: the 4096 row chunks of one tensor cost ~60 bytes each."""
    data = build({"w": (4096, 8)}, {"w": 4096}).to_bytes()
    body = json.loads(data[: data.rfind(b', "manifest_xxh3_64"')] + b"}")
    assert len(body["chunks"]["f"]) == 4096
    assert len(data) / 4096 < 70, len(data) / 4096


def test_tensor_ranges_must_tile_the_table():
    m = build({"a": (4,), "b": (4,)}, {"a": 2, "b": 2})
    data = m.to_bytes()
    body = json.loads(data[: data.rfind(b', "manifest_xxh3_64"')] + b"}")
    body["tensors"]["b"]["chunks"] = [1, 2]  # overlaps a's second row
    from shardsafe.format.checksum import checksum

    head = json.dumps(body, separators=(",", ":")).encode()[:-1]
    bad = head + b', "manifest_xxh3_64": "' + checksum(head).encode() + b'"}\n'
    with pytest.raises(CorruptCheckpointError, match="tensor 'b': chunk range"):
        Manifest.from_bytes(bad)


def test_overlapping_chunks_are_refused_at_planning():
    """Two chunks covering the same rows (sizes still adding up) must not load garbage."""
    import torch

    from shardsafe.plan.load_plan import plan_reads
    from shardsafe.state.match import Fill

    m = build({"w": (4, 2)}, {"w": 2})
    first, second = m.tensors["w"].chunks
    second.offsets = first.offsets  # rows 0-1 twice, rows 2-3 never
    parsed = Manifest.from_bytes(m.to_bytes())
    fill = Fill("w", torch.empty(4, 2), Box((0, 0), (4, 2)), True)
    with pytest.raises(CorruptCheckpointError, match="tensor 'w': saved chunks overlap"):
        plan_reads(parsed, [fill])


@pytest.mark.parametrize("boxes, disjoint", [
    ([((0, 0), (2, 4)), ((2, 0), (2, 4))], True),  # row ranges
    ([((0, 0), (2, 2)), ((0, 2), (2, 2)), ((2, 0), (2, 2)), ((2, 2), (2, 2))], True),  # a 2 x 2 grid
    ([((0, 0), (3, 2)), ((2, 1), (2, 2))], False),  # corners overlap
    ([((0, 0), (4, 1)), ((1, 0), (1, 1)), ((3, 1), (1, 1))], False),  # contained
    ([((0, 0), (2, 4)), ((2, 0), (0, 4)), ((2, 0), (2, 4))], True),  # an empty box overlaps nothing
    ([((), ()), ((), ())], False),  # two 0-d boxes are the same element
])
def test_boxes_disjoint(boxes, disjoint):
    from shardsafe.layout import boxes_disjoint

    assert boxes_disjoint([Box(o, n) for o, n in boxes]) is disjoint
