"""Rewrite a local format-3 checkpoint as format 2.0, for readers of shardsafe releases
that read 2.x only: one manifest with every chunk's byte range and checksums in its chunk
table, rank-local values inline, no file indexes. Data files are not touched."""

from __future__ import annotations

from pathlib import Path

from ..format.manifest import MANIFEST_NAME, FileEntry, Manifest, TensorEntry


def write_format2(path: str | Path) -> Manifest:
    """Rewrite the committed local checkpoint at ``path`` in format 2.0 (every index read
    and verified first; the new manifest is written, then the indexes removed). Returns
    the new manifest. A format-2 checkpoint is left as it is."""
    from ..api import read_manifest

    path = Path(path)
    m = read_manifest(path)
    if not m.indexed:
        return m
    tensors = {k: TensorEntry(e.dtype, e.shape, e.kind, list(e.chunks), e.layout) for k, e in m.tensors.items()}
    files = [FileEntry(f.name, f.nbytes, f.rank, f.header_bytes, f.header_checksum) for f in m.files]
    rank_local = {k: list(m.rank_local[k]) for k in m.rank_local}
    v2 = Manifest(m.tree, tensors, files, m.world_size, rank_local, m.created, m.writer, m.extra)
    tmp = path / (MANIFEST_NAME + ".format2")
    tmp.write_bytes(v2.to_bytes())
    tmp.replace(path / MANIFEST_NAME)
    for f in m.files:
        (path / f.index_name).unlink(missing_ok=True)
    return v2


__all__ = ["write_format2"]
