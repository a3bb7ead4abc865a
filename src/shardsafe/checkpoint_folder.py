"""What is a committed checkpoint, what is a leftover, and how a save commits.

This module is the only place that decides these things; it talks to storage only
through the seam (``storage.base``), so every backend gets the same rules:

- A checkpoint is a folder holding ``manifest.json`` (written last). Anything else is not
  a checkpoint: readers never take a folder without its manifest.
- A save builds its folder as a hidden sibling ``.<name>.shardsafe-tmp-<hex>``, holds a
  lock on it while it runs, writes the manifest last and then publishes it at ``<name>``:
  a plain rename, or, when a checkpoint is already there (``overwrite=True``), an atomic
  swap (``renameat2(RENAME_EXCHANGE)``). Where the filesystem cannot swap, the old
  checkpoint is parked as ``.<name>.shardsafe-old-<hex>``, the new one renamed in, and the
  parked one deleted; should the second rename fail, the old one is renamed back. Should a
  crash fall between the two, the next save (or a manager) renames the parked one back.
- Deleting a checkpoint (retention, the old side of an overwrite) first takes it out of
  readers' sight atomically (rename to ``.<name>.shardsafe-del-<hex>``, or, where that
  fails, removal of its manifest), then deletes the files.
- Leftovers — temp folders nobody holds, parked folders next to a committed checkpoint,
  ``-del-`` folders — are deleted by the next save to the same name and by the manager.
  Where the filesystem has no locks (no ``flock``), a temp folder counts as abandoned once
  it has not changed for ``STALE_AFTER`` seconds.

The rules above are the policy; the mechanics (rename, swap, lock, or a manifest published
in place on object stores without renames) are the backend's commit strategy
(``storage.commit``, ``Folder.commit``), which this module drives through :data:`POLICY`
without asking which kind of backend it has.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

from .errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, CorruptCheckpointError
from .format.file_index import DATA_SUFFIX, INDEX_SUFFIX, data_name, index_name
from .format.manifest import MANIFEST_NAME
from .knobs import STALE_AFTER_S
from .storage.base import Backend, Folder
from .storage.commit import DEL_MARK, MARKS, OLD_MARK, TMP_MARK, Lock, Staging, hidden_name, leftover_of

__all__ = ["DEL_MARK", "MARKS", "OLD_MARK", "POLICY", "TMP_MARK", "SaveTarget", "begin_save", "hidden_name",
           "leftover_of"]

STALE_AFTER = float(STALE_AFTER_S)  # seconds; only where the filesystem has no locks
MAX_MANIFEST_BYTES = 4 << 30


def is_committed(parent: Folder, name: str, kind: str | None = None) -> bool:
    """True when ``parent/name`` is a folder holding a manifest (``kind``: what the caller
    found ``name`` to be already, saving the request that asks)."""
    if (kind or parent.kind(name)) != "dir":
        return False
    try:
        with parent.open_folder(name) as f:
            return f.kind(MANIFEST_NAME) == "file"
    except (CheckpointNotFoundError, CorruptCheckpointError):
        return False  # gone meanwhile, or not a folder: not a checkpoint (storage failures propagate)


def in_use(parent: Folder, entry: str, now: float | None = None) -> bool:
    """True when a live save holds temp folder ``entry`` (by its lock; without locks, by age)."""
    held = parent.commit.held(parent, entry)
    if held is not None:
        return held
    try:
        age = (time.time() if now is None else now) - parent.mtime(entry)
    except CheckpointError:
        return False
    return age < STALE_AFTER


def claim_leftover(parent: Folder, entry: str) -> Lock | None | bool:
    """Take temp folder ``entry`` for deletion: its lock (held while deleting, so a save
    that just created it and has not locked it yet cannot lose it: its own lock fails and
    it starts over), None where there are no locks and the folder is stale, False when a
    live save holds it (or, without locks, it is not stale)."""
    try:
        lock = parent.commit.claim(parent, entry)
    except CheckpointError:
        return False
    if lock is None and in_use(parent, entry):
        return False
    return lock


def siblings(parent: Folder, name: str) -> list[tuple[str, str]]:
    """The hidden siblings of ``name`` in ``parent``: (entry, mark)."""
    out = []
    for entry in parent.names():
        found = leftover_of(entry)
        if found is not None and found[0] == name:
            out.append((entry, found[1]))
    return sorted(out)


def discard(parent: Folder, entry: str) -> None:
    """Delete entry ``entry`` of ``parent`` (a folder: its manifest first, so readers stop
    seeing a checkpoint before its data goes)."""
    if parent.kind(entry) == "dir":
        with contextlib.suppress(CheckpointError), parent.open_folder(entry) as f:
            f.remove(MANIFEST_NAME)
    parent.remove_tree(entry)


def delete_checkpoint(parent: Folder, name: str) -> None:
    """Delete checkpoint ``name`` so that no reader ever sees it half deleted: renamed out
    of sight first (or, where renaming fails or the backend cannot, its manifest removed
    first), then deleted."""
    if parent.kind(name) is None:
        return
    gone = parent.commit.hide(parent, name)
    discard(parent, gone)
    with contextlib.suppress(CheckpointError):
        parent.sync()


def referrers(parent: Folder, name: str) -> list[str]:
    """The committed checkpoints beside ``name`` in ``parent`` whose manifests refer to data
    files of ``name`` (incremental checkpoints); unreadable manifests are skipped. A
    manifest is parsed only when its bytes hold a ``refs`` member and ``name``."""
    import json

    from .format.manifest import Manifest

    out = []
    for entry in sorted(parent.names()):
        if entry == name or entry.startswith(".") or not is_committed(parent, entry):
            continue
        try:
            with parent.open_folder(entry) as f:
                data = f.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
            if b'"refs":' not in data or json.dumps(name).encode() not in data:
                continue  # no references, or none that can name ``name``: no parse needed
            manifest = Manifest.from_bytes(data, entry)
        except CheckpointError:
            continue
        if any(r.checkpoint == name for r in manifest.refs):
            out.append(entry)
    return out


RETIRED_NAME = "retired.json"
"""In a *retired* checkpoint (no manifest: not a checkpoint any more), the data files that
kept incremental checkpoints still refer to, as ``{"format": "shardsafe-retired", "keep": [...]}``."""


def retired_files(parent: Folder, name: str) -> set[str] | None:
    """The files retired checkpoint ``name`` keeps for others (those of its ``keep`` list
    still there), or None when ``name`` is not a retired checkpoint (a committed one, or none)."""

    try:
        with parent.open_folder(name) as f:
            if f.kind(MANIFEST_NAME) is not None:
                return None
            data = f.read_bytes(RETIRED_NAME, 1 << 26)
            present = set(f.names())
    except CheckpointError:
        return None
    return _keep_list(data) & present


def _keep_list(data: bytes) -> set[str]:
    """The ``keep`` list of a retired.json (an empty set when it is not one)."""
    import json

    try:
        keep = json.loads(data).get("keep", [])
        return {n for n in keep if isinstance(n, str)} if isinstance(keep, list) else set()
    except (ValueError, AttributeError, TypeError, RecursionError):
        return set()


def retire_checkpoint(parent: Folder, name: str, keep: set[str]) -> None:
    """Take checkpoint ``name`` out of sight but keep the data files ``keep`` that other
    checkpoints refer to: the list is written first, then the manifest removed (from then on
    ``name`` is no checkpoint), then every other file. A crash at any point leaves the kept
    files and every other checkpoint intact; :func:`prune_retired` finishes the job."""
    import json

    with parent.open_folder(name) as f:
        f.write_bytes(RETIRED_NAME, json.dumps({"format": "shardsafe-retired", "keep": sorted(keep)}).encode())
        with contextlib.suppress(CheckpointNotFoundError):
            f.remove(MANIFEST_NAME)
    prune_retired(parent, name, keep)


def prune_retired(parent: Folder, name: str, keep: set[str]) -> None:
    """Delete the files of retired checkpoint ``name`` outside ``keep``; the whole folder
    once nothing in it is referred to."""
    with parent.open_folder(name) as f:
        listed = retired_files(parent, name)
        if keep and listed is not None and not keep <= listed:
            # never happens through retention (references only shrink); a retired.json is
            # created once and never replaced (no backend replaces a file in place)
            raise CheckpointError(f"retired checkpoint {name} does not list {sorted(keep - listed)} as kept")
        # A keep list that shrank stays as it is: a superset keeps only files that are gone
        # (retired_files counts those still there), and no crash can leave the folder with
        # neither a manifest nor a retired.json.
        for n in f.names():
            if n not in keep and n != RETIRED_NAME:
                with contextlib.suppress(CheckpointNotFoundError):
                    f.remove(n)
        if keep:
            return
    # Nothing is referred to any more: out of sight first where renames exist (a crash then
    # leaves a -del- sibling, which the next save's cleaning deletes), else retired.json last.
    delete_checkpoint(parent, name)


def clean_leftovers(parent: Folder, name: str) -> list[str]:
    """Repair and clean what interrupted saves and deletions left next to ``name``:
    a parked checkpoint whose replacement never arrived is renamed back to ``name``;
    temp folders nobody holds, other parked folders and ``-del-`` folders are deleted.
    Returns the entries deleted or restored."""
    done = []
    entries = siblings(parent, name)
    parked = [e for e, m in entries if m == OLD_MARK]
    if parked and not is_committed(parent, name):
        for entry in parked:  # the newest committed parked folder goes back
            if is_committed(parent, entry) and parent.kind(name) is None:
                parent.commit.restore(parent, entry, name)
                done.append(entry)
                break
    for entry, mark in entries:
        if entry in done:
            continue
        claim = claim_leftover(parent, entry) if mark == TMP_MARK else None
        if claim is False:
            continue
        try:
            with contextlib.suppress(CheckpointError):
                discard(parent, entry)
                done.append(entry)
        finally:
            if claim:
                claim.release()
    return done


def _is_data(name: str, suffix: str = "") -> bool:
    """A data file or a data file's index (of the save with id ``suffix``, when given)."""
    return (name.startswith("data-") or name.startswith("ref-")) and (
        name.endswith(suffix + DATA_SUFFIX) or name.endswith(suffix + INDEX_SUFFIX))


