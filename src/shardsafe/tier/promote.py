"""Promotion: a local step copied to the persistent folder, nothing staged from the model.

The persistent save is built and committed as any save to that backend is (rank 0 begins
it: a temp folder and rename on filesystems, save-unique names on object stores, the
manifest published last); each data file and its index is copied by one rank whose node
holds it, byte for byte, streamed within the budget. The local copies were verified when
they were written and received; the persistent copy's manifest is checked with the
reader's rules before it is published.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..checkpoint_folder import begin_save, reopen_staging
from ..checkpointer import Checkpointer
from ..comm import describe, rebuild
from ..errors import CheckpointError
from ..format.file_index import data_name, index_name
from ..format.manifest import MANIFEST_NAME, Manifest
from ..ops.commit import checked_manifest
from ..steps import step_name
from ..storage.base import Folder
from .local import LocalTier, manifest_files

PIECE = 8 << 20


def promote(tier: LocalTier, step: int, cp: Checkpointer, path: str | os.PathLike, process_group: Any = None
            ) -> None:
    """Copy local step ``step`` (complete across the live nodes) to ``path`` (every rank
    calls; collectives on the tier's group). Raises CheckpointError, the same on every
    rank, when the step is not complete or a copy fails; nothing is published then."""
    del process_group  # the tier's group spans the same ranks
    tc = tier.tcomm
    found = tier.find()
    if found is None or found[0].step != step:
        have = "none" if found is None else str(found[0].step)
        raise CheckpointError(f"cannot promote local step {step}: it is not complete across the live nodes "
                              f"(newest complete local step: {have})")
    where = found[1]
    src = min(r for ranks in where.values() for r in ranks)
    data = None
    if tc.rank == src:
        with tier._folder() as f, f.open_folder(step_name(step)) as s:
            data = s.read_bytes(MANIFEST_NAME, 1 << 30)
    data = tc.broadcast_bytes(data, src)
    manifest = Manifest.from_bytes(data, f"local step {step}'s manifest")
    backend, location = cp.locate(path)
    target = None
    begun: bytes | None = None
    if tc.rank == 0:
        try:
            target = begin_save(backend, location, overwrite=True)
            begun = json.dumps({"tmp": target.tmp, "suffix": target.suffix}).encode()
        except Exception as exc:  # noqa: BLE001 - sent to every rank
            begun = json.dumps({"error": list(describe(exc, 0))}).encode()
    got = json.loads(tc.broadcast_bytes(begun, 0))
    if "error" in got:
        raise rebuild(tuple(got["error"]))  # type: ignore[arg-type]
    suffix = got["suffix"]
    error: BaseException | None = None
    try:
        mine = _assignment(manifest, where, tc.rank, suffix)
        parent_loc, _ = backend.split(location)
        with backend.open(parent_loc, create=True) as parent, reopen_staging(parent, got["tmp"]) as staging, \
                tier._folder() as root, root.open_folder(step_name(step)) as local:
            for old, new in mine:
                _copy(local, old, staging, new, cp)
    except Exception as exc:  # noqa: BLE001 - agreed on below
        error = exc
    try:
        tc.agree(error)
    except BaseException:
        if target is not None:
            target.abort()
            target.release()
            target.parent.close()
        raise
    status = None
    if target is not None:
        try:
            out = manifest.with_file_id(suffix) if manifest.indexed else manifest
            target.commit(checked_manifest(out), True)
        except Exception as exc:  # noqa: BLE001
            target.abort()
            status = describe(exc, 0)
        finally:
            target.release()
            target.parent.close()
    status = tc.broadcast_status(status)
    if status is not None:
        raise rebuild(status)


def _assignment(manifest: Manifest, where: dict[str, list[int]], rank: int, suffix: str) -> list[tuple[str, str]]:
    """(local name, persistent name) of the files this rank copies: each data file with its
    index, by the holder with the fewest bytes assigned so far (the same on every rank)."""
    sizes = manifest_files(manifest)
    load: dict[int, int] = {}
    out = []
    for e in manifest.files:
        holders = [r for r in where.get(e.name, []) if r in where.get(e.index_name, [r])]
        if not holders:
            raise CheckpointError(f"cannot promote: no node holds both {e.name} and its index")
        who = min(holders, key=lambda r: (load.get(r, 0), r))
        load[who] = load.get(who, 0) + sizes[e.name]
        if who == rank:
            new = data_name(e.rank, suffix) if manifest.indexed else e.name
            out.append((e.name, new))
            if manifest.indexed:
                out.append((e.index_name, index_name(new)))
    return out


def _copy(src: Folder, name: str, dst: Folder, new: str, cp: Checkpointer) -> None:
    """Stream file ``name`` of ``src`` into ``dst`` as ``new``, durably."""
    lease = cp.memory.lease(max(1 << 20, min(PIECE, cp.memory.fits(PIECE))))
    try:
        view = memoryview(lease.tensor.numpy())
        with src.open_read(name) as h:
            size = h.size
            w = dst.create(new)
            try:
                off = 0
                while off < size:
                    n = min(len(view), size - off)
                    h.read_into([view[:n]], off)
                    w.write([view[:n]], off)
                    off += n
                w.finish(durable=True)
            except BaseException:
                w.abort()
                raise
    finally:
        lease.release()


__all__ = ["promote"]
