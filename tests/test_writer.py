"""The data-file writer's single pass: every byte lands at its offset and every block
checksum equals the checksum of those bytes, whatever the view sizes and thread count."""

from __future__ import annotations

import os

import numpy as np
import pytest

from shardsafe.engine import writer
from shardsafe.format.checksum import checksum


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_write_and_hash_matches_bytes_and_block_checksums(tmp_path, threads):
    rng = np.random.default_rng(7)
    block = 4096
    # Empty views, tiny ones (more than IOV_MAX in a row), one just under / over a block,
    # several blocks with a short tail, and a gap in the file between two views.
    sizes = [0, 3, 4096, 4097, 10000, 0] + [1] * (writer.IOV_MAX + 5) + [50000, 4095, 12288]
    views = [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]
    starts, pos = [], 64
    for i, v in enumerate(views):
        if i == 7:
            pos += 100  # a gap: units must not merge across it
        starts.append(pos)
        pos += v.nbytes
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        sums = writer.write_and_hash(fd, views, starts, block, threads)
    finally:
        os.close(fd)
    data = path.read_bytes()
    assert len(data) == pos
    for v, s, got in zip(views, starts, sums):
        assert data[s: s + v.nbytes] == v.tobytes()
        assert got == writer.block_checksums(v, block)
    assert sums[0] == [checksum(b"")]
    assert data[starts[6] + 1: starts[7]] == b"\0" * 100  # the gap stays a hole


def test_short_write_is_finished(tmp_path, monkeypatch):
    """pwritev may write less than asked: the rest is written piece by piece."""
    real = os.pwritev
    monkeypatch.setattr(writer.os, "pwritev", lambda fd, bufs, off: real(fd, [bufs[0][:5]], off))
    views = [np.arange(20, dtype=np.uint8), np.arange(100, 130, dtype=np.uint8)]
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        writer.write_and_hash(fd, views, [0, 20], 1 << 20, 1)
    finally:
        os.close(fd)
    assert path.read_bytes() == views[0].tobytes() + views[1].tobytes()
