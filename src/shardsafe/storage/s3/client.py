"""One bucket's connections: its obstore store (reads, listings, single PUTs) and the
botocore client of its multipart uploads; and how an ``s3://`` URL names a bucket and a
key prefix."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import botocore.session
from botocore import UNSIGNED
from botocore.config import Config
from botocore.exceptions import BotoCoreError
from obstore import exceptions as obx
from obstore.store import S3Store

from ...errors import CheckpointError
from ..options import as_bool as _bool
from .config import S3Options, _env
from .errors import _reason

if TYPE_CHECKING:
    from .backend import S3Backend


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
