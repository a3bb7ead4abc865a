"""How S3 and obstore failures map to shardsafe's: which are transient (retried), the
StorageError of one that is not, and the error for a bucket that does not exist."""

from __future__ import annotations

import errno
import re

from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError, IncompleteReadError, NoCredentialsError
from obstore import exceptions as obx

from ...errors import CheckpointNotFoundError, StorageError

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


class RangeNotSupportedError(StorageError):
    """The server answered a ranged GET with the whole object (HTTP 200, not 206 Partial
    Content), as rclone's ``serve s3`` does: it cannot serve a load, which reads byte
    ranges. ``filename`` names the object; the message names the range asked for."""


def _whole_object_answer(exc: BaseException) -> bool:
    """True when ``exc`` is obstore's error for a 200 answer to a ranged GET."""
    return isinstance(exc, obx.BaseError) and ("non-partial response" in str(exc) or "NotPartial" in str(exc))


def _range_not_supported(where: str, lo: int, hi: int) -> RangeNotSupportedError:
    return RangeNotSupportedError(
        f"cannot read bytes {lo}-{hi - 1} of {where}: the server answered the ranged GET (Range: bytes={lo}-{hi - 1}) "
        "with the whole object (HTTP 200 instead of 206 Partial Content); shardsafe reads checkpoints in byte ranges "
        "and needs a server that honours Range requests (rclone's serve s3 does not)", errno.ENOTSUP, where)