def _manifest_files(folder: Folder, names: list[str] | None = None) -> set[str] | None:
    """The data file names the manifest in ``folder`` lists (with no manifest, the files a
    retired.json keeps, or none); None when a manifest or retired.json is there but cannot
    be read or parsed. ``names``: the folder's entries when the caller has listed them
    already (no request then asks whether the manifest or retired.json is there)."""
    import json

    try:
        if names is not None:
            manifest, retired = MANIFEST_NAME in names, RETIRED_NAME in names
        else:
            manifest = folder.kind(MANIFEST_NAME) is not None
            retired = not manifest and folder.kind(RETIRED_NAME) is not None
        if not manifest and not retired:
            return set()
        if not manifest:
            data = folder.read_bytes(RETIRED_NAME, 1 << 26)
            kept = _keep_list(data)
            if not kept and b'"keep": []' not in data:
                return set(folder.names())  # unreadable list: keep everything (retention rewrites it)
            return kept
        data = folder.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        body = json.loads(data[: data.rfind(b', "manifest_xxh3_64"')] + b"}")
        files = body.get("files", [])
        if isinstance(files, dict):  # format 3: names follow from ranks and the save id; each has an index
            names = [data_name(r, files.get("id", "")) for r in files.get("rank", []) if isinstance(r, int)]
            return set(names) | {index_name(n) for n in names} | _own_refs(body.get("refs"))
        return {f["name"] for f in files if isinstance(f, dict) and isinstance(f.get("name"), str)}
    except (CheckpointError, ValueError, TypeError, AttributeError, RecursionError):
        return None


