"""The S3 backend (``shardsafe[s3]``): ``s3://bucket/prefix`` locations on Amazon S3 or any
S3-compatible server, through obstore.

A :class:`S3Folder` is a key prefix; its entries are the objects and the sub-prefixes just
below it. Reads are ranged GETs pinned to the object's ETag (a file replaced or deleted
while it is read raises :class:`~shardsafe.errors.CheckpointChangedError`, never mixes
versions). Writes assemble fixed-size parts from positional writes (several threads, any
order) and upload each part as soon as its bytes are complete, several at once, with
bounded memory; a file smaller than one part is a single PUT. There are no renames and
no locks: commits publish the manifest last with a conditional PUT (If-None-Match), see
``shardsafe.checkpoint_folder``.

Retries: obstore's own retries are off (they cannot be counted); every request is retried
here after a transient failure (connection errors, timeouts, 5xx, 429, SlowDown) with
exponential backoff and jitter, up to ``max_retries`` times, and every retry is counted in
:attr:`S3Backend.retries`. obstore exposes no call per multipart part, so parts are
uploaded by a small signed (SigV4) client of this module, which retries each part alone.
It needs static credentials (from the options or ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``); with credentials only obstore can find
(instance roles, web identity, container credentials) parts are streamed through
obstore's multipart writer instead, whose retries are obstore's own and are not counted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import hmac
import http.client
import os
import queue
import random
import re
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar
from urllib.parse import quote, urlsplit

import obstore
from obstore import exceptions as obx
from obstore.store import S3Store

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
class _HTTPError(Exception):
    """A non-2xx answer to a request of the signed client."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}".strip())
        self.status = status
        self.code = code


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


def _transient(exc: BaseException) -> bool:
    """True for failures worth retrying: connection errors, timeouts, 5xx, 429, throttling."""
    if isinstance(exc, _HTTPError):
        return exc.status >= 500 or exc.status == 429 or any(c in exc.code for c in _TRANSIENT_CODES)
    if isinstance(exc, _PERMANENT):
        return False
    if isinstance(exc, (OSError, http.client.HTTPException)):
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
    """The first line of an error, without obstore's debug dump."""
    text = str(exc).split("\n", 1)[0].strip()
    return text[:500] or type(exc).__name__


def _errno_of(exc: BaseException) -> int:
    if isinstance(exc, (obx.PermissionDeniedError, obx.UnauthenticatedError)):
        return errno.EACCES
    if isinstance(exc, _HTTPError) and exc.status in (401, 403):
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


# -- the signed client for multipart parts ----------------------------------------------------
def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _hmac(key: bytes, msg: str) -> bytes:
    return hmac.new(key, msg.encode(), hashlib.sha256).digest()


def _uri(text: str) -> str:
    return quote(text, safe="-_.~")


def sign_v4(method: str, host: str, path: str, query: dict[str, str], headers: dict[str, str], payload_hash: str,
            access_key: str, secret_key: str, region: str, when: datetime, token: str | None = None) -> dict[str, str]:
    """AWS Signature Version 4 for S3: ``headers`` plus ``x-amz-date``,
    ``x-amz-content-sha256``, the session token and ``Authorization``. ``path`` is the
    already encoded request path."""
    amz_date = when.strftime("%Y%m%dT%H%M%SZ")
    out = {k.lower(): v for k, v in headers.items()}
    out["host"] = host
    out["x-amz-date"] = amz_date
    out["x-amz-content-sha256"] = payload_hash
    if token:
        out["x-amz-security-token"] = token
    names = sorted(out)
    canonical = "\n".join([
        method, path, "&".join(f"{_uri(k)}={_uri(v)}" for k, v in sorted(query.items())),
        "".join(f"{k}:{' '.join(str(out[k]).split())}\n" for k in names), ";".join(names), payload_hash])
    scope = f"{amz_date[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", amz_date, scope, _sha256(canonical.encode())])
    key = _hmac(_hmac(_hmac(_hmac(("AWS4" + secret_key).encode(), amz_date[:8]), region), "s3"), "aws4_request")
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    out["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope}, SignedHeaders={';'.join(names)}, "
                            f"Signature={signature}")
    return out


