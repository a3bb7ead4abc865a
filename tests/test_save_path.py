"""A sync save is the async save awaited (issue 23): one run (ops.save.start, then
ops.save.complete), one place that decides how bytes are staged, the same files."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import shardsafe
from shardsafe.ops.save import SYNC_STAGING, stage_policy

SRC = Path(__file__).resolve().parent.parent / "src" / "shardsafe"


def test_one_place_builds_the_save_writer():
    """Only ops/save.py builds a FileWriter, and the Checkpointer wires no writer itself."""
    builders = [p.relative_to(SRC).as_posix() for p in SRC.rglob("*.py")
                if re.search(r"\bFileWriter\(", p.read_text())]
    assert builders == ["ops/save.py"]
    assert "FileWriter" not in (SRC / "checkpointer.py").read_text()


def test_stage_policy_differs_only_in_what_waiting_permits():
    awaited, background = stage_policy(True, 3), stage_policy(False, 3, 1 << 20)
    assert (awaited.borrow, awaited.threads, awaited.staging_bytes, awaited.help_write) == (True, 2, SYNC_STAGING, True)
    assert (background.borrow, background.threads, background.staging_bytes, background.help_write) == \
        (False, 1, 1 << 20, False)
    assert stage_policy(False, 3).staging_bytes is None  # the whole share: the caller never waits for the disk


def test_sync_and_async_saves_write_the_same_files(tmp_path):
    state = {"w": torch.arange(1 << 18, dtype=torch.float32).view(512, 512), "b": torch.ones(7),
             "step": 3, "nested": {"t": torch.zeros(2, 3, dtype=torch.bfloat16)}}
    with shardsafe.Checkpointer() as cp:
        info = cp.save(state, tmp_path / "sync")
        done = cp.async_save(state, tmp_path / "async").result()
    assert (info.bytes_written, info.files, info.tensors) == (done.bytes_written, done.files, done.tensors)
    sync_files = sorted(p.name for p in (tmp_path / "sync").iterdir())
    assert sync_files == sorted(p.name for p in (tmp_path / "async").iterdir())
    for name in sync_files:
        if name.endswith(".safetensors") or name.endswith(".index.json"):
            assert (tmp_path / "sync" / name).read_bytes() == (tmp_path / "async" / name).read_bytes(), name
    loaded = shardsafe.load_full(tmp_path / "async")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
