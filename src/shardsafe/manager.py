"""CheckpointManager: a folder of step checkpoints with an interval, retention, resume
from the latest valid checkpoint, async saves and a final model-only export.

Layout: ``FOLDER/step-00000500/``, one shardsafe checkpoint per step. New saves are named
with 8 digits, zero padded (larger steps simply use more digits); any ``step-<N>`` folder
counts, whatever its padding (``step-100`` saved by hand is step 100, and a save of step
100 then writes to it); two committed folders for one step are a CheckpointError naming
both (see :mod:`shardsafe.steps`). Retention runs on rank 0 after a newer checkpoint
has committed, when ``keep_last`` or ``keep_best`` is set: it keeps the ``keep_last``
newest steps, every step divisible by ``keep_every`` and the ``keep_best`` steps with the
best reported metric, and never deletes the checkpoint being written or the one last loaded.

Metrics: ``save(step, state, metric=value)`` (or ``maybe_save(..., metric=value)``) stores
``{"name": <the manager's metric name>, "value": value}`` as a plain value under the
top-level key ``"shardsafe_metric"`` (:data:`METRIC_KEY`) of that step's checkpoint, so the
ranking survives restarts; loads ignore the key unless the destination asks for it.

``enable=False``: the manager touches nothing on disk (no folder is created, nothing is
cleaned), saves nothing and loads nothing (``load`` returns None).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from .checkpoint_folder import (
    clean_killed,
    clean_leftovers,
    delete_checkpoint,
    is_committed,
    leftover_of,
    prune_retired,
    retire_checkpoint,
    retired_files,
)
from .checkpointer import Checkpointer, SaveFuture
from .comm import Comm, describe, rebuild, resolve
from .errors import (
    BaseCheckpointError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    FormatVersionError,
)
from .hints import warn_user
from .manager_config import ASYNC_MODES, TORCHTITAN_ONLY, CheckpointConfig, refuse_torchtitan_only  # noqa: F401 (re-exported)
from .manager_export import ExportMethods, _join
from .manager_tier import TierMethods
from .ops.incremental import chain_depth
from .ops.load import LoadInfo
from .steps import by_step, parse_step, step_name, width_of
from .storage.base import Folder

PathLike = str | os.PathLike
METRIC_KEY = "shardsafe_metric"
"""Top-level key of a checkpoint that holds the metric reported with ``save(..., metric=)``."""


def step_dir(folder: PathLike, step: int) -> Path | str:
    """The folder of ``step``: ``FOLDER/step-00000500`` (a Path, or a string for URLs)."""
    return _join(folder, step_name(step))


def _from_rank0(comm: Comm, compute: Callable[[], list[int]], size: int | None = None) -> list[int]:
    """``compute()`` run on rank 0, its ints on every rank; a CheckpointError it raises is
    raised on every rank. ``size``: the number of ints when fixed (one broadcast, else
    two; one more on error)."""
    values: list[int] | None = None
    error: CheckpointError | None = None
    if comm.rank == 0:
        try:
            values = compute()
        except CheckpointError as exc:
            error = exc
    if size is not None:
        got = comm.broadcast_ints(None if comm.rank else [0 if values is None else 1] + (values or [0] * size),
                                  size + 1)
        count, values = (-1 if got[0] == 0 else size), got[1:]
    else:
        count = comm.broadcast_ints(None if comm.rank else [-1 if values is None else len(values)], 1)[0]
        if count > 0:
            values = comm.broadcast_ints(values, count)
    if count < 0:
        status = comm.broadcast_status(describe(error, 0) if error is not None else None)
        raise error if error is not None else rebuild(status or ("CheckpointError", "rank 0 failed"))
    return values if count else []


class CheckpointManager(TierMethods, ExportMethods):
    """Step checkpoints in one folder; every rank of the job calls every method.

    The manager owns a :class:`~shardsafe.Checkpointer` (its memory budget, staging
    buffers and async save in flight); ``close()`` releases it. Rank 0 lists the folder,
    chooses what to load and applies retention; the other ranks follow its choice.

    ``keep_best=K`` keeps the K checkpoints with the best ``metric`` (``mode="min"``: lowest
    value) reported through ``save(..., metric=value)``; see the module docstring.
    ``enable=False``: nothing is created, saved or loaded; ``load_only=True``: loads, but
    creates, cleans and saves nothing."""

    def __init__(
        self,
        folder: PathLike,
        *,
        interval: int = 500,
        keep_last: int | None = None,
        keep_every: int | None = None,
        keep_best: int | None = None,
        metric: str = "metric",
        mode: str = "min",
        enable: bool = True,
        load_only: bool = False,
        async_mode: str = "disabled",
        max_staging_bytes: int | None = None,
        exclude_from_loading: str | Iterable[str] = (),
        process_group: Any = None,
        checkpointer: Checkpointer | None = None,
        incremental: bool = False,
        full_every: int = 10,
        version_skip: bool = False,
        compression: str = "off",
        local: PathLike | None = None,
        local_interval: int | None = None,
        local_keep: int = 2,
        replicas: int = 1,
        replica_stride: int | None = None,
        node: int | None = None,
        local_max_bytes: int | None = None,
        local_async: bool = True,
        promote_every: int | None = None,
    ) -> None:
        self.config = CheckpointConfig(
            folder=str(folder), enable=enable, interval=interval, keep_last=keep_last, keep_every=keep_every,
            keep_best=keep_best, metric=metric, mode=mode, load_only=load_only, async_mode=async_mode,
            max_staging_bytes=max_staging_bytes, exclude_from_loading=exclude_from_loading,  # type: ignore[arg-type]
            incremental=incremental, full_every=full_every, version_skip=version_skip, compression=compression)
        self.folder: Path | str = folder if "://" in os.fspath(folder) else Path(folder)
        self.process_group = process_group
        self.checkpointer = checkpointer if checkpointer is not None else Checkpointer(
            pin_memory=self.config.async_mode == "async_pinned")
        self._owns_checkpointer = checkpointer is None
        self._async = self.config.async_mode != "disabled"
        self._pending_step: int | None = None
        self._names: dict[int, str] = {}  # step -> its folder's name, as last listed or saved
        self._loaded_step: int | None = None
        self._metrics: dict[int, float | None] = {}  # step -> its stored metric (rank 0's cache)
        self.last_future: SaveFuture | None = None
        self._closed = False
        backend, location = self.checkpointer.locate(folder)
        self._backend, self._location = backend, location
        self._cleaned = False
        self.tier: Any = None
        self.last_load: LoadInfo | None = None
        self._local_interval = local_interval or interval
        self._local_async = local_async
        self._promote_every = promote_every
        self._local_saves = 0
        if local_interval is not None and local_interval <= 0:
            raise ValueError(f"local_interval must be positive, not {local_interval}")
        if promote_every is not None and promote_every <= 0:
            raise ValueError(f"promote_every must be positive, not {promote_every}")
        if not enable:
            return
        if local is not None:
            from .tier import LocalTier

            self.tier = LocalTier(local, self.checkpointer, keep=local_keep, replicas=replicas, stride=replica_stride,
                                  node=node, max_bytes=local_max_bytes, process_group=process_group)
        if load_only:
            return  # a disabled or load-only manager creates and cleans nothing
        with self._open(create=True):
            pass  # leftovers are cleaned by the first save (an observer never changes the folder)

    @classmethod
    def from_config(cls, config: CheckpointConfig | dict[str, Any], process_group: Any = None) -> CheckpointManager:
        """A manager driven by a :class:`CheckpointConfig` (or its dict form). Settings in
        :data:`TORCHTITAN_ONLY` need torchtitan's trainer: when set they raise ValueError
        naming them (use ``shardsafe.integrations.torchtitan``)."""
        if isinstance(config, dict):
            config = CheckpointConfig.from_dict(config)
        refuse_torchtitan_only(config)
        mgr = cls(config.folder, interval=config.interval, keep_last=config.keep_last, keep_every=config.keep_every,
                  keep_best=config.keep_best, metric=config.metric, mode=config.mode, enable=config.enable,
                  load_only=config.load_only,
                  async_mode=config.async_mode, max_staging_bytes=config.max_staging_bytes,
                  exclude_from_loading=config.exclude_from_loading, process_group=process_group,
                  incremental=config.incremental, full_every=config.full_every, version_skip=config.version_skip,
                  compression=config.compression)
        mgr.config = config
        return mgr

    def _open(self, create: bool = False) -> Folder:
        return self._backend.open(self._location, create=create)

    # -- listing ----------------------------------------------------------------------
    def _listing(self) -> dict[int, str]:
        """Committed step -> its folder's name, as this rank lists the folder (two folders
        for one step: CheckpointError naming both)."""
        try:
            with self._open() as f:
                names = by_step((n for n in f.names() if parse_step(n) is not None and is_committed(f, n)),
                                str(self.folder))
        except CheckpointNotFoundError as exc:
            if getattr(exc, "bucket", None) is not None:  # a missing bucket is no empty folder
                raise
            return {}
        self._names.update(names)
        return names

    def steps(self) -> list[int]:
        """Steps with a committed checkpoint (manifest present), ascending, as this rank sees
        them. Raises CheckpointError when two folders hold one step (``step-100`` and
        ``step-00000100``)."""
        return sorted(self._listing())

    def _agreed_listing(self) -> dict[int, str]:
        """Rank 0's :meth:`_listing` on every rank (every rank calls it; rank 0's error is
        raised on every rank)."""
        comm = resolve(self.process_group)

        def flat() -> list[int]:
            return [v for step, name in sorted(self._listing().items()) for v in (step, width_of(name))]

        pairs = _from_rank0(comm, flat)
        names = {pairs[i]: step_name(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)}
        self._names.update(names)
        return names

    def agreed_steps(self) -> list[int]:
        """Steps with a committed checkpoint as rank 0 lists them, ascending: the same list
        on every rank (every rank calls it)."""
        return sorted(self._agreed_listing())

    def path(self, step: int) -> Path | str:
        """The folder of ``step`` in this manager's folder: its name as the manager last
        listed or saved it (``step-100`` for a checkpoint saved by hand under that name),
        else the name a new save gets (``step-00000100``)."""
        return _join(self.folder, self._names.get(step) or step_name(step))

    def _warn_no_steps(self) -> None:
        """Say why a folder without step checkpoints loads nothing, when it holds committed
        checkpoints under other names (rank 0)."""
        try:
            with self._open() as f:
                others = sorted(n for n in f.names() if not n.startswith(".") and is_committed(f, n))
        except CheckpointError:
            return
        if others:
            shown = ", ".join(repr(n) for n in others[:5]) + (", ..." if len(others) > 5 else "")
            warn_user(f"no step checkpoints in {self.folder}: it holds checkpoints named {shown}, and a "
                      "CheckpointManager loads only folders named step-<N> (like step-100 or step-00000100)")

    def _clean(self, folder: Folder) -> None:
        """Repair and delete what interrupted saves and deletions left (rank 0)."""
        entries = folder.names()
        names = {found[0] for found in (leftover_of(n) for n in entries) if found is not None}
        for name in sorted(names):
            if parse_step(name) is not None:
                with contextlib.suppress(CheckpointError):
                    clean_leftovers(folder, name)
        for name in sorted(n for n in entries if parse_step(n) is not None):  # saves that wrote in place
            with contextlib.suppress(CheckpointError):
                clean_killed(folder, name)

    # -- saving -----------------------------------------------------------------------
    def should_save(self, step: int, *, force: bool = False) -> bool:
        """True when ``maybe_save(step, ...)`` would save: never when disabled or
        ``load_only``; else when forced, at multiples of the interval, and at step 1 with
        ``enable_first_step_checkpoint``."""
        cfg = self.config
        if not cfg.enable or cfg.load_only:
            return False
        return force or step % cfg.interval == 0 or (step == 1 and cfg.enable_first_step_checkpoint) \
            or self._local_due(step)

    def _local_due(self, step: int) -> bool:
        return self.tier is not None and step % self._local_interval == 0

    def maybe_save(self, step: int, state: dict[str, Any], *, force: bool = False,
                   metric: float | None = None) -> bool:
        """Save when :meth:`should_save` says so; True if it saved. ``metric`` as in :meth:`save`.
        With a local tier, a step due for the local tier is saved there (see :meth:`save_local`);
        a step due for both is saved to both."""
        if not self.should_save(step, force=force):
            return False
        if self._local_due(step):
            self.save_local(step, state)
        cfg = self.config
        if force or step % cfg.interval == 0 or (step == 1 and cfg.enable_first_step_checkpoint):
            self.save(step, state, metric=metric)
        return True

    def save(self, step: int, state: dict[str, Any], *, metric: float | None = None) -> SaveFuture | None:
        """Save ``state`` as step ``step`` (sync or async per ``async_mode``), then apply
        retention. ``metric``: a number stored with the checkpoint under :data:`METRIC_KEY`
        that ``keep_best`` ranks by. A disabled or ``load_only`` manager saves nothing."""
        if not self.config.enable or self.config.load_only:
            return None
        self._complete_pending()
        if metric is not None:
            if METRIC_KEY in state:
                raise ValueError(f"the state has a top-level key {METRIC_KEY!r}, which the manager uses for metrics")
            state = {**state, METRIC_KEY: {"name": self.config.metric, "value": float(metric)}}
        self._metrics[step] = None if metric is None else float(metric)
        if not self._cleaned and resolve(self.process_group).rank == 0:
            self._cleaned = True
            with self._open(create=True) as f:
                self._clean(f)
        path, base = self._targets(step)
        skip = self.config.version_skip and self.config.incremental

        def start(base: Path | str | None) -> SaveFuture | None:
            if not self._async:
                self.checkpointer.save(state, path, overwrite=True, process_group=self.process_group, base=base,
                                       version_skip=skip, compression=self.config.compression)
                return None
            return self.checkpointer.async_save(state, path, overwrite=True, process_group=self.process_group,
                                                max_staging_bytes=self.config.max_staging_bytes, base=base,
                                                version_skip=skip, compression=self.config.compression)

        try:
            future = start(base)
        except BaseCheckpointError as exc:  # every rank got it: every rank saves in full instead
            warn_user(f"step {step}: saved in full, its base cannot be used: {exc}")
            future = start(None)
        if not self._async:
            self._retain(protect=step)
            return None
        self._pending_step = step
        self.last_future = future
        return self.last_future

    def _targets(self, step: int) -> tuple[Path | str, Path | str | None]:
        """(the folder to save ``step`` to, the incremental base or None), chosen by rank 0
        and followed by every rank. The folder is the one that already holds ``step``
        (whatever its spelling), else ``step_name(step)``. The base (with ``incremental``):
        the newest committed checkpoint before ``step``, unless the chain ending there
        already has ``full_every - 1`` incremental saves (then a full save)."""
        comm = resolve(self.process_group)
        got = _from_rank0(comm, lambda: self._choose_targets(step), size=3)
        width, base, base_width = got
        self._names[step] = step_name(step, width)
        if base >= 0:
            self._names[base] = step_name(base, base_width)
        return self.path(step), None if base < 0 else self.path(base)

    def _choose_targets(self, step: int) -> list[int]:
        """Rank 0's choice for :meth:`_targets`: [width of the step's name, base step or -1,
        width of the base's name]."""
        canonical = step_name(step)
        with self._open(create=True) as f:
            spelt = [n for n in f.names() if parse_step(n) == step and (n == canonical or is_committed(f, n))]
            if len(spelt) > 1 and not is_committed(f, canonical):
                spelt.remove(canonical)
            name = by_step(spelt, str(self.folder)).get(step, canonical)
        base, base_width = -1, 0
        if self.config.incremental:
            try:
                earlier = {s: n for s, n in self._listing().items() if s < step}
                if earlier and self.config.full_every > 1:
                    last = max(earlier)
                    m = self.checkpointer.read_manifest(_join(self.folder, earlier[last]), indexes=False)
                    if chain_depth(m) + 1 < self.config.full_every:
                        base, base_width = last, width_of(earlier[last])
            except CheckpointError as exc:  # an unreadable newest checkpoint: save in full
                warn_user(f"incremental save of step {step} is a full save: {exc}")
        return [width_of(name), base, base_width]

    def _complete_pending(self) -> None:
        """Wait for the async save in flight; on success apply retention."""
        if self.tier is not None:
            self.tier.wait()
        if self._pending_step is None:
            return
        step, self._pending_step = self._pending_step, None
        self.checkpointer.wait()  # raises the background error, if any
        self._retain(protect=step)

    def wait(self) -> None:
        """Block until any async save has committed (raises its error)."""
        self._complete_pending()

    def _retain(self, protect: int) -> None:
        """Delete checkpoints outside the retention policy (rank 0 only). Each deletion
        takes the checkpoint out of readers' sight first (see ``checkpoint_folder``)."""
        cfg = self.config
        if resolve(self.process_group).rank != 0 or (cfg.keep_last is None and cfg.keep_best is None):
            return
        try:
            names = self._listing()
        except CheckpointError as exc:  # e.g. two folders for one step: the user must choose
            warn_user(f"retention skipped: {exc}")
            return
        steps = sorted(names)
        keep = set(steps[-cfg.keep_last:]) if cfg.keep_last else set()
        if cfg.keep_every:
            keep |= {s for s in steps if s % cfg.keep_every == 0}
        if cfg.keep_best:
            keep |= set(self.best_steps(steps))
        keep.add(protect)
        self._drop(names, keep)

    def retain(self, keep: Iterable[int]) -> list[int]:
        """Delete every committed step checkpoint not in ``keep`` (rank 0 only; the other
        ranks do nothing), the way the retention policy does: a dropped checkpoint that a
        kept one refers to is retired (the data files kept checkpoints need stay), never
        left dangling; the checkpoint last loaded and the save in flight are kept. For an
        outside policy (e.g. Ray Train's ``CheckpointConfig``) deciding what is kept.
        Returns the steps dropped, ascending."""
        if resolve(self.process_group).rank != 0 or not self.config.enable or self.config.load_only:
            return []
        try:
            names = self._listing()
        except CheckpointError as exc:
            warn_user(f"retention skipped: {exc}")
            return []
        keep = {int(s) for s in keep}
        if self._pending_step is not None:
            keep.add(self._pending_step)
        return self._drop(names, keep)

    def _drop(self, names: dict[int, str], keep: set[int]) -> list[int]:
        """Delete (or retire, when kept checkpoints refer to them) the steps of ``names``
        outside ``keep`` and the last loaded step; prune retired folders (rank 0)."""
        steps = sorted(names)
        dropped: list[int] = []
        if self._loaded_step is not None:
            keep = keep | {self._loaded_step}
        try:
            needed = self._referenced([names[s] for s in steps if s in keep], set(names.values()))
        except CheckpointError as exc:  # unreadable kept manifest: delete nothing this time
            warn_user(f"retention skipped: {exc}")
            return dropped
        with self._open() as f:
            for s in steps:
                if s not in keep:
                    name = names[s]
                    try:
                        if needed.get(name):
                            retire_checkpoint(f, name, needed[name])
                        else:
                            delete_checkpoint(f, name)
                    except CheckpointError as exc:  # retention must not fail training: the next one retries
                        warn_user(f"retention could not delete {self.path(s)}: {exc}")
                        continue
                    self._metrics.pop(s, None)
                    self._names.pop(s, None)
                    dropped.append(s)
            for name in f.names():
                if parse_step(name) is None or name in names.values():
                    continue
                kept = retired_files(f, name)
                if kept is not None and (kept != needed.get(name, set()) or not kept):
                    with contextlib.suppress(CheckpointError):
                        prune_retired(f, name, needed.get(name, set()))
        return dropped

    def _referenced(self, kept: list[str], steps: set[str]) -> dict[str, set[str]]:
        """Checkpoint name -> the data files in it that the kept step folders ``kept``, and
        any other committed checkpoint in the folder (not one of the step folders
        ``steps``: one saved there by hand under another name), refer to."""
        paths = [_join(self.folder, name) for name in kept]
        with self._open() as f:
            for name in sorted(f.names()):
                if not name.startswith(".") and name not in steps and is_committed(f, name):
                    paths.append(_join(self.folder, name))
        out: dict[str, set[str]] = {}
        for i, path in enumerate(paths):
            try:
                m = self.checkpointer.read_manifest(path, indexes=False)
            except CheckpointError:
                if i < len(kept):
                    raise  # a kept step we cannot read: delete nothing this time
                continue  # a folder of someone else's with a manifest.json: not ours to keep alive
            for r in m.refs:
                if r.checkpoint:
                    out.setdefault(r.checkpoint, set()).add(r.name)
        return out

    def metric(self, step: int) -> float | None:
        """The metric stored in step ``step``'s checkpoint under this manager's metric name
        (None when it has none, was saved under another name, or cannot be read)."""
        if step not in self._metrics:
            value = None
            try:
                stored = self.checkpointer.load_full(self.path(step), keys=METRIC_KEY)[METRIC_KEY]
                if isinstance(stored, dict) and stored.get("name") == self.config.metric:
                    value = float(stored["value"])
            except (CheckpointError, KeyError, TypeError, ValueError):
                value = None
            self._metrics[step] = value
        return self._metrics[step]

    def best_steps(self, steps: list[int] | None = None) -> list[int]:
        """The ``keep_best`` steps (all ranked ones when keep_best is None) with the best
        metric, best first; ties go to the newer step, NaN never ranks."""
        scored = [(v, s) for s in (self.steps() if steps is None else steps)
                  if (v := self.metric(s)) is not None and not math.isnan(v)]
        sign = 1.0 if self.config.mode == "min" else -1.0
        scored.sort(key=lambda vs: (sign * vs[0], -vs[1]))
        return [s for _, s in scored[:self.config.keep_best]]

    # -- loading ----------------------------------------------------------------------
    def load(self, state: dict[str, Any], step: int | None = None, *, strict: bool = True,
             cast_dtype: bool | None = None) -> int | None:
        """Load step ``step``, or the latest valid checkpoint when None (skipping incomplete
        or corrupt ones with a warning naming them). Returns the step loaded, or None when
        there is no checkpoint (always, when the manager is disabled). Keys in
        ``exclude_from_loading`` are left untouched. ``cast_dtype`` (default: the config's)
        converts tensors saved in another dtype, as :func:`shardsafe.load` does.

        Rank 0 chooses the candidates (its listing) and every rank follows, so ranks with
        different views of the folder (NFS attribute caches) never restore different
        steps; the load itself checks that every rank read the same manifest."""
        if not self.config.enable:
            return None
        self._complete_pending()
        if step is None and self.config.load_step is not None:
            step = self.config.load_step
        candidates = [step] if step is not None else list(reversed(self.agreed_steps()))
        cast = self.config.cast_dtype if cast_dtype is None else cast_dtype
        if self.tier is not None:
            got = self._restore_local(state, step, candidates[0] if candidates and step is None else None,
                                      strict=strict, exclude=self.config.exclude_from_loading, cast_dtype=cast)
            if got is not None:
                return got
        for s in candidates:
            try:
                self.last_load = self.checkpointer.load(state, self.path(s), strict=strict,
                                                        process_group=self.process_group,
                                                        exclude=self.config.exclude_from_loading, cast_dtype=cast)
                self.last_load.tier = "persistent"
            except (CorruptCheckpointError, CheckpointNotFoundError, FormatVersionError) as exc:
                if step is not None:
                    raise
                warn_user(f"skipping checkpoint {self.path(s)}: {exc}")
                continue
            self._loaded_step = s
            return s
        return None

    # -- lifecycle --------------------------------------------------------------------
    def close(self) -> None:
        """Wait for pending work; the manager can no longer save afterwards."""
        if self._closed:
            return
        try:
            self._complete_pending()
        finally:
            self._closed = True
            if self.tier is not None:
                self.tier.close()
            if self._owns_checkpointer:
                self.checkpointer.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