def _xml_text(body: bytes, tag: str) -> str | None:
    try:
        root = ET.fromstring(body)
    except ET.ParseError:
        return None
    for el in root.iter():
        if el.tag == tag or el.tag.endswith("}" + tag):
            return el.text or ""
    return None


def _xml_root(body: bytes) -> str:
    try:
        return ET.fromstring(body).tag
    except ET.ParseError:
        return ""


class _SignedClient:
    """Just enough of the S3 REST API for multipart uploads (create, upload part, complete,
    abort), signed with static credentials, one keep-alive connection per thread."""

    def __init__(self, bucket: str, opts: S3Options, region: str, endpoint: str | None,
                 creds: tuple[str, str, str | None] | None) -> None:
        virtual = bool(opts.virtual_hosted_style_request)
        if endpoint:
            u = urlsplit(endpoint)
            self.https = u.scheme != "http"
            self.host = u.netloc
            base = u.path.rstrip("/")
            self.base = base if virtual else f"{base}/{_uri(bucket)}"  # virtual hosted: the endpoint names the bucket
        else:
            self.https = True
            self.host = f"{bucket}.s3.{region}.amazonaws.com" if virtual else f"s3.{region}.amazonaws.com"
            self.base = "" if virtual else f"/{_uri(bucket)}"
        self.region = region
        self.creds = creds
        self.timeout = opts.timeout or 120.0
        self._local = threading.local()
        x = opts.extra
        self.headers: dict[str, str] = {}  # on every request
        payer = x.get("request_payer")
        if payer is not None and (str(payer).lower() == "requester" or _bool("request_payer", payer)):
            self.headers["x-amz-request-payer"] = "requester"
        self.create_headers: dict[str, str] = {}  # on the creation of an upload (obstore sends them on PUTs)
        if x.get("server_side_encryption"):
            self.create_headers["x-amz-server-side-encryption"] = str(x["server_side_encryption"])
        if x.get("sse_kms_key_id"):
            self.create_headers["x-amz-server-side-encryption-aws-kms-key-id"] = str(x["sse_kms_key_id"])
        if x.get("sse_bucket_key_enabled") is not None:
            enabled = _bool("sse_bucket_key_enabled", x["sse_bucket_key_enabled"])
            self.create_headers["x-amz-server-side-encryption-bucket-key-enabled"] = str(enabled).lower()

    def _conn(self) -> http.client.HTTPConnection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
            conn = self._local.conn = cls(self.host, timeout=self.timeout)
        return conn

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        self._local.conn = None
        if conn is not None:
            conn.close()

    def request(self, method: str, key: str, query: dict[str, str], body: bytes | memoryview = b"",
                signed_body: bool = False, headers: dict[str, str] | None = None
                ) -> tuple[int, http.client.HTTPMessage, bytes]:
        """One request; raises _HTTPError for a non-2xx answer, OSError/HTTPException when the
        connection fails. A kept-alive connection the server closed meanwhile is replaced
        once, without counting it as a retry (the request never reached the server)."""
        path = f"{self.base}/{quote(key, safe='/-_.~')}"
        target = path + ("?" + "&".join(f"{_uri(k)}={_uri(v)}" if v else _uri(k) for k, v in sorted(query.items()))
                         if query else "")
        payload = _sha256(bytes(body)) if signed_body else "UNSIGNED-PAYLOAD"
        for attempt in (0, 1):
            sent = {**self.headers, **(headers or {})}
            if self.creds is not None:
                sent = sign_v4(method, self.host, path, query, sent, payload, self.creds[0], self.creds[1],
                               self.region, datetime.now(UTC), self.creds[2])
                sent.pop("host")
            conn = self._conn()
            reused = conn.sock is not None
            try:
                conn.request(method, target, body=body if len(body) else None, headers=sent)
                resp = conn.getresponse()
                data = resp.read()
                break
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._drop()
                if attempt or not reused:
                    raise
            except BaseException:
                self._drop()
                raise
        if resp.getheader("connection", "").lower() == "close":
            self._drop()
        if resp.status >= 300:
            raise _HTTPError(resp.status, _xml_text(data, "Code") or resp.reason, _xml_text(data, "Message") or "")
        return resp.status, resp.headers, data

    def close(self) -> None:
        self._drop()


