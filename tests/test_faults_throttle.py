"""The fault-injecting backend's throttle (storage/faults.py): a throttled backend is never
faster than its rate, whatever the number of threads, and what goes through it reads back
bitwise. Only lower bounds on time are checked (a busy machine can only make it slower)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import shardsafe
from shardsafe.storage.faults import FaultyBackend, Throttle

MiB = 1 << 20


def test_throttle_is_never_faster_than_its_rate_across_threads():
    rate = 64 * MiB
    t = Throttle(rate)
    per, threads = 2 * MiB, 4

    def worker() -> None:
        for _ in range(per // (256 << 10)):
            t.pace(256 << 10, lambda: None)

    t0 = time.monotonic()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    elapsed = time.monotonic() - t0
    assert t.bytes == per * threads
    assert elapsed >= per * threads / rate * 0.9


def test_throttle_refuses_a_rate_of_zero():
    with pytest.raises(ValueError):
        Throttle(0)


def test_throttled_save_and_load_round_trip(tmp_path):
    rate = 32 * MiB
    backend = FaultyBackend(throttle_write_bps=rate, throttle_read_bps=rate)
    cp = shardsafe.Checkpointer(storage=backend)
    g = torch.Generator().manual_seed(0)
    state = {"a": torch.randn(1 << 20, generator=g), "b": torch.randn(512, 1024, generator=g).to(torch.bfloat16),
             "step": 7}
    t0 = time.monotonic()
    cp.save(state, tmp_path / "ck")
    save_s = time.monotonic() - t0
    assert backend.written >= 5 * MiB
    assert save_s >= backend.written / rate * 0.9
    dest = {"a": torch.zeros(1 << 20), "b": torch.zeros(512, 1024, dtype=torch.bfloat16), "step": 0}
    t0 = time.monotonic()
    cp.load(dest, tmp_path / "ck")
    load_s = time.monotonic() - t0
    assert backend.bytes_read >= 5 * MiB
    assert load_s >= backend.bytes_read / rate * 0.9
    assert torch.equal(dest["a"].view(torch.int32), state["a"].view(torch.int32))
    assert torch.equal(dest["b"].view(torch.int16), state["b"].view(torch.int16))
    assert dest["step"] == 7


@pytest.mark.parametrize("cache", [False, True])
def test_throttle_cache_charges_a_reread_once(tmp_path, cache):
    backend = FaultyBackend(throttle_write_bps=256 * MiB, throttle_read_bps=256 * MiB, throttle_cache=cache)
    folder = backend.open(str(tmp_path), create=True)
    data = bytes(range(256)) * (4 * MiB // 256)
    folder.write_bytes("f", data)
    assert backend.write_throttle.bytes == len(data)
    got = bytearray(len(data))
    for _ in range(2):
        with folder.open_read("f") as h:
            h.read_into([memoryview(got)[: MiB], memoryview(got)[MiB:]], 0)
    assert got == data
    assert backend.bytes_read == 2 * len(data)
    assert backend.read_throttle.bytes == (1 if cache else 2) * len(data)
    backend.forget()
    with folder.open_read("f") as h:
        h.read_into([memoryview(got)], 0)
    assert backend.read_throttle.bytes == (2 if cache else 3) * len(data)
