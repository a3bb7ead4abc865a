"""The S3 backend (``shardsafe[s3]``): ``s3://bucket/prefix`` locations on Amazon S3 or any
S3-compatible server, through obstore (reads, listings, single PUTs) and botocore
(multipart uploads).

A :class:`S3Folder` is a key prefix; its entries are the objects and the sub-prefixes just
below it. Reads are ranged GETs pinned to the object's ETag (a file replaced or deleted
while it is read raises :class:`~shardsafe.errors.CheckpointChangedError`, never mixes
versions). Writes assemble fixed-size parts from positional writes (several threads, any
order) and upload each part as soon as its bytes are complete, several at once, with
memory leased from the one host-memory budget (:class:`~shardsafe.budget.HostMemory`); a
file smaller than one part is a single PUT. There are no renames and
no locks: commits publish the manifest last with a conditional PUT (If-None-Match), see
``shardsafe.checkpoint_folder``.

Retries: obstore's and botocore's own retries are off (they cannot be counted); every
request is retried here after a transient failure (connection errors, timeouts, 5xx, 429,
SlowDown) with exponential backoff and jitter, up to ``max_retries`` times, and every retry
is counted in :attr:`S3Backend.retries`. obstore exposes no call per multipart part, so
parts go through botocore's ``create_multipart_upload`` / ``upload_part`` /
``complete_multipart_upload`` / ``abort_multipart_upload`` (signing and the credential chain
are botocore's: keys from the options or the environment, config and credentials files,
SSO, web identity, container and instance roles); each part is retried alone.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar
from urllib.parse import urlsplit

import botocore.session
import obstore
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError, NoCredentialsError
from obstore import exceptions as obx
from obstore.store import S3Store

from ..budget import HostMemory, Lease
from ..errors import (
    CheckpointChangedError,
    CheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
)
from .base import Backend, Entry, Folder, ReadHandle, WriteHandle
from .commit import IN_PLACE
from .options import Spellings, read_options
from .options import as_bool as _bool

__all__ = ["S3Backend", "S3Folder", "S3Options", "parse_options"]

T = TypeVar("T")
MiB = 1 << 20
MIN_PART = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000  # S3's maximum number of parts


# -- options --------------------------------------------------------------------------------
@dataclass
class S3Options:
    """Connection, retry and upload settings (see :func:`parse_options` for the spellings)."""

    endpoint: str | None = None
    region: str | None = None
    access_key_id: str | None = None
    secret_access_key: str | None = None
    session_token: str | None = None
    allow_http: bool | None = None
    virtual_hosted_style_request: bool | None = None
    anon: bool = False
    max_retries: int = 10
    retry_backoff: float = 0.1  # seconds before the first retry; doubles each time
    max_backoff: float = 5.0
    timeout: float | None = None  # seconds per request (obstore's default when None: 30 s)
    connect_timeout: float | None = None
    part_size: int = 16 * MiB
    max_concurrency: int = 4  # parts of one file uploaded at once (memory: about (this + 2) parts per file)
    extra: dict[str, Any] = field(default_factory=dict)  # obstore S3 config keys passed as they are


_ALIASES = {
    "endpoint": ("endpoint", "endpoint_url", "aws_endpoint", "aws_endpoint_url", "aws_endpoint_url_s3"),
    "region": ("region", "region_name", "aws_region", "default_region", "aws_default_region"),
    "access_key_id": ("access_key_id", "key", "aws_access_key_id"),
    "secret_access_key": ("secret_access_key", "secret", "aws_secret_access_key"),
    "session_token": ("session_token", "token", "aws_session_token"),
    "allow_http": ("allow_http", "aws_allow_http"),
    "virtual_hosted_style_request": ("virtual_hosted_style_request", "aws_virtual_hosted_style_request",
                                     "virtual_hosted_style"),
    "anon": ("anon", "skip_signature", "aws_skip_signature"),
    "max_retries": ("max_retries", "retries"),
    "retry_backoff": ("retry_backoff", "backoff"),
    "max_backoff": ("max_backoff",),
    "timeout": ("timeout", "read_timeout"),
    "connect_timeout": ("connect_timeout",),
    "part_size": ("part_size", "chunk_size", "multipart_chunksize", "block_size"),
    "max_concurrency": ("max_concurrency", "concurrency"),
}
# obstore configuration keys passed through unchanged (server-side encryption, requester pays, ...)
_PASSTHROUGH = ("server_side_encryption", "sse_kms_key_id", "sse_bucket_key_enabled", "request_payer",
                "conditional_put", "disable_tagging", "disable_bulk_delete")
SPELLINGS = Spellings("S3", _ALIASES, bools=frozenset({"allow_http", "virtual_hosted_style_request", "anon"}),
                      floats=frozenset({"retry_backoff", "max_backoff", "timeout", "connect_timeout"}),
                      ints=frozenset({"max_retries", "part_size", "max_concurrency"}), passthrough=_PASSTHROUGH,
                      prefix="aws_")


def parse_options(options: dict[str, Any] | None) -> S3Options:
    """Read a ``storage_options`` mapping. Accepted spellings (any case): endpoint /
    endpoint_url, region / region_name, key / access_key_id, secret / secret_access_key,
    token / session_token, allow_http, virtual_hosted_style_request, anon, max_retries,
    retry_backoff, max_backoff, timeout, connect_timeout, part_size, max_concurrency,
    client_kwargs (s3fs style: region_name, endpoint_url), each with or without the
    ``aws_`` prefix, and obstore's own keys for encryption and requester pays. Unknown keys
    raise a CheckpointError naming them."""
    opts = read_options(S3Options(), options, SPELLINGS)
    if opts.part_size < MIN_PART:
        raise CheckpointError(f"storage option part_size must be at least {MIN_PART} bytes (S3's minimum part)")
    if opts.max_retries < 0 or opts.max_concurrency < 1:
        raise CheckpointError("storage options max_retries must be >= 0 and max_concurrency >= 1")
    return opts


def _env(*names: str) -> str | None:
    for n in names:
        v = os.environ.get(n)
        if v:
            return v
    return None


# -- errors and retries ---------------------------------------------------------------------
_STATUS = re.compile(r"status code: (\d{3})")
_TRANSIENT_CODES = ("SlowDown", "Throttl", "RequestTimeout", "InternalError", "ServiceUnavailable",
                    "TooManyRequests", "RequestLimitExceeded", "BandwidthLimitExceeded")
_NETWORK_WORDS = ("error sending request", "HTTP error", "timed out", "timeout", "connection", "Connection",
                  "broken pipe", "reset by peer", "body from connection", "decoding response body")
# obstore raises the builtin FileNotFoundError for a missing object (obx.NotFoundError exists too)
_NOT_FOUND = (obx.NotFoundError, FileNotFoundError)
_PERMANENT = (*_NOT_FOUND, PermissionError, FileExistsError, obx.AlreadyExistsError, obx.PreconditionError,
              obx.NotModifiedError, obx.PermissionDeniedError, obx.UnauthenticatedError, obx.InvalidPathError,
              obx.NotSupportedError, obx.UnknownConfigurationKeyError)
# botocore's failures of the connection (refused, reset, closed, timed out) and of a body cut short
_BOTO_NETWORK = (HTTPClientError, IncompleteReadError)


def _client_error(exc: ClientError) -> tuple[int, str, str]:
    """(HTTP status, S3 error code, message) of an error answer botocore raised."""
    answer = exc.response or {}
    err = answer.get("Error") or {}
    status = int((answer.get("ResponseMetadata") or {}).get("HTTPStatusCode") or 0)
    return status, str(err.get("Code") or ""), str(err.get("Message") or "")


def _transient(exc: BaseException) -> bool:
    """True for failures worth retrying: connection errors, timeouts, 5xx, 429, throttling."""
    if isinstance(exc, ClientError):
        status, code, _ = _client_error(exc)
        return status >= 500 or status == 429 or any(c in code for c in _TRANSIENT_CODES)
    if isinstance(exc, BotoCoreError):
        return isinstance(exc, _BOTO_NETWORK)
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, OSError):
        return True
    if isinstance(exc, obx.BaseError):
        text = str(exc)
        m = _STATUS.search(text)
        if m is not None:
            status = int(m.group(1))
            return status >= 500 or status == 429 or any(c in text for c in _TRANSIENT_CODES)
        return any(w in text for w in _NETWORK_WORDS)
    return False


def _reason(exc: BaseException) -> str:
    """The first line of an error, without obstore's debug dump (an S3 error answer: its
    HTTP status, code and message)."""
    if isinstance(exc, ClientError):
        status, code, message = _client_error(exc)
        return f"HTTP {status} {code}: {message}".strip()[:500]
    text = str(exc).split("\n", 1)[0].strip()
    return text[:500] or type(exc).__name__


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError, NoCredentialsError)):
        return errno.EACCES
    if isinstance(exc, ClientError) and _client_error(exc)[0] in (401, 403):
        return errno.EACCES
    if isinstance(exc, _NOT_FOUND):
        return errno.ENOENT
    if isinstance(exc, obx.AlreadyExistsError):
        return errno.EEXIST
    if isinstance(exc, obx.NotSupportedError):
        return errno.ENOTSUP
    return errno.EIO


def _storage_error(exc: BaseException, what: str, where: str, retried: int = 0) -> StorageError:
    note = f" (gave up after {retried} retries)" if retried else ""
    err = StorageError(f"cannot {what} {where}: {_reason(exc)}{note}", _errno_of(exc), where)
    err.__cause__ = exc
    return err


# -- the botocore client for multipart uploads -------------------------------------------------
def _boto_client(bucket: str, o: S3Options, region: str, endpoint: str | None) -> Any:
    """A botocore S3 client for the multipart uploads of ``bucket``: botocore's credential
    chain (the options' keys, else the environment, the shared config and credentials
    files, SSO, web identity, container and instance roles), SigV4 by botocore, its own
    retries off (:meth:`S3Backend.call` retries and counts), no payload hashing (like
    obstore's PUTs: each file carries its own checksums) and no parameter validation (part
    bodies are memoryviews of leased buffers, sent without a copy)."""
    virtual = bool(o.virtual_hosted_style_request)
    if virtual and endpoint:  # obstore's convention: such an endpoint names the bucket already
        u = urlsplit(endpoint)
        if (u.hostname or "").startswith(bucket + "."):
            endpoint = u._replace(netloc=u.netloc.replace(bucket + ".", "", 1)).geturl()
    config = Config(
        region_name=region, signature_version=UNSIGNED if o.anon else "s3v4",
        retries={"total_max_attempts": 1}, connect_timeout=o.connect_timeout or 60, read_timeout=o.timeout or 120,
        max_pool_connections=max(10, 4 * o.max_concurrency), parameter_validation=False,
        request_checksum_calculation="when_required", response_checksum_validation="when_required",
        s3={"addressing_style": "virtual" if virtual else "path", "payload_signing_enabled": False})
    keys: dict[str, Any] = {}
    if o.access_key_id and o.secret_access_key:
        keys = {"aws_access_key_id": o.access_key_id, "aws_secret_access_key": o.secret_access_key,
                "aws_session_token": o.session_token}
    try:
        return _new_client("s3", region_name=region, endpoint_url=endpoint, config=config, **keys)
    except BotoCoreError as exc:
        raise CheckpointError(f"cannot configure S3 for bucket {bucket!r}: {_reason(exc)}") from None


_SESSION: list[Any] = []  # one botocore session per process: its service models load once
_SESSION_LOCK = threading.Lock()


def _new_client(*args: Any, **kwargs: Any) -> Any:
    """``create_client`` of the process's one botocore session (a session is not
    thread-safe: one client is made at a time)."""
    with _SESSION_LOCK:
        if not _SESSION:
            _SESSION.append(botocore.session.get_session())
        return _SESSION[0].create_client(*args, **kwargs)


def _upload_args(o: S3Options) -> tuple[dict[str, Any], dict[str, Any]]:
    """The extra arguments of every multipart call (requester pays) and those of the
    upload's creation (server-side encryption; obstore sends them on its PUTs)."""
    x = o.extra
    every: dict[str, Any] = {}
    payer = x.get("request_payer")
    if payer is not None and (str(payer).lower() == "requester" or _bool("request_payer", payer)):
        every["RequestPayer"] = "requester"
    create = dict(every)
    if x.get("server_side_encryption"):
        create["ServerSideEncryption"] = str(x["server_side_encryption"])
    if x.get("sse_kms_key_id"):
        create["SSEKMSKeyId"] = str(x["sse_kms_key_id"])
    if x.get("sse_bucket_key_enabled") is not None:
        create["BucketKeyEnabled"] = _bool("sse_bucket_key_enabled", x["sse_bucket_key_enabled"])
    return every, create


