"""``shardsafe copy --compression zstd|lz4|off``: a copy whose data files are written
again with another codec (format 3.2), or raw.

Each data file of the source is rewritten with the same chunks in the same order: every
chunk is read (a compressed one decompressed, bounded by its blocks' declared lengths) and
its block checksums verified, then the file is written by the save's own
:class:`~shardsafe.engine.writer.FileWriter` (``ops.save.write_one_file``) with the chosen codec, and its index rebuilt
(the same rows, rank-local values and tensors; block checksums and chunk digests are over
the uncompressed bytes, so they come out unchanged). Memory: one data file's chunks at a
time. Checkpoints that refer to other checkpoints' files (incremental) are refused: copy
them without ``--compression``.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.datafile import ChunkEntry, build_header, chunk_name
from ..format.dtypes import safetensors_code, torch_dtype
from ..format.file_index import ZIP_VERSION, IndexedChunk, build_index, data_name, index_name
from ..format.manifest import FORMAT_VERSION, FileEntry, Manifest
from ..layout import Box
from ..plan.save_plan import ChunkWrite, FileWrite


def _rows(manifest: Manifest, index: int) -> list[tuple[int, str, Any]]:
    """(ordinal, key, chunk) of every chunk of data file ``index``, in file order."""
    fi = manifest.index(index)
    rows = [(t, manifest.key_in_file(index, t), fi.chunk(r)) for r, t in enumerate(fi.ordinals)]
    if fi.zchunks is not None:
        rows += [(t, manifest.key_of(t), c) for t, c in zip(fi.zchunks.ordinals,
                                                              fi.zchunks.table.chunks(0, len(fi.zchunks.ordinals)))]

    def stored_start(row: tuple[int, str, Any]) -> int:
        z = manifest.zrow(row[2]) if manifest.version >= (3, 2) else None
        return row[2].start if z is None else z.start

    return sorted(rows, key=stored_start)


def _read_chunk(reader: Any, key: str, chunk: Any, dtype: torch.dtype, block: int) -> torch.Tensor:
    """A chunk's tensor, read from its file and checked block by block."""
    out = torch.empty(chunk.lengths, dtype=dtype)
    n = chunk.end - chunk.start
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy()) if n else memoryview(b"")
    if n:
        reader.files.handle(chunk.file).read_into([view], chunk.start)
    for b, expected in enumerate(chunk.checksum):
        if checksum(view[b * block: (b + 1) * block]) != expected:
            raise CorruptCheckpointError(f"checksum mismatch in {reader.files.name(chunk.file)}, tensor '{key}', "
                                         f"block {b}: the data is corrupt")
    return out


def recompress_file(reader: Any, cp: Any, index: int, folder: Any, name: str, codec: str
                    ) -> tuple[FileEntry, bool]:
    """Write data file ``index`` of ``reader``'s checkpoint again as ``folder``/``name`` with
    ``codec`` ("" for raw), and its index; returns its entry and whether it is compressed."""
    from ..ops.save import write_one_file

    manifest: Manifest = reader.manifest
    block = manifest.extra["checksum_block"]
    fi = manifest.index(index)
    rows = _rows(manifest, index)
    tensors: dict[int, torch.Tensor] = {}
    entries = []
    meta = []
    for i, (_, key, c) in enumerate(rows):
        entry = manifest.tensors[key]
        dtype = torch_dtype(entry.dtype)
        if dtype is None:
            raise CorruptCheckpointError(f"tensor '{key}': unknown dtype {entry.dtype!r}")
        tensors[i] = _read_chunk(reader, key, c, dtype, block)
        whole = tuple(c.lengths) == tuple(entry.shape) and not any(c.offsets)
        nbytes = c.end - c.start
        entries.append(ChunkEntry(chunk_name(key, c.offsets, whole), safetensors_code(dtype), tuple(c.lengths),
                                  nbytes))
        meta.append((key, Box(tuple(c.offsets), tuple(c.lengths)), whole, safetensors_code(dtype)))
    header, ranges = build_header(entries)
    chunks = [ChunkWrite(key, box, whole, code, lo, hi) for (key, box, whole, code), (lo, hi) in zip(meta, ranges)]
    plan = FileWrite(name, fi.rank, header, chunks)
    order = {id(cw): i for i, cw in enumerate(chunks)}
    written = write_one_file(folder, plan, lambda cw: tensors[order[id(cw)]], cp.memory, block=block, codec=codec,
                             raw_keys=frozenset(fi.local_tensors))
    got = written.ranges or [(cw.start, cw.end) for cw in chunks]
    stored = written.stored or [()] * len(chunks)
    rows_out = [IndexedChunk(t, tuple(c.offsets), tuple(c.lengths), lo, hi, sums, digest,
                             codec=written.codec if z else "", stored=z)
                for (t, _, c), sums, digest, (lo, hi), z in zip(rows, written.checksums, written.digests, got, stored)]
    data = build_index(fi.rank, written.entry.header_bytes, written.entry.header_checksum, rows_out,
                       dict(fi.local_tensors), fi.rank_local)
    folder.write_bytes(index_name(name), data)
    e = written.entry
    return FileEntry(name, e.nbytes, e.rank, e.header_bytes, e.header_checksum, len(data), checksum(data)), any(stored)


def recompressed_manifest(manifest: Manifest, reader: Any, cp: Any, target: Any, codec: str) -> tuple[Manifest, int]:
    """Every data file rewritten into ``target``'s staging folder; the copy's manifest and its bytes."""
    if not manifest.indexed or manifest.refs:
        raise CheckpointError("copy --compression needs a format-3 checkpoint without references to other "
                              "checkpoints (an incremental checkpoint: copy it whole, without --compression)")
    reader.fetch_all_indexes()
    out = manifest.with_file_id(target.suffix)
    zipped = False
    total = 0
    for i, entry in enumerate(manifest.files):
        new, z = recompress_file(reader, cp, i, target.staging, data_name(entry.rank, target.suffix), codec)
        out.files[i] = new
        zipped |= z
        total += new.nbytes
    out.version = ZIP_VERSION if zipped else FORMAT_VERSION
    out.requires = ["compression"] if zipped else []
    return out, total


__all__ = ["recompress_file", "recompressed_manifest"]