def _own_refs(refs: object) -> set[str]:
    """The referenced files a manifest's ``refs`` places in the checkpoint's own folder
    (a self-contained copy's ``ref-*`` files); nothing when ``refs`` is malformed."""
    if not isinstance(refs, dict):
        return set()
    checkpoints, cs, names = refs.get("checkpoints"), refs.get("c"), refs.get("name")
    if not (isinstance(checkpoints, list) and isinstance(cs, list) and isinstance(names, list)):
        return set()
    return {n for c, n in zip(cs, names)
            if isinstance(n, str) and type(c) is int and 0 <= c < len(checkpoints) and checkpoints[c] == ""}


def clean_in_place(folder: Folder, now: float | None = None) -> list[str]:
    """Where saves write in place (object stores): delete data files in the checkpoint folder that its
    manifest does not list and that have not changed for STALE_AFTER seconds (a killed
    save's; a live save's are younger). Returns what it deleted. One listing when the
    folder holds no data file (a fresh save's target)."""
    names = folder.names()
    if not any(_is_data(n) for n in names):
        return []
    keep = _manifest_files(folder, names)
    if keep is None:
        return []  # a manifest or retired.json it cannot read: delete nothing (others may refer to the files)
    now = time.time() if now is None else now
    done = []
    for n in names:
        if n in keep or not _is_data(n):
            continue
        with contextlib.suppress(CheckpointError):
            if now - folder.mtime(n) >= STALE_AFTER:
                folder.remove(n)
                done.append(n)
    return done


