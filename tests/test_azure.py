"""The Azure Blob backend (``az://container/prefix``) against a real server: Azurite, the
Azure Storage emulator, on 127.0.0.1 (see azure_server.py and the ``az`` fixture). Round
trip of every value kind (bitwise), overwrite, a missing container, a misspelt option,
FSDP2 saved by 4 gloo ranks and loaded by 2, manager retention, and ``shardsafe copy``
local -> az -> local with the CLI configured by the usual environment variables."""

from __future__ import annotations

import json

import pytest
import torch

import s3_dist_cases as cases
import shardsafe
from bitwise import assert_bitwise
from shardsafe import CheckpointManager
from shardsafe.__main__ import main as cli
from shardsafe.format.manifest import MANIFEST_NAME

pytest.importorskip("obstore")

MiB = 1 << 20
T = 120  # seconds a distributed case may take on every rank


def state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {"w": torch.randn(700, 1500, generator=g), "b": torch.arange(40, dtype=torch.bfloat16),
                      "i": torch.randint(0, 1 << 40, (33,), generator=g)},
            "optim": {"lr": 0.1, "betas": (0.9, 0.99), "names": ["a", "b"]}, "step": 7, "empty": torch.empty(0, 3)}


def test_round_trip_bitwise_and_overwrite(az):
    """Values of every kind round trip bitwise; a 4 MiB+ tensor goes up as several blocks
    (part_size 1 MiB); an overwrite replaces the checkpoint and deletes the old blobs."""
    _, container, opts = az
    opts = dict(opts, part_size=1 * MiB)
    url = f"az://{container}/runs/ck"
    shardsafe.save(state(1), url, storage_options=opts)
    assert_bitwise(state(1), shardsafe.load_full(url, storage_options=opts))
    dest = state(5)
    shardsafe.load(dest, url, storage_options=opts)
    assert_bitwise(state(1), dest)
    with pytest.raises(shardsafe.CheckpointExistsError):
        shardsafe.save(state(2), url, storage_options=opts)
    first = shardsafe.read_manifest(url, storage_options=opts).files
    shardsafe.save(state(2), url, storage_options=opts, overwrite=True)
    assert_bitwise(state(2), shardsafe.load_full(url, storage_options=opts))
    m = shardsafe.read_manifest(url, storage_options=opts)
    assert {f.name for f in m.files}.isdisjoint({f.name for f in first})
    cp = shardsafe.Checkpointer(storage_options=opts)
    try:
        backend, location = cp.locate(url)
        with backend.open(location) as folder:
            names = set(folder.names())
    finally:
        cp.close()
    assert names == {f.name for f in m.files} | {f.index_name for f in m.files} | {MANIFEST_NAME}


def test_block_buffers_come_from_the_checkpointers_budget(az):
    """Azure blocks are leased from the Checkpointer's one HostMemory, as S3 parts are, and
    all given back once the save ends (obstore holds a block until it is uploaded); a
    budget smaller than the blob still completes an async save, bitwise."""
    _, container, opts = az
    opts = dict(opts, part_size=1 * MiB)  # the 4.2 MB tensor: 5 blocks
    url = f"az://{container}/budget"
    cp = shardsafe.Checkpointer(storage_options=opts, memory_budget=3 * MiB)
    try:
        cp.async_save(state(5), url).result(timeout=300)
        backend, _ = cp.locate(url)
        assert backend.memory is cp.memory
        assert cp.memory.in_use == 0 and cp.memory.peak >= 1 * MiB  # the blocks were counted
        assert_bitwise(state(5), cp.load_full(url))
        cp.save(state(6), url, overwrite=True)  # the kept block buffers, reused: no stale bytes
        assert cp.memory.in_use == 0
        assert_bitwise(state(6), cp.load_full(url))
    finally:
        cp.close()


def test_missing_container_and_misspelt_option(az):
    _, container, opts = az
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="container 'nope' does not exist"):
        shardsafe.load_full("az://nope/ck", storage_options=opts)
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="container 'nope' does not exist"):
        shardsafe.save(state(), "az://nope/ck", storage_options=opts)
    with pytest.raises(shardsafe.CheckpointError, match="did you mean 'account_name'"):
        shardsafe.save(state(), f"az://{container}/ck", storage_options=dict(opts, acount_name="x"))
    with pytest.raises(shardsafe.CheckpointNotFoundError, match="no checkpoint"):
        shardsafe.load_full(f"az://{container}/absent", storage_options=opts)


def test_fsdp_save_4_load_2(pg_pool, az, tmp_path):
    """FSDP2 saved by 4 gloo ranks to az:// loads bitwise on 2 ranks (resharded) and as a
    full tree; the reference is a local torch.save of the full state taken at save time."""
    _, container, opts = az
    url, ref = f"az://{container}/fsdp", str(tmp_path / "fsdp.ref.pt")
    saved = pg_pool(4).run(cases.save_trained, "fsdp", url, opts, ref, timeout=T)
    assert [s["error"] for s in saved] == [None] * 4
    assert sum(s["files"] for s in saved) == 4
    two = pg_pool(2).run(cases.load_checked, "fsdp", url, opts, ref, timeout=T)
    assert len(two) == 2 and all(r["tensors"] > 0 for r in two)
    assert_bitwise(torch.load(ref, weights_only=True), shardsafe.load_full(url, storage_options=opts))


def test_manager_retention_on_az(az):
    _, container, opts = az
    cp = shardsafe.Checkpointer(storage_options=opts)
    folder = f"az://{container}/runs/exp1"
    m = CheckpointManager(folder, interval=1, keep_last=2, checkpointer=cp)
    try:
        for step in range(1, 5):
            m.save(step, {"w": torch.full((1000,), float(step)), "step": step})
        m.wait()
        assert m.steps() == [3, 4]
        backend, location = cp.locate(folder)
        with backend.open(location) as f:
            assert sorted(f.names()) == ["step-00000003", "step-00000004"]
        dest = {"w": torch.zeros(1000), "step": 0}
        assert m.load(dest) == 4
        assert torch.equal(dest["w"], torch.full((1000,), 4.0)) and dest["step"] == 4
    finally:
        m.close()
        cp.close()


def test_cli_copy_local_az_local(az, capsys, tmp_path, monkeypatch):
    """``shardsafe copy`` local -> az -> local, the CLI finding Azurite by the usual
    environment variables; both copies verify and load bitwise."""
    server, container, _ = az
    for name, value in server.env().items():
        monkeypatch.setenv(name, value)
    cp = shardsafe.api.default_checkpointer()
    cp.backends.pop("az", None)  # built again from this environment
    try:
        src = tmp_path / "src"
        shardsafe.save(state(3), src)
        url = f"az://{container}/copied"
        for argv in (["copy", str(src), url], ["verify", url], ["copy", url, str(tmp_path / "back")]):
            code = cli([*argv, "--json", "--no-progress"])
            out = json.loads(capsys.readouterr().out)
            assert code == 0, out
        assert_bitwise(state(3), shardsafe.load_full(url))
        assert_bitwise(state(3), shardsafe.load_full(tmp_path / "back"))
    finally:
        cp.backends.pop("az", None)
