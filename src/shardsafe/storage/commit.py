"""Commit strategies: how a save's files become a visible checkpoint, chosen once per backend.

A backend's folders carry one strategy (``Folder.commit``); the folder policy
(``shardsafe.checkpoint_folder``) drives every save, deletion and clean-up through it and
never asks which kind of backend it has:

- :class:`RenameCommit` (filesystems): a save builds a hidden temp sibling it holds a lock on,
  writes the manifest last and renames the folder into place (an atomic swap or
  park-rename-delete when a checkpoint is there). Deletions first rename out of sight. Its
  folders are :class:`Renaming` folders: rename, exchange, lock (the filesystem-only
  operations live here, not in the generic seam).
- :class:`InPlaceCommit` (object stores, no renames): data files go straight into the
  checkpoint's folder under names unique to the save; the manifest, published last with a
  conditional write, is the commit; the replaced checkpoint's files go after it.

What a checkpoint is (its manifest, which files a manifest lists, leftovers, targets that
may be saved to) is the policy's business: strategies ask it through :class:`Policy`.
"""

from __future__ import annotations

import contextlib
import errno
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError, StorageError
from .base import Folder

__all__ = ["DEL_MARK", "MARKS", "OLD_MARK", "TMP_MARK", "Commit", "InPlaceCommit", "Lock", "Policy", "RenameCommit",
           "Renaming", "Staging", "hidden_name", "leftover_of"]

TMP_MARK = ".shardsafe-tmp-"
OLD_MARK = ".shardsafe-old-"
DEL_MARK = ".shardsafe-del-"
MARKS = (TMP_MARK, OLD_MARK, DEL_MARK)


def hidden_name(name: str, mark: str) -> str:
    """A fresh hidden sibling name for ``name`` with ``mark`` (tmp, old or del)."""
    return f".{name}{mark}{uuid.uuid4().hex[:12]}"


def leftover_of(entry: str) -> tuple[str, str] | None:
    """(checkpoint name, mark) when ``entry`` is a hidden sibling made by a save, else None."""
    if not entry.startswith("."):
        return None
    for mark in MARKS:
        cut = entry.rfind(mark)
        if cut > 1:
            return entry[1:cut], mark
    return None


class Lock(ABC):
    """An exclusive claim on a folder entry, held until :meth:`release`."""

    @abstractmethod
    def release(self) -> None:
        """Give up the claim (idempotent)."""


class Renaming(Folder):
    """A folder of a filesystem: besides the seam's operations, atomic renames, swaps and
    advisory locks, which :class:`RenameCommit` commits with."""

    @abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Rename entry ``src`` to ``dst`` atomically (``dst`` must not exist)."""

    @abstractmethod
    def exchange(self, a: str, b: str) -> bool:
        """Swap entries ``a`` and ``b`` atomically; False when the filesystem cannot."""

    @abstractmethod
    def lock(self, name: str) -> Lock | None:
        """An exclusive, non-blocking claim on sub-folder ``name``; None when the filesystem
        has no locks. Raises StorageError when someone else holds it."""

    @abstractmethod
    def locked(self, name: str) -> bool | None:
        """True when someone holds the claim on ``name``; None when there are no locks."""


class Policy(Protocol):
    """What a strategy asks the folder policy (``shardsafe.checkpoint_folder``)."""

    marker: str  # the file whose presence makes a folder a checkpoint (written last)

    def committed(self, parent: Folder, name: str) -> bool: ...
    def check_target(self, parent: Folder, name: str, overwrite: bool, ignore: Callable[[str], bool]) -> None: ...
    def clean_leftovers(self, parent: Folder, name: str) -> list[str]: ...
    def clean_stale(self, folder: Folder) -> list[str]: ...
    def clean_killed(self, parent: Folder, name: str) -> list[str]: ...
    def listed(self, folder: Folder) -> set[str] | None: ...
    def is_data(self, name: str, suffix: str = "") -> bool: ...
    def discard(self, parent: Folder, entry: str) -> None: ...


@dataclass
class Staging:
    """Where a save under way writes: ``folder`` (entry ``tmp`` of the parent), the lock it
    holds on it, and the suffix of its data files' names (in place: unique to the save)."""

    folder: Folder
    tmp: str
    lock: Lock | None = None
    suffix: str = ""


def _exists_meanwhile(where: str) -> CheckpointExistsError:
    return CheckpointExistsError(f"a checkpoint was committed at {where} while this save was running; "
                                 "pass overwrite=True to replace it")


