"""Writing S3 objects: positional writes assembled into fixed-size parts (leased from
the host-memory budget), each part uploaded once complete through botocore's multipart
upload, several at once; a file within one part is a single PUT."""

from __future__ import annotations

import contextlib
import errno
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from botocore.exceptions import ClientError

from ... import workers
from ...budget import HostMemory, Lease
from ...errors import StorageError
from ..base import WriteHandle
from .config import MAX_PARTS
from .errors import _client_error
from .reads import _bytes_view

if TYPE_CHECKING:
    from .folder import S3Folder

T = TypeVar("T")


class _Part:
    """The buffer of one part, leased from the backend's memory budget without waiting (the
    writer filling it may hold a staging slot of the same budget), and the byte ranges of
    it written so far. Buffers are kept by the budget for the next parts (``keep``): a
    save after a save allocates nothing (freed 16 MiB buffers stay in malloc's arenas and
    grew the RSS by about 4 parts per save when each part had a new one)."""

    __slots__ = ("lease", "buf", "ranges", "have")

    def __init__(self, memory: HostMemory, size: int) -> None:
        self.lease: Lease | None = memory.lease(size, keep=True, wait=False)
        self.buf: memoryview | None = memoryview(self.lease.tensor.numpy())
        self.ranges: list[tuple[int, int]] = []
        self.have = 0

    def add(self, a: int, b: int) -> int:
        """Mark ``[a, b)`` written; the number of bytes written now."""
        merged: list[tuple[int, int]] = []
        for lo, hi in self.ranges:
            if hi < a or lo > b:
                merged.append((lo, hi))
            else:
                a, b = min(a, lo), max(b, hi)
        merged.append((a, b))
        merged.sort()
        self.ranges = merged
        self.have = sum(hi - lo for lo, hi in merged)
        return self.have

    def zero_gaps(self, n: int) -> None:
        """Zero the bytes of ``[0, n)`` never written (holes read as zeros, as in a sparse file)."""
        if self.have >= n or self.lease is None:
            return
        t = self.lease.tensor
        at = 0
        for lo, hi in self.ranges:
            if lo > at:
                t[at: min(lo, n)].zero_()
            at = max(at, hi)
        if at < n:
            t[at:n].zero_()

    def release(self) -> None:
        """Give the buffer back to the budget and drop it (idempotent)."""
        lease, self.lease = self.lease, None
        self.buf = None  # the memory is freed once no upload holds a view of it
        if lease is not None:
            lease.release()


