"""``shardsafe copy SRC DST``: copy a checkpoint between any two backends (local <-> s3),
streaming, verifying every checksum on the way, committing last.

Each data file is read in windows of whole checksum blocks (at most ``window`` bytes), each
block hashed and compared with the manifest before its bytes are written to the
destination; the destination is built and committed exactly as a save builds and commits
(temp folder and rename locally, per-copy file names and the manifest published last on
object stores), so a failed or killed copy leaves no checkpoint (and any previous one at
DST intact). The manifest is written again with the destination's file names (in the
current format version).

An incremental checkpoint's copy is self-contained: each file it refers to (in other
checkpoints) is copied whole into the destination as ``ref-<N><id>.safetensors`` (the
chunks the checkpoint uses verified on the way), and the copy's manifest refers to those
files in its own folder; the indexes stay byte for byte.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..checkpoint_folder import begin_save
from ..checkpointer import Checkpointer
from ..errors import CheckpointError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.file_index import data_name, index_name
from ..format.manifest import FileEntry, Manifest
from ..format.refs import RefFile
from ..knobs import COPY_WINDOW as WINDOW
from ..ops.load import block_size
from ..plan.load_plan import BlockCheck, chunk_checks
from .common import PathLike, human_bytes


@dataclass
class CopyReport:
    """What ``copy_checkpoint`` did."""

    src: str
    dst: str
    files: int
    bytes: int
    seconds: float

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return dict(self.__dict__)

    def to_text(self) -> str:
        """A one-line summary."""
        rate = f", {human_bytes(self.bytes / self.seconds)}/s" if self.seconds > 0 else ""
        return (f"copied {self.src} to {self.dst}: {self.files} data files, {human_bytes(self.bytes)}, "
                f"checksums verified, in {self.seconds:.2f} s{rate}")


def _windows(checks: list[BlockCheck], limit: int) -> list[list[BlockCheck]]:
    out: list[list[BlockCheck]] = []
    for c in checks:
        if out and out[-1][-1].hi == c.lo and c.hi - out[-1][0].lo <= limit:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def copy_checkpoint(src: PathLike, dst: PathLike, *, overwrite: bool = False, window: int = WINDOW,
                    checkpointer: Checkpointer | None = None, compression: str | None = None) -> CopyReport:
    """Copy the committed checkpoint at ``src`` to ``dst`` (any two backends), verifying
    every block and header checksum while streaming; ``dst`` is committed last (replacing
    a checkpoint there only with ``overwrite``). Memory: one window (8 MiB).

    ``compression`` ("zstd", "lz4" or "off"): the data files are written again with that
    codec, or raw (tools/recompress.py; memory: one data file's tensors)."""
    if compression is not None and compression not in ("zstd", "lz4", "off"):
        raise CheckpointError(f"compression={compression!r}: expected 'zstd', 'lz4' or 'off'")
    t0 = time.perf_counter()
    cp = checkpointer if checkpointer is not None else Checkpointer()
    total = 0
    try:
        with cp.open_reader(src) as reader:
            manifest = reader.manifest
            block = block_size(manifest)
            backend, location = cp.locate(dst)
            target = begin_save(backend, location, overwrite)
            try:
                if compression is not None:
                    from ..ops.commit import checked_manifest
                    from .recompress import recompressed_manifest

                    out, total = recompressed_manifest(manifest, reader, cp, target,
                                                       "" if compression == "off" else compression)
                    target.commit(checked_manifest(out), overwrite)
                    return CopyReport(str(src), str(dst), len(manifest.files), total, time.perf_counter() - t0)
                files: list[FileEntry] = []  # format 2: new names; format 3 derives them from the save id
                for index, entry in enumerate(manifest.files):
                    name = data_name(entry.rank, target.suffix, len([f for f in files if f.rank == entry.rank]))
                    total += _copy_file(reader, index, target.staging, name, block, window)
                    if manifest.indexed:  # the index, verified against the manifest when read, byte for byte
                        target.staging.write_bytes(index_name(name), manifest.index(index).raw)
                    files.append(FileEntry(name, entry.nbytes, entry.rank, entry.header_bytes, entry.header_checksum))
                out = manifest.with_file_id(target.suffix) if manifest.indexed else \
                    Manifest(manifest.tree, manifest.tensors, files, manifest.world_size, manifest.rank_local,
                             manifest.created, manifest.writer, manifest.extra)
                if manifest.refs:
                    reader.fetch_all_indexes()
                    refs = []
                    for j, ref in enumerate(manifest.refs):
                        name = f"ref-{j:05d}{target.suffix}.safetensors"
                        total += _copy_referenced(reader, len(manifest.files) + j, target.staging, name, block,
                                                  window)
                        refs.append(RefFile("", name, ref.nbytes))
                    out.refs = refs
                    out.extra = {k: v for k, v in out.extra.items() if k != "incremental"}  # no longer in a chain
                target.commit(out.to_bytes(), overwrite)
            except BaseException:
                target.abort()
                raise
            finally:
                target.release()
                target.parent.close()
    finally:
        if checkpointer is None:
            cp.close()
    return CopyReport(str(src), str(dst), len(manifest.files), total, time.perf_counter() - t0)


def _copy_referenced(reader: Any, file: int, folder: Any, name: str, block: int, window: int) -> int:
    """Stream referenced file ``file`` whole to ``folder``/``name``, verifying the blocks of
    every chunk the checkpoint refers to in it; its size."""
    manifest: Manifest = reader.manifest
    ref = manifest.ref_file(file)
    assert ref is not None
    checks = sorted({(c.lo, c.hi): c for f in range(len(manifest.files)) for o, chunk in manifest.index(f).referred()
                     if chunk.file == file for c in chunk_checks(manifest.key_of(o), chunk, None, block)}.values(),
                    key=lambda c: c.lo)
    handle = reader.files.handle(file)
    if manifest.version >= (3, 2) and manifest.zrows(file):
        return _copy_verbatim(reader, file, folder, name, ref.nbytes, checks, window)
    out = folder.create(name)
    try:
        buf = bytearray(max(window, block))
        pos = 0
        for c in [*checks, None]:
            stop = ref.nbytes if c is None else c.lo
            while pos < stop:  # bytes this checkpoint does not use: copied as they are
                n = min(len(buf), stop - pos)
                view = memoryview(buf)[:n]
                handle.read_into([view], pos)
                out.write([view], pos)
                pos += n
            if c is None:
                break
            view = memoryview(buf)[: c.hi - c.lo]
            if c.hi > c.lo:
                handle.read_into([view], c.lo)
            if checksum(view) != c.expected:
                raise CorruptCheckpointError(
                    f"checksum mismatch in {reader.files.name(file)}, tensor '{c.key}', bytes {c.lo}-{c.hi}")
            if c.hi > c.lo:
                out.write([view], c.lo)
            pos = c.hi
        out.finish()
    except BaseException:
        out.abort()
        raise
    return ref.nbytes


def _copy_file(reader: Any, index: int, folder: Any, name: str, block: int, window: int) -> int:
    """Stream data file ``index`` to ``folder``/``name``, verifying as it goes; its size."""
    manifest: Manifest = reader.manifest
    entry = manifest.files[index]
    handle = reader.files.handle(index)
    reader.fetch_indexes([index])  # format 3: the file's chunks are listed in its index
    checks = sorted((c for key, chunk in manifest.chunks_in_file(index)
                     for c in chunk_checks(key, chunk, None, block)), key=lambda c: c.lo)
    if manifest.version >= (3, 2) and manifest.zrows(index):
        reader.files.check_header(index)
        return _copy_verbatim(reader, index, folder, name, entry.nbytes, checks, window)
    out = folder.create(name)
    try:
        header = bytearray(entry.header_bytes)
        handle.read_into([memoryview(header)], 0)
        if checksum(header) != entry.header_checksum:
            raise CorruptCheckpointError(f"checksum mismatch in the header of {reader.files.name(index)}")
        out.write([memoryview(header)], 0)
        pos = entry.header_bytes
        buf = bytearray(max(window, block))
        for w in _windows(checks, max(window, block)):
            lo, hi = w[0].lo, w[-1].hi
            if lo != pos:
                raise CorruptCheckpointError(f"{reader.files.name(index)}: bytes {pos}-{lo} belong to no chunk")
            view = memoryview(buf)[: hi - lo]
            if hi > lo:
                handle.read_into([view], lo)
            for c in w:
                if checksum(view[c.lo - lo: c.hi - lo]) != c.expected:
                    raise CorruptCheckpointError(
                        f"checksum mismatch in {reader.files.name(index)}, tensor '{c.key}', bytes {c.lo}-{c.hi}")
            if hi > lo:
                out.write([view], lo)
            pos = hi
        if pos != entry.nbytes:
            raise CorruptCheckpointError(f"{reader.files.name(index)}: bytes {pos}-{entry.nbytes} belong to no chunk")
        out.finish()
    except BaseException:
        out.abort()
        raise
    return entry.nbytes


def _copy_verbatim(reader: Any, file: int, folder: Any, name: str, nbytes: int, checks: list, window: int) -> int:
    """A file with compressed chunks (format 3.2): every block the checkpoint uses is read
    and verified (compressed ones decompressed, bounded), then the file's stored bytes
    are copied as they are; its size."""
    handle = reader.files.handle(file)
    for c in checks:
        view = memoryview(bytearray(c.hi - c.lo))
        if c.hi > c.lo:
            handle.read_into([view], c.lo)
        if checksum(view) != c.expected:
            raise CorruptCheckpointError(
                f"checksum mismatch in {reader.files.name(file)}, tensor '{c.key}', bytes {c.lo}-{c.hi}")
    raw = getattr(handle, "inner", handle)
    out = folder.create(name)
    try:
        buf = bytearray(window)
        pos = 0
        while pos < nbytes:
            view = memoryview(buf)[: min(window, nbytes - pos)]
            raw.read_into([view], pos)
            out.write([view], pos)
            pos += len(view)
        out.finish()
    except BaseException:
        out.abort()
        raise
    return nbytes