class Commit(ABC):
    """How checkpoints become visible (and invisible) on one kind of backend."""

    @abstractmethod
    def begin(self, parent: Folder, name: str, overwrite: bool, policy: Policy) -> Staging:
        """Check the target ``name``, clean what earlier saves left, and make the staging."""

    @abstractmethod
    def reopen(self, parent: Folder, tmp: str) -> Folder:
        """The staging folder ``tmp`` another rank's :meth:`begin` made (all ranks write there)."""

    @abstractmethod
    def publish(self, parent: Folder, name: str, staging: Staging, manifest: bytes, overwrite: bool,
                policy: Policy) -> None:
        """Write ``manifest`` last and make the save visible at ``name`` (without
        ``overwrite``, a checkpoint committed meanwhile wins: CheckpointExistsError)."""

    @abstractmethod
    def abort(self, parent: Folder, staging: Staging, policy: Policy) -> None:
        """Delete what the save wrote (never raises)."""

    @abstractmethod
    def hide(self, parent: Folder, name: str) -> str:
        """Take entry ``name`` out of readers' sight where the backend can (a rename); the
        name it now has."""

    @abstractmethod
    def clean_killed(self, parent: Folder, name: str, policy: Policy) -> list[str]:
        """What killed saves left inside checkpoint folder ``name`` (a manager's cleaning)."""

    @abstractmethod
    def output(self, parent: Folder, name: str) -> str:
        """The entry a tool builds its output ``name`` in (an older output in its way is
        deleted first where the output is built in place)."""

    @abstractmethod
    def place(self, parent: Folder, tmp: str, name: str, policy: Policy) -> None:
        """Put finished entry ``tmp`` (from :meth:`output`) at ``name``, atomically for readers."""

    def claim(self, parent: Folder, entry: str) -> Lock | None:
        """An exclusive claim on temp folder ``entry`` (None: no locks here)."""
        return None

    def held(self, parent: Folder, entry: str) -> bool | None:
        """True when a live save holds ``entry``; None when there are no locks."""
        return None

    def restore(self, parent: Folder, parked: str, name: str) -> None:
        """Rename parked checkpoint ``parked`` back to ``name`` (StorageError without renames)."""
        raise StorageError(f"cannot rename {parent.where(parked)}: this storage has no renames", errno.ENOTSUP,
                           parent.where(parked))


class RenameCommit(Commit):
    """Filesystems: temp sibling under a lock, manifest last, rename (or swap) into place."""

    def begin(self, parent: Folder, name: str, overwrite: bool, policy: Policy) -> Staging:
        assert isinstance(parent, Renaming)
        policy.clean_leftovers(parent, name)
        policy.check_target(parent, name, overwrite, lambda n: False)
        for attempt in range(3):
            tmp = hidden_name(name, TMP_MARK)
            try:
                staging = parent.open_folder(tmp, create=True)
            except CheckpointNotFoundError:
                continue  # another save's cleaning deleted it before we could open it: a new name
            try:
                lock = parent.lock(tmp)
            except CheckpointError:
                staging.close()
                if attempt == 2:
                    raise
                continue  # another save's cleaning claimed it first: a new name
            if lock is not None and parent.kind(tmp) != "dir":  # deleted between open and lock
                lock.release()
                staging.close()
                continue
            return Staging(staging, tmp, lock)
        raise CheckpointError(f"cannot create a temporary folder beside {parent.where(name)}")

    def reopen(self, parent: Folder, tmp: str) -> Folder:
        return parent.open_folder(tmp)

    def publish(self, parent: Folder, name: str, staging: Staging, manifest: bytes, overwrite: bool,
                policy: Policy) -> None:
        staging.folder.write_bytes(policy.marker, manifest)
        staging.folder.sync()
        if not overwrite and policy.committed(parent, name):
            raise _exists_meanwhile(parent.where(name))
        self.place(parent, staging.tmp, name, policy)

    def abort(self, parent: Folder, staging: Staging, policy: Policy) -> None:
        with contextlib.suppress(Exception):
            staging.folder.close()
            policy.discard(parent, staging.tmp)

    def hide(self, parent: Folder, name: str) -> str:
        assert isinstance(parent, Renaming)
        gone = hidden_name(name, DEL_MARK)
        try:
            parent.rename(name, gone)
        except CheckpointError:
            return name
        return gone

    def clean_killed(self, parent: Folder, name: str, policy: Policy) -> list[str]:
        return []  # a killed save's files are in its temp folder: a leftover, cleaned as such

    def output(self, parent: Folder, name: str) -> str:
        return hidden_name(name, TMP_MARK)

    def place(self, parent: Folder, tmp: str, name: str, policy: Policy) -> None:
        """A rename when nothing is at ``name`` (an empty folder is removed first), else an
        atomic swap, else park-rename-delete with rollback (see ``checkpoint_folder``)."""
        assert isinstance(parent, Renaming)
        kind = parent.kind(name)
        if kind is None:
            _rename_synced(parent, tmp, name)
            return
        if kind == "dir" and not policy.committed(parent, name):
            with parent.open_folder(name) as f:
                empty = not f.names()
            if empty:
                parent.remove_tree(name)
                parent.rename(tmp, name)
                parent.sync()
                return
        if parent.exchange(tmp, name):
            try:
                parent.sync()
            except BaseException:
                parent.exchange(tmp, name)  # roll back: the old entry goes back to its name
                raise
            with contextlib.suppress(CheckpointError):
                policy.discard(parent, tmp)  # tmp now names the old entry
            return
        old = hidden_name(name, OLD_MARK)
        parent.rename(name, old)
        try:
            _rename_synced(parent, tmp, name)
        except BaseException:
            parent.rename(old, name)  # roll back: the old entry stays in place
            raise
        with contextlib.suppress(CheckpointError):
            policy.discard(parent, old)

    def claim(self, parent: Folder, entry: str) -> Lock | None:
        assert isinstance(parent, Renaming)
        return parent.lock(entry)

    def held(self, parent: Folder, entry: str) -> bool | None:
        assert isinstance(parent, Renaming)
        return parent.locked(entry)

    def restore(self, parent: Folder, parked: str, name: str) -> None:
        assert isinstance(parent, Renaming)
        parent.rename(parked, name)
        parent.sync()


