"""Remote loads keep the byte ranges they fetch in memory leased from the budget when it
has room, else in a local spill file (storage/spill.py, engine/fetch.py), on a real S3
server (moto): round trips through each path and through both at once, a corrupt block
failing the load before any destination byte changes, and every lease given back."""

from __future__ import annotations

import pytest
import torch

import shardsafe
from shardsafe import CheckpointError
from shardsafe.storage import spill
from test_roundtrip import assert_same, make

pytest.importorskip("obstore")

MiB = 1 << 20


def url(bucket: str, *parts: str) -> str:
    return "s3://" + "/".join((bucket, *parts))


def state() -> dict:
    return {"a": make(torch.float32, (3 * MiB,), seed=6), "b": make(torch.bfloat16, (1000, 333), seed=7),
            "c": make(torch.int64, (5, 7), seed=8)}


def dest_like(sd: dict) -> dict:
    """A destination of random values (never the saved ones), to see whether a byte changed."""
    return {k: make(v.dtype, tuple(v.shape), seed=100 + i) for i, (k, v) in enumerate(sd.items())}


def data_bytes(server, bucket: str, prefix: str) -> int:
    return sum(server.client.head_object(Bucket=bucket, Key=k)["ContentLength"]
               for k in server.keys(bucket) if k.startswith(prefix) and k.endswith(".safetensors"))


@pytest.fixture
def small_requests(monkeypatch):
    """Requests of an odd size: checksum blocks straddle two requests, reads span pieces."""
    monkeypatch.setattr(spill.merge_ranges, "__defaults__", (spill.MERGE_GAP, 3 * MiB + 4099))


@pytest.mark.parametrize("requests", ["default", "small"])
def test_a_load_within_the_budget_fetches_into_memory(s3, request, requests):
    if requests == "small":
        request.getfixturevalue("small_requests")
    server, bucket, opts = s3
    sd = state()
    shardsafe.save(sd, url(bucket, "ck"), storage_options=opts)
    data = data_bytes(server, bucket, "ck/")
    cp = shardsafe.Checkpointer(storage_options=opts, memory_budget=64 * MiB)
    try:
        dest = dest_like(sd)
        info = cp.load(dest, url(bucket, "ck"))
        for k in sd:
            assert_same(dest[k], sd[k])
        assert info.bytes_fetched == info.bytes_fetched_to_memory == data  # each byte once, all in memory
        assert cp.memory.in_use == 0 and cp.memory.peak >= data  # leased from the budget, all given back
        full = cp.load_full(url(bucket, "ck"))
        for k in sd:
            assert_same(full[k], sd[k])
        assert cp.memory.in_use == 0
    finally:
        cp.close()


@pytest.mark.parametrize("budget_mib, path", [(2, "disk"), (20, "both")])
def test_a_budget_too_small_spills_to_disk(s3, small_requests, budget_mib, path):
    """2 MiB: no request fits the room, every byte goes to the spill file; 20 MiB: the
    requests that fit go to memory, the others to disk, and reads span both."""
    server, bucket, opts = s3
    sd = {**state(), "d": make(torch.float32, (4 * MiB,), seed=9)}  # 28 MiB of data
    shardsafe.save(sd, url(bucket, "ck"), storage_options=opts)
    data = data_bytes(server, bucket, "ck/")
    cp = shardsafe.Checkpointer(storage_options=opts, memory_budget=budget_mib * MiB)
    try:
        dest = dest_like(sd)
        info = cp.load(dest, url(bucket, "ck"))
        for k in sd:
            assert_same(dest[k], sd[k])
        assert info.bytes_fetched == data
        if path == "disk":
            assert info.bytes_fetched_to_memory == 0
        else:
            assert info.bytes_fetched_to_memory == budget_mib * MiB - spill_headroom()  # not all fit: headroom kept
        assert cp.memory.in_use == 0
    finally:
        cp.close()


def spill_headroom() -> int:
    from shardsafe.knobs import SPILL_HEADROOM

    return SPILL_HEADROOM


def test_no_budget_keeps_the_disk_spill_by_default(s3):
    server, bucket, opts = s3
    sd = state()
    shardsafe.save(sd, url(bucket, "ck"), storage_options=opts)
    dest = dest_like(sd)
    info = shardsafe.load(dest, url(bucket, "ck"), storage_options=opts)
    for k in sd:
        assert_same(dest[k], sd[k])
    assert info.bytes_fetched == data_bytes(server, bucket, "ck/") and info.bytes_fetched_to_memory == 0


@pytest.mark.parametrize("where", ["first block", "last block", "straddling"])
def test_a_corrupt_block_fails_the_load_before_any_byte_lands(s3, small_requests, where):
    """A flipped byte in the fetched bytes (in memory) fails the load with a checksum error
    naming the file; the destination is bitwise what it was; every lease is back."""
    server, bucket, opts = s3
    sd = state()
    shardsafe.save(sd, url(bucket, "ck"), storage_options=opts)
    key = next(k for k in server.keys(bucket) if k.endswith(".safetensors"))
    body = bytearray(server.client.get_object(Bucket=bucket, Key=key)["Body"].read())
    at = {"first block": 100_000, "last block": len(body) - 100, "straddling": 3 * MiB + 4099 + 10}[where]
    body[at] ^= 0x01
    server.client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    cp = shardsafe.Checkpointer(storage_options=opts, memory_budget=64 * MiB)
    try:
        dest = dest_like(sd)
        before = {k: v.clone() for k, v in dest.items()}
        with pytest.raises(CheckpointError, match="checksum mismatch") as info:
            cp.load(dest, url(bucket, "ck"))
        assert key.rpartition("/")[2] in str(info.value)
        for k in dest:
            assert_same(dest[k], before[k])  # untouched
        assert cp.memory.in_use == 0 and cp.memory.peak >= len(body) - 64 * 1024  # it was the memory path
        with pytest.raises(CheckpointError, match="checksum mismatch"):
            cp.load_full(url(bucket, "ck"))
        assert cp.memory.in_use == 0
    finally:
        cp.close()


