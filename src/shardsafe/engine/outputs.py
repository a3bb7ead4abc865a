"""Output files written tensor by tensor through the storage seam: a safetensors file
(header first: every name, dtype and shape is known up front) and a ``torch.save`` file
(a skeleton written by ``torch.save`` under ``torch.serialization.skip_data`` in memory,
tensors replaced by stand-ins that pickle as torch pickles them; their storage bytes are
then filled in place). Both place each tensor at a byte offset known before its data is
read, so a tensor can be written and dropped before the next one is read; adjacent writes
are gathered (up to ``FLUSH_BYTES``) into one vectored write. ``torch_save_frame`` gives the
bytes around one tensor's data in its own ``torch.save`` file (``export --to dcp``).
"""

from __future__ import annotations

import bisect
import functools
import io
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.datafile import ChunkEntry, build_header
from ..format.dtypes import itemsize, safetensors_code
from ..knobs import FLUSH_BYTES
from ..storage.base import Folder, WriteHandle
from .buffers import flat_bytes


@dataclass(frozen=True)
class Slot:
    """A tensor to write: ``key`` in the source, ``name`` in the output, its output dtype and shape."""

    key: str
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @functools.cached_property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * itemsize(self.dtype)


"""Tensor bytes an output file gathers before writing them (tensors are written whole, so a
larger tensor is written at once): runs of adjacent tensors and fixed bytes (headers,
the torch zip's records) become one vectored write each, not one write per tensor."""


