"""S3 settings: the ``storage_options`` an S3 (or Azure) backend accepts, their
spellings, and S3's limits on parts."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointError
from ...knobs import MiB
from ..options import Spellings, read_options

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

