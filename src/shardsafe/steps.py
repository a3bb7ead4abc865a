"""Step folders of a manager folder: ``step-00000500`` (at least 8 digits, zero padded).

The one place that names step folders and reads step numbers back from names; the
manager, ``shardsafe ls`` and the tools all use it. A name counts as a step folder only in
its canonical form (``step-5`` or ``step-000000005`` do not), so that a step number
always maps to exactly one folder name.
"""

from __future__ import annotations

import re

from .checkpoint_folder import leftover_of

STEP_PREFIX = "step-"
_DIGITS = re.compile(r"[0-9]{8,}", re.ASCII)


def step_name(step: int) -> str:
    """The folder name of ``step``: ``step-00000500``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    """The step of a canonical step folder name, else None."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    if not _DIGITS.fullmatch(digits):
        return None
    step = int(digits)
    return step if step_name(step) == name else None


def parse_leftover_step(entry: str) -> tuple[int, str] | None:
    """(step, mark) when ``entry`` is a hidden sibling that a save of a step folder left."""
    found = leftover_of(entry)
    if found is None:
        return None
    step = parse_step(found[0])
    return None if step is None else (step, found[1])
