"""Ray Train integration: shardsafe as the checkpoint layer of ``TorchTrainer``.

Inside ``train_loop_per_worker``::

    from shardsafe.integrations import ray as ss_ray

    step = ss_ray.restore(state) or 0            # resharded onto this run's worker count
    for step in range(step + 1, total + 1):
        ...
        if step % interval == 0:
            ss_ray.report(state, {"loss": loss}, step=step)
    ss_ray.close()

Where the bytes go: every worker writes its own shards, once, straight into the run's
storage (``RunConfig(storage_path=...)``, a filesystem path or ``s3://``), as step
``step`` of a :class:`shardsafe.CheckpointManager` in ``<experiment>/shardsafe/``. Ray is
then handed a *pointer* checkpoint, ``<experiment>/checkpoint_<step>/shardsafe.json`` (a
few hundred bytes naming the step), with ``checkpoint_upload_mode=NO_UPLOAD`` (sync
saves: the pointer is written after the commit) or ``ASYNC`` with a
``checkpoint_upload_fn`` that waits for the commit and then writes the pointer (async
saves). Ray copies and uploads nothing, and registers a checkpoint only once shardsafe
has committed it, so ``ray.train.get_checkpoint()`` never hands back a torn save.

Retention: Ray's ``CheckpointConfig`` decides. Ray deletes the pointer folders it does
not keep; at each ``report`` (and at ``close``) rank 0 asks Ray which checkpoints it keeps
(``ray.train.get_all_reported_checkpoints``) and drops the other shardsafe steps with
:meth:`shardsafe.CheckpointManager.retain`, which retires (keeps the referenced data files
of) a checkpoint that kept incremental checkpoints refer to. The data never lives in a
folder Ray deletes, so no reference dangles. See docs/ray.md.

Only this module imports Ray; it uses shardsafe's public API only.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Mapping
from typing import Any

import ray.train
import torch.distributed as dist

import shardsafe
from shardsafe import Checkpointer, CheckpointError, CheckpointManager

POINTER_NAME = "shardsafe.json"
"""The file in a Ray checkpoint folder that names the shardsafe checkpoint it stands for."""
POINTER_FORMAT = "shardsafe-ray"
POINTER_VERSION = 1
DATA_FOLDER = "shardsafe"
"""The CheckpointManager folder inside the experiment folder: ``<experiment>/shardsafe/step-<N>``."""
STATE_KEY = "train"
"""The top-level key a state that is not a dict (a ``TrainState``, any Stateful) is saved under."""
_RAY_NAME = re.compile(r"^checkpoint_(\d+)$")


def ray_checkpoint_name(step: int) -> str:
    """The name of the Ray checkpoint folder of ``step``: ``checkpoint_00000500``."""
    return f"checkpoint_{step:08d}"


def _tree(state: Any) -> dict[str, Any]:
    """What is saved: a dict as it is, anything else (a TrainState) under STATE_KEY."""
    return state if isinstance(state, dict) else {STATE_KEY: state}


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ----------------------------------------------------------------------------- locations


def storage_url(filesystem: Any, fs_path: str) -> str:
    """The shardsafe location of ``fs_path`` on a Ray storage ``filesystem`` (pyarrow): the
    path itself on the local filesystem, ``s3://<fs_path>`` on S3. Any other filesystem
    raises CheckpointError naming it (shardsafe stores to local paths and ``s3://``)."""
    kind = getattr(filesystem, "type_name", type(filesystem).__name__)
    if kind == "local":
        return fs_path
    if kind == "s3":
        return "s3://" + fs_path.lstrip("/")
    raise CheckpointError(
        f"Ray's storage filesystem {kind!r} (path {fs_path!r}) is not one shardsafe stores to: use a "
        "RunConfig(storage_path=...) on a local or shared filesystem path, or an s3:// URL")


def read_pointer(checkpoint: Any) -> dict[str, Any]:
    """The pointer of a Ray ``checkpoint`` written by :func:`report`. CheckpointError naming
    the file when the checkpoint is not one (a Ray directory checkpoint, a torn folder)."""
    fs, path = checkpoint.filesystem, posixpath.join(checkpoint.path, POINTER_NAME)
    where = f"{storage_url(fs, checkpoint.path)}/{POINTER_NAME}"
    try:
        with fs.open_input_stream(path) as f:
            data = f.read()
    except (FileNotFoundError, OSError) as exc:
        raise CheckpointError(
            f"the Ray checkpoint {storage_url(fs, checkpoint.path)} was not written by "
            f"shardsafe.integrations.ray.report: it has no {POINTER_NAME} ({exc})") from None
    try:
        pointer = json.loads(data)
        ok = (isinstance(pointer, dict) and pointer.get("format") == POINTER_FORMAT
              and type(pointer.get("step")) is int and isinstance(pointer.get("checkpoint"), str))
    except ValueError:
        ok = False
    if not ok:
        raise shardsafe.CorruptCheckpointError(f"{where} is not a shardsafe Ray pointer: {data[:200]!r}")
    if pointer.get("version") != POINTER_VERSION:
        raise shardsafe.FormatVersionError(
            f"{where} has pointer version {pointer.get('version')!r}; this reader knows {POINTER_VERSION}")
    relative = pointer["checkpoint"]
    if relative.startswith("/") or ".." in relative.split("/"):
        raise shardsafe.CorruptCheckpointError(f"{where} points outside its experiment folder: {relative!r}")
    return pointer


def checkpoint_location(checkpoint: Any) -> tuple[str, int]:
    """``(location, step)`` of the shardsafe checkpoint a Ray ``checkpoint`` (from
    ``ray.train.get_checkpoint()``, ``Result.checkpoint`` or ``Result.best_checkpoints``)
    stands for: a path or ``s3://`` URL to pass to ``shardsafe.load`` / ``load_full`` /
    ``shardsafe verify``."""
    pointer = read_pointer(checkpoint)
    experiment = posixpath.dirname(checkpoint.path.rstrip("/"))
    return storage_url(checkpoint.filesystem, posixpath.join(experiment, pointer["checkpoint"])), pointer["step"]


# ----------------------------------------------------------------------------- the session


class RayCheckpointing:
    """shardsafe checkpoints of one Ray Train worker: ``report`` / ``restore`` / ``close``.

    One exists per worker process (the module functions make it on first use). Options:
    ``async_save`` (report returns once the state is staged; Ray registers the checkpoint
    after the background commit), ``incremental`` / ``full_every`` (refer to unchanged
    chunks of the previous step, see docs/incremental.md), ``storage_options`` (for
    ``s3://``: endpoint, credentials; default the AWS environment variables),
    ``memory_budget`` (host bytes for staging, per worker), ``compression`` ("off",
    "auto", "zstd" or "lz4": see shardsafe.save)."""

    def __init__(self, *, async_save: bool = False, incremental: bool = False, full_every: int = 10,
                 storage_options: dict[str, Any] | None = None, memory_budget: int | None = None,
                 compression: str = "off") -> None:
        self.options = {"async_save": bool(async_save), "incremental": bool(incremental),
                        "full_every": int(full_every), "storage_options": dict(storage_options or {}),
                        "memory_budget": memory_budget, "compression": compression}
        self.checkpointer = Checkpointer(storage_options=self.options["storage_options"], memory_budget=memory_budget)
        self._manager: CheckpointManager | None = None
        self._storage: Any = None
        self.last_step: int | None = None
        self._closed = False

    def configure(self, *, storage_options: dict[str, Any] | None = None, **save_options: Any) -> None:
        """Check ``storage_options`` and ``memory_budget`` (when given) against this
        session's, and set the save options (``async_save``, ``incremental``,
        ``full_every``, ``compression``) until the first save fixes them; a different value afterwards is a
        ValueError naming it. None (or an option left out) keeps the session's value."""
        given = {**({} if storage_options is None else {"storage_options": dict(storage_options)}), **save_options}
        for name, value in given.items():
            if name not in self.options:
                raise TypeError(f"unknown option {name!r}")
            fixed = name in ("storage_options", "memory_budget") or self._manager is not None
            if fixed and value != self.options[name]:
                raise ValueError(f"{name}={value!r} differs from {name}={self.options[name]!r} given earlier in this "
                                 "run; pass the same options to every report / restore call of a run")
            self.options[name] = value

    # -- where -------------------------------------------------------------------------
    def _bind(self) -> Any:
        """This run's Ray storage context (the same run for the whole session)."""
        storage = ray.train.get_context().get_storage()
        if self._storage is None:
            self._storage = storage
        elif storage.experiment_fs_path != self._storage.experiment_fs_path:
            raise CheckpointError(
                f"this shardsafe Ray session belongs to the run at {self._storage.experiment_fs_path}, not "
                f"{storage.experiment_fs_path}: call shardsafe.integrations.ray.close() at the end of each run")
        return storage

    def data_folder(self) -> str:
        """The CheckpointManager folder of this run: ``<experiment>/shardsafe``."""
        storage = self._bind()
        return storage_url(storage.storage_filesystem, posixpath.join(storage.experiment_fs_path, DATA_FOLDER))

    @property
    def manager(self) -> CheckpointManager:
        """The CheckpointManager saving this run's steps (made on first use)."""
        if self._closed:
            raise CheckpointError("this shardsafe Ray session is closed")
        if self._manager is None:
            opts = self.options
            # interval 1: report saves whenever it is called; retention comes from Ray (retain), not keep_last
            self._manager = CheckpointManager(
                self.data_folder(), interval=1, async_mode="async" if opts["async_save"] else "disabled",
                incremental=opts["incremental"], full_every=opts["full_every"], compression=opts["compression"],
                checkpointer=self.checkpointer)
        return self._manager

    # -- report ------------------------------------------------------------------------
    def report(self, state: Any, metrics: Mapping[str, Any], *, step: int) -> None:
        """Save ``state`` as step ``step`` into the run's storage and report it to Ray with
        ``metrics`` (every worker calls it, as ``ray.train.report``)."""
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, not {step!r}")
        if self.last_step is not None and step <= self.last_step:
            raise ValueError(f"step {step} is not after step {self.last_step}, the last one reported or restored: "
                             "each report needs a new, larger step (Ray keeps one checkpoint folder per step)")
        storage = self._bind()
        mgr = self.manager
        mgr.wait()  # the async save in flight has committed (its error raised on every rank)
        self._follow_ray_retention()
        future = mgr.save(step, _tree(state))
        self.last_step = step
        name = ray_checkpoint_name(step)
        fs = storage.storage_filesystem
        pointer = None
        if _rank() == 0:
            pointer = ray.train.Checkpoint(path=storage.build_checkpoint_path_from_name(name), filesystem=fs)
        data_path = f"{DATA_FOLDER}/{posixpath.basename(str(mgr.path(step)))}"
        if future is None:  # committed: the pointer, then the report (Ray copies nothing)
            if pointer is not None:
                _write_pointer(pointer, step, data_path)
            ray.train.report(dict(metrics), checkpoint=pointer, checkpoint_dir_name=name,
                             checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD)
            return

        def after_commit(checkpoint: Any, _name: str) -> Any:
            future.result()  # raises the background error: Ray fails the worker, nothing is registered
            _write_pointer(checkpoint, step, data_path)
            return checkpoint

        ray.train.report(dict(metrics), checkpoint=pointer, checkpoint_dir_name=name,
                         checkpoint_upload_mode=ray.train.CheckpointUploadMode.ASYNC,
                         delete_local_checkpoint_after_upload=False, checkpoint_upload_fn=after_commit)

    def _follow_ray_retention(self) -> list[int]:
        """Rank 0: drop the shardsafe steps of this run that Ray no longer keeps (Ray's
        ``CheckpointConfig`` decides; retiring keeps what kept checkpoints refer to)."""
        if _rank() != 0 or self._manager is None:
            return []
        storage = self._storage
        kept: set[int] = set()
        for reported in ray.train.get_all_reported_checkpoints(
                consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED):
            path = reported.checkpoint.path.rstrip("/")
            match = _RAY_NAME.match(posixpath.basename(path))
            if match and posixpath.dirname(path) == storage.experiment_fs_path.rstrip("/"):
                kept.add(int(match.group(1)))
        return self._manager.retain(kept)

    # -- restore -----------------------------------------------------------------------
    def restore(self, state: Any, *, checkpoint: Any = None, strict: bool = True) -> int | None:
        """Load the run's latest checkpoint (``ray.train.get_checkpoint()``; else
        ``checkpoint``, a Ray checkpoint of an earlier run) into ``state`` on this run's
        workers, resharding; returns its step, or None when there is none."""
        self._bind()
        ckpt = ray.train.get_checkpoint() or checkpoint
        if ckpt is None:
            return None
        location, step = _agreed_location(ckpt)
        self.checkpointer.load(_tree(state), location, strict=strict)
        self.last_step = step
        return step

    # -- end ---------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the async save in flight (raising its error), apply Ray's retention
        once more (rank 0) and release buffers. Call it at the end of the training loop."""
        if self._closed:
            return
        try:
            if self._manager is not None:
                self._manager.wait()
                self._follow_ray_retention()
        finally:
            self._closed = True
            if self._manager is not None:
                self._manager.close()
            self.checkpointer.close()


def _agreed_location(checkpoint: Any) -> tuple[str, int]:
    """:func:`checkpoint_location` on every worker, checked to agree: a worker that cannot
    read the pointer (storage not shared, say) or reads another one makes every worker
    raise CheckpointError naming it, instead of the others waiting in the load."""
    try:
        mine: tuple[str, int] | str = checkpoint_location(checkpoint)
        error: CheckpointError | None = None
    except CheckpointError as exc:
        mine, error = f"{type(exc).__name__}: {exc}", exc
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return mine  # type: ignore[return-value]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    failed = [f"rank {r}: {v}" for r, v in enumerate(everyone) if isinstance(v, str)]
    if failed:
        raise CheckpointError(f"cannot restore {checkpoint.path}: " + "; ".join(failed)) from error
    others = [r for r, v in enumerate(everyone) if tuple(v) != tuple(everyone[0])]
    if others:
        raise CheckpointError(f"the workers read different shardsafe checkpoints behind {checkpoint.path}: rank 0 "
                              f"{everyone[0]}, " + ", ".join(f"rank {r} {everyone[r]}" for r in others))
    return mine  # type: ignore[return-value]


def _write_pointer(checkpoint: Any, step: int, data_path: str) -> None:
    """Write ``shardsafe.json`` into the Ray checkpoint folder (after the commit)."""
    fs = checkpoint.filesystem
    fs.create_dir(checkpoint.path)
    body = json.dumps({"format": POINTER_FORMAT, "version": POINTER_VERSION, "step": step,
                       "checkpoint": data_path}).encode()
    with fs.open_output_stream(posixpath.join(checkpoint.path, POINTER_NAME)) as f:
        f.write(body)


# ----------------------------------------------------------------------------- module functions

_SESSION: RayCheckpointing | None = None
_SESSION_KEY: tuple[Any, ...] | None = None


def _session(storage_options: dict[str, Any] | None, **save_options: Any) -> RayCheckpointing:
    """This worker's session for the current run (made on first use). ``storage_options``
    are fixed when it is made, the save options by the first ``report``; a different value
    later is a ValueError naming it."""
    global _SESSION, _SESSION_KEY
    key = (ray.train.get_context().get_storage().experiment_fs_path,
           id(dist.group.WORLD) if dist.is_available() and dist.is_initialized() else None)
    if _SESSION is not None and (_SESSION_KEY != key or _SESSION._closed):
        if not _SESSION._closed:
            _SESSION.close()
        _SESSION = None
    if _SESSION is None:
        _SESSION, _SESSION_KEY = RayCheckpointing(storage_options=storage_options), key
    _SESSION.configure(storage_options=storage_options, **save_options)
    return _SESSION


def report(state: Any, metrics: Mapping[str, Any], *, step: int, async_save: bool = False,
           incremental: bool = False, full_every: int = 10, storage_options: dict[str, Any] | None = None,
           compression: str = "off") -> None:
    """Save the whole training ``state`` (a TrainState or any state tree) as step ``step``
    straight into the run's storage, each worker writing its own shards, and report it to
    Ray with ``metrics`` (no second copy, no upload). Every worker calls it. See
    :class:`RayCheckpointing` for the options."""
    _session(storage_options, async_save=async_save, incremental=incremental,
             full_every=full_every, compression=compression).report(state, metrics, step=step)


def restore(state: Any, *, checkpoint: Any = None, strict: bool = True,
            storage_options: dict[str, Any] | None = None) -> int | None:
    """Restore ``state`` from ``ray.train.get_checkpoint()`` (else ``checkpoint``) on this
    run's workers, resharding to their number; the step restored, or None."""
    return _session(storage_options).restore(state, checkpoint=checkpoint, strict=strict)


def close() -> None:
    """End this worker's session: wait for the async save in flight, apply Ray's retention
    (rank 0), release buffers."""
    global _SESSION, _SESSION_KEY
    session, _SESSION, _SESSION_KEY = _SESSION, None, None
    if session is not None:
        session.close()


__all__ = ["RayCheckpointing", "report", "restore", "close", "checkpoint_location", "read_pointer", "storage_url",
           "ray_checkpoint_name", "POINTER_NAME", "DATA_FOLDER", "STATE_KEY"]
