"""Reading S3 objects: ranged GETs pinned to the object's ETag, streamed into their
destinations in pieces of ``STREAM_PIECE`` bytes (:mod:`shardsafe.knobs`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import obstore
from obstore import exceptions as obx

from ...errors import CheckpointChangedError, CorruptCheckpointError, StorageError
from ...knobs import STREAM_PIECE
from ..base import ReadHandle
from ..memcopy import copy_bytes
from .errors import _NOT_FOUND, RangeNotSupportedError, _range_not_supported, _whole_object_answer

if TYPE_CHECKING:
    from .folder import S3Folder


def _bytes_view(b: memoryview) -> memoryview:
    return b.cast("B") if (b.format != "B" or b.ndim != 1) else b


class S3ReadHandle(ReadHandle):
    """An object opened for ranged GETs, pinned to the ETag it had when opened."""

    def __init__(self, folder: S3Folder, name: str, size: int, etag: str | None) -> None:
        self.folder = folder
        self.name = name
        self.size = size
        self.etag = etag
        self.where = folder.where(name)
        self.key = folder.key(name)

    def _get(self, store: Any, lo: int, hi: int) -> Any:
        """The answer to a GET of ``[lo, hi)`` pinned to the ETag opened; a server that
        answers with the whole object (200, not 206) raises RangeNotSupportedError."""
        opts: dict[str, Any] = {"range": (lo, hi)}
        if self.etag:
            opts["if_match"] = self.etag
        try:
            return obstore.get(store, self.key, options=opts)
        except obx.BaseError as exc:
            if _whole_object_answer(exc):
                raise _range_not_supported(self.where, lo, hi) from exc
            raise

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        """One ranged GET of the whole range, streamed into ``buffers`` in pieces of
        ``STREAM_PIECE`` bytes (memory stays bounded whatever the range); a transient
        failure midway resumes from the first byte not yet received. An object that ends
        first is corrupt, one replaced or deleted meanwhile has changed."""
        views = [v for v in (_bytes_view(memoryview(b)) for b in buffers) if len(v)]
        total = sum(len(v) for v in views)
        if not total:
            return
        end = offset + total
        if end > self.size:
            raise CorruptCheckpointError(f"{self.where}: file ends at byte {self.size}, expected at least {end}")
        store = self.folder.b.store
        sink = _Scatter(views)

        def get() -> None:
            lo = offset + sink.done
            for piece in self._get(store, lo, end).stream(min_chunk_size=STREAM_PIECE):
                if not sink.put(memoryview(piece)):
                    raise CorruptCheckpointError(f"{self.where}: the server sent more than the {total} bytes "
                                                 f"asked for from byte {offset}")

        try:
            self.folder.backend.call("read", self.where, get,
                                     (*_NOT_FOUND, obx.PreconditionError, CorruptCheckpointError,
                                      RangeNotSupportedError))
        except obx.PreconditionError:
            raise CheckpointChangedError(f"{self.where} was replaced while it was read") from None
        except _NOT_FOUND:
            raise CheckpointChangedError(f"{self.where} was deleted while it was read") from None
        if sink.done < total:
            raise CorruptCheckpointError(
                f"{self.where}: file ends at byte {offset + sink.done}, expected at least {end}")

    def stream_to(self, lo: int, hi: int, sink: Callable[[memoryview, int], None], piece: int = 0) -> None:
        """One ranged GET of ``[lo, hi)`` streamed to ``sink`` in pieces (resumed after a
        transient failure from the first byte not yet handed over)."""
        if hi <= lo:
            return
        if hi > self.size:
            raise CorruptCheckpointError(f"{self.where}: file ends at byte {self.size}, expected at least {hi}")
        store = self.folder.b.store
        pos = [lo]

        def get() -> None:
            for chunk in self._get(store, pos[0], hi).stream(min_chunk_size=piece or STREAM_PIECE):
                view = memoryview(chunk)
                if pos[0] + len(view) > hi:
                    raise CorruptCheckpointError(f"{self.where}: the server sent more than asked for")
                sink(view, pos[0])
                pos[0] += len(view)

        try:
            self.folder.backend.call("read", self.where, get,
                                     (*_NOT_FOUND, obx.PreconditionError, CorruptCheckpointError, StorageError))
        except obx.PreconditionError:
            raise CheckpointChangedError(f"{self.where} was replaced while it was read") from None
        except _NOT_FOUND:
            raise CheckpointChangedError(f"{self.where} was deleted while it was read") from None
        if pos[0] < hi:
            raise CorruptCheckpointError(f"{self.where}: file ends at byte {pos[0]}, expected at least {hi}")

    def close(self) -> None:
        pass



class _Scatter:
    """Copies a stream of pieces into consecutive buffers; ``done`` counts bytes placed."""

    def __init__(self, views: list[memoryview]) -> None:
        self.views = views
        self.index = 0  # the buffer being filled
        self.at = 0  # bytes of it filled
        self.done = 0

    def put(self, piece: memoryview) -> bool:
        """Place ``piece``; False when it does not fit (more bytes than asked for)."""
        piece = _bytes_view(piece)
        i, n = 0, len(piece)
        while i < n:
            if self.index >= len(self.views):
                return False
            v = self.views[self.index]
            m = min(len(v) - self.at, n - i)
            copy_bytes(v[self.at: self.at + m], piece[i: i + m])
            i += m
            self.at += m
            self.done += m
            if self.at == len(v):
                self.index += 1
                self.at = 0
        return True