class OutputFile:
    """An output file being written; ``close`` makes it durable, ``abort`` removes it.

    ``write`` gathers up to ``FLUSH_BYTES`` of tensors (holding them), then writes them with
    the fixed bytes that lie before them, each run of adjacent buffers in one ``pwritev``."""

    handle: WriteHandle | None = None
    offsets: dict[str, int]

    def _start(self, folder: Folder, name: str, fixed: list[tuple[int, Any]]) -> None:
        """Create the file; ``fixed``: (offset, bytes) written along with the tensors."""
        self._fixed = sorted(fixed, key=lambda p: p[0])
        self._next_fixed = 0
        self._pending: list[tuple[int, memoryview]] = []
        self._pending_bytes = 0
        self.handle = folder.create(name)

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Put ``tensor`` (of ``slot``'s dtype and shape) in its place."""
        self._queue([self.offsets[slot.name]], tensor)

    def _queue(self, offsets: list[int], tensor: torch.Tensor) -> None:
        assert self.handle is not None
        if not tensor.numel():
            return
        view = tensor_bytes(tensor.contiguous())
        for offset in offsets:
            self._pending.append((offset, view))
            self._pending_bytes += len(view)
        if self._pending_bytes >= FLUSH_BYTES:
            self._flush()

    def _flush(self, final: bool = False) -> None:
        """Write what is pending, with the fixed bytes before its end (all of them if ``final``)."""
        assert self.handle is not None
        items = self._pending
        self._pending, self._pending_bytes = [], 0
        limit = max((o + len(v) for o, v in items), default=0)
        while self._next_fixed < len(self._fixed) and (final or self._fixed[self._next_fixed][0] < limit):
            offset, data = self._fixed[self._next_fixed]
            items.append((offset, memoryview(data)))
            self._next_fixed += 1
        items.sort(key=lambda p: p[0])
        i = 0
        while i < len(items):
            start, first = items[i]
            run, end = [first], start + len(first)
            i += 1
            while i < len(items) and items[i][0] == end:
                run.append(items[i][1])
                end += len(items[i][1])
                i += 1
            self.handle.write(run, start)

    def close(self) -> None:
        """Write what is left, make the file durable and close it."""
        if self.handle is not None:
            self._flush(final=True)
            h, self.handle = self.handle, None
            h.finish(True)

    def abort(self) -> None:
        """Remove the unfinished file."""
        self._pending = []
        if self.handle is not None:
            h, self.handle = self.handle, None
            h.abort()


class SafetensorsOutput(OutputFile):
    """A safetensors file: its header (every name, dtype and shape, known up front) and
    then each tensor at its place."""

    def __init__(self, folder: Folder, name: str, slots: list[Slot], metadata: dict[str, str] | None = None) -> None:
        entries = [ChunkEntry(s.name, safetensors_code(s.dtype), tuple(s.shape), s.nbytes) for s in slots]
        header, ranges = build_header(entries, dict(metadata or {"format": "pt"}))
        self.offsets = {s.name: start for s, (start, _) in zip(slots, ranges)}
        self.size = ranges[-1][1] if ranges else len(header)
        self._start(folder, name, [(0, header)])


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides ``torch.empty(shape)`` has (a size-0 or size-1 dim counts as 1)."""
    strides = []
    acc = 1
    for d in reversed(shape):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@functools.cache
def _reduce_template(dtype: torch.dtype) -> tuple[Any, bool, int]:
    """How ``torch.save`` pickles a CPU tensor of ``dtype``: (rebuild function, whether its
    storage is a TypedStorage (else an UntypedStorage followed by the dtype), number of
    arguments), read off torch's own reduction of an empty tensor of that dtype."""
    func, args = torch.empty(0, dtype=dtype).__reduce_ex__(2)
    return func, isinstance(args[0], torch.TypedStorage), len(args)


def _reduction(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[Any, tuple[Any, ...]]:
    """What ``torch.save`` pickles for a contiguous CPU tensor of ``dtype`` and ``shape``,
    with a storage of the right size that holds no memory (on the meta device, recorded
    with the location ``cpu``, as torch does for a FakeTensor under ``skip_data``)."""
    func, typed, nargs = _reduce_template(dtype)
    numel = 1
    for d in shape:
        numel *= d
    storage: Any = torch.UntypedStorage(numel * itemsize(dtype), device="meta")
    if typed:
        storage = torch.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    storage._fake_device = "cpu"  # the location torch.save records (persistent_id reads it)
    # new tuples every time, as torch makes them (the pickle memoizes by identity)
    args: tuple[Any, ...] = (storage, 0, tuple([*shape]), _contiguous_strides(shape), False, OrderedDict())
    if not typed:
        args += (dtype,)
    if len(args) != nargs:
        raise CheckpointError(f"torch {torch.__version__} pickles a {dtype} tensor with {nargs} arguments, not "
                              f"{len(args)}: this torch is not supported by export --to torch")
    return func, args


class _StandIn:
    """A tensor's place in the skeleton handed to ``torch.save``: pickled as torch pickles
    a tensor of the slot's dtype and shape; notes the order in which torch meets the
    tensors (``torch.save`` names storages ``0, 1, ...`` in that order)."""

    __slots__ = ("slot", "order")

    def __init__(self, slot: Slot, order: list[Slot]) -> None:
        self.slot = slot
        self.order = order

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        self.order.append(self.slot)
        return _reduction(self.slot.dtype, self.slot.shape)


def _stand_ins(skeleton: Any, order: list[Slot]) -> Any:
    if isinstance(skeleton, Slot):
        return _StandIn(skeleton, order)
    if isinstance(skeleton, dict):
        return {k: _stand_ins(v, order) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [_stand_ins(v, order) for v in skeleton]
    if isinstance(skeleton, tuple):
        return tuple(_stand_ins(v, order) for v in skeleton)
    return skeleton


def _pickle_record(obj: Any) -> bytes:
    """The ``data.pkl`` record of ``torch.save(obj)`` (without tensor data)."""
    from torch.serialization import skip_data

    buf = io.BytesIO()
    with skip_data():
        torch.save(obj, buf)
    with zipfile.ZipFile(buf) as zf:
        name = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
        return zf.read(name)


@functools.cache
def check_stand_in(dtype: torch.dtype) -> None:
    """Check, once per dtype and process, that a stand-in pickles exactly as torch pickles
    a real tensor (the same ``data.pkl`` bytes); CheckpointError if this torch differs."""
    for shp in ((2, 3), ()):
        real = _pickle_record({"t": torch.zeros(shp, dtype=dtype), "u": torch.zeros(shp, dtype=dtype)})
        order: list[Slot] = []
        fake = _pickle_record(_stand_ins({"t": Slot("t", "t", dtype, shp), "u": Slot("u", "u", dtype, shp)}, order))
        if real != fake:
            raise CheckpointError(f"torch {torch.__version__} pickles {dtype} tensors in a way export --to torch "
                                  "does not reproduce; export to safetensors instead, or use another torch")


def save_skeleton(skeleton: Any) -> tuple[SparseFile, list[tuple[Slot, int]]]:
    """``torch.save(skeleton)`` without tensor data, in memory: the file's bytes but the
    holes its tensors' data will fill, and (slot, byte offset of its data) for every Slot of
    ``skeleton`` in the file's storage order.

    ``torch.save`` itself writes it, under ``torch.serialization.skip_data`` (so torch lays
    out the zip: records, alignment, version, byte order), with each Slot replaced by a
    stand-in that pickles exactly as torch pickles a CPU tensor of that dtype and shape but
    whose storage holds no memory (checked against torch's own pickling, once per dtype and
    process: :func:`check_stand_in`). Storage ``i`` belongs to the ``i``-th tensor torch
    meets; its data offset is read from the zip's directory with the standard library's
    ``zipfile``. Nothing is unpickled."""
    from torch.serialization import skip_data

    order: list[Slot] = []
    stand_ins = _stand_ins(skeleton, order)
    for dtype in {s.dtype for s in _slots(skeleton)}:
        check_stand_in(dtype)
    buf = SparseFile()
    with skip_data():
        torch.save(stand_ins, buf)
    del stand_ins
    placed: list[tuple[Slot, int]] = []
    with zipfile.ZipFile(buf) as zf:
        records = {i.filename: i for i in zf.infolist()}
        prefix = next((n[: -len("data.pkl")] for n in records if n.endswith("/data.pkl")), None)
        data = [n for n in records if prefix is not None and n.startswith(prefix + "data/")]
        if prefix is None or len(data) != len(order):
            raise CheckpointError(f"torch.save skeleton: {len(data)} storages for {len(order)} tensors")
        for i, slot in enumerate(order):
            info = records.get(f"{prefix}data/{i}")
            if info is None or info.file_size != slot.nbytes or info.compress_type != zipfile.ZIP_STORED:
                raise CheckpointError(f"torch.save skeleton: storage {i} is not the {slot.nbytes} bytes of "
                                      f"tensor '{slot.key}'")
            head = buf.read_at(info.header_offset, 30)
            if head[:4] != b"PK\x03\x04":
                raise CheckpointError(f"torch.save skeleton: no local header for storage {i}")
            n, e = struct.unpack("<HH", head[26:30])
            placed.append((slot, info.header_offset + 30 + n + e))
    return buf, placed


@functools.lru_cache(maxsize=256)
def torch_save_frame(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, bytes]:
    """(bytes before, bytes after) the data in the file ``torch.save`` writes for one CPU
    tensor of ``dtype`` and ``shape``: ``before + the tensor's bytes + after`` is that file
    (``torch.load`` reads it; only the zip's CRC fields, which torch does not check, are 0
    for the data record). Cached per dtype and shape."""
    slot = Slot("", "", dtype, tuple(shape))
    buf, placed = save_skeleton(slot)
    ((_, offset),) = placed
    end = offset + slot.nbytes
    return buf.read_at(0, offset), buf.read_at(end, buf.size - end)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (a byte view of its memory)."""
    if t.dim() and t.numel():
        try:
            return memoryview(t.numpy()).cast("B")  # the fast way, for dtypes numpy has
        except (TypeError, RuntimeError):
            pass
    return memoryview(flat_bytes(t).numpy())


class TorchSaveOutput(OutputFile):
    """A ``torch.save`` file of ``skeleton`` (a tree whose tensors are Slots): the file is
    written without tensor data first (:func:`save_skeleton`, tens of microseconds per
    tensor; torch's FakeTensorMode, used before, cost ~3 ms a tensor: 26 s for 8,000);
    ``write`` then fills each tensor's storage bytes."""

    def __init__(self, folder: Folder, name: str, skeleton: Any) -> None:
        buf, placed = save_skeleton(skeleton)
        self.offsets_of: dict[str, list[int]] = {}
        for slot, offset in placed:
            self.offsets_of.setdefault(slot.key, []).append(offset)
        self._start(folder, name, buf.pieces())

    def write(self, slot: Slot, tensor: torch.Tensor) -> None:
        """Put ``tensor`` at every place the skeleton holds tensor ``slot.key``."""
        self._queue(self.offsets_of[slot.key], tensor)


def _slots(skeleton: Any) -> Iterator[Slot]:
    if isinstance(skeleton, Slot):
        yield skeleton
    elif isinstance(skeleton, dict):
        for v in skeleton.values():
            yield from _slots(v)
    elif isinstance(skeleton, (list, tuple)):
        for v in skeleton:
            yield from _slots(v)


class SparseFile(io.RawIOBase):
    """An in-memory seekable file that keeps only what was written (holes read as zeros),
    so a ``torch.save`` skeleton of a large state costs its metadata, not its size.
    Writes that continue the previous one extend it (one piece per run of bytes)."""

    def __init__(self) -> None:
        super().__init__()
        self._starts: list[int] = []  # sorted, non-overlapping pieces
        self._data: list[bytearray] = []
        self._pos = 0
        self._end = 0
        self._last_end = -1  # where the last piece ends

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    @property
    def size(self) -> int:
        """The file's size (its end, holes included)."""
        return self._end

    def seek(self, offset: int, whence: int = 0) -> int:
        self._pos = offset if whence == 0 else (self._pos + offset if whence == 1 else self._end + offset)
        return self._pos

    def write(self, data) -> int:  # noqa: ANN001 - bytes-like
        b = data if type(data) is bytes else memoryview(data).cast("B")
        n = len(b)
        if not n:
            return 0
        lo, hi = self._pos, self._pos + n
        if lo == self._last_end and self._starts:
            self._data[-1] += b  # the usual case: a write that continues the last piece
            self._pos = self._last_end = hi
            self._end = max(self._end, hi)
            return n
        if not self._starts or self._last_end < lo:
            self._starts.append(lo)
            self._data.append(bytearray(b))
        else:  # overwrites or fills a gap: merge with every piece it touches
            i = bisect.bisect_right(self._starts, lo) - 1
            if i < 0 or self._starts[i] + len(self._data[i]) < lo:
                i += 1
            j = bisect.bisect_right(self._starts, hi)
            start = min(lo, self._starts[i]) if i < j else lo
            end = max([hi] + [self._starts[k] + len(self._data[k]) for k in range(i, j)])
            merged = bytearray(end - start)
            for k in range(i, j):
                merged[self._starts[k] - start: self._starts[k] - start + len(self._data[k])] = self._data[k]
            merged[lo - start: hi - start] = b
            self._starts[i:j] = [start]
            self._data[i:j] = [merged]
        self._last_end = self._starts[-1] + len(self._data[-1])
        self._pos = hi
        self._end = max(self._end, hi)
        return n

    def read_at(self, offset: int, n: int) -> bytes:
        """``n`` bytes from ``offset`` (fewer at the end of the file; holes are zeros)."""
        n = max(0, min(n, self._end - offset))
        out = bytearray(n)
        lo, hi = offset, offset + n
        i = max(0, bisect.bisect_right(self._starts, lo) - 1)
        while i < len(self._starts) and self._starts[i] < hi:
            s, d = self._starts[i], self._data[i]
            a, b = max(lo, s), min(hi, s + len(d))
            if a < b:
                out[a - lo: b - lo] = d[a - s: b - s]
            i += 1
        return bytes(out)

    def readinto(self, out) -> int:  # noqa: ANN001 - a writable buffer
        view = memoryview(out).cast("B")
        got = self.read_at(self._pos, len(view))
        view[: len(got)] = got
        self._pos += len(got)
        return len(got)

    def pieces(self) -> list[tuple[int, bytearray]]:
        """What was written, as (offset, bytes), in file order."""
        return list(zip(self._starts, self._data))
