"""Where a path or URL lives: which backend, and the location that backend understands.

Plain paths and ``file://`` URLs go to the local filesystem; ``s3://bucket/prefix`` URLs to
the S3 backend (``shardsafe[s3]``; the location is the URL itself). Any other scheme is
refused with a clear error, so that ``save(sd, "gs://bucket/x")`` never creates a local
folder named ``gs:``.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from ..errors import CheckpointError
from .base import Backend

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

PathLike = str | os.PathLike
OBJECT_SCHEMES = ("s3",)  # URL schemes whose backend is built from storage_options


class UnsupportedLocationError(CheckpointError, ValueError):
    """A path or URL this shardsafe cannot use (unknown scheme, bad file:// URL)."""


def parse(path: PathLike) -> tuple[str, str]:
    """(scheme, location): ``("file", "/abs/or/relative/path")`` for plain paths and
    ``file://`` URLs; raises UnsupportedLocationError for any other scheme."""
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise UnsupportedLocationError(f"path {text!r} contains a NUL character")
    m = _SCHEME.match(text)
    if m is None:
        return "file", text
    scheme = m.group(1).lower()
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise UnsupportedLocationError(f"{text}: file:// URLs must name a local path (file:///path)")
        return "file", unquote(parts.path)
    if scheme == "s3":
        parts = urlsplit(text)
        if not parts.netloc:
            raise UnsupportedLocationError(f"{text}: an s3:// URL names a bucket: s3://bucket/prefix")
        return "s3", f"s3://{parts.netloc}{parts.path}".rstrip("/")
    hint = " (object storage: only s3:// and S3-compatible servers are supported)" if scheme in (
        "gs", "gcs", "az", "abfs", "abfss", "hdfs", "http", "https") else ""
    raise UnsupportedLocationError(
        f"unsupported URL scheme {scheme!r} in {text!r}{hint}: use a local path, a file:// or an s3:// URL")


def default_backends() -> dict[str, Backend]:
    """The backends used when none is given: the local filesystem for ``file``."""
    from .local import LocalBackend

    return {"file": LocalBackend()}


def make_backend(scheme: str, options: dict | None = None) -> Backend:
    """A backend for ``scheme`` built on first use (``s3``: needs ``shardsafe[s3]``)."""
    if scheme == "s3":
        try:
            from .s3 import S3Backend
        except ImportError as exc:
            raise UnsupportedLocationError(
                f"s3:// locations need the S3 client: pip install 'shardsafe[s3]' ({exc})") from None
        return S3Backend(options)
    raise UnsupportedLocationError(f"no storage backend for {scheme}:// locations")


def resolve(path: PathLike, backends: dict[str, Backend], options: dict | None = None) -> tuple[Backend, str]:
    """The backend for ``path`` (from ``backends`` by scheme, else built with ``options``
    and added to ``backends``) and its location there."""
    scheme, location = parse(path)
    backend = backends.get(scheme)
    if backend is None and scheme == "s3":
        backend = backends[scheme] = make_backend(scheme, options)
    if backend is None:
        raise UnsupportedLocationError(f"no storage backend for {scheme}:// locations ({os.fspath(path)!r})")
    if location == "":
        raise UnsupportedLocationError("empty path")
    return backend, location
