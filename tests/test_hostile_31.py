"""Hostile format-3.1 cases of issue 22 section 2 (the ones mended so far): int64 overflow of
checksum block counts, JSON booleans where integers belong, one validating decoder of typed
containers for every reader, and the writer's int limit (what torch's weights-only loader reads)."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import shardsafe
from shardsafe.errors import CorruptCheckpointError, UnsupportedValueError
from shardsafe.format.chunk_table import ChunkTable
from shardsafe.format.values import PICKLE_INT_BOUND, container, decode, encode_scalar
from shardsafe.state.saved import children, select, walk
from shardsafe.state.tree import saved_items, saved_sequence


def test_checksum_block_counts_that_wrap_int64_are_refused():
    # Eight uint8 chunks of 2^61 bytes, checksum_block 1: 2^64 blocks, 0 mod 2^64, would
    # match an empty checksum string.
    n, size = 8, 1 << 61
    start = np.full(n, 8, dtype=np.int64)
    table = ChunkTable(np.zeros(n, dtype=np.int64), np.full(n, size, dtype=np.int64), np.ones(n, dtype=np.int64),
                       np.zeros(n, dtype=np.int64), start, start + size, "", 1, [0])
    assert table.blocks_overflow
    assert int(table.xs[-1]) <= n  # nothing sized by the wrapped claim
    bad = table.problem([(size,)] * n, [1] * n, np.arange(n + 1), np.array([8]), np.array([size + 8]), ["f"])
    assert bad == (-1, "the chunks claim 2^62 or more checksum blocks; 0 are listed")


@pytest.mark.parametrize("column", [[False], [0, False], [True, 1]])
def test_booleans_in_integer_columns_are_refused(column):
    with pytest.raises(CorruptCheckpointError, match="'f' holds something other than integers"):
        ChunkTable.from_json({"f": column, "b": [8, 9] * len(column), "o": [], "n": [], "x": ""},
                             np.zeros(len(column), dtype=np.int64), 1, [0])


BAD_NODES = [
    ({"$tuple": 5}, "bad $tuple value 5: payload is not a list"),
    ({"$dict": [[1]]}, "bad $dict value [[1]]: entry [1] is not a [key, value] pair"),
    ({"$dict": [[1, "a"], [1, "b"]]}, "bad $dict value [[1, 'a'], [1, 'b']]: duplicate key 1"),
    ({"$dict": [[[1], "a"]]}, "bad $dict value [[[1], 'a']]: dict key [1] is not a str or int"),
]


@pytest.mark.parametrize("node, needle", BAD_NODES)
def test_one_decoder_for_every_reader(node, needle):
    tree = {"cfg": {"x": node}}
    calls = [lambda: decode(tree), lambda: list(walk(tree)), lambda: select(tree, ["cfg.x"]) and decode(
        select(tree, ["cfg.x"])), lambda: children(node, "cfg.x"), lambda: container(node, "cfg.x")]
    if "$dict" in node:
        calls.append(lambda: saved_items(node, "cfg.x"))
    else:
        calls.append(lambda: saved_sequence(node, tuple, "cfg.x"))
    for call in calls:
        with pytest.raises(CorruptCheckpointError) as ei:
            call()
        assert str(ei.value) == f"manifest: value at 'cfg.x': {needle}"


def test_load_full_names_the_key(tmp_path):
    from test_hostile_manifest import edit, make_ckpt

    path = make_ckpt(tmp_path)
    edit(path, '"lr":0.5', '"lr":{"$dict":[[1,"a"],[1,"b"]]}')
    with pytest.raises(CorruptCheckpointError, match=r"value at 'cfg\.lr': bad \$dict value .*duplicate key 1"):
        shardsafe.load_full(path)


def test_writer_int_limit_is_what_weights_only_torch_load_reads(tmp_path):
    for value in (PICKLE_INT_BOUND - 1, -PICKLE_INT_BOUND):
        buf = io.BytesIO()
        torch.save({"v": value}, buf)
        buf.seek(0)
        assert torch.load(buf, weights_only=True)["v"] == value
        assert decode(encode_scalar(value, "v")) == value
    for value in (PICKLE_INT_BOUND, -PICKLE_INT_BOUND - 1):
        buf = io.BytesIO()
        torch.save({"v": value}, buf)
        buf.seek(0)
        with pytest.raises(Exception, match="(?i)unpickl|weights"):
            torch.load(buf, weights_only=True)
        with pytest.raises(UnsupportedValueError, match=r"'train\.step'.*at most 2039 bits"):
            encode_scalar(value, "train.step")
    path = tmp_path / "ck"
    with pytest.raises(UnsupportedValueError, match=r"'step'.*at most 2039 bits"):
        shardsafe.save({"w": torch.ones(2), "step": 10**1000}, path)
    assert not path.exists()
    # readers keep reading what older writers wrote (up to 20,000 digits)
    assert decode({"$int": "9" * 5000}) == 10**5000 - 1
