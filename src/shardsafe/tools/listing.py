"""``shardsafe ls``: the step checkpoints of a manager folder and whether each is usable.

The check is cheap: the manifest's integrity trailer, and every data file present with
the size the manifest records. No data is hashed (``shardsafe verify`` does that).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from ..checkpoint_folder import MAX_MANIFEST_BYTES, OLD_MARK, TMP_MARK
from ..errors import CheckpointError, CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME, Manifest
from ..steps import by_step, parse_leftover_step, parse_step
from ..storage.base import Folder
from .common import PathLike, human_bytes, locate

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer


@dataclass
class StepEntry:
    """One folder entry of ``shardsafe ls``.

    ``status`` is ``valid`` (committed, manifest and file sizes check out), ``invalid``
    (a step folder that is torn or damaged: ``problem`` says how), ``ambiguous`` (one of
    two or more committed folders of one step spelt differently, ``step-100`` and
    ``step-00000100``: a CheckpointManager refuses the folder until one is renamed or
    deleted; ``problem`` names the others), ``incomplete`` (the
    temporary folder of a save that has not committed, or was interrupted), ``parked``
    (a previous checkpoint left aside by an interrupted overwrite), ``deleting`` (a
    checkpoint taken out of sight by retention whose files are not all deleted yet) or
    ``retired`` (deleted by retention, but holding data files that kept incremental
    checkpoints refer to).

    ``size`` is what the folder holds (its own bytes); ``referred`` the bytes of chunks the
    checkpoint leaves in other checkpoints' files (incremental saves), ``refers_to`` the
    names of those checkpoints."""

    name: str
    step: int | None  # None: a single checkpoint folder not named step-<N>
    status: str
    size: int
    created: float | None = None
    world_size: int | None = None
    problem: str | None = None
    referred: int = 0
    refers_to: list[str] | None = None
    coverage: str | None = None  # a node-local tier folder: the ranks whose files this node holds

    def to_json(self) -> dict:
        """A JSON-ready dict."""
        return asdict(self)


def _size(folder: Folder, name: str) -> int:
    """Bytes of the regular files in sub-folder ``name`` (symlinks and others not counted)."""
    total = 0
    try:
        with folder.open_folder(name) as sub:
            for entry in sub.names():
                kind = sub.kind(entry)
                if kind == "file":
                    total += sub.size(entry)
                elif kind == "dir":
                    total += _size(sub, entry)
    except CheckpointError:
        pass
    return total


def check_step(folder: Folder, parent: Folder | None = None) -> tuple[Manifest | None, str | None]:
    """(manifest, None) when ``folder`` is a committed checkpoint whose manifest verifies and
    whose data files (and, given its ``parent``, the files it refers to) have the recorded
    sizes, else (manifest or None, the problem)."""
    try:
        if folder.kind(MANIFEST_NAME) is None:
            return None, "no manifest.json (torn save or not a checkpoint)"
        data = folder.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
    except CheckpointError as exc:
        return None, f"cannot read manifest.json: {exc}"
    try:
        manifest = Manifest.from_bytes(data, folder.where(MANIFEST_NAME))
    except CheckpointError as exc:
        return None, str(exc)
    problems = file_problems(folder, manifest, parent, first=True)
    return manifest, problems[0] if problems else None


def file_problems(folder: Folder, manifest: Manifest, parent: Folder | None = None,
                  first: bool = False) -> list[str]:
    """What is wrong with the files of the checkpoint in ``folder`` described by
    ``manifest``: each data file or file index missing, not a regular file or not of the
    recorded size, and (given its ``parent`` folder) each file it refers to in other
    checkpoints. Sizes only, no data read; with ``first``, stops at the first problem."""
    out: list[str] = []
    for entry in manifest.files:
        if first and out:
            return out
        kind = folder.kind(entry.name)
        if kind is None:
            out.append(f"data file {entry.name} is missing")
            continue
        if kind != "file":
            out.append(f"data file {entry.name} is not a regular file")
            continue
        size = folder.size(entry.name)
        if size != entry.nbytes:
            out.append(f"data file {entry.name} has {size} bytes, the manifest says {entry.nbytes}")
            continue
        if manifest.indexed:  # format 3: each data file has an index of the recorded size
            kind = folder.kind(entry.index_name)
            if kind != "file":
                out.append(f"file index {entry.index_name} is {'missing' if kind is None else 'not a file'}")
                continue
            size = folder.size(entry.index_name)
            if size != entry.index_bytes:
                out.append(f"file index {entry.index_name} has {size} bytes, the manifest says {entry.index_bytes}")
    for ref in manifest.refs:
        if first and out:
            return out
        problem = _ref_problem(folder, parent, ref.checkpoint, ref.name, ref.nbytes)
        if problem:
            out.append(problem)
    return out


def _ref_problem(folder: Folder, parent: Folder | None, checkpoint: str, name: str, nbytes: int) -> str | None:
    """What is wrong with a referenced file (missing, resized), or None; unchecked (None)
    when the checkpoint was opened without its parent folder."""
    try:
        if checkpoint == "":
            size = folder.size(name) if folder.kind(name) == "file" else None
        elif parent is None:
            return None
        elif parent.kind(checkpoint) != "dir":
            return f"refers to checkpoint '{checkpoint}', which is missing"
        else:
            with parent.open_folder(checkpoint) as other:
                size = other.size(name) if other.kind(name) == "file" else None
    except CheckpointError as exc:
        return f"cannot check referenced file {checkpoint}/{name}: {exc}"
    if size is None:
        return f"referenced data file {checkpoint or '.'}/{name} is missing"
    if size != nbytes:
        return f"referenced data file {checkpoint or '.'}/{name} has {size} bytes, the manifest says {nbytes}"
    return None


def referred_bytes(manifest: Manifest) -> int:
    """Bytes of the chunks a checkpoint leaves in other checkpoints' files (its indexes
    fetched when it has references; 0 without)."""
    if not manifest.refs:
        return 0
    return sum(c.end - c.start for f in range(len(manifest.files)) for _, c in manifest.index(f).referred())


def list_checkpoints(folder: PathLike, checkpointer: Checkpointer | None = None) -> list[StepEntry]:
    """The step checkpoints (``step-<N>`` folders) and leftover temporary folders in
    ``folder``, by step. ``folder`` may also be a single checkpoint folder."""
    try:
        backend, location = locate(folder, checkpointer)
        root = backend.open(location)
    except CheckpointNotFoundError as exc:
        if getattr(exc, "bucket", None) is not None:  # a missing bucket (s3): says so itself
            raise
        raise CheckpointNotFoundError(f"no folder at {folder}") from None
    out: list[StepEntry] = []
    with root:
        if root.kind(MANIFEST_NAME) is not None:
            parent_location, name = backend.split(location)
            try:
                parent: Folder | None = backend.open(parent_location)
            except CheckpointError:
                parent = None
            try:
                manifest, problem = check_step(root, parent)
            finally:
                if parent is not None:
                    parent.close()
            size = sum(root.size(n) for n in root.names() if root.kind(n) == "file")
            out.append(_with_refs(StepEntry(name, parse_step(name), "valid" if problem is None else "invalid", size,
                                            manifest.created if manifest else None,
                                            manifest.world_size if manifest else None, problem), manifest, root))
            return out
        for name in root.names():
            if root.kind(name) != "dir":
                continue
            step = parse_step(name)
            if step is not None:
                out.append(_entry(root, name, step))
                continue
            hidden = parse_leftover_step(name)
            if hidden is not None:
                step, mark = hidden
                if mark == TMP_MARK:
                    status, problem = "incomplete", "save in progress or interrupted (not committed)"
                elif mark == OLD_MARK:
                    status, problem = "parked", "previous checkpoint left by an interrupted overwrite"
                else:
                    status, problem = "deleting", "a deleted checkpoint whose files are still being removed"
                out.append(StepEntry(name, step, status, _size(root, name), problem=problem))
        _mark_ambiguous(root, out)
        if root.kind(TIER_MARKER) == "file":
            for e in out:
                _local_coverage(root, e)
    out.sort(key=lambda e: (e.step or 0, e.name.startswith("."), e.name))
    return out


TIER_MARKER = ".shardsafe-tier.json"  # shardsafe.tier.local.MARKER (kept in step by test_tier)


def _local_coverage(root: Folder, e: StepEntry) -> None:
    """A step of a node-local tier folder holds its own ranks' files and replicas, not
    every file: ``local`` when it holds all, ``partial`` (the rest are on peer nodes) when
    every file it holds has its recorded size; ``coverage`` names the ranks held."""
    if e.name.startswith(".") or e.status not in ("valid", "invalid"):
        return
    try:
        with root.open_folder(e.name) as f:
            manifest, _ = check_step(f)
            if manifest is None:
                return
            held, bad = [], []
            for entry in manifest.files:
                if f.kind(entry.name) is None:
                    continue
                ok = f.size(entry.name) == entry.nbytes and (not manifest.indexed or (
                    f.kind(entry.index_name) == "file" and f.size(entry.index_name) == entry.index_bytes))
                (held if ok else bad).append(entry.rank)
    except CheckpointError:
        return
    if bad:
        return  # a wrong size: stays invalid
    n = len(manifest.files)
    e.coverage = f"files of ranks {_ranges(sorted(held))} ({len(held)} of {n})"
    e.status, e.problem = ("local", None) if len(held) == n else ("partial", f"holds {e.coverage}; the others "
                                                                  "are on peer nodes")


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out) or "none"


def _mark_ambiguous(root: Folder, entries: list[StepEntry]) -> None:
    """Mark as ``ambiguous`` the committed step folders (those holding a manifest, as the
    manager counts them) that share a step with another (``step-100`` and
    ``step-00000100``), with the manager's own error as the problem."""
    from ..checkpoint_folder import is_committed

    steps: dict[int, list[StepEntry]] = {}
    for e in entries:
        if e.step is not None and not e.name.startswith(".") and e.status != "retired":
            steps.setdefault(e.step, []).append(e)
    for same in steps.values():
        same = [e for e in same if is_committed(root, e.name)] if len(same) > 1 else []
        if len(same) < 2:
            continue
        try:
            by_step([e.name for e in same], "this folder")
        except CheckpointError as exc:
            for e in same:
                e.status, e.problem = "ambiguous", str(exc)


