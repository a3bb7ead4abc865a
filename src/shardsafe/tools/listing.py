"""``shardsafe ls``: the step checkpoints of a manager folder and whether each is usable.

The check is cheap: the manifest's integrity trailer, and every data file present with
the size the manifest records. No data is hashed (``shardsafe verify`` does that).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import CheckpointError, CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..storage.local import OLD_MARK, TMP_MARK
from .common import PathLike, human_bytes

_STEP = re.compile(r"step-(\d+)")
_HIDDEN = re.compile(r"\.(step-(\d+))(" + re.escape(TMP_MARK) + "|" + re.escape(OLD_MARK) + r").*")


@dataclass
class StepEntry:
    """One folder entry of ``shardsafe ls``.

    ``status`` is ``valid`` (committed, manifest and file sizes check out), ``invalid``
    (a step folder that is torn or damaged: ``problem`` says how), ``incomplete`` (the
    temporary folder of a save that has not committed, or was interrupted) or ``parked``
    (a previous checkpoint left aside by an interrupted overwrite)."""

    name: str
    step: int | None  # None: a single checkpoint folder not named step-<N>
    status: str
    size: int
    created: float | None = None
    world_size: int | None = None
    problem: str | None = None

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def _dir_size(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total


def check_step(path: Path) -> tuple[Manifest | None, str | None]:
    """(manifest, None) when ``path`` is a committed checkpoint whose manifest verifies and
    whose data files have the recorded sizes, else (manifest or None, the problem)."""
    mpath = path / MANIFEST_NAME
    try:
        data = mpath.read_bytes()
    except FileNotFoundError:
        return None, "no manifest.json (torn save or not a checkpoint)"
    except OSError as exc:
        return None, f"cannot read manifest.json: {exc.strerror or exc}"
    try:
        manifest = Manifest.from_bytes(data, str(mpath))
    except CheckpointError as exc:
        return None, str(exc)
    for entry in manifest.files:
        try:
            size = os.stat(path / entry.name).st_size
        except FileNotFoundError:
            return manifest, f"data file {entry.name} is missing"
        if size != entry.nbytes:
            return manifest, f"data file {entry.name} has {size} bytes, the manifest says {entry.nbytes}"
    return manifest, None


def list_checkpoints(folder: PathLike) -> list[StepEntry]:
    """The step checkpoints (``step-<N>`` folders) and leftover temporary folders in
    ``folder``, by step. ``folder`` may also be a single checkpoint folder."""
    root = Path(folder)
    if not root.is_dir():
        raise CheckpointNotFoundError(f"no folder at {root}")
    out: list[StepEntry] = []
    if (root / MANIFEST_NAME).is_file():
        m = _STEP.fullmatch(root.name)
        out.append(_entry(root, int(m.group(1)) if m else None))
        return out
    for child in root.iterdir():
        if not child.is_dir():
            continue
        m = _STEP.fullmatch(child.name)
        if m:
            out.append(_entry(child, int(m.group(1))))
            continue
        h = _HIDDEN.fullmatch(child.name)
        if h:
            status = "incomplete" if h.group(3) == TMP_MARK else "parked"
            problem = ("save in progress or interrupted (not committed)" if status == "incomplete"
                       else "previous checkpoint left by an interrupted overwrite")
            out.append(StepEntry(child.name, int(h.group(2)), status, _dir_size(child), problem=problem))
    out.sort(key=lambda e: (e.step or 0, e.name.startswith("."), e.name))
    return out


def _entry(path: Path, step: int | None) -> StepEntry:
    manifest, problem = check_step(path)
    return StepEntry(
        path.name, step, "valid" if problem is None else "invalid", _dir_size(path),
        manifest.created if manifest else None, manifest.world_size if manifest else None, problem,
    )


def format_listing(entries: list[StepEntry], folder: PathLike) -> str:
    """The text table of ``shardsafe ls``."""
    if not entries:
        return f"no step checkpoints in {folder}"
    rows = [("STEP", "STATUS", "SIZE", "CREATED", "WORLD", "NAME")]
    for e in entries:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.created)) if e.created else "-"
        name = e.name + (f"  ({e.problem})" if e.problem and e.status != "valid" else "")
        rows.append((str(e.step) if e.step is not None else "-", e.status, human_bytes(e.size), created,
                     str(e.world_size) if e.world_size is not None else "-", name))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5] for r in rows]
    return "\n".join(lines)