def clean_killed_in_place(parent: Folder, name: str, now: float | None = None) -> list[str]:
    """Where saves write in place: the stale data files a killed save left in folder
    ``name`` (see :func:`clean_in_place`); a folder left with nothing else (no manifest: the
    killed save was its first) goes too. Returns what it deleted."""
    with parent.open_folder(name) as f:
        done = clean_in_place(f, now)
        if done and not f.names():
            parent.remove_tree(name)
    return done


def clean_killed(parent: Folder, name: str) -> list[str]:
    """What killed saves left inside checkpoint folder ``name``, where the backend's saves
    write in place (elsewhere they leave temp folders, see :func:`clean_leftovers`)."""
    return parent.commit.clean_killed(parent, name, POLICY)


def refuse_referred(parent: Folder, name: str, action: str, *, retired: bool = False) -> None:
    """Refuse to ``action`` ("replace", "delete", "save onto") checkpoint ``name`` (a retired
    one with ``retired``) while incremental checkpoints beside it refer to its data files:
    a CheckpointError naming them (the first five)."""
    others = referrers(parent, name)
    if others:
        listed = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
        what = "the retired checkpoint" if retired else "the checkpoint"
        raise CheckpointError(
            f"cannot {action} {what} at {parent.where(name)}: incremental checkpoints refer to its data ({listed}); "
            "delete them first (or make them self-contained with 'shardsafe copy')")


def check_target(parent: Folder, name: str, overwrite: bool, ignore: Callable[[str], bool] | None = None) -> None:
    """Refuse a save target that holds a committed checkpoint (unless ``overwrite``) or
    anything that is not a shardsafe checkpoint (entries ``ignore`` accepts aside: where
    saves write in place, a killed save's data files)."""
    kind = parent.kind(name)
    where = parent.where(name)
    if kind is None:
        return
    if kind != "dir":
        raise CheckpointError(f"cannot save to {where}: it exists and is not a folder")
    if is_committed(parent, name, kind):
        if not overwrite:
            raise CheckpointExistsError(f"a checkpoint already exists at {where}; pass overwrite=True to replace it")
        refuse_referred(parent, name, "replace")
        return
    if retired_files(parent, name) is not None:
        refuse_referred(parent, name, "save onto", retired=True)
        prune_retired(parent, name, set())  # nothing refers to its files any more: it is garbage
        return
    with parent.open_folder(name) as f:
        names = [n for n in f.names() if ignore is None or not ignore(n)]
        if names:
            raise CheckpointError(f"cannot save to {where}: the folder is not empty and holds no shardsafe checkpoint")


class _Policy:
    """The rules of this module, as the commit strategies ask for them (``storage.commit.Policy``);
    each call goes through the module's functions as they are at call time."""

    marker = MANIFEST_NAME

    def committed(self, parent: Folder, name: str) -> bool:
        return is_committed(parent, name)

    def check_target(self, parent: Folder, name: str, overwrite: bool, ignore: Callable[[str], bool]) -> None:
        check_target(parent, name, overwrite, ignore)

    def clean_leftovers(self, parent: Folder, name: str) -> list[str]:
        return clean_leftovers(parent, name)

    def clean_stale(self, folder: Folder) -> list[str]:
        return clean_in_place(folder)

    def clean_killed(self, parent: Folder, name: str) -> list[str]:
        return clean_killed_in_place(parent, name)

    def listed(self, folder: Folder) -> set[str] | None:
        return _manifest_files(folder)

    def is_data(self, name: str, suffix: str = "") -> bool:
        return _is_data(name, suffix)

    def discard(self, parent: Folder, entry: str) -> None:
        discard(parent, entry)


POLICY = _Policy()


@dataclass
class SaveTarget:
    """A save under way: its staging folder (``staging``: a temp folder, or in place the
    checkpoint's own), where data files are written."""

    parent: Folder
    name: str
    tmp: str
    staging: Folder
    lock: Lock | None
    suffix: str = ""  # in place (no renames): this save's data files are named data-...<suffix>.safetensors

    @property
    def location(self) -> str:
        """The printable location of the checkpoint being saved."""
        return self.parent.where(self.name)

    def _staged(self) -> Staging:
        return Staging(self.staging, self.tmp, self.lock, self.suffix)

    def commit(self, manifest: bytes, overwrite: bool) -> None:
        """Write the manifest last and publish the checkpoint at its name (see the module
        docstring). Without ``overwrite``, a checkpoint committed meanwhile wins."""
        self.parent.commit.publish(self.parent, self.name, self._staged(), manifest, overwrite, POLICY)

    def abort(self) -> None:
        """Delete what this save wrote: its temp folder, or in place its own data files
        (never raises)."""
        with contextlib.suppress(Exception):
            self.parent.commit.abort(self.parent, self._staged(), POLICY)

    def release(self) -> None:
        """Close the temp folder and drop the lock (after commit or abort)."""
        self.staging.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def publish(parent: Folder, tmp: str, name: str) -> None:
    """Put the finished entry ``tmp`` (a folder or a file) at ``name``, atomically for
    readers: a rename when nothing is there (an empty folder is removed first), else an
    atomic swap, else park-rename-delete with rollback (see the module docstring)."""
    parent.commit.place(parent, tmp, name, POLICY)


