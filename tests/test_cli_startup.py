"""The ``shardsafe`` command starts fast: ``python -m shardsafe`` works, ``--version`` and
``ls`` import no torch (checked by module presence, not by timing), every argument has help."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shardsafe
from shardsafe.tools.cli import _parser

# Runs ``python -m shardsafe ARGS`` in this interpreter, then prints whether torch was imported.
RUN_MAIN = """
import json, runpy, sys
sys.argv = ["shardsafe", *json.loads(sys.argv[1])]
try:
    runpy.run_module("shardsafe", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
print(json.dumps({"exit": code, "torch": "torch" in sys.modules, "transformers": "transformers" in sys.modules}))
"""


def run_main(*args: str) -> tuple[dict, str]:
    proc = subprocess.run([sys.executable, "-c", RUN_MAIN, json.dumps([str(a) for a in args])],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    *lines, last = proc.stdout.strip().splitlines()
    return json.loads(last), "\n".join(lines)


def test_python_m_shardsafe_version_imports_no_torch():
    info, out = run_main("--version")
    assert info == {"exit": 0, "torch": False, "transformers": False}
    assert out == f"shardsafe {shardsafe.__version__}"
    proc = subprocess.run([sys.executable, "-m", "shardsafe", "--version"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"shardsafe {shardsafe.__version__}"


def test_import_shardsafe_is_lazy():
    code = ("import sys, shardsafe; assert 'torch' not in sys.modules; "
            "shardsafe.CheckpointError; assert 'torch' not in sys.modules; "
            "shardsafe.save; assert 'torch' in sys.modules; print(sorted(shardsafe.__all__) == sorted(set(dir("
            "shardsafe)) & set(shardsafe.__all__)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr


def test_every_public_name_resolves():
    for name in shardsafe.__all__:
        assert getattr(shardsafe, name) is not None, name
    with pytest.raises(AttributeError):
        shardsafe.no_such_name  # noqa: B018


def test_ls_imports_no_torch(tmp_path):
    with shardsafe.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, {"model": {"w": torch.ones(3)}})
    info, out = run_main("ls", tmp_path)
    assert "step-00000005" in out and "valid" in out
    assert info == {"exit": 0, "torch": False, "transformers": False}


def test_ls_of_hand_named_and_ambiguous_steps_imports_no_torch(tmp_path):
    for name in ("step-100", "step-00000100", "step-7"):
        shardsafe.save({"w": torch.ones(2)}, tmp_path / name)
    info, out = run_main("ls", tmp_path)
    assert info == {"exit": 0, "torch": False, "transformers": False}
    rows = {line.split()[-1] if "(" not in line else line.split("  (")[0].split()[-1]: line
            for line in out.splitlines()[1:]}
    assert set(rows) == {"step-7", "step-100", "step-00000100"}
    assert " valid " in rows["step-7"] and rows["step-7"].startswith("7 ")
    for name in ("step-100", "step-00000100"):
        assert "ambiguous" in rows[name] and "'step-00000100' and 'step-100'" in rows[name]


def test_ls_runs_through_python_m(tmp_path):
    with shardsafe.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, {"model": {"w": torch.ones(3)}})
    info, out = run_main("ls", tmp_path)
    assert info["exit"] == 0 and "step-00000005" in out and not info["transformers"]


def _actions(parser: argparse.ArgumentParser, where: str = "shardsafe"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{where} {name}")
        else:
            yield where, action


def test_every_cli_argument_has_help():
    missing = [f"{where}: {a.option_strings or a.dest}" for where, a in _actions(_parser())
               if not (a.help and a.help.strip()) or a.help == argparse.SUPPRESS]
    assert not missing, missing


def test_import_help_lists_every_source_kind():
    proc = subprocess.run([sys.executable, "-m", "shardsafe", "import", "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())
    for kind in ("torch: a torch.save file", "safetensors: a .safetensors file", "hf: a Hugging Face folder",
                 "dcp: a torch.distributed.checkpoint folder"):
        assert kind in text, kind
    top = subprocess.run([sys.executable, "-m", "shardsafe", "--help"], capture_output=True, text=True, timeout=120)
    assert "Hugging Face" in top.stdout and "DCP" in top.stdout


def test_docs_mention_every_export_format():
    text = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text()
    for fmt in ("--to torch", "--to safetensors", "--to hf", "--to dcp", "--rename", "--config", "python -m shardsafe"):
        assert fmt in text, fmt