def _rename_synced(parent: Renaming, tmp: str, name: str) -> None:
    """Rename ``tmp`` to ``name`` durably; renamed back when the sync fails (not published)."""
    parent.rename(tmp, name)
    try:
        parent.sync()
    except BaseException:
        parent.rename(name, tmp)
        raise


class InPlaceCommit(Commit):
    """Object stores: data files under save-unique names in the checkpoint's own folder;
    the manifest published last with a conditional write is the commit."""

    def begin(self, parent: Folder, name: str, overwrite: bool, policy: Policy) -> Staging:
        # in place: a killed save's data files may be in the folder, nothing else
        policy.check_target(parent, name, overwrite, policy.is_data)
        staging = parent.open_folder(name, create=True)
        policy.clean_stale(staging)
        return Staging(staging, name, None, f".{uuid.uuid4().hex[:12]}")

    def reopen(self, parent: Folder, tmp: str) -> Folder:
        return parent.open_folder(tmp, create=True)  # a prefix that may hold no object yet

    def publish(self, parent: Folder, name: str, staging: Staging, manifest: bytes, overwrite: bool,
                policy: Policy) -> None:
        """Publish the manifest (replacing the old one with ``overwrite``, else only if none
        appeared meanwhile), then delete the files of the checkpoint it replaced."""
        folder = staging.folder
        old = (policy.listed(folder) or set()) if overwrite else set()  # unreadable: delete nothing
        try:
            folder.publish_bytes(policy.marker, manifest, replace=overwrite)
        except CheckpointError as exc:
            if not overwrite and getattr(exc, "errno", None) == errno.EEXIST:
                raise _exists_meanwhile(parent.where(name)) from None
            raise
        if not old:
            return  # nothing replaced: no listing needed
        mine = {n for n in folder.names() if policy.is_data(n, staging.suffix)}
        for stale in sorted(old - mine):
            with contextlib.suppress(CheckpointError):
                folder.remove(stale)

    def abort(self, parent: Folder, staging: Staging, policy: Policy) -> None:
        with contextlib.suppress(Exception):
            for n in staging.folder.names():
                if policy.is_data(n, staging.suffix):
                    staging.folder.remove(n)

    def hide(self, parent: Folder, name: str) -> str:
        return name  # no renames: the manifest goes first (see discard)

    def clean_killed(self, parent: Folder, name: str, policy: Policy) -> list[str]:
        return policy.clean_killed(parent, name)

    def output(self, parent: Folder, name: str) -> str:
        if parent.kind(name) is not None:
            parent.remove_tree(name)
        return name

    def place(self, parent: Folder, tmp: str, name: str, policy: Policy) -> None:
        if tmp != name:
            raise StorageError(f"cannot rename {parent.where(tmp)}: this storage has no renames", errno.ENOTSUP,
                               parent.where(tmp))


RENAME = RenameCommit()
IN_PLACE = InPlaceCommit()
