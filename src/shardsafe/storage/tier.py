"""The node-local tier's storage: the local filesystem (tmpfs or NVMe) with a commit
strategy for folders that are not shared between nodes.

A local save writes each rank's files into a staging folder on the rank's own node. Its
name is fixed by the step (:func:`tier_tmp`), so every rank opens it without asking rank
0, and :class:`TierCommit` creates it on every node that writes there. Rank 0's publish
writes the manifest into its own node's staging folder and stops there: the tier
(``shardsafe.tier``) copies the manifest to every node, replicates the files to peers,
and only then renames each node's staging folder into place (:func:`publish_node`).

Locations are ``shardsafe-tier://local/<absolute path>`` (:func:`tier_location`), so the
manager's Checkpointer routes them here and plain paths keep the ordinary strategy.
"""

from __future__ import annotations

import os

from .base import Folder
from .commit import TMP_MARK, RenameCommit, Staging
from .local import LocalBackend, LocalFolder

TIER_SCHEME = "shardsafe-tier"
_PREFIX = f"{TIER_SCHEME}://local"


def tier_location(path: str | os.PathLike) -> str:
    """The location of local-tier folder ``path`` (an absolute path of this node)."""
    return _PREFIX + os.path.abspath(os.fspath(path))


def tier_tmp(name: str) -> str:
    """The staging folder of local checkpoint ``name``: the same name on every node (a
    hidden temp sibling that the folder policy cleans as a leftover)."""
    return f".{name}{TMP_MARK}tier"


class TierCommit(RenameCommit):
    """Every node stages in :func:`tier_tmp`; publish writes the manifest there and does not
    rename (the tier renames each node's folder once replication is done)."""

    def begin(self, parent: Folder, name: str, overwrite: bool, policy: object) -> Staging:
        tmp = tier_tmp(name)
        return Staging(parent.open_folder(tmp, create=True), tmp, None)

    def reopen(self, parent: Folder, tmp: str) -> Folder:
        return parent.open_folder(tmp, create=True)

    def publish(self, parent: Folder, name: str, staging: Staging, manifest: bytes, overwrite: bool,
                policy: object) -> None:
        staging.folder.write_bytes(policy.marker, manifest)  # type: ignore[attr-defined]
        staging.folder.sync()


TIER_COMMIT = TierCommit()


class TierFolder(LocalFolder):
    """A local-tier folder: a local directory committing by :class:`TierCommit`."""

    commit = TIER_COMMIT


class TierBackend(LocalBackend):
    """The local filesystem under ``shardsafe-tier://local`` locations (see module docstring)."""

    folder_class = TierFolder

    @staticmethod
    def path_of(location: str) -> str:
        """The filesystem path of a tier location."""
        return location[len(_PREFIX):] if location.startswith(_PREFIX) else location

    def open(self, location: str, create: bool = False) -> Folder:
        return super().open(self.path_of(location), create)

    def split(self, location: str) -> tuple[str, str]:
        parent, name = super().split(self.path_of(location))
        return _PREFIX + parent, name

    def exists(self, location: str) -> bool:
        return super().exists(self.path_of(location))


def publish_node(parent: Folder, name: str) -> None:
    """Rename this node's staging folder of ``name`` into place (an older ``name`` is
    removed first: local steps are rewritten whole)."""
    tmp = tier_tmp(name)
    if parent.kind(name) is not None:
        parent.remove_tree(name)
    parent.rename(tmp, name)  # type: ignore[attr-defined]
    parent.sync()




def tier_backend() -> LocalBackend:
    """A backend for ``shardsafe-tier://local`` locations (what callers above storage/ use)."""
    return TierBackend()


__all__ = ["TIER_SCHEME", "TierBackend", "TierCommit", "TierFolder", "publish_node", "tier_backend", "tier_location",
           "tier_tmp"]
