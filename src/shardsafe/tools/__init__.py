"""Tools for shardsafe checkpoints, as Python functions and as the ``shardsafe`` command.

Each subcommand of ``shardsafe`` (see ``shardsafe --help`` and docs/cli.md) is one
function here; each returns a report object with ``to_json()`` (and ``to_text()``).
The names are imported on first use, so that commands which need no tensors (``ls``,
``--version``) start without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

_WHERE: dict[str, str] = {
    "UsageError": ".common", "parse_size": ".common",
    "DiffReport": ".diff", "compare_tensors": ".diff", "diff_checkpoints": ".diff",
    "ExportReport": ".export", "export_checkpoint": ".export",
    "ImportReport": ".import_", "import_checkpoint": ".import_",
    "Inspection": ".inspect", "inspect_checkpoint": ".inspect",
    "StepEntry": ".listing", "list_checkpoints": ".listing",
    "LayoutBox": ".picture", "layout_boxes": ".picture", "layout_png": ".picture", "layout_text": ".picture",
    "Problem": ".verify", "VerifyReport": ".verify", "verify_checkpoint": ".verify",
    "CopyReport": ".copy", "copy_checkpoint": ".copy",
}

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
    "copy_checkpoint",
    "CopyReport",
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


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__)


if TYPE_CHECKING:
    from .common import UsageError, parse_size
    from .copy import CopyReport, copy_checkpoint
    from .diff import DiffReport, compare_tensors, diff_checkpoints
    from .export import ExportReport, export_checkpoint
    from .import_ import ImportReport, import_checkpoint
    from .inspect import Inspection, inspect_checkpoint
    from .listing import StepEntry, list_checkpoints
    from .picture import LayoutBox, layout_boxes, layout_png, layout_text
    from .verify import Problem, VerifyReport, verify_checkpoint