# -- backend -----------------------------------------------------------------------------------
class _Bucket:
    """One bucket: its obstore store (no internal retries) for reads, listings and single
    PUTs, and the botocore client of its multipart uploads (made on first use)."""

    def __init__(self, backend: S3Backend, name: str) -> None:
        o = backend.opts
        self.name = name
        self.opts = o
        self.endpoint = o.endpoint or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
        self.region = o.region or _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
        config: dict[str, Any] = {"region": self.region, **o.extra}
        if o.endpoint:
            config["endpoint"] = o.endpoint
        if o.access_key_id and o.secret_access_key:
            config["access_key_id"], config["secret_access_key"] = o.access_key_id, o.secret_access_key
            if o.session_token:
                config["session_token"] = o.session_token
        if o.virtual_hosted_style_request is not None:
            config["virtual_hosted_style_request"] = o.virtual_hosted_style_request
        if o.anon:
            config["skip_signature"] = True
        client: dict[str, Any] = {}
        allow_http = o.allow_http
        if allow_http is None and self.endpoint and self.endpoint.lower().startswith("http://"):
            allow_http = True  # an http:// endpoint given on purpose (a local test server, MinIO)
        if allow_http:
            client["allow_http"] = True
        if o.timeout:
            client["timeout"] = timedelta(seconds=o.timeout)
        if o.connect_timeout:
            client["connect_timeout"] = timedelta(seconds=o.connect_timeout)
        try:
            self.store = S3Store(name, config=config, client_options=client or None, retry_config={"max_retries": 0})
        except obx.BaseError as exc:
            raise CheckpointError(f"cannot configure S3 for bucket {name!r}: {_reason(exc)}") from None
        self.every_args, self.create_args = _upload_args(o)
        self._client: Any = None
        self._lock = threading.Lock()

    def client(self) -> Any:
        """The botocore client of this bucket's multipart uploads."""
        with self._lock:
            if self._client is None:
                self._client = _boto_client(self.name, self.opts, self.region, self.endpoint)
            return self._client