def test_spilled_handle_reads_across_memory_and_disk(monkeypatch):
    """A SpilledHandle serves a read that spans two ranges held in memory and one in the
    spill file, and gives its leases back when closed."""
    from shardsafe.budget import HostMemory
    from shardsafe.storage.base import ReadHandle

    blob = bytes(range(256)) * 64  # 16 KiB

    class Remote(ReadHandle):
        name, size, reads = "blob", len(blob), 0

        def read_into(self, buffers, offset):
            Remote.reads += 1
            for b in buffers:
                b[:] = blob[offset: offset + len(b)]
                offset += len(b)

        def close(self):
            pass

    monkeypatch.setattr(spill.merge_ranges, "__defaults__", (0, 8192))  # requests [0, 8192) and [8192, 16384)
    memory = HostMemory(1 << 20)
    h = spill.SpilledHandle(Remote())
    try:
        seen = []
        got = spill.prefetch({0: h}, {0: [(0, 4096), (4096, 16384)]}, threads=2, memory=memory,
                             memory_room=9000, on_fetched=lambda f: lambda lo, hi, data: seen.append((lo, hi)))
        # the first request in memory, the second split: its head fills the room, its tail to disk
        assert got == 16384 and h.fetched == 16384 and h.in_memory == 9000 and sorted(seen) == [(0, 8192), (8192, 9000)]
        assert memory.in_use == 9000
        reads = Remote.reads
        out = bytearray(9000)
        h.read_into([memoryview(out)[:1000], memoryview(out)[1000:]], 3000)
        assert bytes(out) == blob[3000:12000] and Remote.reads == reads  # no new remote read
        assert bytes(h.view(10, 20)) == blob[10:20] and h.view(8000, 9000) is None
    finally:
        h.close()
    assert memory.in_use == 0


def test_a_compressed_checkpoint_loads_through_memory(s3):
    """Compressed chunks: their stored blocks are fetched into memory, decompressed and
    verified from there (blocks are checked after decompression, not on the fetch thread)."""
    server, bucket, opts = s3
    sd = {"z": torch.arange(2 * MiB, dtype=torch.float32) % 7, "r": make(torch.float32, (MiB,), seed=3)}
    info = shardsafe.save(sd, url(bucket, "z"), storage_options=opts, compression="zstd")
    assert info.compression == "zstd"
    cp = shardsafe.Checkpointer(storage_options=opts, memory_budget=64 * MiB)
    try:
        dest = dest_like(sd)
        got = cp.load(dest, url(bucket, "z"))
        for k in sd:
            assert_same(dest[k], sd[k])
        assert 0 < got.bytes_fetched == got.bytes_fetched_to_memory <= info.bytes_written
        assert cp.memory.in_use == 0
    finally:
        cp.close()


def test_buffers_kept_from_a_save_count_against_the_room(s3):
    """An async save keeps its part buffers for the next save; a load that needs their room
    frees them first, so kept + leased memory stays within the budget."""
    server, bucket, opts = s3
    sd = state()
    cp = shardsafe.Checkpointer(storage_options={**opts, "part_size": 5 * MiB}, memory_budget=40 * MiB)
    try:
        cp.async_save(sd, url(bucket, "ck")).result(timeout=300)
        kept = cp.memory.kept_bytes
        assert kept > 0 and kept + 14 * MiB > 40 * MiB, kept  # the part buffers, kept for reuse
        dest = dest_like(sd)
        info = cp.load(dest, url(bucket, "ck"))
        for k in sd:
            assert_same(dest[k], sd[k])
        assert info.bytes_fetched_to_memory == info.bytes_fetched > 40 * MiB - kept  # did not fit beside them
        assert cp.memory.kept_bytes == 0 and cp.memory.in_use == 0
    finally:
        cp.close()


def test_a_huge_page_lease_is_counted_writable_and_given_back():
    from shardsafe.budget import HostMemory
    from shardsafe.storage.hugepages import HUGE_MIN, huge_buffer

    memory = HostMemory(64 * MiB)
    lease = memory.lease(HUGE_MIN + 123, wait=False, alloc=huge_buffer)
    assert memory.in_use == HUGE_MIN + 123 and lease.tensor.numel() == HUGE_MIN + 123
    lease.tensor.fill_(7)
    view = memoryview(lease.tensor.numpy())
    view[-1] = 9
    assert int(lease.tensor[0]) == 7 and int(lease.tensor[-1]) == 9
    del view
    lease.release()
    assert memory.in_use == 0 and memory.kept_bytes == 0
