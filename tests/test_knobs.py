"""knobs.py: every tunable in one place, overridable by SHARDSAFE_<NAME>, bad values refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import shardsafe
from shardsafe import knobs
from shardsafe.errors import CheckpointError

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _in_child(env: dict[str, str], code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_environment_overrides_reach_the_modules_that_use_them():
    """A knob set in the environment is the value the engine and planner run with."""
    code = ("import json, shardsafe.engine.writer as w, shardsafe.plan.save_plan as p, shardsafe.knobs as k;"
            "print(json.dumps([w.SLOT, p.SMALL_BYTES, k.KNOBS['SLOT_BYTES'].default]))")
    out = _in_child({"SHARDSAFE_SLOT_BYTES": "8M", "SHARDSAFE_SMALL_BYTES": "4096"}, code)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [8 << 20, 4096, 64 << 20]


def test_a_save_and_load_run_with_small_knobs(tmp_path):
    """Small slots, batches and windows change how bytes move, never what lands."""
    code = ("import torch, shardsafe, sys; src = {f't{i}': torch.randn(3000 + i) for i in range(40)};"
            "shardsafe.save(src, sys.argv[1]); dst = {k: torch.empty_like(v) for k, v in src.items()};"
            "shardsafe.load(dst, sys.argv[1]);"
            "assert all(torch.equal(src[k], dst[k]) for k in src); print('ok')")
    env = {"SHARDSAFE_SLOT_BYTES": "1M", "SHARDSAFE_READ_BATCH": "4K", "SHARDSAFE_VERIFY_WINDOW": "64K",
           "SHARDSAFE_CHECKSUM_BLOCK": "4K"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "ck")], env={**os.environ, **env},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert shardsafe.read_manifest(tmp_path / "ck").extra["checksum_block"] == 4096


@pytest.mark.parametrize("text, why", [("lots", "not an integer"), ("12Q", "not an integer"),
                                       ("0", "must be at least 1048576"), ("-5M", "must be at least 1048576")])
def test_a_bad_value_names_the_variable(text, why):
    with pytest.raises(CheckpointError, match=f"SHARDSAFE_SLOT_BYTES={text!r}: {why}"):
        knobs.parse_value(text, "SHARDSAFE_SLOT_BYTES", 1 << 20)
    out = _in_child({"SHARDSAFE_SLOT_BYTES": text}, "import shardsafe.knobs")
    assert out.returncode != 0 and "SHARDSAFE_SLOT_BYTES" in out.stderr


def test_suffixes_and_defaults():
    assert knobs.parse_value("3K", "X", 1) == 3 << 10
    assert knobs.parse_value("2g", "X", 1) == 2 << 30
    assert knobs.parse_value("1_000", "X", 1) == 1000
    assert all(k.value == k.default for k in knobs.KNOBS.values() if k.env not in os.environ)


def test_every_knob_is_documented():
    """docs/knobs.md lists every knob by its environment variable."""
    text = (DOCS / "knobs.md").read_text()
    missing = [k.env for k in knobs.KNOBS.values() if f"`{k.env}`" not in text]
    assert not missing, missing