def _split_url(location: str, scheme: str = "s3") -> tuple[str, str]:
    """(bucket, key prefix) of ``s3://bucket/a/b`` (``.`` and ``..`` resolved, empty
    segments dropped); ``scheme``: another object store's URLs of the same shape."""
    head = f"{scheme}://"
    if not location.startswith(head):
        raise CheckpointError(f"not an {head} URL: {location!r}")
    bucket, _, rest = location[len(head):].partition("/")
    if not bucket:
        raise CheckpointError(f"{location}: an {head} URL names a bucket: {head}bucket/prefix")
    parts: list[str] = []
    for seg in rest.split("/"):
        if seg in ("", "."):
            continue
        if seg == "..":
            if parts:
                parts.pop()
            continue
        parts.append(seg)
    return bucket, "/".join(parts)


class BucketNotFoundError(CheckpointNotFoundError):
    """The bucket of an ``s3://`` location does not exist: ``bucket`` names it. Readers
    pass it on as it is (no hint about the folder could help)."""

    def __init__(self, bucket: str, context: str) -> None:
        super().__init__(f"bucket {bucket!r} does not exist ({context}); create it first, or check the bucket "
                         "name and the endpoint (storage option endpoint / AWS_ENDPOINT_URL)")
        self.bucket = bucket

    def __reduce__(self):  # noqa: ANN204 - rebuilt from its own arguments (pickled across ranks)
        return _bucket_error, (self.bucket, str(self))


