"""The S3 backend: ``s3://bucket/prefix`` locations, its buckets, and the one retry loop
every request goes through (:meth:`S3Backend.call`)."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ...budget import HostMemory
from ...errors import CheckpointNotFoundError
from ..base import Backend, Folder
from .client import _Bucket, _split_url
from .config import parse_options
from .errors import BucketNotFoundError, _storage_error, _transient
from .folder import S3Folder

T = TypeVar("T")


class S3Backend(Backend):
    """``s3://bucket/prefix`` locations. ``options`` is a ``storage_options`` mapping (see
    :func:`parse_options`); what it leaves out comes from the usual AWS environment
    variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
    ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL``, ``AWS_ALLOW_HTTP``, ...).

    ``retries`` counts every request retried after a transient failure. ``memory``: the
    host-memory budget part buffers are leased from (a Checkpointer hands over its own with
    :meth:`use_memory`; a backend used alone has an unbounded one of its own)."""

    remote = True
    scheme = "s3"
    missing_words = ("NoSuchBucket",)  # in an error: the bucket does not exist

    def __init__(self, options: dict[str, Any] | None = None, memory: HostMemory | None = None) -> None:
        self.opts = parse_options(options)
        self.memory = memory if memory is not None else HostMemory()
        self.retries = 0
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

    def use_memory(self, memory: HostMemory) -> None:
        """Lease the buffers of uploads started from now on from ``memory``."""
        self.memory = memory

    # -- plumbing -----------------------------------------------------------------------
    def bucket(self, name: str) -> _Bucket:
        """The configured store of bucket ``name`` (made on first use)."""
        with self._lock:
            b = self._buckets.get(name)
            if b is None:
                b = self._buckets[name] = _Bucket(self, name)
            return b

    def missing(self, bucket: str, context: str) -> BucketNotFoundError:
        """The error for a bucket that does not exist."""
        return BucketNotFoundError(bucket, context)

    def is_missing(self, exc: BaseException) -> bool:
        """True when ``exc`` says the bucket does not exist."""
        return any(w in str(exc) for w in self.missing_words)

    def _count_retry(self) -> None:
        with self._lock:
            self.retries += 1

    def call(self, what: str, where: str, fn: Callable[[], T], passthrough: tuple[type[BaseException], ...] = (),
             on_retry: Callable[[], None] | None = None) -> T:
        """``fn()``, retried after transient failures (each retry counted). Errors of the
        ``passthrough`` types are raised as they are; others become StorageErrors naming
        ``what`` and ``where``."""
        o = self.opts
        attempt = 0
        while True:
            try:
                return fn()
            except passthrough:
                raise
            except Exception as exc:
                if self.is_missing(exc):
                    raise self.missing(where.partition("://")[2].partition("/")[0], f"cannot {what} {where}") from exc
                if not _transient(exc):
                    raise _storage_error(exc, what, where) from exc
                if attempt >= o.max_retries:
                    raise _storage_error(exc, what, where, attempt) from exc
                attempt += 1
                self._count_retry()
                if on_retry is not None:
                    on_retry()
                delay = min(o.max_backoff, o.retry_backoff * 2 ** (attempt - 1))
                time.sleep(delay / 2 + random.uniform(0, delay / 2))

    # -- Backend ------------------------------------------------------------------------
    def _folder(self, bucket: str, prefix: str) -> S3Folder:
        return S3Folder(self, self.bucket(bucket), prefix)

    def open(self, location: str, create: bool = False) -> Folder:
        bucket, prefix = _split_url(location, self.scheme)
        folder = self._folder(bucket, prefix)
        if not create:
            folder.check_exists()
        return folder

    def open_and_read(self, location: str, name: str, limit: int) -> tuple[Folder, bytes | None]:
        """One GET where the file is there; the folder's existence is asked only when not."""
        bucket, prefix = _split_url(location, self.scheme)
        folder = self._folder(bucket, prefix)
        try:
            return folder, folder.read_bytes(name, limit)
        except BucketNotFoundError:
            raise
        except CheckpointNotFoundError:
            folder.check_exists()  # no folder (or a file in its place): CheckpointNotFoundError
            return folder, None

    def split(self, location: str) -> tuple[str, str]:
        bucket, prefix = _split_url(location, self.scheme)
        parent, _, name = prefix.rpartition("/")
        return (f"{self.scheme}://{bucket}/{parent}" if parent else f"{self.scheme}://{bucket}"), name

    def exists(self, location: str) -> bool:
        bucket, prefix = _split_url(location, self.scheme)
        folder = self._folder(bucket, prefix)
        try:
            folder.check_exists(files=True)
        except CheckpointNotFoundError:
            return False
        return True

