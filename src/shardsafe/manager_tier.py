"""The local-tier methods of CheckpointManager (``local=``): local saves, the restore
from the fastest complete copy, promotion to the persistent folder (see shardsafe.tier)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from .checkpointer import SaveFuture
from .errors import CheckpointError
from .hints import warn_user

_tier_log = logging.getLogger("shardsafe.tier")


class TierMethods:
    """Mixed into CheckpointManager; uses its tier, config, checkpointer and retention."""

    tier: Any
    config: Any
    checkpointer: Any
    last_load: Any
    _loaded_step: int | None
    _local_async: bool
    _promote_every: int | None
    _local_saves: int

    def _complete_pending(self) -> None: ...  # CheckpointManager's
    def _targets(self, step: int) -> tuple[Any, Any]: ...  # noqa: D102
    def _retain(self, protect: int) -> None: ...  # noqa: D102

    def save_local(self, step: int, state: dict[str, Any]) -> SaveFuture | None:
        """Save ``state`` as step ``step`` to the node-local tier (``local=``): each rank's
        files on its node, copied to ``replicas - 1`` peers, committed on every node once
        all are there (async unless ``local_async=False``: :meth:`wait` joins it). Every
        ``promote_every``-th local save is then copied to the persistent folder
        (:meth:`promote`). Raises CheckpointError when the manager has no local tier, or
        the local folder cannot hold it (checked before the first local save)."""
        if self.tier is None:
            raise CheckpointError("this CheckpointManager has no local tier: pass local='/dev/shm/<run>'")
        if not self.config.enable or self.config.load_only:
            return None
        self._complete_pending()
        future = self.tier.save(step, state, async_save=self._local_async, compression=self.config.compression,
                                **({"max_staging_bytes": self.config.max_staging_bytes}
                                   if self._local_async and self.config.max_staging_bytes else {}))
        self._local_saves += 1
        if self._promote_every and self._local_saves % self._promote_every == 0:
            self.tier.wait()
            self.promote(step)
        return future

    def local_steps(self) -> list[int]:
        """The local steps complete across the live nodes, newest first, as far as the newest
        (every rank calls it: one all-gather)."""
        if self.tier is None:
            return []
        found = self.tier.find()
        return [] if found is None else [found[0].step]

    def _restore_local(self, state: dict[str, Any], step: int | None, persistent: int | None,
                       **load_kwargs: Any) -> int | None:
        """Restore the newest step complete in the local tier when it is at least as new as
        the persistent folder's newest (``persistent``) or is the ``step`` asked for; None
        (with a log line saying why) when the persistent folder must be used."""
        found = self.tier.find()
        if found is None or (step is not None and found[0].step != step) or \
                (step is None and persistent is not None and found[0].step < persistent):
            why = "no local step is complete across the live nodes" if found is None else \
                f"the newest complete local step is {found[0].step}" + \
                (f", step {step} was asked for" if step is not None else f", the persistent folder has {persistent}")
            _tier_log.info("local tier: loading from the persistent folder: %s", why)
            return None
        try:
            restored = self.tier.restore(state, found, **load_kwargs)
        except CheckpointError as exc:
            warn_user(f"local tier: step {found[0].step} could not be restored ({exc}); loading from the "
                      "persistent folder")
            return None
        _tier_log.info("local tier: restored step %d from %s (%d bytes received from peers)", restored.step,
                       "this node's folder" if restored.tier == "local" else "this node's folder and peers",
                       restored.received)
        self.last_load = restored.info
        self._loaded_step = restored.step
        return restored.step

    def promote(self, step: int) -> Path | str:
        """Copy local step ``step`` to the persistent folder (each rank its node's files, no
        staging from the model; the manifest last), then apply retention. Returns its path."""
        from .tier.promote import promote

        if self.tier is None:
            raise CheckpointError("this CheckpointManager has no local tier to promote from")
        self.tier.wait()
        path, _ = self._targets(step)
        promote(self.tier, step, self.checkpointer, path, self.process_group)
        self._retain(protect=step)
        return path

