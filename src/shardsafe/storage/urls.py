"""Where a path or URL lives: which backend, and the location that backend understands.

Plain paths and ``file://`` URLs go to the local filesystem. Any other scheme is refused
with a clear error (object storage is not supported by this version), so that
``save(sd, "s3://bucket/x")`` never creates a local folder named ``s3:``.
"""

from __future__ import annotations

import os
import re
from urllib.parse import unquote, urlsplit

from ..errors import CheckpointError
from .base import Backend

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

PathLike = str | os.PathLike


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
    hint = " (object storage is not supported by this version of shardsafe)" if scheme in (
        "s3", "gs", "gcs", "az", "abfs", "abfss", "hdfs", "http", "https") else ""
    raise UnsupportedLocationError(
        f"unsupported URL scheme {scheme!r} in {text!r}{hint}: use a local path or a file:// URL")


def default_backends() -> dict[str, Backend]:
    """The backends used when none is given: the local filesystem for ``file``."""
    from .local import LocalBackend

    return {"file": LocalBackend()}


def resolve(path: PathLike, backends: dict[str, Backend]) -> tuple[Backend, str]:
    """The backend for ``path`` (from ``backends``, by scheme) and its location there."""
    scheme, location = parse(path)
    backend = backends.get(scheme)
    if backend is None:
        raise UnsupportedLocationError(f"no storage backend for {scheme}:// locations ({os.fspath(path)!r})")
    if location == "":
        raise UnsupportedLocationError("empty path")
    return backend, location
