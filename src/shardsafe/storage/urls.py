"""Where a path or URL lives: which backend, and the location that backend understands.

Plain paths and ``file://`` URLs go to the local filesystem; ``<scheme>://`` URLs to the
backend the scheme registry (``storage.registry``: built-ins ``s3``, ``az``, plus entry
points) or the caller's ``storage={scheme: backend}`` names. Any other scheme is refused
with a clear error, so that ``save(sd, "gs://bucket/x")`` never creates a local folder
named ``gs:``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from urllib.parse import unquote, urlsplit

from . import registry
from .base import Backend
from .registry import UnsupportedLocationError

__all__ = ["OBJECT_SCHEMES", "UnsupportedLocationError", "default_backends", "make_backend", "parse", "resolve"]

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

PathLike = str | os.PathLike


class _OptionSchemes:
    """The schemes whose backends are built from ``storage_options`` (every registered
    scheme but ``file``), read live from the registry."""

    def __iter__(self) -> Iterator[str]:
        return iter([s for s in registry.names() if s != "file"])

    def __contains__(self, scheme: object) -> bool:
        return scheme != "file" and isinstance(scheme, str) and registry.lookup(scheme) is not None


OBJECT_SCHEMES = _OptionSchemes()


def _split_scheme(path: PathLike) -> tuple[str | None, str]:
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise UnsupportedLocationError(f"path {text!r} contains a NUL character")
    m = _SCHEME.match(text)
    return (None if m is None else m.group(1).lower()), text


def _unknown(scheme: str, text: str) -> UnsupportedLocationError:
    hint = " (no backend is registered for it: install a package that adds it, or pass storage={scheme: backend})"
    return UnsupportedLocationError(
        f"unsupported URL scheme {scheme!r} in {text!r}{hint}: use a local path, a file://, s3:// or az:// URL")


def parse(path: PathLike, known: frozenset[str] | set[str] = frozenset()) -> tuple[str, str]:
    """(scheme, location): ``("file", "/abs/or/relative/path")`` for plain paths and
    ``file://`` URLs; for a registered scheme (or one in ``known``: backends the caller
    passed) the location its backend understands; UnsupportedLocationError otherwise."""
    scheme, text = _split_scheme(path)
    if scheme is None:
        return "file", text
    if scheme == "file":
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise UnsupportedLocationError(f"{text}: file:// URLs must name a local path (file:///path)")
        return "file", unquote(parts.path)
    entry = registry.lookup(scheme)
    if entry is not None:
        return scheme, entry.location(text)
    if scheme in known:
        return scheme, registry.url_location(scheme, text)
    raise _unknown(scheme, text)


def default_backends() -> dict[str, Backend]:
    """The backends used when none is given: the local filesystem for ``file``."""
    from .local import LocalBackend

    return {"file": LocalBackend()}


def make_backend(scheme: str, options: dict | None = None) -> Backend:
    """A backend for registered ``scheme`` built with ``options`` (``storage_options``)."""
    entry = registry.lookup(scheme)
    if entry is None:
        raise UnsupportedLocationError(f"no storage backend for {scheme}:// locations")
    return entry.build(options)


def resolve(path: PathLike, backends: dict[str, Backend], options: dict | None = None) -> tuple[Backend, str]:
    """The backend for ``path`` (from ``backends`` by scheme, else built from the registry
    with ``options`` and added to ``backends``) and its location there."""
    scheme, location = parse(path, set(backends))
    backend = backends.get(scheme)
    if backend is None:
        backend = backends[scheme] = make_backend(scheme, options)
    if location == "":
        raise UnsupportedLocationError("empty path")
    return backend, location


def local_backend() -> Backend:
    """The local filesystem's backend (for tools that read local files by path)."""
    return make_backend("file")
