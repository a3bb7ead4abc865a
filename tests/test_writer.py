"""The one write-and-hash routine (FileWriter): every byte lands at its offset and every
block checksum equals the checksum of those bytes, whatever the chunk sizes, thread
count, staging slot size and source (borrowed memory, staged copies, non-dense views)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from shardsafe.engine import writer
from shardsafe.engine.memory import HostMemory
from shardsafe.format.checksum import checksum
from shardsafe.format.dtypes import safetensors_code
from shardsafe.layout import Box
from shardsafe.plan.save_plan import Assignment, plan_file
from shardsafe.storage.local import LocalBackend, LocalFolder


def _sources(seed: int = 7) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 3, 4096, 4097, 10000, 0] + [1] * (writer.IOV_MAX + 5) + [50000, 4095, 12288]
    out = {f"t{i:04d}": torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for i, n in enumerate(sizes)}
    out["transposed"] = torch.randn(300, 70, generator=g).t()  # not dense: always staged
    out["odd_stride"] = torch.arange(8.0)[::8]  # one element, stride 8: torch calls it contiguous
    return out


def _write(tmp_path, sources, *, borrow, threads, staging, memory=None):
    keys = sorted(sources)
    assignments = [Assignment(k, Box.whole(sources[k].shape), True) for k in keys]
    codes = {k: safetensors_code(sources[k].dtype) for k in keys}
    sizes = {k: sources[k].element_size() for k in keys}
    plan = plan_file("f.safetensors", 0, assignments, codes, sizes)
    block = 4096
    with LocalBackend().open(str(tmp_path)) as folder:
        w = writer.FileWriter(folder, plan, lambda c: sources[c.key], memory or HostMemory(), block=block,
                              borrow=borrow, threads=threads, staging_bytes=staging)
        w.start()
        w.stage()
        written = w.finish(help_write=True)
    return plan, written, block


@pytest.mark.parametrize("threads", [0, 1, 2])
@pytest.mark.parametrize("borrow", [True, False])
@pytest.mark.parametrize("staging", [None, 8192, 20000])
def test_file_writer_bytes_and_block_checksums(tmp_path, threads, borrow, staging):
    sources = _sources()
    plan, written, block = _write(tmp_path, sources, borrow=borrow, threads=threads, staging=staging)
    data = (tmp_path / "f.safetensors").read_bytes()
    assert len(data) == plan.size == written.entry.nbytes
    assert data[: len(plan.header)] == plan.header and written.entry.header_checksum == checksum(plan.header)
    for chunk, sums in zip(plan.chunks, written.checksums):
        expected = sources[chunk.key].clone().numpy().tobytes()
        got = data[chunk.start: chunk.end]
        assert got == expected, chunk.key
        blocks = [expected[i: i + block] for i in range(0, len(expected), block)] or [b""]
        assert sums == [checksum(b) for b in blocks], chunk.key


def test_staging_stays_within_the_budget(tmp_path):
    """Staged bytes stream through a budget smaller than the file."""
    g = torch.Generator().manual_seed(1)
    sources = {f"t{i}": torch.randn(64, 512, generator=g).t() for i in range(8)}  # 8 x 128 KiB, not dense
    memory = HostMemory(64 << 10)
    plan, written, _ = _write(tmp_path, sources, borrow=True, threads=1, staging=None, memory=memory)
    assert memory.peak <= 64 << 10 and memory.in_use == 0
    data = (tmp_path / "f.safetensors").read_bytes()
    for chunk in plan.chunks:
        assert data[chunk.start: chunk.end] == sources[chunk.key].clone().numpy().tobytes()


def test_short_write_is_finished(tmp_path, monkeypatch):
    """The local backend's pwritev may write less than asked: the rest is written."""
    import shardsafe.storage.local as local

    real = os.pwritev
    monkeypatch.setattr(local.os, "pwritev", lambda fd, bufs, off: real(fd, [bufs[0][:5]], off))
    views = [np.arange(20, dtype=np.uint8), np.arange(100, 130, dtype=np.uint8)]
    with LocalBackend().open(str(tmp_path)) as folder:
        assert isinstance(folder, LocalFolder)
        h = folder.create("f")
        h.write([memoryview(v) for v in views], 0)
        h.finish()
    assert (tmp_path / "f").read_bytes() == views[0].tobytes() + views[1].tobytes()


def test_many_buffers_with_short_writes(tmp_path, monkeypatch):
    """More buffers than one pwritev takes (IOV_MAX), some writes short: every byte lands
    in order (the export writes thousands of small tensors in one call)."""
    import random

    import shardsafe.storage.local as local

    real = os.pwritev
    rng = random.Random(0)

    def short(fd, bufs, off):
        assert len(bufs) <= 1024
        if rng.random() < 0.3:
            return real(fd, [bufs[0][: max(1, len(bufs[0]) // 2)]], off)
        return real(fd, bufs, off)

    monkeypatch.setattr(local.os, "pwritev", short)
    views = [np.full(rng.randrange(1, 9), i % 251, dtype=np.uint8) for i in range(3000)]
    with LocalBackend().open(str(tmp_path)) as folder:
        h = folder.create("f")
        h.write([memoryview(v) for v in views], 7)
        h.finish()
    assert (tmp_path / "f").read_bytes() == bytes(7) + b"".join(v.tobytes() for v in views)