def _entry(parent: Folder, name: str, step: int | None) -> StepEntry:
    from ..checkpoint_folder import retired_files

    kept = retired_files(parent, name)
    if kept is not None:
        return StepEntry(name, step, "retired", _size(parent, name),
                         problem=f"deleted by retention; keeps {len(kept)} data file(s) newer checkpoints refer to")
    try:
        with parent.open_folder(name) as folder:
            manifest, problem = check_step(folder, parent)
            entry = StepEntry(
                name, step, "valid" if problem is None else "invalid", _size(parent, name),
                manifest.created if manifest else None, manifest.world_size if manifest else None, problem,
            )
            return _with_refs(entry, manifest, folder)
    except CheckpointError as exc:
        return StepEntry(name, step, "invalid", _size(parent, name), problem=str(exc))


def _with_refs(entry: StepEntry, manifest: Manifest | None, folder: Folder) -> StepEntry:
    """``entry`` with the bytes its checkpoint refers to (read from its indexes)."""
    if manifest is None or not any(r.checkpoint for r in manifest.refs):
        return entry  # no references, or only to files in its own folder (a self-contained copy)
    from ..ops.metadata import Opened, fetch_all_indexes, index_reader

    entry.refers_to = sorted({r.checkpoint for r in manifest.refs if r.checkpoint})
    inc = manifest.extra.get("incremental")
    recorded = inc.get("referred_bytes") if isinstance(inc, dict) else None
    if type(recorded) is int and recorded >= 0:  # recorded at save time: no index read
        entry.referred = recorded
        return entry
    try:
        fetch_all_indexes(Opened(folder.location, folder, manifest, 0, read_indexes=index_reader(folder, 0, False)))
        entry.referred = referred_bytes(manifest)
    except CheckpointError as exc:
        if entry.problem is None:
            entry.status, entry.problem = "invalid", str(exc)
    return entry


def format_listing(entries: list[StepEntry], folder: PathLike) -> str:
    """The text table of ``shardsafe ls``."""
    if not entries:
        return f"no step checkpoints in {folder}"
    rows = [("STEP", "STATUS", "OWNS", "REFERS", "CREATED", "WORLD", "NAME")]
    for e in entries:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e.created)) if e.created else "-"
        name = e.name + (f"  ({e.problem})" if e.problem and e.status != "valid" else "")
        if e.coverage and e.status == "local":
            name += f"  (holds {e.coverage})"
        if e.refers_to:
            name += f"  (refers to {', '.join(e.refers_to)})"
        rows.append((str(e.step) if e.step is not None else "-", e.status, human_bytes(e.size),
                     human_bytes(e.referred) if e.referred else "-", created,
                     str(e.world_size) if e.world_size is not None else "-", name))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + "  " + r[6] for r in rows]
    return "\n".join(lines)
