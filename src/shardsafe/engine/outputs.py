"""Output files written tensor by tensor through the storage seam: a safetensors file
(header first: every name, dtype and shape is known up front) and a ``torch.save`` file
(a skeleton made with ``torch.serialization.skip_data`` in memory, whose storage bytes are
then filled in place). Both place each tensor at a byte offset known before its data is
read, so a tensor can be written and dropped before the next one is read.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.datafile import ChunkEntry, build_header
from ..format.dtypes import itemsize, safetensors_code
from ..storage.base import Folder, WriteHandle
from .buffers import flat_bytes


@dataclass(frozen=True)
class Slot:
    """A tensor to write: ``key`` in the source, ``name`` in the output, its output dtype and shape."""

    key: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * itemsize(self.dtype)


def _write_tensor(handle: WriteHandle, offset: int, tensor: torch.Tensor) -> None:
    if tensor.numel():
        handle.write([memoryview(flat_bytes(tensor.contiguous()).numpy())], offset)


class OutputFile:
    """An output file being written; ``close`` makes it durable, ``abort`` removes it."""

    handle: WriteHandle | None = None
    offsets: dict[str, int]

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Put ``tensor`` (of ``slot``'s dtype and shape) in its place."""
        assert self.handle is not None
        _write_tensor(self.handle, self.offsets[self._key(slot)], tensor)

    def _key(self, slot: Slot) -> str:
        return slot.name

    def close(self) -> None:
        """Make the file durable and close it."""
        if self.handle is not None:
            h, self.handle = self.handle, None
            h.finish(True)

    def abort(self) -> None:
        """Remove the unfinished file."""
        if self.handle is not None:
            h, self.handle = self.handle, None
            h.abort()


class SafetensorsOutput(OutputFile):
    """A safetensors file whose header is written at once; tensors then go to their places."""

    def __init__(self, folder: Folder, name: str, slots: list[Slot], metadata: dict[str, str] | None = None) -> None:
        entries = [ChunkEntry(s.name, safetensors_code(s.dtype), tuple(s.shape), s.nbytes) for s in slots]
        header, ranges = build_header(entries, dict(metadata or {"format": "pt"}))
        self.offsets = {s.name: start for s, (start, _) in zip(slots, ranges)}
        self.size = ranges[-1][1] if ranges else len(header)
        self.handle = folder.create(name)
        try:
            self.handle.write([memoryview(header)], 0)
        except BaseException:
            self.abort()
            raise


def _pairs(skeleton: Any, loaded: Any) -> Iterator[tuple[Slot, torch.Tensor]]:
    """(slot, loaded fake tensor) for every slot of ``skeleton``, walking both alike."""
    if isinstance(skeleton, Slot):
        yield skeleton, loaded
    elif isinstance(skeleton, dict):
        for k, v in skeleton.items():
            yield from _pairs(v, loaded[k])
    elif isinstance(skeleton, (list, tuple)):
        for v, w in zip(skeleton, loaded):
            yield from _pairs(v, w)


def _fake(skeleton: Any) -> Any:
    if isinstance(skeleton, Slot):
        return torch.empty(skeleton.shape, dtype=skeleton.dtype)
    if isinstance(skeleton, dict):
        return {k: _fake(v) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_fake(v) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_fake(v) for v in skeleton)
    return skeleton


class TorchSaveOutput(OutputFile):
    """A ``torch.save`` file of ``skeleton`` (a tree whose tensors are Slots): the file is
    written without tensor data first; ``write`` then fills each tensor's storage bytes.

    Uses two public (prototype) torch APIs: ``torch.serialization.skip_data`` to save
    fake tensors without their bytes, and loading under ``FakeTensorMode`` to learn each
    storage's offset in the file (``untyped_storage()._checkpoint_offset``). Nothing is
    unpickled from a file: the skeleton is read back from memory we just wrote."""

    def __init__(self, folder: Folder, name: str, skeleton: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.serialization import skip_data

        with FakeTensorMode():
            fake = _fake(skeleton)
        buf = SparseFile()  # the skeleton without the holes skip_data leaves for tensor bytes
        with skip_data(materialize_fake_tensors=True):
            torch.save(fake, buf)
        del fake
        buf.seek(0)
        with FakeTensorMode():
            loaded = torch.load(buf, weights_only=True)
        self.offsets = {}
        for slot, t in _pairs(skeleton, loaded):
            offset = t.untyped_storage()._checkpoint_offset
            if offset is None or t.storage_offset() != 0:
                raise CheckpointError("torch.save skeleton: storage offsets unavailable (torch too old?)")
            self.offsets[slot.key] = int(offset)
        self.handle = folder.create(name)
        try:
            for offset, piece in buf.pieces():
                self.handle.write([memoryview(piece)], offset)
        except BaseException:
            self.abort()
            raise

    def _key(self, slot: Slot) -> str:
        return slot.key


class SparseFile(io.RawIOBase):
    """An in-memory seekable file that keeps only what was written (holes read as zeros),
    so a ``torch.save`` skeleton of a large state costs its metadata, not its size."""

    def __init__(self) -> None:
        super().__init__()
        self._pieces: dict[int, bytes] = {}
        self._pos = 0
        self._end = 0

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._end + offset)
        return self._pos

    def write(self, data) -> int:  # noqa: ANN001 - bytes-like
        b = bytes(data)
        if b:
            self._pieces[self._pos] = b
            self._pos += len(b)
            self._end = max(self._end, self._pos)
        return len(b)

    def readinto(self, out) -> int:  # noqa: ANN001 - a writable buffer
        view = memoryview(out).cast("B")
        n = max(0, min(len(view), self._end - self._pos))
        view[:n] = bytes(n)
        lo, hi = self._pos, self._pos + n
        for start, piece in self._pieces.items():
            a, b = max(lo, start), min(hi, start + len(piece))
            if a < b:
                view[a - lo: b - lo] = piece[a - start: b - start]
        self._pos = hi
        return n

    def pieces(self) -> list[tuple[int, bytes]]:
        """What was written, as (offset, bytes), in file order."""
        return sorted(self._pieces.items())


def write_safetensors(folder: Folder, name: str, tensors: dict[str, torch.Tensor],
                      metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` (CPU) as safetensors file ``name`` of ``folder``, durably. Tensors
    sharing memory (tied weights) are written as separate copies, as safetensors requires."""
    slots = [Slot(k, k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    out = SafetensorsOutput(folder, name, slots, metadata)
    try:
        for s in slots:
            out.write(s, tensors[s.key])
        out.close()
    except BaseException:
        out.abort()
        raise
