"""Compressed chunks (format 3.2) through the pipelines: a load reads stored blocks ahead
(engine/zread.ReadAhead) while it decompresses, a save compresses ahead of its writes
(engine/zwrite.OrderedWrites). Round trips are bitwise, the files do not depend on how far
ahead the pipelines run, errors surface before any destination byte is written, and every
buffer goes back to the budget."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

import shardsafe
from shardsafe import knobs
from shardsafe.engine import zread
from shardsafe.errors import CheckpointError, CorruptCheckpointError
from shardsafe.storage.faults import Fault, FaultyBackend

MiB = 1 << 20
DATA = "data-r00000-00.safetensors"


def _state() -> dict:
    g = torch.Generator().manual_seed(1)
    return {
        "a": torch.randn(3 * MiB // 4, generator=g) * 0.02,  # 3 MiB: several verify windows
        "b": (torch.randn(5 * MiB // 2, generator=g) * 0.02).bfloat16(),  # 5 MiB
        "c": torch.randn(100, generator=g),  # small chunks between the large ones
        "d": torch.randn(2 * MiB // 4 + 77, generator=g) * 0.02,  # a block with a tail
        "e": torch.arange(3000),
    }


def _zeros_like(state: dict) -> dict:
    return {k: torch.zeros_like(v) for k, v in state.items()}


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _count_fetches(monkeypatch) -> list[int]:
    calls: list[int] = []
    fetch = zread.ZHandle.fetch

    def counted(self, ranges):
        calls.append(sum(hi - lo for lo, hi in ranges))
        return fetch(self, ranges)

    monkeypatch.setattr(zread.ZHandle, "fetch", counted)
    return calls


@pytest.mark.parametrize("ahead", [0, MiB, 8 * MiB])
@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_pipelines_round_trip_and_files_do_not_depend_on_ahead(tmp_path, monkeypatch, codec, ahead):
    state = _state()
    shardsafe.save(state, tmp_path / "ref", compression=codec)  # the default ZIP_AHEAD
    monkeypatch.setattr(knobs, "ZIP_AHEAD", ahead)
    fetched = _count_fetches(monkeypatch)
    cp = shardsafe.Checkpointer(memory_budget=32 * MiB)
    try:
        cp.save(state, tmp_path / "ck", compression=codec)
        assert (tmp_path / "ck" / DATA).read_bytes() == (tmp_path / "ref" / DATA).read_bytes()
        dest = _zeros_like(state)
        cp.load(dest, tmp_path / "ck")
        for k in state:
            assert _bitwise(dest[k], state[k]), k
        assert cp.memory.in_use == 0
    finally:
        cp.close()
    assert (len(fetched) > 0) == (ahead > 0)  # the verify pass read windows ahead (with room for them)
    assert not [t for t in threading.enumerate() if "read-ahead" in t.name or "zip-write" in t.name]


def test_corrupt_block_read_ahead_is_refused_before_landing(tmp_path, monkeypatch):
    """A corrupt block in a window fetched ahead: CorruptCheckpointError naming the tensor,
    no destination byte written, every buffer returned."""
    state = _state()
    shardsafe.save(state, tmp_path / "ck", compression="zstd")
    fetched = _count_fetches(monkeypatch)
    path = tmp_path / "ck" / DATA
    data = bytearray(path.read_bytes())
    data[-200] ^= 0xFF  # in the last chunk's stored bytes
    data[len(data) // 2] ^= 0xFF  # and one in the middle
    path.write_bytes(bytes(data))
    cp = shardsafe.Checkpointer()
    try:
        dest = _zeros_like(state)
        with pytest.raises(CorruptCheckpointError, match=DATA):
            cp.load(dest, tmp_path / "ck")
        assert not any(t.any() for t in dest.values())
        assert cp.memory.in_use == 0
    finally:
        cp.close()
    assert fetched


@pytest.mark.parametrize("skip", [3, 6])
def test_read_failure_during_read_ahead(tmp_path, skip):
    state = _state()
    shardsafe.save(state, tmp_path / "ck", compression="zstd")
    backend = FaultyBackend(faults=[Fault("read", errno.EIO, name="data-r", skip=skip)])
    cp = shardsafe.Checkpointer(storage=backend)
    try:
        dest = _zeros_like(state)
        with pytest.raises(CheckpointError):
            cp.load(dest, tmp_path / "ck")
        assert not any(t.any() for t in dest.values())
        assert cp.memory.in_use == 0
    finally:
        cp.close()


@pytest.mark.parametrize("skip", [0, 2, 5])
def test_write_failure_in_the_write_thread(tmp_path, monkeypatch, skip):
    """A write of the compressed file fails: the save raises it, publishes nothing, and
    every packet buffer goes back to the budget (also with a small ZIP_AHEAD, packers waiting)."""
    monkeypatch.setattr(knobs, "ZIP_AHEAD", MiB)
    backend = FaultyBackend(faults=[Fault("write", errno.ENOSPC, name="data-r", skip=skip)])
    cp = shardsafe.Checkpointer(storage=backend)
    try:
        with pytest.raises(CheckpointError):
            cp.save(_state(), tmp_path / "ck", compression="zstd")
        assert not (tmp_path / "ck" / "manifest.json").exists()
        assert cp.memory.in_use == 0
    finally:
        cp.close()
    assert not [t for t in threading.enumerate() if "zip-write" in t.name]


def test_throttled_round_trip(tmp_path):
    """Through a throttled backend (the benchmark's slow disk): bitwise, same file bytes."""
    state = _state()
    shardsafe.save(state, tmp_path / "ref", compression="zstd")
    backend = FaultyBackend(throttle_write_bps=400e6, throttle_read_bps=400e6, throttle_cache=True)
    cp = shardsafe.Checkpointer(storage=backend)
    try:
        cp.save(state, tmp_path / "ck", compression="zstd")
        assert (tmp_path / "ck" / DATA).read_bytes() == (tmp_path / "ref" / DATA).read_bytes()
        dest = _zeros_like(state)
        cp.load(dest, tmp_path / "ck")
        for k in state:
            assert _bitwise(dest[k], state[k]), k
    finally:
        cp.close()
