"""Checkpoints written by older shardsafe releases keep loading, bitwise.

``assets/format2/fsdp_tp`` was written by the last release that wrote format 2.0 (commit
98d6641; see ``assets/format2/make_assets.py``): the suite's Tiny model + AdamW on 4 ranks
under FSDP2 over tensor parallelism. Format 1.0 is covered in test_corruption.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

import dist_cases
import shardsafe
from shardsafe.tools import verify_checkpoint

ASSET = Path(__file__).resolve().parent / "assets" / "format2" / "fsdp_tp"
REF = ASSET.parent / "fsdp_tp.ref.pt"


def _copy(tmp_path: Path) -> Path:
    path = tmp_path / "fsdp_tp"
    shutil.copytree(ASSET, path)
    return path


def test_the_asset_is_format_2():
    assert json.loads((ASSET / "manifest.json").read_bytes())["version"] == [2, 0]
    assert not list(ASSET.glob("*.index.json"))


def test_format_2_loads_bitwise_in_its_own_layout_and_resharded(pg_pool, tmp_path):
    path = _copy(tmp_path)
    pg_pool(4).run(dist_cases.load_into, "fsdp_tp", str(path), str(REF))  # the saving layout
    pg_pool(2).run(dist_cases.load_into, "fsdp", str(path), str(REF))  # 4 -> 2, another layout
    pg_pool(1).run(dist_cases.load_into, "single", str(path), str(REF))


def test_format_2_full_load_verify_and_copy(tmp_path):
    path = _copy(tmp_path)
    ref = torch.load(REF, weights_only=True)
    got = shardsafe.load_full(path)
    dist_cases.assert_bitwise(ref, got)
    report = verify_checkpoint(path)
    assert report.ok and report.chunks > 0, report
    shardsafe.tools.copy_checkpoint(path, tmp_path / "copy")  # a copy keeps the format it copies
    assert json.loads((tmp_path / "copy" / "manifest.json").read_bytes())["version"] == [2, 0]
    dist_cases.assert_bitwise(ref, shardsafe.load_full(tmp_path / "copy"))