# -- backend -----------------------------------------------------------------------------------
class _Bucket:
    """One bucket: its obstore store (no internal retries) and, with static credentials,
    the signed client for multipart parts (else a retrying store for streamed uploads)."""

    def __init__(self, backend: S3Backend, name: str) -> None:
        o = backend.opts
        self.name = name
        endpoint = o.endpoint or _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")
        region = o.region or _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1"
        key = o.access_key_id or (None if o.secret_access_key else _env("AWS_ACCESS_KEY_ID"))
        secret = o.secret_access_key or (None if o.access_key_id else _env("AWS_SECRET_ACCESS_KEY"))
        token = o.session_token or (_env("AWS_SESSION_TOKEN") if not o.access_key_id else None)
        config: dict[str, Any] = {"region": region, **o.extra}
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
        if allow_http is None and endpoint and endpoint.lower().startswith("http://"):
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
        self.signed: _SignedClient | None = None
        self.stream_store: S3Store | None = None
        if (key and secret) or o.anon:
            self.signed = _SignedClient(name, o, region, endpoint, None if o.anon else (key, secret, token))
        else:
            backoff = {"init_backoff": timedelta(seconds=o.retry_backoff),
                       "max_backoff": timedelta(seconds=o.max_backoff)}
            self.stream_store = S3Store(name, config=config, client_options=client or None,
                                        retry_config={"max_retries": o.max_retries, "backoff": backoff})


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

    ``retries`` counts every request retried after a transient failure."""

    remote = True
    scheme = "s3"
    missing_words = ("NoSuchBucket",)  # in an error: the bucket does not exist

    def __init__(self, options: dict[str, Any] | None = None) -> None:
        self.opts = parse_options(options)
        self.retries = 0
        self._lock = threading.Lock()
        self._buckets: dict[str, _Bucket] = {}

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
    """The buffer of one part and the byte ranges of it written so far."""

    __slots__ = ("buf", "ranges", "have")

    def __init__(self, size: int) -> None:
        self.buf = bytearray(size)
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


class _Uploads:
    """A multipart upload through the signed client: parts in any order, each retried alone."""

    def __init__(self, folder: S3Folder, name: str, client: _SignedClient) -> None:
        self.folder, self.name, self.client = folder, name, client
        self.key = folder.key(name)
        self.where = folder.where(name)
        self.upload_id: str | None = None
        self.strays = False

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        return self.folder.backend.call(what, self.where, fn)

    def start(self) -> None:
        retried: list[int] = []
        _, _, body = self.folder.backend.call(
            "start the upload of", self.where,
            lambda: self.client.request("POST", self.key, {"uploads": ""}, headers=self.client.create_headers),
            on_retry=lambda: retried.append(1))
        # A retried start whose lost first answer created an upload leaves that upload
        # behind: it is aborted once this one ends (the key is this save's own).
        self.strays = bool(retried)
        self.upload_id = _xml_text(body, "UploadId")
        if not self.upload_id:
            raise StorageError(f"cannot start the upload of {self.where}: no UploadId in the answer", errno.EIO,
                               self.where)

    def put_part(self, number: int, data: memoryview) -> str:
        assert self.upload_id is not None
        q = {"partNumber": str(number), "uploadId": self.upload_id}
        _, headers, _ = self._call(f"upload part {number} of", lambda: self.client.request("PUT", self.key, q, data))
        etag = headers.get("ETag")
        if not etag:
            raise StorageError(f"cannot upload part {number} of {self.where}: no ETag in the answer", errno.EIO,
                               self.where)
        return etag

    def complete(self, etags: dict[int, str], size: int) -> None:
        assert self.upload_id is not None
        body = ("<CompleteMultipartUpload>" + "".join(
            f"<Part><PartNumber>{n}</PartNumber><ETag>{etags[n]}</ETag></Part>" for n in sorted(etags))
            + "</CompleteMultipartUpload>").encode()
        q = {"uploadId": self.upload_id}
        retried = []

        def complete() -> None:
            try:
                _, _, answer = self.client.request("POST", self.key, q, body, signed_body=True)
            except _HTTPError as exc:
                if exc.code == "NoSuchUpload" and retried:
                    raise _NoSuchUpload() from exc
                raise
            if _xml_root(answer).endswith("Error"):  # S3 may report a failure inside a 200 answer
                raise _HTTPError(500, _xml_text(answer, "Code") or "InternalError", _xml_text(answer, "Message") or "")

        try:
            self.folder.backend.call("complete the upload of", self.where, complete, (_NoSuchUpload,),
                                     on_retry=lambda: retried.append(1))
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
        q = {"uploadId": self.upload_id}
        with contextlib.suppress(Exception):
            self._call("abort the upload of", lambda: self.client.request("DELETE", self.key, q))
        self.abort_strays()

    def abort_strays(self) -> None:
        """Abort the other unfinished uploads of this key (left by a retried start); never raises."""
        if not self.strays:
            return
        self.strays = False
        with contextlib.suppress(Exception):
            _, _, body = self._call("list the uploads of",
                                    lambda: self.client.request("GET", "", {"uploads": "", "prefix": self.key}))
            root = ET.fromstring(body)
            for up in root.iter():
                if not (up.tag == "Upload" or up.tag.endswith("}Upload")):
                    continue
                fields = {el.tag.rpartition("}")[2]: el.text or "" for el in up}
                if fields.get("Key") == self.key and fields.get("UploadId") not in (None, self.upload_id):
                    q = {"uploadId": fields["UploadId"]}
                    self._call("abort the upload of", lambda q=q: self.client.request("DELETE", self.key, q))


class _NoSuchUpload(Exception):
    pass


class _Stream:
    """A multipart upload streamed through obstore (credentials only obstore can find):
    parts are handed over in order; obstore uploads several at once and retries them (not
    counted)."""

    def __init__(self, folder: S3Folder, name: str, store: S3Store, part_size: int, concurrency: int) -> None:
        self.folder, self.name = folder, name
        self.where = folder.where(name)
        self.key = folder.key(name)
        self.store, self.part_size, self.concurrency = store, part_size, concurrency
        self.q: queue.Queue[memoryview | BaseException | None] = queue.Queue(maxsize=2)
        self.pending: dict[int, memoryview] = {}
        self.next = 1
        self.lock = threading.Lock()
        self.error: BaseException | None = None
        self.thread: threading.Thread | None = None
        self.upload_id = "stream"

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"s3-stream-{self.name}", daemon=True)
        self.thread.start()

    def _parts(self):  # noqa: ANN202 - a generator of part buffers
        while True:
            item = self.q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run(self) -> None:
        try:
            obstore.put(self.store, self.key, self._parts(), use_multipart=True, chunk_size=self.part_size,
                        max_concurrency=self.concurrency)
        except BaseException as exc:  # noqa: BLE001 - reported by complete()
            self.error = exc
            with contextlib.suppress(queue.Empty):
                while True:
                    self.q.get_nowait()

    def _push(self, item: memoryview | BaseException | None) -> None:
        while self.thread is not None and self.thread.is_alive():
            try:
                self.q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def put_part(self, number: int, data: memoryview) -> str:
        with self.lock:  # parts go to obstore in order; a part that comes early waits here
            self.pending[number] = data
            while self.next in self.pending:
                self._push(self.pending.pop(self.next))
                self.next += 1
        if self.error is not None:
            raise _storage_error(self.error, "upload", self.where)
        return ""

    def complete(self, etags: dict[int, str], size: int) -> None:
        self._push(None)
        assert self.thread is not None
        self.thread.join()
        if self.error is not None:
            raise _storage_error(self.error, "upload", self.where)

    def abort(self) -> None:
        if self.thread is not None:
            self._push(RuntimeError("aborted"))
            self.thread.join()


class S3WriteHandle(WriteHandle):
    """A new object written by positional writes from any number of threads: bytes land in
    part buffers; each part is uploaded once all its bytes are there (at most
    ``max_concurrency`` at once; two more may wait their turn, then a writer that completes a part waits);
    ``finish`` uploads the rest and completes the upload (a file within one part: one PUT)."""

    def __init__(self, folder: S3Folder, name: str) -> None:
        self.folder = folder
        self.name = name
        self.where = folder.where(name)
        opts = folder.backend.opts
        self.part_size = opts.part_size
        self.concurrency = opts.max_concurrency
        self._lock = threading.Lock()
        self._parts: dict[int, _Part] = {}
        self._sent: set[int] = set()
        self._etags: dict[int, str] = {}
        self._futures: list[Future] = []
        self._slots = threading.BoundedSemaphore(self.concurrency + 2)
        self._size = 0
        self._upload: _Uploads | _Stream | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._error: BaseException | None = None
        self._state = "open"  # open -> finished | aborted
        self._finishing = False  # finish() began: an object may exist, abort() deletes it

    # -- parts -----------------------------------------------------------------------------
    def _part(self, index: int) -> _Part:
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
                part = self._parts[index] = _Part(self.part_size)
            return part

    def _start(self) -> _Uploads | _Stream:
        with self._lock:
            if self._upload is None:
                b = self.folder.b
                if b.signed is not None:
                    up: _Uploads | _Stream = _Uploads(self.folder, self.name, b.signed)
                else:
                    assert b.stream_store is not None
                    up = _Stream(self.folder, self.name, b.stream_store, self.part_size, self.concurrency)
                up.start()
                self._upload = up
                self._pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="s3-part")
            return self._upload

    def _send(self, index: int, data: memoryview) -> None:
        """Queue part ``index`` for upload (waits while too many are queued)."""
        self._slots.acquire()
        try:
            up = self._start()
            assert self._pool is not None
            fut = self._pool.submit(self._upload_part, up, index, data)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _f: self._slots.release())
        with self._lock:
            self._futures.append(fut)

    def _upload_part(self, up: _Uploads | _Stream, index: int, data: memoryview) -> None:
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
                part = self._part(index)
                part.buf[off: off + m] = view[i: i + m]
                with self._lock:
                    full = part.add(off, off + m) == ps and self._parts.get(index) is part
                    if full:
                        del self._parts[index]
                        self._sent.add(index)
                    self._size = max(self._size, pos + m)
                if full:
                    self._send(index, memoryview(part.buf))
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
                data = memoryview(part.buf)[:size] if part is not None else memoryview(b"")
                self.folder.put(self.name, data)
            else:
                last = (size - 1) // self.part_size
                for index in range(last + 1):  # holes read as zeros, as in a sparse file
                    if index in self._sent:
                        continue
                    part = self._parts.pop(index, None) or _Part(self.part_size)
                    with self._lock:
                        self._sent.add(index)
                    n = min(self.part_size, size - index * self.part_size)
                    self._send(index, memoryview(part.buf)[:n])
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
        self._parts.clear()

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
        self._parts.clear()
