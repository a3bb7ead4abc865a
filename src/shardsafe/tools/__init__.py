"""Tools for shardsafe checkpoints, as Python functions and as the ``shardsafe`` command.

Each subcommand of ``shardsafe`` (see ``shardsafe --help`` and docs/cli.md) is one
function here; each returns a report object with ``to_json()`` (and ``to_text()``).
"""

from __future__ import annotations

from .common import UsageError, parse_size
from .diff import DiffReport, compare_tensors, diff_checkpoints
from .export import ExportReport, export_checkpoint
from .import_ import ImportReport, import_checkpoint
from .inspect import Inspection, inspect_checkpoint
from .listing import StepEntry, list_checkpoints
from .picture import LayoutBox, layout_boxes, layout_png, layout_text
from .verify import Problem, VerifyReport, verify_checkpoint

__all__ = [
    "list_checkpoints",
    "inspect_checkpoint",
    "layout_boxes",
    "layout_text",
    "layout_png",
    "verify_checkpoint",
    "diff_checkpoints",
    "compare_tensors",
    "export_checkpoint",
    "import_checkpoint",
    "StepEntry",
    "Inspection",
    "LayoutBox",
    "Problem",
    "VerifyReport",
    "DiffReport",
    "ExportReport",
    "ImportReport",
    "UsageError",
    "parse_size",
]
