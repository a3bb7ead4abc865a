"""Checkpoints written by older shardsafe releases keep loading, bitwise.

``assets/format2/fsdp_tp`` was written by the last release that wrote format 2.0 (commit
98d6641), ``assets/format3_0/fsdp_tp`` by the last that wrote format 3.0 (commit 57f503f,
before chunk digests and references), both by ``assets/make_old_format.py``: the suite's
Tiny model + AdamW on 4 ranks under FSDP2 over tensor parallelism. Format 1.0 is covered in
test_corruption.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import dist_cases
import shardsafe
from bitwise import assert_bitwise
from shardsafe.tools import verify_checkpoint

ASSETS = Path(__file__).resolve().parent / "assets"
VERSIONS = {"format2": [2, 0], "format3_0": [3, 0]}


def _asset(which: str) -> Path:
    return ASSETS / which / "fsdp_tp"


def _ref(which: str) -> Path:
    return ASSETS / which / "fsdp_tp.ref.pt"


def _copy(tmp_path: Path, which: str) -> Path:
    path = tmp_path / "fsdp_tp"
    shutil.copytree(_asset(which), path)
    return path


@pytest.mark.parametrize("which", sorted(VERSIONS))
def test_the_asset_has_its_format(which):
    assert json.loads((_asset(which) / "manifest.json").read_bytes())["version"] == VERSIONS[which]
    indexes = list(_asset(which).glob("*.index.json"))
    assert bool(indexes) == (which != "format2")
    for index in indexes:  # 3.0: no chunk digests, no references
        body = json.loads(index.read_bytes())
        assert body["version"] == [3, 0] and "h" not in body["chunks"] and "refs" not in body


@pytest.mark.parametrize("which", sorted(VERSIONS))
def test_old_format_loads_bitwise_in_its_own_layout_and_resharded(pg_pool, tmp_path, which):
    path = _copy(tmp_path, which)
    pg_pool(4).run(dist_cases.load_into, "fsdp_tp", str(path), str(_ref(which)))  # the saving layout
    pg_pool(2).run(dist_cases.load_into, "fsdp", str(path), str(_ref(which)))  # 4 -> 2, another layout
    pg_pool(1).run(dist_cases.load_into, "single", str(path), str(_ref(which)))


@pytest.mark.parametrize("which", sorted(VERSIONS))
def test_old_format_full_load_verify_and_copy(tmp_path, which):
    path = _copy(tmp_path, which)
    ref = torch.load(_ref(which), weights_only=True)
    got = shardsafe.load_full(path)
    assert_bitwise(ref, got)
    report = verify_checkpoint(path)
    assert report.ok and report.chunks > 0, report
    shardsafe.tools.copy_checkpoint(path, tmp_path / "copy")  # a copy keeps the major format it copies
    assert json.loads((tmp_path / "copy" / "manifest.json").read_bytes())["version"][0] == VERSIONS[which][0]
    assert_bitwise(ref, shardsafe.load_full(tmp_path / "copy"))


def test_format_3_0_base_gives_a_full_save(tmp_path):
    """A 3.0 checkpoint has no chunk digests: an incremental save on it refers to nothing
    (writes every chunk) and loads bitwise."""
    path = _copy(tmp_path, "format3_0")
    state = shardsafe.load_full(path)
    info = shardsafe.save(state, tmp_path / "next", base=path)
    assert info.bytes_referred == 0 and info.chunks_referred == 0
    assert not shardsafe.read_manifest(tmp_path / "next", indexes=False).refs
    assert_bitwise(torch.load(_ref("format3_0"), weights_only=True),
                              shardsafe.load_full(tmp_path / "next"))