class _Uploads:
    """A multipart upload through botocore: parts in any order, each retried alone (and
    counted) by :meth:`S3Backend.call`."""

    def __init__(self, folder: S3Folder, name: str) -> None:
        self.folder, self.name = folder, name
        self.client = folder.b.client()
        self.bucket = folder.b.name
        self.key = folder.key(name)
        self.where = folder.where(name)
        self.args = folder.b.every_args
        self.upload_id: str | None = None
        self.strays = False

    def _call(self, what: str, fn: Callable[[], T], passthrough: tuple[type[BaseException], ...] = (),
              on_retry: Callable[[], None] | None = None) -> T:
        return self.folder.backend.call(what, self.where, fn, passthrough, on_retry)

    def _ids(self) -> dict[str, Any]:
        return {"Bucket": self.bucket, "Key": self.key, "UploadId": self.upload_id, **self.args}

    def start(self) -> None:
        retried: list[int] = []
        answer = self._call("start the upload of", lambda: self.client.create_multipart_upload(
            Bucket=self.bucket, Key=self.key, **self.folder.b.create_args), on_retry=lambda: retried.append(1))
        # A retried start whose lost first answer created an upload leaves that upload
        # behind: it is aborted once this one ends (the key is this save's own).
        self.strays = bool(retried)
        self.upload_id = answer.get("UploadId")
        if not self.upload_id:
            raise StorageError(f"cannot start the upload of {self.where}: no UploadId in the answer", errno.EIO,
                               self.where)

    def put_part(self, number: int, data: memoryview) -> str:
        assert self.upload_id is not None
        answer = self._call(f"upload part {number} of", lambda: self.client.upload_part(
            PartNumber=number, Body=data, ContentLength=len(data), **self._ids()))
        etag = answer.get("ETag")
        if not etag:
            raise StorageError(f"cannot upload part {number} of {self.where}: no ETag in the answer", errno.EIO,
                               self.where)
        return etag

    def complete(self, etags: dict[int, str], size: int) -> None:
        assert self.upload_id is not None
        parts = {"Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]}
        retried: list[int] = []

        cond = {"IfNoneMatch": "*"}  # the object must not exist (no HEAD when the upload starts)

        def complete() -> None:  # botocore turns an error inside a 200 answer into a 500 ClientError
            try:
                self.client.complete_multipart_upload(MultipartUpload=parts, **cond, **self._ids())
            except ClientError as exc:
                status, code, _ = _client_error(exc)
                if retried and code in ("NoSuchUpload", "PreconditionFailed"):
                    raise _NoSuchUpload() from exc  # the first attempt may have landed: check below
                if code == "PreconditionFailed" or status == 412:
                    raise _Exists() from exc
                if cond and (status == 501 or code == "NotImplemented"):  # no conditional completion here
                    if self.folder._head(self.name) is not None:
                        raise _Exists() from exc
                    cond.clear()
                    return complete()
                raise

        try:
            self._call("complete the upload of", complete, (_NoSuchUpload, _Exists),
                       on_retry=lambda: retried.append(1))
            self.abort_strays()
            return
        except _Exists:
            self.abort_strays()
            raise self.folder.exists_error(self.name) from None
        except _NoSuchUpload:
            self.abort_strays()
        # A retried completion whose first attempt landed: the object is there, the upload is gone.
        meta = self.folder._head(self.name)
        if meta is None or int(meta["size"]) != size:
            raise StorageError(f"cannot complete the upload of {self.where}: the upload vanished", errno.EIO,
                               self.where)

    def abort(self) -> None:
        if self.upload_id is None:
            return
        with contextlib.suppress(Exception):
            self._call("abort the upload of", lambda: self.client.abort_multipart_upload(**self._ids()))
        self.abort_strays()

    def abort_strays(self) -> None:
        """Abort the other unfinished uploads of this key (left by a retried start); never raises."""
        if not self.strays:
            return
        self.strays = False
        with contextlib.suppress(Exception):
            answer = self._call("list the uploads of", lambda: self.client.list_multipart_uploads(
                Bucket=self.bucket, Prefix=self.key, **self.args))
            for up in answer.get("Uploads", []):
                if up.get("Key") == self.key and up.get("UploadId") not in (None, self.upload_id):
                    ids = {**self._ids(), "UploadId": up["UploadId"]}
                    self._call("abort the upload of", lambda ids=ids: self.client.abort_multipart_upload(**ids))


class _NoSuchUpload(Exception):
    pass


class _Exists(Exception):
    pass


class S3WriteHandle(WriteHandle):
    """A new object written by positional writes from any number of threads: bytes land in
    part buffers; each part is uploaded once all its bytes are there (at most
    ``max_concurrency`` at once; two more may wait their turn, then a writer that completes a part waits);
    ``finish`` uploads the rest and completes the upload (a file within one part: one PUT).
    Part buffers are leased from the backend's :class:`~shardsafe.budget.HostMemory` (the
    Checkpointer's budget) and given back once their part is uploaded."""

    def __init__(self, folder: S3Folder, name: str) -> None:
        self.folder = folder
        self.name = name
        self.where = folder.where(name)
        opts = folder.backend.opts
        self.part_size = opts.part_size
        self.concurrency = opts.max_concurrency
        self.memory = folder.backend.memory
        self._lock = threading.Lock()
        self._parts: dict[int, _Part] = {}
        self._sent: set[int] = set()
        self._etags: dict[int, str] = {}
        self._futures: list[Future] = []
        self._slots = threading.BoundedSemaphore(self.concurrency + 2)
        self._size = 0
        self._upload: _Uploads | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None
        self._state = "open"  # open -> finished | aborted
        self._finishing = False  # finish() began: an object may exist, abort() deletes it

    # -- parts -----------------------------------------------------------------------------
    def _part(self, index: int) -> tuple[_Part, memoryview]:
        """Part ``index`` and its buffer (held here: an abort may release the part meanwhile)."""
        with self._lock:
            if self._state != "open":
                raise StorageError(f"cannot write {self.where}: the file is {self._state}", errno.EBADF, self.where)
            if index in self._sent:
                raise StorageError(f"cannot write {self.where}: part {index + 1} was already uploaded",
                                   errno.EINVAL, self.where)
            part = self._parts.get(index)
            if part is None:
                if index >= MAX_PARTS:
                    raise StorageError(
                        f"cannot write {self.where}: more than {MAX_PARTS} parts of {self.part_size} bytes "
                        "(raise the part_size storage option)", errno.EFBIG, self.where)
                part = self._parts[index] = _Part(self.memory, self.part_size)
            assert part.buf is not None
            return part, part.buf

    def _start(self) -> _Uploads:
        with self._lock:
            if self._upload is None:
                up = _Uploads(self.folder, self.name)
                up.start()
                self._upload = up
                self._pool = workers.pool(self.concurrency, "s3-part")
            return self._upload

    def _send(self, index: int, part: _Part, n: int) -> None:
        """Queue the first ``n`` bytes of ``part`` (number ``index + 1``) for upload (waits
        while too many are queued); its buffer goes back to the budget once it is done."""
        self._slots.acquire()
        try:
            up = self._start()
            assert self._pool is not None
            fut = self._pool.submit(self._upload_part, up, index, part.buf[:n])
        except BaseException:
            part.release()
            self._slots.release()
            raise

        def done(_f: Future) -> None:  # also when cancelled
            part.release()
            self._slots.release()

        fut.add_done_callback(done)
        with self._lock:
            self._futures.append(fut)

    def _upload_part(self, up: _Uploads, index: int, data: memoryview) -> None:
        if self._error is not None or self._state == "aborted":
            return
        try:
            etag = up.put_part(index + 1, data)
            with self._lock:
                self._etags[index + 1] = etag
        except BaseException as exc:
            with self._lock:
                if self._error is None:
                    self._error = exc
            raise

    def _check(self) -> None:
        if self._error is not None:
            raise self._error

    # -- WriteHandle -------------------------------------------------------------------------
    def write(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Copy ``buffers`` into their parts at ``offset``; upload every part this completes."""
        self._check()
        pos = offset
        ps = self.part_size
        for buf in buffers:
            view = _bytes_view(memoryview(buf))
            i, n = 0, len(view)
            while i < n:
                index, off = divmod(pos, ps)
                m = min(ps - off, n - i)
                part, buf = self._part(index)
                buf[off: off + m] = view[i: i + m]
                with self._lock:
                    full = part.add(off, off + m) == ps and self._parts.get(index) is part
                    if full:
                        del self._parts[index]
                        self._sent.add(index)
                    self._size = max(self._size, pos + m)
                if full:
                    self._send(index, part, ps)
                pos += m
                i += m
        self._check()

    def finish(self, durable: bool = True) -> None:
        """Upload what is left and complete the object (a whole object within one part:
        one PUT); any failure aborts the upload and raises."""
        if self._state == "finished":
            return
        self._finishing = True
        try:
            self._check()
            size = self._size
            if self._upload is None and size <= self.part_size:
                part = self._parts.pop(0, None)
                if part is None:
                    self.folder.put_new(self.name, memoryview(b""))
                else:
                    try:
                        part.zero_gaps(size)
                        self.folder.put_new(self.name, part.buf[:size])
                    finally:
                        part.release()
            else:
                last = (size - 1) // self.part_size
                for index in range(last + 1):  # holes read as zeros, as in a sparse file
                    if index in self._sent:
                        continue
                    part = self._parts.pop(index, None) or _Part(self.memory, self.part_size)
                    with self._lock:
                        self._sent.add(index)
                    n = min(self.part_size, size - index * self.part_size)
                    part.zero_gaps(n)
                    self._send(index, part, n)
                for fut in list(self._futures):
                    fut.exception()
                self._check()
                assert self._upload is not None
                self._upload.complete(self._etags, size)
            self._state = "finished"
        except BaseException as exc:
            if isinstance(exc, StorageError) and exc.errno == errno.EEXIST:
                self._finishing = False  # the object there is another writer's: abort() leaves it
            self.abort()
            raise
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._drop_parts()

    def _drop_parts(self) -> None:
        """Give the buffers of the parts never sent back to the budget."""
        with self._lock:
            parts = list(self._parts.values())
            self._parts.clear()
        for part in parts:
            part.release()

    def abort(self) -> None:
        """Abort the upload and remove anything written (idempotent; never raises)."""
        with self._lock:
            state, self._state = self._state, "aborted"
        if state == "aborted":
            return
        with contextlib.suppress(Exception):
            if self._pool is not None:
                self._pool.shutdown(wait=True, cancel_futures=True)
            if self._upload is not None and state != "finished":
                self._upload.abort()
            if state == "finished" or self._finishing:
                self.folder.remove(self.name)
        self._drop_parts()