def _bucket_error(bucket: str, message: str) -> BucketNotFoundError:
    err = BucketNotFoundError.__new__(BucketNotFoundError)
    CheckpointNotFoundError.__init__(err, message)
    err.bucket = bucket
    return err


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


# -- folders -----------------------------------------------------------------------------------
class S3Folder(Folder):
    """The objects and sub-prefixes below ``prefix/`` in a bucket; commits in place
    (manifest last, conditional PUT: :class:`~shardsafe.storage.commit.InPlaceCommit`)."""

    commit = IN_PLACE

    def __init__(self, backend: S3Backend, bucket: Any, prefix: str) -> None:
        self.backend = backend
        self.b = bucket
        self.prefix = prefix
        head = f"{backend.scheme}://{bucket.name}"
        self.location = f"{head}/{prefix}" if prefix else head

    def key(self, name: str) -> str:
        """The object key of entry ``name``."""
        if not name or "/" in name or name in (".", ".."):
            raise StorageError(f"bad entry name {name!r} in {self.location}", errno.EINVAL, self.where(name))
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, what: str, name: str | None, fn: Callable[[], T],
              passthrough: tuple[type[BaseException], ...] = ()) -> T:
        where = self.location if name is None else self.where(name)
        return self.backend.call(what, where, fn, passthrough)

    def _head(self, name: str) -> dict | None:
        key = self.key(name)
        try:
            return self._call("inspect", name, lambda: obstore.head(self.b.store, key), _NOT_FOUND)
        except _NOT_FOUND:
            return None

    def _first_under(self, key: str | None) -> list[dict]:
        """At most a few objects below ``key/`` (the whole bucket for None)."""
        def first() -> list[dict]:
            for chunk in obstore.list(self.b.store, key, chunk_size=1):
                return list(chunk)
            return []
        return self._call("list", None if key is None or key == self.prefix else key.rpartition("/")[2], first)

    def check_exists(self, files: bool = False) -> None:
        """Raise CheckpointNotFoundError unless this prefix holds something (the bucket root:
        unless the bucket exists); with ``files``, an object at the prefix counts too."""
        if not self.prefix:
            try:
                self._first_under(None)
            except StorageError as exc:
                if exc.errno == errno.ENOENT or self.backend.is_missing(exc):
                    raise self.backend.missing(self.b.name, f"no folder at {self.location}") from None
                raise
            return
        if self._first_under(self.prefix):
            return
        try:
            meta = self._call("inspect", None, lambda: obstore.head(self.b.store, self.prefix), _NOT_FOUND)
        except _NOT_FOUND:
            meta = None
        if meta is not None:
            if files:
                return
            raise CheckpointNotFoundError(f"{self.location} is a file, not a folder")
        raise CheckpointNotFoundError(f"no folder at {self.location}")

    # -- entries ------------------------------------------------------------------------
    def stat(self, name: str) -> Entry | None:
        meta = self._head(name)
        if meta is not None:
            return Entry("file", int(meta["size"]), meta["last_modified"].timestamp())
        first = self._first_under(self.key(name))
        return Entry("dir", 0, first[0]["last_modified"].timestamp()) if first else None

    def names(self) -> list[str]:
        result = self._call("list", None, lambda: obstore.list_with_delimiter(self.b.store, self.prefix or None))
        out = [p.rpartition("/")[2] for p in result["common_prefixes"]]
        out += [m["path"].rpartition("/")[2] for m in result["objects"]]
        return [n for n in dict.fromkeys(out) if n]

    def mtime(self, name: str) -> float:
        meta = self._head(name)
        if meta is not None:
            return meta["last_modified"].timestamp()
        key = self.key(name)
        objs = self._call("list", name, lambda: obstore.list(self.b.store, key).collect())
        if not objs:
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist")
        return max(m["last_modified"] for m in objs).timestamp()

    # -- files ---------------------------------------------------------------------------
    def open_read(self, name: str) -> ReadHandle:
        meta = self._head(name)
        if meta is None:
            if self._first_under(self.key(name)):
                raise CorruptCheckpointError(
                    f"{self.where(name)} is not a regular file; checkpoints hold regular files only")
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist")
        return S3ReadHandle(self, name, int(meta["size"]), meta.get("e_tag"))

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The whole object ``name`` in one GET (no HEAD first: manifests and file indexes
        are read whole); more than ``limit`` bytes is a CorruptCheckpointError, read no further."""
        key = self.key(name)

        def get() -> bytes | int:
            result = obstore.get(self.b.store, key)
            size = int(result.meta["size"])
            return size if size > limit else bytes(result.bytes())

        try:
            got = self._call("read", name, get, _NOT_FOUND)
        except _NOT_FOUND:
            if self._first_under(key):
                raise CorruptCheckpointError(
                    f"{self.where(name)} is not a regular file; checkpoints hold regular files only") from None
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist") from None
        if isinstance(got, int):
            raise CorruptCheckpointError(f"{self.where(name)}: {got} bytes, more than the {limit} allowed")
        return got

    def create(self, name: str) -> WriteHandle:
        if self._head(name) is not None:
            raise StorageError(f"cannot create {self.where(name)}: it exists", errno.EEXIST, self.where(name))
        return S3WriteHandle(self, name)

    def put(self, name: str, data: bytes | memoryview, mode: str = "overwrite", what: str = "write") -> bool:
        """One PUT of ``data`` at ``name`` (``mode="create"``: only if absent); returns True
        when a retry happened (a "create" that then fails may have been this call's own)."""
        key = self.key(name)
        retried = []
        self.backend.call(what, self.where(name),
                          lambda: obstore.put(self.b.store, key, data, mode=mode, use_multipart=False),
                          (obx.AlreadyExistsError, obx.PreconditionError, obx.NotSupportedError),
                          on_retry=lambda: retried.append(1))
        return bool(retried)

    def publish_bytes(self, name: str, data: bytes, replace: bool) -> None:
        """One PUT; without ``replace`` a conditional create (If-None-Match: *), so that of
        two concurrent commits only one wins."""
        where = self.where(name)
        if replace:
            self.put(name, data, what="publish")
            return
        try:
            self.put(name, data, mode="create", what="publish")
            return
        except (obx.AlreadyExistsError, obx.PreconditionError) as exc:
            # A retried create whose first attempt landed sees its own object: not a conflict.
            if self._same(name, data):
                return
            err = StorageError(f"cannot publish {where}: it exists", errno.EEXIST, where)
            raise err from exc
        except obx.NotSupportedError:
            pass  # a server without conditional PUTs: check, then put (not atomic)
        if self._head(name) is not None:
            raise StorageError(f"cannot publish {where}: it exists", errno.EEXIST, where)
        self.put(name, data, what="publish")

    def _same(self, name: str, data: bytes) -> bool:
        meta = self._head(name)
        if meta is None or int(meta["size"]) != len(data):
            return False
        etag = (meta.get("e_tag") or "").strip('"')
        if etag and "-" not in etag and len(etag) == 32:
            return etag == hashlib.md5(data, usedforsecurity=False).hexdigest()
        with contextlib.suppress(CheckpointError):
            return self.read_bytes(name, len(data)) == data
        return False

    def remove(self, name: str) -> None:
        key = self.key(name)
        self._call("delete", name, lambda: obstore.delete(self.b.store, key))

    # -- folders -------------------------------------------------------------------------
    def open_folder(self, name: str, create: bool = False) -> Folder:
        folder = type(self)(self.backend, self.b, self.key(name))
        if not create:
            try:
                folder.check_exists()
            except CheckpointNotFoundError as exc:
                if "is a file" in str(exc):
                    raise CorruptCheckpointError(f"{self.where(name)} is not a folder") from None
                raise
        return folder

    def remove_tree(self, name: str) -> None:
        key = self.key(name)
        keys = [m["path"] for m in self._call("list", name, lambda: obstore.list(self.b.store, key).collect())]
        if self._head(name) is not None:
            keys.append(key)
        for i in range(0, len(keys), 1000):
            batch = keys[i: i + 1000]
            self._call("delete", name, lambda batch=batch: obstore.delete(self.b.store, batch))


# -- reading -----------------------------------------------------------------------------------
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
            opts: dict[str, Any] = {"range": (offset + sink.done, end)}
            if self.etag:
                opts["if_match"] = self.etag
            for piece in obstore.get(store, self.key, options=opts).stream(min_chunk_size=STREAM_PIECE):
                if not sink.put(memoryview(piece)):
                    raise CorruptCheckpointError(f"{self.where}: the server sent more than the {total} bytes "
                                                 f"asked for from byte {offset}")

        try:
            self.folder.backend.call("read", self.where, get,
                                     (*_NOT_FOUND, obx.PreconditionError, CorruptCheckpointError))
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
            opts: dict[str, Any] = {"range": (pos[0], hi)}
            if self.etag:
                opts["if_match"] = self.etag
            for chunk in obstore.get(store, self.key, options=opts).stream(min_chunk_size=piece or STREAM_PIECE):
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


STREAM_PIECE = 4 * MiB  # a ranged GET is copied into its destination in pieces of about this size


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
            v[self.at: self.at + m] = piece[i: i + m]
            i += m
            self.at += m
            self.done += m
            if self.at == len(v):
                self.index += 1
                self.at = 0
        return True


# -- writing -----------------------------------------------------------------------------------
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

        def complete() -> None:  # botocore turns an error inside a 200 answer into a 500 ClientError
            try:
                self.client.complete_multipart_upload(MultipartUpload=parts, **self._ids())
            except ClientError as exc:
                if retried and _client_error(exc)[1] == "NoSuchUpload":
                    raise _NoSuchUpload() from exc
                raise

        try:
            self._call("complete the upload of", complete, (_NoSuchUpload,), on_retry=lambda: retried.append(1))
            self.abort_strays()
            return
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
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-part")
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
                    self.folder.put(self.name, memoryview(b""))
                else:
                    try:
                        part.zero_gaps(size)
                        self.folder.put(self.name, part.buf[:size])
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
        except BaseException:
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
