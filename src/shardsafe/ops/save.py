"""A save, phase by phase: describe -> plan -> stage -> write -> commit.

Every phase takes and returns plain data (the live tensors stay in the
:class:`~.describe.Described` of the rank that holds them, resolved by the writer); every
collective is a :class:`~shardsafe.comm.Comm` call. Protocol (every rank of the group
calls it):

1. **describe** (:mod:`.describe`, :mod:`.prepare`) each rank describes what it holds;
   rank 0 begins the save (temp folder, lock); one ``all_gather`` of small fixed data
   shares the layouts' signatures, the temp folder and any error.
2. **plan** (:mod:`.prepare`) every rank computes the same global plan (cached by the
   ranks' layouts), takes its own share, less what an incremental save's base holds
   (:mod:`.incremental`), and lays out its data file.
3. **stage** (:func:`stage`) the file's bytes are borrowed or copied into slots of the
   memory budget.
4. **write** (:func:`complete`) the bytes are hashed and written; the file made durable.
5. **commit** (:mod:`.commit`) each rank writes its file's index; rank 0 writes the
   manifest last and publishes the checkpoint; every rank learns whether it committed.

A sync save and an async save are the same run: :func:`start` (phases 1-3) then
:func:`complete` (phases 4-5), by the caller or on a background thread. The one thing
that differs is what waiting permits, decided in :func:`stage_policy`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..comm import Comm
from ..engine.memory import HostMemory
from ..engine.writer import FileWriter
from ..knobs import SYNC_STAGING
from ..state.context import active_group
from ..storage.base import Backend
from .commit import FileResult, file_result, finish, remember
from .compression import choose
from .incremental import VersionMemo
from .prepare import CHECKSUM_BLOCK, PlanCache, PreparedSave, SaveInfo, prepare

__all__ = ["CHECKSUM_BLOCK", "SYNC_STAGING", "PlanCache", "SaveInfo", "SaveRequest", "StagePolicy", "StagedSave",
           "complete", "stage", "stage_policy", "start"]


@dataclass(frozen=True)
class StagePolicy:
    """How a save stages and writes its bytes (the :class:`FileWriter`'s settings)."""

    borrow: bool  # dense CPU tensors are written from their own memory, not copied
    threads: int  # background writer threads
    staging_bytes: int | None  # most bytes of staging slots at once (None: the rank's whole share)
    write_while_staging: bool  # writes start before staging ends
    help_write: bool  # the thread that completes the save writes too


def stage_policy(awaited: bool, write_threads: int, max_staging_bytes: int | None = None) -> StagePolicy:
    """The one place that decides how a save stages. A save whose caller waits for it
    (``awaited``) may borrow its tensors' memory (the caller cannot change them before it
    returns), writes while staging on ``write_threads`` threads (the caller's among them)
    through at most SYNC_STAGING bytes of slots; a save in the background copies every
    byte out (at most ``max_staging_bytes`` at a time) before its caller goes on, and
    writes on one thread of its own."""
    if awaited:
        return StagePolicy(borrow=True, threads=write_threads - 1, staging_bytes=SYNC_STAGING,
                           write_while_staging=True, help_write=True)
    return StagePolicy(borrow=False, threads=1, staging_bytes=max_staging_bytes, write_while_staging=False,
                       help_write=False)


@dataclass
class SaveRequest:
    """What to save where: a save's arguments, resolved to a backend and locations."""

    state: dict[str, Any]
    backend: Backend
    location: str
    overwrite: bool = False
    check_replicas: bool = False
    base: str | None = None  # incremental: the base checkpoint's location (same backend)
    memo: VersionMemo | None = None  # version_skip: the chunk digests of the last save
    compression: str = "off"  # "off", "auto", "zstd" or "lz4" (ops/compression.py)
    bandwidth: float | None = None  # auto: the storage's write bandwidth measured by an earlier raw save
    rates: dict[str, float] | None = None  # auto: each codec's rate (raw bytes/s) in an earlier save here


@dataclass
class StagedSave:
    """A save after phase 3: the bytes are staged (or the error that stopped it)."""

    prep: PreparedSave
    writer: FileWriter | None
    error: BaseException | None
    policy: StagePolicy
    memo: VersionMemo | None
    seconds: float  # spent staging


def start(request: SaveRequest, comm: Comm, group: Any, cache: PlanCache, memory: HostMemory,
          policy: StagePolicy, pin: bool) -> StagedSave:
    """Phases 1-3: describe and plan (``group``: the caller's process group, active while
    the state is described), then stage. A failure in phases 1-2 raises on every rank; a
    failure to stage is kept for :func:`complete` to agree on."""
    with active_group(group, comm.rank, comm.world):
        prep = prepare(request.state, request.backend, request.location, request.overwrite, comm, cache,
                       request.check_replicas, request.base, request.memo)
    return stage(prep, memory, policy, pin, request.memo, request.compression, request.bandwidth, request.rates)


def stage(prep: PreparedSave, memory: HostMemory, policy: StagePolicy, pin: bool,
          memo: VersionMemo | None = None, compression: str = "off", bandwidth: float | None = None,
          rates: dict[str, float] | None = None) -> StagedSave:
    """Phase 3: this rank's file's bytes borrowed or copied into the budget's slots (with
    ``policy.write_while_staging``, written as they are)."""
    t0 = time.perf_counter()
    writer: FileWriter | None = None
    error: BaseException | None = None
    try:
        if prep.error is not None:
            raise prep.error
        if prep.mine is not None:
            assert prep.staging is not None
            codec = choose(compression, prep.mine, prep.described.source, policy.threads + int(policy.help_write),
                           bandwidth, rates)
            writer = FileWriter(prep.staging, prep.mine, prep.described.source, memory, block=CHECKSUM_BLOCK,
                                borrow=policy.borrow, threads=policy.threads, pin=pin,
                                staging_bytes=policy.staging_bytes, write_while_staging=policy.write_while_staging,
                                codec=codec, raw_keys=frozenset(t.key for t in prep.described.local))
            writer.start()
            writer.stage()
    except BaseException as exc:  # noqa: BLE001 - the commit reports it to every rank
        error = exc
        if writer is not None:
            writer.abort(exc)
            writer = None
    return StagedSave(prep, writer, error, policy, memo, time.perf_counter() - t0)


def complete(staged: StagedSave) -> SaveInfo:
    """Phases 4 and 5: the staged bytes written and made durable, then the commit (every
    rank raises the same error when it fails)."""
    prep, error = staged.prep, staged.error
    results: list[FileResult] = []
    t0 = time.perf_counter()
    bandwidth = 0.0
    if staged.writer is not None:
        try:
            written = staged.writer.finish(help_write=staged.policy.help_write)
            if error is None:
                results = [file_result(prep, written)]
                seconds = staged.seconds + time.perf_counter() - t0 if staged.policy.write_while_staging else \
                    time.perf_counter() - t0
                bandwidth = prep.zip_stats[1] / max(seconds, 1e-9)  # chunk bytes (before compression) per second
        except BaseException as exc:  # noqa: BLE001 - agreed on by finish()
            error = error or exc
    info = finish(prep, results, error)
    info.write_bandwidth = bandwidth
    if staged.memo is not None:
        remember(prep, staged.memo)
    return info


def write_one_file(folder: Any, plan: Any, source: Any, memory: HostMemory, *, block: int, codec: str,
                   raw_keys: frozenset[str]) -> Any:
    """Write one data file outside a save (``shardsafe copy --compression``): the same
    writer as a save, borrowing ``source``'s tensors on one thread; aborted (nothing left
    behind) when staging fails. Returns the writer's account (ranges, checksums, digests)."""
    writer = FileWriter(folder, plan, source, memory, block=block, borrow=True, threads=1, codec=codec,
                        raw_keys=raw_keys)
    writer.start()
    try:
        writer.stage()
    except BaseException as exc:
        writer.abort(exc)
        raise
    return writer.finish()
