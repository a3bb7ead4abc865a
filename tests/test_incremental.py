"""Incremental checkpoints (format 3.1): chunks whose bytes equal the base's are referred to,
not written; loads, resharding, tools and retention go through the references."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import incremental_cases
import shardsafe
from bitwise import assert_bitwise
from shardsafe import CheckpointError, CheckpointManager, CorruptCheckpointError
from shardsafe.format.manifest import MANIFEST_NAME
from shardsafe.tools.copy import copy_checkpoint
from shardsafe.tools.inspect import inspect_checkpoint
from shardsafe.tools.listing import list_checkpoints
from shardsafe.tools.verify import verify_checkpoint


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {f"layer{i}.weight": torch.randn(64, 300 + i, generator=g) for i in range(6)}
        | {"layer0.bias": torch.randn(16, generator=g), "emb": torch.randint(0, 100, (500, 40), generator=g)},
        "optim": {"step": torch.tensor(3.0), "lr": 0.1, "betas": (0.9, 0.99)},
        "counter": 0,
    }


def clone(state):
    if isinstance(state, torch.Tensor):
        return state.clone()
    if isinstance(state, dict):
        return {k: clone(v) for k, v in state.items()}
    return state


def tensors_of(state, prefix=""):
    out = {}
    for k, v in state.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = v
        elif isinstance(v, dict):
            out.update(tensors_of(v, key + "."))
    return out


def a_then_b(tmp_path: Path) -> dict:
    """Checkpoint "a" of a state, then "b" on base "a" with one tensor changed; the state."""
    state = make_state()
    shardsafe.save(state, tmp_path / "a")
    state["model"]["layer0.weight"].add_(1)
    shardsafe.save(state, tmp_path / "b", base=tmp_path / "a")
    return state


def save_1_and_2(mgr: CheckpointManager, state: dict) -> None:
    """Steps 1 and 2 with one tensor changed between them (with keep_last=1 and incremental
    saves, step 1 is then retired: step 2 refers to it)."""
    mgr.save(1, state)
    state["model"]["layer0.weight"].add_(1)
    mgr.save(2, state)


def holders(path: Path) -> dict[str, str]:
    """Tensor key -> the checkpoint that holds its bytes ("." = this one)."""
    out = {}
    for row in inspect_checkpoint(path).tensor_rows:
        held = row.held_in or {".": row.nbytes}
        assert len(held) == 1, row
        out[row.key] = next(iter(held))
    return out


def test_chain_of_ten_random_changes_bitwise(tmp_path):
    """Ten saves, each on the previous one, with a random subset of tensors changed:
    every checkpoint loads bitwise; unchanged tensors are referred to, changed ones
    written; a reference names the checkpoint that wrote the bytes (never a chain)."""
    rng = random.Random(1)
    state = make_state()
    snaps = []
    changed_at: dict[str, int] = {k: 0 for k in tensors_of(state)}
    previous = None
    for i in range(10):
        if i:
            keys = rng.sample(sorted(tensors_of(state)), rng.randint(1, 4))
            for k in keys:
                tensors_of(state)[k].add_(1)
                changed_at[k] = i
            state["counter"] = i
        info = shardsafe.save(state, tmp_path / f"c{i}", base=previous)
        snaps.append(clone(state))
        held = holders(tmp_path / f"c{i}")
        for k, at in changed_at.items():
            assert held[k] == ("." if at == i else f"c{at}"), (i, k, held[k], at)
        if i:
            unchanged = sum(t.nbytes for k, t in tensors_of(state).items() if changed_at[k] != i)
            assert info.bytes_referred == unchanged
        previous = tmp_path / f"c{i}"
    for i, snap in enumerate(snaps):
        assert_bitwise(snap, shardsafe.load_full(tmp_path / f"c{i}"))
        m = shardsafe.read_manifest(tmp_path / f"c{i}")
        assert m.version == (3, 1)
        for ref in m.refs:  # the referenced file is one the named checkpoint wrote itself
            other = shardsafe.read_manifest(tmp_path / ref.checkpoint)
            assert ref.name in {f.name for f in other.files}


def test_incremental_bytes_written_and_load_in_place(tmp_path):
    """A save where nothing changed writes only headers, index and manifest; load()
    into live tensors (not only load_full) goes through the references."""
    state = make_state()
    full = shardsafe.save(state, tmp_path / "a")
    again = shardsafe.save(state, tmp_path / "b", base=tmp_path / "a")
    total = sum(t.nbytes for t in tensors_of(state).values())
    assert again.bytes_referred == total and again.bytes_written < 200
    assert full.bytes_written > total
    dest = make_state(seed=5)
    shardsafe.load(dest, tmp_path / "b")
    assert_bitwise(state, dest)


def test_async_save_with_base(tmp_path):
    """async_save decides references while staging: later changes do not leak in."""
    state = make_state()
    shardsafe.save(state, tmp_path / "a")
    state["model"]["layer1.weight"].add_(2)
    snap = clone(state)
    fut = shardsafe.async_save(state, tmp_path / "b", base=tmp_path / "a")
    fut.staged()
    state["model"]["layer2.weight"].add_(5)  # after staging: not in checkpoint b
    info = fut.result()
    assert info.chunks_referred >= 5
    assert_bitwise(snap, shardsafe.load_full(tmp_path / "b"))


def test_dtype_or_shape_change_is_written(tmp_path):
    """A tensor whose dtype or shape changed is written, never referred to."""
    state = make_state()
    shardsafe.save(state, tmp_path / "a")
    state["model"]["layer0.weight"] = state["model"]["layer0.weight"].double()
    state["model"]["layer1.weight"] = state["model"]["layer1.weight"][:10].clone()
    shardsafe.save(state, tmp_path / "b", base=tmp_path / "a")
    held = holders(tmp_path / "b")
    assert held["model.layer0.weight"] == "." and held["model.layer1.weight"] == "."
    assert held["model.layer2.weight"] == "a"
    assert_bitwise(state, shardsafe.load_full(tmp_path / "b"))


def test_version_skip_reuses_digests_and_plain_mode_sees_data_writes(tmp_path, monkeypatch):
    """version_skip: an unchanged tensor is not hashed again; without it, a change made
    through ``.data`` (invisible to the version counter) is still found."""
    import shardsafe.ops.incremental as inc

    calls = []
    real = inc.full_digest
    monkeypatch.setattr(inc, "full_digest", lambda src, block: calls.append(1) or real(src, block))
    cp = shardsafe.Checkpointer()
    try:
        state = make_state()
        cp.save(state, tmp_path / "a", version_skip=True)
        cp.save(state, tmp_path / "b", base=tmp_path / "a", version_skip=True)
        assert calls == []  # every digest came from the memo of the save of "a"
        state["model"]["layer3.weight"].data.add_(1)  # bypasses _version
        cp.save(state, tmp_path / "c", base=tmp_path / "b")
        # every unchanged chunk hashed in full; layer3 already fails the first-block check
        assert len(calls) == len(tensors_of(state)) - 1
        assert holders(tmp_path / "c")["model.layer3.weight"] == "."
        assert_bitwise(state, shardsafe.load_full(tmp_path / "c"))
    finally:
        cp.close()


def test_base_must_be_a_sibling_and_not_itself(tmp_path):
    state = make_state()
    shardsafe.save(state, tmp_path / "a")
    (tmp_path / "sub").mkdir()
    with pytest.raises(CheckpointError, match="same folder"):
        shardsafe.save(state, tmp_path / "sub" / "b", base=tmp_path / "a")
    with pytest.raises(CheckpointError, match="its own base"):
        shardsafe.save(state, tmp_path / "a", base=tmp_path / "a", overwrite=True)
    with pytest.raises(shardsafe.BaseCheckpointError, match="nothing"):
        shardsafe.save(state, tmp_path / "b", base=tmp_path / "nothing")
    assert not (tmp_path / "b").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "sub"]


def test_corrupted_referenced_block_fails_load_and_leaves_model_untouched(tmp_path):
    a_then_b(tmp_path)
    data = next((tmp_path / "a").glob("data-*.safetensors"))
    m = shardsafe.read_manifest(tmp_path / "a")
    chunk = m.tensors["model.layer4.weight"].chunks[0]
    with open(data, "r+b") as f:
        f.seek(chunk.start + 100)
        byte = f.read(1)
        f.seek(chunk.start + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    dest = make_state(seed=9)
    before = clone(dest)
    with pytest.raises(CorruptCheckpointError, match=r"a/data-r00000-00\.safetensors.*model\.layer4\.weight"):
        shardsafe.load(dest, tmp_path / "b")
    assert_bitwise(before, dest)
    report = verify_checkpoint(tmp_path / "b")
    assert not report.ok and any("model.layer4.weight" == p.key and "a/data-" in (p.file or "")
                                 for p in report.problems)


def test_deleted_base_is_reported_by_name(tmp_path):
    a_then_b(tmp_path)
    shutil.rmtree(tmp_path / "a")
    with pytest.raises(CheckpointError, match="checkpoint 'a'.*missing"):
        shardsafe.load_full(tmp_path / "b")
    entries = list_checkpoints(tmp_path / "b")
    assert entries[0].status == "invalid" and "'a'" in entries[0].problem


def test_tools_ls_verify_inspect_copy(tmp_path):
    state = a_then_b(tmp_path)
    total = sum(t.nbytes for t in tensors_of(state).values())
    changed = state["model"]["layer0.weight"].nbytes
    (entry,) = list_checkpoints(tmp_path / "b")
    assert entry.referred == total - changed and entry.refers_to == ["a"]
    report = verify_checkpoint(tmp_path / "b")
    assert report.ok and report.referred_bytes == total - changed
    rows = {r.key: r for r in inspect_checkpoint(tmp_path / "b").tensor_rows}
    assert rows["model.layer0.weight"].held_in == {".": changed}
    assert rows["model.layer1.weight"].held_in == {"a": state["model"]["layer1.weight"].nbytes}
    from safetensors.torch import load_file

    from shardsafe.tools.export import export_checkpoint

    out = tmp_path / "model.safetensors"
    export_checkpoint(tmp_path / "b", out, "safetensors")  # self-contained by nature
    exported = load_file(out)
    for k, t in tensors_of(state).items():
        assert torch.equal(exported[k], t), k
    copy_checkpoint(tmp_path / "b", tmp_path / "elsewhere" / "b2")
    shutil.rmtree(tmp_path / "a")  # the copy needs nothing outside its folder
    assert_bitwise(state, shardsafe.load_full(tmp_path / "elsewhere" / "b2"))
    assert verify_checkpoint(tmp_path / "elsewhere" / "b2").ok
    m = shardsafe.read_manifest(tmp_path / "elsewhere" / "b2")
    assert m.refs and all(r.checkpoint == "" for r in m.refs)


def test_format_3_1_refs_refused_when_hostile(tmp_path):
    """A manifest whose refs name a path (not a sibling name) or whose own-folder ref
    shadows the manifest is refused before anything is opened."""
    from shardsafe.format.manifest import Manifest

    a_then_b(tmp_path)
    m = shardsafe.read_manifest(tmp_path / "b", indexes=False)
    for bad_ckpt, bad_name, what in (("../x", "data-r00000-00.safetensors", "plain folder names"),
                                     ("", MANIFEST_NAME, "name of its manifest"),
                                     ("a", "sub/file", "plain file names")):
        m.refs = [type(m.refs[0])(bad_ckpt, bad_name, 100)]
        with pytest.raises(CorruptCheckpointError, match=what):
            Manifest.from_bytes(m.to_bytes())


def test_manager_incremental_keep_last_two(tmp_path):
    """keep_last=2 over chains (full_every=3): kept checkpoints always load; a dropped
    checkpoint that kept ones refer to is retired (manifest gone, only the referenced data
    files left); once nothing refers to it, it is gone."""
    rng = random.Random(4)
    state = make_state()
    snaps = {}
    with CheckpointManager(tmp_path, interval=1, keep_last=2, incremental=True, full_every=3) as mgr:
        for step in range(1, 10):
            for k in rng.sample(sorted(tensors_of(state)), 2):
                tensors_of(state)[k].add_(1)
            mgr.save(step, state)
            snaps[step] = clone(state)
            kept = mgr.steps()
            assert kept == [s for s in (step - 1, step) if s >= 1]
            for s in kept:
                assert_bitwise(snaps[s], shardsafe.load_full(mgr.path(s)))
            refs = set()
            for s in kept:
                refs |= {(r.checkpoint, r.name) for r in shardsafe.read_manifest(mgr.path(s), indexes=False).refs}
            for folder in tmp_path.iterdir():
                if (folder / MANIFEST_NAME).exists():
                    continue
                kept_files = {n for n in os.listdir(folder) if n != "retired.json"}
                assert kept_files and kept_files == {n for c, n in refs if c == folder.name}, (step, folder.name)
            depth = [shardsafe.read_manifest(mgr.path(s), indexes=False).extra.get("incremental") for s in kept]
            assert (step - 1) % 3 != 0 or depth[-1] is None  # steps 1, 4, 7: full saves
    listing = {e.name: e.status for e in list_checkpoints(tmp_path)}
    assert listing["step-00000009"] == "valid" and "retired" in listing.values()


def test_manager_async_incremental(tmp_path):
    state = make_state()
    with CheckpointManager(tmp_path, interval=1, async_mode="async", incremental=True) as mgr:
        mgr.save(1, state)
        state["model"]["layer5.weight"].add_(1)
        mgr.save(2, state)
        mgr.wait()
        m = shardsafe.read_manifest(mgr.path(2), indexes=False)
        assert [r.checkpoint for r in m.refs] == ["step-00000001"]
        assert_bitwise(state, shardsafe.load_full(mgr.path(2)))


# --------------------------------------------------------------------------- distributed


def test_fsdp2_chain_of_ten_and_reshard_4_to_2(pg_pool, tmp_path):
    refs = tmp_path / "refs.pt"
    out = pg_pool(4).run(incremental_cases.chain_of_saves, str(tmp_path), 10, str(refs), timeout=300)
    referred = [sum(o["referred"][i] for o in out) for i in range(10)]
    assert referred[0] == 0 and all(r > 0 for r in referred[1:])
    assert pg_pool(2).run(incremental_cases.load_chain_resharded, str(tmp_path), 10, str(refs),
                          timeout=300) == [10, 10]
    for i in range(10):
        assert verify_checkpoint(tmp_path / f"step-{i:08d}").ok


def test_fsdp2_async_saves_with_base(pg_pool, tmp_path):
    referred = pg_pool(4).run(incremental_cases.async_chain, str(tmp_path), timeout=300)
    assert all(r[0] == 0 and r[1] > 0 and r[2] > 0 for r in referred)


def test_fsdp2_manager_keep_last_two(pg_pool, tmp_path):
    kept = pg_pool(4).run(incremental_cases.manager_chain, str(tmp_path), 7, timeout=300)
    assert kept == [[6, 7]] * 4


# --------------------------------------------------------------------------- crashes

CHILD = textwrap.dedent(
    r"""
    import os, signal, sys
    import torch
    torch.set_num_threads(1)
    import shardsafe
    import shardsafe.checkpoint_folder as cf

    folder, first, last, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

    def state(step):
        g = torch.Generator().manual_seed(0)
        base = {f"t{i}": torch.randn(128, 512, generator=g) for i in range(6)}
        for i in range(6):
            base[f"t{i}"] += sum(1 for s in range(1, step + 1) if (s * 7 + i) % 3 == 0)
        return {"tensors": base, "step": step}

    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)

    if kill_at == "commit":   # data and indexes written, manifest not yet
        cf.SaveTarget.commit = die
    elif kill_at == "retire":  # retired.json written, manifest removed, nothing pruned
        cf.prune_retired = die
    elif kill_at == "delete":  # renamed out of sight, not deleted
        cf.discard = die
    mgr = shardsafe.CheckpointManager(folder, interval=1, keep_last=2, incremental=True, full_every=3)
    for step in range(first, last + 1):
        mgr.save(step, state(step))
        print(step, flush=True)
    """
)


def _expected(step: int) -> dict:
    g = torch.Generator().manual_seed(0)
    base = {f"t{i}": torch.randn(128, 512, generator=g) for i in range(6)}
    for i in range(6):
        base[f"t{i}"] += sum(1 for s in range(1, step + 1) if (s * 7 + i) % 3 == 0)
    return {"tensors": base, "step": step}


def _run_child(script: Path, folder: Path, first: int, last: int, kill_at: str, delay: float | None) -> int:
    """Run the child; with ``delay``, SIGKILL it after that many seconds. Returns the last
    step it reported as saved (first - 1 if none)."""
    proc = subprocess.Popen([sys.executable, str(script), str(folder), str(first), str(last), kill_at],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if delay is not None:
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    done = [int(x) for x in out.split()]
    if kill_at != "none" or delay is not None:
        assert proc.returncode == -signal.SIGKILL or (delay is not None and proc.returncode == 0), err
    else:
        assert proc.returncode == 0, err
    return done[-1] if done else first - 1


def test_sigkill_during_saves_and_retention(tmp_path):
    """A manager process with incremental saves and keep_last=2 is killed (SIGKILL) while
    committing, while retiring a referenced checkpoint, while deleting one, and at random
    moments; after each kill every committed checkpoint loads bitwise and verifies, and the
    next run cleans up and goes on."""
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    folder = tmp_path / "ckpts"
    rng = random.Random(5)
    step = 0
    plan = [("none", None), ("commit", None), ("none", None), ("retire", None), ("delete", None),
            ("none", rng.uniform(2.0, 4.0)), ("none", rng.uniform(2.0, 4.0)), ("retire", None), ("none", None)]
    for kill_at, delay in plan:
        step = _run_child(script, folder, step + 1, step + 4, kill_at, delay)
        mgr = CheckpointManager(folder, interval=1, load_only=True)
        steps = mgr.steps()
        assert steps, (kill_at, delay)
        for s in steps:
            assert_bitwise(_expected(s), shardsafe.load_full(mgr.path(s)))
            assert verify_checkpoint(mgr.path(s)).ok
        mgr.close()
        step = max(steps[-1], step)
    names = sorted(os.listdir(folder))
    assert [n for n in names if n.startswith(".")] == []  # every leftover cleaned by the later runs
    committed = [n for n in names if (folder / n / MANIFEST_NAME).exists()]
    assert len(committed) == 2
    for n in names:
        if n not in committed:
            listed = json.loads((folder / n / "retired.json").read_text())["keep"]
            assert sorted(os.listdir(folder / n)) == sorted([*listed, "retired.json"])


def test_delete_refuses_a_referenced_checkpoint(tmp_path):
    state = a_then_b(tmp_path)
    with pytest.raises(CheckpointError, match=r"refer to its data \(b\)"):
        shardsafe.delete(tmp_path / "a")
    assert_bitwise(state, shardsafe.load_full(tmp_path / "b"))
    assert shardsafe.delete(tmp_path / "b") and shardsafe.delete(tmp_path / "a")
    assert list(tmp_path.iterdir()) == []


def test_referred_bytes_recorded_in_the_manifest(tmp_path):
    """The commit records the bytes referred to (every rank's, gathered with the file sizes),
    so ``ls`` reads no index; a self-contained copy is not part of a chain."""
    state = make_state()
    shardsafe.save(state, tmp_path / "a")
    state["model"]["layer0.weight"].add_(1)
    info = shardsafe.save(state, tmp_path / "b", base=tmp_path / "a")
    inc = shardsafe.read_manifest(tmp_path / "b", indexes=False).extra["incremental"]
    assert inc == {"base": "a", "depth": 1, "referred_bytes": info.bytes_referred}
    copy_checkpoint(tmp_path / "b", tmp_path / "c")
    assert "incremental" not in shardsafe.read_manifest(tmp_path / "c", indexes=False).extra
    (entry,) = list_checkpoints(tmp_path / "c")
    assert entry.referred == 0 and entry.refers_to is None and entry.status == "valid"


# --------------------------------------------------------------------------- review regressions


def test_version_skip_memo_is_emptied_by_a_load(tmp_path):
    """A load writes into tensors without bumping _version: the next version_skip save must
    hash them again, not refer to the bytes they had before the load."""
    cp = shardsafe.Checkpointer()
    try:
        w = torch.ones(300_000)
        cp.save({"w": torch.zeros(300_000)}, tmp_path / "zeros")
        cp.save({"w": w}, tmp_path / "a", version_skip=True)
        version = w._version
        cp.load({"w": w}, tmp_path / "zeros")
        assert w._version == version and w.sum() == 0  # the counter did not move
        cp.save({"w": w}, tmp_path / "b", base=tmp_path / "a", version_skip=True)
        assert torch.equal(shardsafe.load_full(tmp_path / "b")["w"], torch.zeros(300_000))
    finally:
        cp.close()


def test_version_skip_memo_keeps_the_storage_alive(tmp_path):
    """A memo entry holds its source's storage: the memory cannot be reused by a new tensor
    that would then pass for unchanged."""
    cp = shardsafe.Checkpointer()
    try:
        snap = torch.ones(300_000)
        ptr = snap.untyped_storage().data_ptr()
        cp.save({"w": snap}, tmp_path / "a", version_skip=True)
        del snap
        (state, storage, _), = cp.memo.entries.values()
        assert storage.data_ptr() == ptr and storage.nbytes() == 1_200_000
    finally:
        cp.close()


def test_overwriting_or_saving_onto_referenced_data_is_refused(tmp_path):
    state = a_then_b(tmp_path)
    with pytest.raises(CheckpointError, match=r"cannot replace .* refer to its data \(b\)"):
        shardsafe.save(state, tmp_path / "a", overwrite=True)
    assert_bitwise(state, shardsafe.load_full(tmp_path / "b"))


def test_manager_rewind_onto_a_retired_step_names_the_referrers(tmp_path):
    state = make_state()
    with CheckpointManager(tmp_path, interval=1, keep_last=1, incremental=True) as mgr:
        save_1_and_2(mgr, state)
        assert (tmp_path / "step-00000001" / "retired.json").exists()
        with pytest.raises(CheckpointError, match=r"retired checkpoint .*\(step-00000002\)"):
            mgr.save(1, state)
    assert_bitwise(state, shardsafe.load_full(tmp_path / "step-00000002"))


def test_damaged_base_gives_a_full_save_in_the_manager(tmp_path):
    """A base whose data file was truncated, or whose index is corrupt, is refused as a
    base (BaseCheckpointError, nothing written); the manager then saves in full."""
    state = make_state()
    shardsafe.save(state, tmp_path / "a")
    data = next((tmp_path / "a").glob("data-*.safetensors"))
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size - 1)
    with pytest.raises(shardsafe.BaseCheckpointError, match="a/data-r00000-00.safetensors"):
        shardsafe.save(state, tmp_path / "b", base=tmp_path / "a")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
    run = tmp_path / "run"
    with CheckpointManager(run, interval=1, incremental=True) as mgr:
        mgr.save(1, state)
        index = next((run / "step-00000001").glob("*.index.json"))
        index.write_bytes(index.read_bytes().replace(b'"rank":0', b'"rank":7'))  # digest mismatch
        with pytest.warns(UserWarning, match="saved in full"):
            mgr.save(2, state)
        assert not shardsafe.read_manifest(mgr.path(2), indexes=False).refs
    assert_bitwise(state, shardsafe.load_full(run / "step-00000002"))


def test_format_2_base_refers_to_nothing(tmp_path):
    from shardsafe.tools.format2 import write_format2

    state = make_state()
    shardsafe.save(state, tmp_path / "a")
    write_format2(tmp_path / "a")
    info = shardsafe.save(state, tmp_path / "b", base=tmp_path / "a")
    assert info.bytes_referred == 0
    assert_bitwise(state, shardsafe.load_full(tmp_path / "b"))


def test_retention_keeps_what_other_checkpoints_in_the_folder_refer_to(tmp_path):
    state = make_state()
    with CheckpointManager(tmp_path, interval=1, keep_last=1, incremental=True) as mgr:
        mgr.save(1, state)
        state["model"]["layer0.weight"].add_(1)
        shardsafe.save(state, tmp_path / "best", base=mgr.path(1))  # saved by hand beside the steps
        mgr.save(2, state)
        mgr.save(3, state)
    assert_bitwise(state, shardsafe.load_full(tmp_path / "best"))


def test_a_retired_folder_left_without_its_files_is_finished_later(tmp_path):
    """A crash after a retired folder's files were deleted but before its retired.json:
    the next retention deletes the rest."""
    state = make_state()
    with CheckpointManager(tmp_path, interval=1, keep_last=1, incremental=True, full_every=2) as mgr:
        mgr.save(1, state)
        state["model"]["layer0.weight"].add_(1)
        mgr.save(2, state)  # refers to step 1: step 1 retired
        for f in (tmp_path / "step-00000001").iterdir():
            if f.name != "retired.json":
                f.unlink()
        mgr.save(3, state)  # a full save (full_every=2): step 2 deleted, step 1 referred to by nothing
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]
        (tmp_path / "step-00000002").mkdir()  # a user's own empty folder: never shardsafe's to delete
        mgr.save(4, state)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002", "step-00000003", "step-00000004"]
    # A prune cut short leaves its folder out of sight (renamed before deletion): the next
    # manager's first save deletes it.
    (tmp_path / ".step-00000001.shardsafe-del-0123456789ab").mkdir()
    (tmp_path / ".step-00000001.shardsafe-del-0123456789ab" / "retired.json").write_text("{}")
    with CheckpointManager(tmp_path, interval=1, keep_last=1, incremental=True, full_every=2) as mgr:
        mgr.save(5, state)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_hostile_retired_json_and_refs_do_not_crash_tools_or_retention(tmp_path):
    from shardsafe.checkpoint_folder import _manifest_files
    from shardsafe.storage.local import LocalBackend

    state = make_state()
    with CheckpointManager(tmp_path, interval=1, keep_last=1, incremental=True) as mgr:
        save_1_and_2(mgr, state)
        retired = tmp_path / "step-00000001" / "retired.json"
        for junk in (b'{"keep": 5}', b'{"keep": null}', b"[" * 100_000, b"\xff"):
            retired.write_bytes(junk)
            assert {e.status for e in list_checkpoints(tmp_path)} == {"retired", "valid"}
            with LocalBackend().open(str(tmp_path / "step-00000001")) as f:
                assert "data-r00000-00.safetensors" in _manifest_files(f)  # unreadable list: keep everything
        mgr.save(3, state)
        assert_bitwise(state, shardsafe.load_full(mgr.path(3)))


def test_a_base_tensor_named_like_a_rank_local_one(tmp_path):
    shardsafe.save({"rng#rank0.torch": torch.zeros(10, dtype=torch.uint8), "w": torch.ones(3)}, tmp_path / "a")
    state = {"rng": shardsafe.rank_local({"torch": torch.ones(10, dtype=torch.uint8)}), "w": torch.ones(3)}
    shardsafe.save(state, tmp_path / "b", base=tmp_path / "a")
    out = shardsafe.load_full(tmp_path / "b")
    assert torch.equal(out["w"], torch.ones(3))


# --------------------------------------------------------------------------- second review


def test_version_skip_memo_of_an_async_save_overtaken_by_a_load(tmp_path):
    """A load while an async version_skip save is still committing: the save's memo (taken
    before the load) is not recorded, so the next save hashes the loaded-over tensor."""
    cp = shardsafe.Checkpointer()
    try:
        w = torch.ones(2_000_000)
        cp.save({"w": torch.zeros(2_000_000)}, tmp_path / "zeros")
        fut = cp.async_save({"w": w}, tmp_path / "a", version_skip=True)
        fut.staged()
        cp.load({"w": w}, tmp_path / "zeros")  # may overlap the background commit
        fut.result()
        cp.save({"w": w}, tmp_path / "b", base=tmp_path / "a", version_skip=True)
        assert torch.equal(shardsafe.load_full(tmp_path / "b")["w"], torch.zeros(2_000_000))
        # Whichever finished first above, the rule itself: a memo taken before a load is dropped.
        from shardsafe.ops.incremental import VersionMemo

        before = VersionMemo.epoch()
        shardsafe.load({"w": w}, tmp_path / "a")
        cp.memo.replace({("w", None): ((), None, "x")}, before)  # type: ignore[dict-item]
        assert cp.memo.entries == {}
    finally:
        cp.close()


def test_version_skip_with_inference_tensors_and_memo_release(tmp_path):
    cp = shardsafe.Checkpointer()
    try:
        with torch.inference_mode():
            t = torch.ones(100_000)
        cp.save({"t": t}, tmp_path / "a", version_skip=True)  # no version counter: simply not memoized
        cp.save({"t": t}, tmp_path / "b", base=tmp_path / "a", version_skip=True)
        assert torch.equal(shardsafe.load_full(tmp_path / "b")["t"], t)
        cp.save({"u": torch.ones(100_000)}, tmp_path / "c", version_skip=True)
        assert len(cp.memo.entries) == 1
        cp.save({"u": torch.ones(100_000)}, tmp_path / "d")  # a save without version_skip drops the memo
        assert cp.memo.entries == {}
        cp.save({"u": torch.ones(100_000)}, tmp_path / "e", version_skip=True)
    finally:
        cp.close()
    assert cp.memo.entries == {}  # close() releases the storages it held


def test_foreign_manifest_or_user_folder_does_not_stop_retention(tmp_path):
    (tmp_path / "wandb-export").mkdir()
    (tmp_path / "wandb-export" / "manifest.json").write_text("not ours")
    with CheckpointManager(tmp_path, interval=1, keep_last=2) as mgr:
        for step in range(1, 5):
            mgr.save(step, {"w": torch.full((10,), float(step))})
        assert mgr.steps() == [3, 4]
    assert (tmp_path / "wandb-export" / "manifest.json").read_text() == "not ours"


def test_unreferenced_retired_folder_can_be_deleted_or_saved_onto(tmp_path):
    state = make_state()
    with CheckpointManager(tmp_path, interval=1, keep_last=1, incremental=True) as mgr:
        save_1_and_2(mgr, state)
    assert (tmp_path / "step-00000001" / "retired.json").exists()
    with pytest.raises(CheckpointError, match="refer to its data"):
        shardsafe.delete(tmp_path / "step-00000001")
    assert shardsafe.delete(tmp_path / "step-00000002")
    shardsafe.save(state, tmp_path / "step-00000001")  # nothing refers to the retired one any more
    assert_bitwise(state, shardsafe.load_full(tmp_path / "step-00000001"))
    with CheckpointManager(tmp_path / "other", interval=1, keep_last=1, incremental=True) as mgr:
        save_1_and_2(mgr, state)
        assert shardsafe.delete(mgr.path(2))
        assert shardsafe.delete(mgr.path(1))  # retired, referred to by nothing: deleted
    assert list((tmp_path / "other").iterdir()) == []


def test_killed_save_cleanup_deletes_nothing_beside_an_unreadable_manifest(tmp_path):
    from shardsafe.checkpoint_folder import clean_in_place
    from shardsafe.storage.local import LocalBackend

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "manifest.json").write_bytes(b"\x00garbage")
    (folder / "data-r00000-00.safetensors").write_bytes(b"x" * 64)
    with LocalBackend().open(str(folder)) as f:
        assert clean_in_place(f, now=time.time() + 7 * 3600) == []
    assert (folder / "data-r00000-00.safetensors").exists()


def test_a_retired_checkpoint_whose_kept_files_shrink_is_pruned(tmp_path):
    """Retention prunes a retired checkpoint down to the files still referred to, also when
    that set shrinks (a retired.json is never replaced: it was, and the refused overwrite
    left the files on disk for good); the whole folder goes once nothing is referred to."""
    import shardsafe.checkpoint_folder as cf
    from shardsafe.storage.local import LocalBackend

    step = tmp_path / "step-00000001"
    step.mkdir()
    for n in ("a", "b", "c"):
        (step / n).write_bytes(n.encode() * 10)
    (step / "retired.json").write_text(json.dumps({"format": "shardsafe-retired", "keep": ["a", "b"]}))
    with LocalBackend().open(str(tmp_path)) as parent:
        assert cf.retired_files(parent, "step-00000001") == {"a", "b"}
        cf.prune_retired(parent, "step-00000001", {"a"})
        assert sorted(p.name for p in step.iterdir()) == ["a", "retired.json"]
        assert cf.retired_files(parent, "step-00000001") == {"a"}
        with pytest.raises(CheckpointError, match=r"does not list \['b'\]"):
            cf.prune_retired(parent, "step-00000001", {"a", "b"})
        cf.prune_retired(parent, "step-00000001", set())
    assert not step.exists()
