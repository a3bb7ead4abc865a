"""Rewrite a format-3 checkpoint as format 2.0, for readers of shardsafe releases that
read 2.x only: one manifest with every chunk's byte range and checksums in its chunk
table, rank-local values inline, no file indexes. Data files are not touched."""

from __future__ import annotations

import contextlib
from typing import Any

from ..errors import CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME, FileEntry, Manifest, TensorEntry
from .common import PathLike


def write_format2(path: PathLike, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Rewrite the committed checkpoint at ``path`` in format 2.0 (every index read and
    verified first; the new manifest replaces the old one atomically and durably, then the
    indexes are removed). Returns the new manifest. A format-2 checkpoint is left as it is."""
    from ..api import default_checkpointer

    cp = default_checkpointer()
    m = cp.read_manifest(path, storage_options)
    if not m.indexed:
        return m
    tensors = {k: TensorEntry(e.dtype, e.shape, e.kind, list(e.chunks), e.layout) for k, e in m.tensors.items()}
    files = [FileEntry(f.name, f.nbytes, f.rank, f.header_bytes, f.header_checksum) for f in m.files]
    rank_local = {k: list(m.rank_local[k]) for k in m.rank_local}
    v2 = Manifest(m.tree, tensors, files, m.world_size, rank_local, m.created, m.writer, m.extra)
    backend, location = cp.locate(path, storage_options)
    with backend.open(location) as folder:
        folder.publish_bytes(MANIFEST_NAME, v2.to_bytes(), replace=True)
        for f in m.files:
            with contextlib.suppress(CheckpointNotFoundError):
                folder.remove(f.index_name)
    return v2


__all__ = ["write_format2"]
