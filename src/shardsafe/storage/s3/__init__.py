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

The package's modules, one job each: ``config`` (options and S3's limits), ``errors``
(transient or permanent, the StorageError of a failure, BucketNotFoundError),
``client`` (a bucket's obstore store and botocore client), ``backend`` (S3Backend and
its retrying :meth:`~S3Backend.call`), ``folder`` (S3Folder), ``reads`` (S3ReadHandle),
``writes`` (parts, multipart uploads, S3WriteHandle).
"""

from __future__ import annotations

from .backend import S3Backend
from .config import MAX_PARTS, MIN_PART, SPELLINGS, S3Options, parse_options
from .errors import BucketNotFoundError, RangeNotSupportedError
from .folder import S3Folder
from .reads import S3ReadHandle
from .writes import S3WriteHandle

__all__ = ["MAX_PARTS", "MIN_PART", "SPELLINGS", "BucketNotFoundError", "RangeNotSupportedError", "S3Backend",
           "S3Folder", "S3Options", "S3ReadHandle", "S3WriteHandle", "parse_options"]
