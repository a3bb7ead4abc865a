"""Step folders of a manager folder: ``step-<N>``.

The one place that names step folders and reads step numbers back from names; the
manager, ``shardsafe ls`` and the tools all use it. Any ``step-`` followed by ASCII digits
is a step folder, whatever its zero padding: ``step-100``, ``step-0100`` and
``step-00000100`` are all step 100, so a checkpoint saved by hand as ``ckpt/step-100``
is one of ``CheckpointManager("ckpt")``'s steps. New saves of the manager are named
``step-00000500`` (:func:`step_name`: 8 digits, zero padded; larger steps use more
digits), and a save of a step that already has a folder writes to that folder, whatever
its spelling. Two committed folders for one step (``step-100`` and ``step-00000100``)
are ambiguous: :func:`by_step` refuses them with a CheckpointError naming both.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from .errors import CheckpointError
from .storage.commit import leftover_of

STEP_PREFIX = "step-"
WIDTH = 8  # digits of the names new saves get (zero padded)
MAX_STEP = 2**63 - 1  # steps travel between ranks as int64
_DIGITS = re.compile(r"[0-9]{1,19}", re.ASCII)


def step_name(step: int, width: int = WIDTH) -> str:
    """The folder name of ``step`` with at least ``width`` digits: ``step-00000500``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    return f"{STEP_PREFIX}{step:0{width}d}"


def parse_step(name: str) -> int | None:
    """The step of a step folder name (``step-`` and 1 to 19 ASCII digits, any zero
    padding, at most :data:`MAX_STEP`), else None."""
    if not name.startswith(STEP_PREFIX):
        return None
    digits = name[len(STEP_PREFIX):]
    if not _DIGITS.fullmatch(digits):
        return None
    step = int(digits)
    return step if step <= MAX_STEP else None


def width_of(name: str) -> int:
    """The number of digits of step folder ``name`` (``step_name(parse_step(n), width_of(n)) == n``)."""
    return len(name) - len(STEP_PREFIX)


def by_step(names: Iterable[str], where: str = "the folder") -> dict[int, str]:
    """Step -> name of the step folders among ``names`` (others are ignored). Two names
    for one step raise a CheckpointError naming both (pass only committed checkpoints'
    names: an empty or torn folder beside a checkpoint is no ambiguity)."""
    out: dict[int, str] = {}
    for name in sorted(names):
        step = parse_step(name)
        if step is None:
            continue
        if step in out:
            raise CheckpointError(
                f"step {step} has two checkpoints in {where}: {out[step]!r} and {name!r}; rename or delete one "
                f"(a CheckpointManager names new step folders like {step_name(step)!r})")
        out[step] = name
    return out


def parse_leftover_step(entry: str) -> tuple[int, str] | None:
    """(step, mark) when ``entry`` is a hidden sibling that a save of a step folder left."""
    found = leftover_of(entry)
    if found is None:
        return None
    step = parse_step(found[0])
    return None if step is None else (step, found[1])