def output_entry(parent: Folder, name: str) -> str:
    """The entry a tool builds its output ``name`` in before :func:`publish` puts it in
    place (a hidden temp sibling; where saves write in place, ``name`` itself, emptied)."""
    return parent.commit.output(parent, name)


def reopen_staging(parent: Folder, tmp: str) -> Folder:
    """The staging folder ``tmp`` that rank 0's :func:`begin_save` made (every rank writes there)."""
    return parent.commit.reopen(parent, tmp)


def begin_save(backend: Backend, location: str, overwrite: bool) -> SaveTarget:
    """Check the target, clean leftovers of earlier saves to it, and create and lock a
    fresh temp folder beside it (in place: open the checkpoint's folder)."""
    parent_loc, name = backend.split(location)
    if name in ("", ".", ".."):
        raise CheckpointError(f"cannot save to {location!r}: give a folder name")
    parent = backend.open(parent_loc, create=True)
    try:
        st = parent.commit.begin(parent, name, overwrite, POLICY)
        return SaveTarget(parent, name, st.tmp, st.folder, st.lock, st.suffix)
    except BaseException:
        parent.close()
        raise


def not_found_hint(backend: Backend, location: str) -> str:
    """Why there is no checkpoint at ``location``, when the folder says more: a parked
    previous checkpoint, a manager folder of step checkpoints, a DCP checkpoint."""
    hint = parked_hint(backend, location)
    if hint:
        return hint
    try:
        with backend.open(location) as folder:
            names = folder.names()
    except CheckpointError:
        return ""
    from .steps import parse_step

    steps = sorted(n for n in names if parse_step(n) is not None)
    if steps:
        shown = ", ".join(steps[-3:])
        return (f": it is a folder of step checkpoints ({len(steps)}: ... {shown}); load one of them, or use "
                "CheckpointManager(folder).load(state) for the newest valid one")
    if ".metadata" in names:
        return (": it looks like a torch.distributed.checkpoint (DCP) folder, whose metadata is a pickle; convert "
                f"it once with `shardsafe import {location} OUT --from dcp --trust-pickle` (only if you trust it)")
    return ""


def parked_hint(backend: Backend, location: str) -> str:
    """A note for a missing checkpoint whose previous version sits parked beside it."""
    try:
        parent_loc, name = backend.split(location)
        with backend.open(parent_loc) as parent:
            parked = [e for e, m in siblings(parent, name) if m == OLD_MARK and is_committed(parent, e)]
    except CheckpointError:
        return ""
    if not parked:
        return ""
    return (f" (a previous checkpoint was left at {parent.where(parked[0])} by an interrupted overwrite; "
            "the next save or CheckpointManager restores it)")


def open_committed(backend: Backend, location: str, attempts: int = 3) -> tuple[Folder, bytes]:
    """The folder of the committed checkpoint at ``location`` (held open, so later reads
    see this checkpoint even if another is renamed into its place) and its manifest bytes.
    A folder that loses its manifest between being opened and read (an overwrite swapped
    it out and is deleting it) is opened again from ``location``."""
    for attempt in range(attempts):
        try:
            folder, data = backend.open_and_read(location, MANIFEST_NAME, MAX_MANIFEST_BYTES)
        except CheckpointNotFoundError as exc:
            if getattr(exc, "bucket", None) is not None:  # a missing bucket (s3): the backend's words say it all
                raise
            raise CheckpointNotFoundError(f"no checkpoint at {location}{not_found_hint(backend, location)}") from None
        if data is not None:
            return folder, data
        folder.close()
        if attempt == attempts - 1:
            raise CheckpointNotFoundError(
                f"no checkpoint at {location} (no {MANIFEST_NAME}){not_found_hint(backend, location)}") from None
    raise AssertionError("unreachable")  # pragma: no cover
