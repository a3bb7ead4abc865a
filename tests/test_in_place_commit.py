"""The commit policy of backends without folder renames (object stores), exercised on the
local disk through the fault backend acting like one (``renames=False``): data files go
straight into the checkpoint folder under names unique to the save, the manifest is
published last, the replaced checkpoint's files are deleted after it."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest
import torch

import shardsafe
from bitwise import assert_bitwise
from shardsafe.storage.faults import Fault, FaultyBackend


@pytest.fixture
def cp():
    checkpointer = shardsafe.Checkpointer(storage=FaultyBackend(renames=False))
    yield checkpointer
    checkpointer.close()


def state(v: float) -> dict:
    return {"w": torch.full((1000,), v), "n": {"b": torch.arange(5) + int(v)}, "tag": str(v)}


def test_save_overwrite_load(cp, tmp_path):
    path = tmp_path / "ck"
    cp.save(state(1.0), path)
    first = sorted(os.listdir(path))
    assert first[-1] == "manifest.json" and first[0].startswith("data-r00000-00.") and len(first) == 3
    assert first[0].endswith(".index.json") and first[1] == first[0].replace(".index.json", ".safetensors")
    with pytest.raises(shardsafe.CheckpointExistsError):
        cp.save(state(2.0), path)
    cp.save(state(2.0), path, overwrite=True)
    second = sorted(os.listdir(path))
    assert len(second) == 3 and second[0] != first[0], "the replaced checkpoint's files are deleted"
    assert_bitwise(state(2.0), cp.load_full(path))
    dest = state(0.0)
    cp.load(dest, path)
    assert_bitwise(state(2.0), dest)
    assert not [p for p in tmp_path.iterdir() if p.name != "ck"]


def test_failed_save_leaves_the_previous_checkpoint(cp, tmp_path):
    path = tmp_path / "ck"
    cp.save(state(1.0), path)
    before = sorted(os.listdir(path))
    bad = shardsafe.Checkpointer(storage=FaultyBackend(renames=False, faults=[Fault("write", errno.ENOSPC, skip=1)]))
    with pytest.raises(shardsafe.StorageError):
        bad.save(state(2.0), path, overwrite=True)
    bad.close()
    assert sorted(os.listdir(path)) == before, "the failed save's own files are removed, nothing else"
    assert_bitwise(state(1.0), cp.load_full(path))


def test_killed_save_leftovers_are_cleaned_when_stale(cp, tmp_path):
    path = tmp_path / "ck"
    cp.save(state(1.0), path)
    orphan = path / "data-r00000-00.deadbeef0000.safetensors"  # a killed save's file
    orphan.write_bytes(b"x" * 10)
    cp.save(state(2.0), path, overwrite=True)
    assert orphan.exists(), "a fresh one may belong to a live save"
    old = time.time() - 7 * 3600
    os.utime(orphan, (old, old))
    cp.save(state(3.0), path, overwrite=True)
    assert not orphan.exists()
    assert_bitwise(state(3.0), cp.load_full(path))


def test_loads_racing_overwrites_see_one_whole_checkpoint(cp, tmp_path):
    path = tmp_path / "ck"
    cp.save(state(1.0), path)
    stop = threading.Event()
    errors: list[BaseException] = []
    count = [0]

    def writer() -> None:
        i = 0
        while not stop.is_set():
            cp.save(state(float(i % 2 + 1)), path, overwrite=True)
            i += 1

    def reader() -> None:
        other = shardsafe.Checkpointer(storage=FaultyBackend(renames=False))
        try:
            while not stop.is_set():
                got = other.load_full(path)
                assert_bitwise(state(float(got["tag"])), got)
                count[0] += 1
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            other.close()

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    threading.Event().wait(2.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:1]
    assert count[0] > 5


def test_manager_retention_in_place(tmp_path):
    cp = shardsafe.Checkpointer(storage=FaultyBackend(renames=False))
    with shardsafe.CheckpointManager(tmp_path, interval=1, keep_last=2, checkpointer=cp) as mgr:
        for step in range(1, 5):
            mgr.save(step, state(float(step)))
        assert mgr.steps() == [3, 4]
        dest = state(0.0)
        assert mgr.load(dest) == 4
    assert_bitwise(state(4.0), dest)
    assert sorted(os.listdir(tmp_path)) == ["step-00000003", "step-00000004"]
    cp.close()


def test_manager_cleans_stale_in_place_leftovers(tmp_path):
    """A killed first save of a step leaves a folder of unlisted data files and no manifest;
    a killed overwrite leaves unlisted files next to a manifest. The manager's first save
    deletes both once stale, and nothing fresh (it may belong to a live save)."""
    (tmp_path / "step-00000007").mkdir()
    first = tmp_path / "step-00000007" / "data-r00000-00.0123456789ab.safetensors"
    first.write_bytes(b"x" * 10)
    cp = shardsafe.Checkpointer(storage=FaultyBackend(renames=False))
    cp.save(state(1.0), tmp_path / "step-00000001")
    second = tmp_path / "step-00000001" / "data-r00001-00.0123456789ab.safetensors"
    second.write_bytes(b"y" * 10)
    fresh = tmp_path / "step-00000001" / "data-r00002-00.ba9876543210.safetensors"
    fresh.write_bytes(b"z" * 10)
    old = time.time() - 7 * 3600
    for f in (first, second):
        os.utime(f, (old, old))
    with shardsafe.CheckpointManager(tmp_path, interval=1, keep_last=5, checkpointer=cp) as mgr:
        mgr.save(2, state(2.0))
        mgr.wait()
        assert mgr.steps() == [1, 2]
    assert not first.exists() and not (tmp_path / "step-00000007").exists()
    assert not second.exists() and fresh.exists()
    assert_bitwise(state(1.0), cp.load_full(tmp_path / "step-00000001"))
    cp.close()


def test_copy_between_backends_verifies_and_commits_last(tmp_path):
    """shardsafe copy: local -> in-place store -> local, bitwise; a corrupt block stops the
    copy before anything is committed at the destination."""
    from shardsafe.tools import copy_checkpoint
    from shardsafe.tools.cli import main

    shardsafe.save(state(1.0), tmp_path / "a")
    store = shardsafe.Checkpointer(storage={"file": FaultyBackend(renames=False)})
    report = copy_checkpoint(tmp_path / "a", tmp_path / "b", checkpointer=store)
    assert report.files == 1 and report.bytes > 4000
    assert any(n.startswith("data-r00000-00.") and n != "data-r00000-00.safetensors"
               for n in os.listdir(tmp_path / "b")), "in place: per-copy file names"
    store.close()
    assert main(["copy", str(tmp_path / "b"), str(tmp_path / "c")]) == 0
    assert_bitwise(state(1.0), shardsafe.load_full(tmp_path / "c"))
    data = next((tmp_path / "a").glob("data-*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-10] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(shardsafe.CorruptCheckpointError, match="checksum mismatch"):
        copy_checkpoint(tmp_path / "a", tmp_path / "d")
    assert not (tmp_path / "d").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.mark.parametrize("to", ["safetensors", "hf", "torch"])
def test_export_to_an_object_store_location(tmp_path, to):
    from shardsafe.tools import export_checkpoint

    shardsafe.save(state(1.0), tmp_path / "a")
    store = shardsafe.Checkpointer(storage={"file": FaultyBackend(renames=False)})
    for _ in range(2):  # the second replaces the first
        export_checkpoint(tmp_path / "a", tmp_path / f"out-{to}", to, keys=["w", "n"], checkpointer=store,
                          overwrite=True)
    store.close()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    if to == "safetensors":
        from safetensors.torch import load_file

        assert torch.equal(load_file(str(tmp_path / "out-safetensors"))["w"], state(1.0)["w"])
