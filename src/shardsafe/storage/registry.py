"""The scheme registry: which backend serves ``<scheme>://`` locations, and how its URLs read.

Built-in schemes: ``file`` (the local filesystem, also plain paths), ``s3``
(``shardsafe[s3]``) and ``az`` (Azure Blob, ``shardsafe[azure]``). A separate package adds a
scheme with an entry point in the group ``shardsafe.storage`` whose name is the scheme and
whose object is a factory ``factory(storage_options: dict | None) -> Backend`` (a
:class:`~shardsafe.storage.base.Backend` subclass taking the options works), for example in
its ``pyproject.toml``::

    [project.entry-points."shardsafe.storage"]
    gs = "shardsafe_gcs:GCSBackend"

or registers it at run time with :func:`register`. The backend then gets the URL itself
(``gs://bucket/prefix``, trailing ``/`` dropped) as its location, unless the registration
gives its own ``parse``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..errors import CheckpointError
from .base import Backend

__all__ = ["ENTRY_POINT_GROUP", "Scheme", "UnsupportedLocationError", "lookup", "register", "url_location"]

ENTRY_POINT_GROUP = "shardsafe.storage"
Factory = Callable[[dict[str, Any] | None], Backend]


class UnsupportedLocationError(CheckpointError, ValueError):
    """A path or URL this shardsafe cannot use (unknown scheme, bad file:// URL)."""


def url_location(scheme: str, text: str) -> str:
    """The location of URL ``text`` for an object-store-like backend: ``scheme://netloc/path``
    without a trailing ``/``; a URL without a netloc (bucket, container) is refused."""
    parts = urlsplit(text)
    if not parts.netloc:
        raise UnsupportedLocationError(
            f"{text}: a {scheme}:// URL names a bucket or container: {scheme}://bucket/prefix")
    return f"{scheme}://{parts.netloc}{parts.path}".rstrip("/")


@dataclass(frozen=True)
class Scheme:
    """A registered URL scheme: how to build its backend from ``storage_options``, how
    its URLs become locations, and (for messages) what to install when it fails to load."""

    name: str
    factory: Factory
    parse: Callable[[str], str] | None = None  # URL text -> location (default: url_location)
    extra: str = ""  # the pip extra the backend needs, for the message when its import fails

    def location(self, text: str) -> str:
        """The location the backend understands for URL ``text``."""
        return self.parse(text) if self.parse is not None else url_location(self.name, text)

    def build(self, options: dict[str, Any] | None) -> Backend:
        """A new backend with ``options`` (a missing client library: a clear error)."""
        try:
            return self.factory(options)
        except ImportError as exc:
            need = f": pip install 'shardsafe[{self.extra}]'" if self.extra else ""
            raise UnsupportedLocationError(
                f"{self.name}:// locations need a client library that is not installed{need} ({exc})") from None


_SCHEMES: dict[str, Scheme] = {}
_LOCK = threading.Lock()
_LOADED: list[bool] = []  # entry points read (once per process)


def register(name: str, factory: Factory, parse: Callable[[str], str] | None = None, *, extra: str = "",
             replace: bool = False) -> Scheme:
    """Serve ``name://`` locations with backends made by ``factory(storage_options)``;
    ``parse`` turns a URL into the backend's location (default: the URL without a trailing
    ``/``). A scheme already registered needs ``replace=True``."""
    name = name.lower()
    scheme = Scheme(name, factory, parse, extra)
    with _LOCK:
        if name in _SCHEMES and not replace:
            raise ValueError(f"storage scheme {name!r} is already registered (pass replace=True)")
        _SCHEMES[name] = scheme
    return scheme


def unregister(name: str) -> None:
    """Forget scheme ``name`` (tests; built-in schemes come back only by registering them)."""
    with _LOCK:
        _SCHEMES.pop(name.lower(), None)


def lookup(name: str) -> Scheme | None:
    """The registered scheme ``name``, or None (entry points are read on first use)."""
    _load_entry_points()
    return _SCHEMES.get(name.lower())


def names() -> list[str]:
    """Every registered scheme."""
    _load_entry_points()
    return sorted(_SCHEMES)


def _load_entry_points() -> None:
    """Register the schemes installed packages declare (group ``shardsafe.storage``); a
    scheme registered already (a built-in) is not replaced, one that fails to load is
    refused when used."""
    if _LOADED:
        return
    with _LOCK:
        if _LOADED:
            return
        _LOADED.append(True)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        name = ep.name.lower()
        if name in _SCHEMES:
            continue

        def factory(options: dict[str, Any] | None, ep: Any = ep) -> Backend:
            return ep.load()(options)

        register(name, factory, extra="", replace=True)


def _local(options: dict[str, Any] | None) -> Backend:
    from .local import LocalBackend

    return LocalBackend()


def _s3(options: dict[str, Any] | None) -> Backend:
    from .s3 import S3Backend

    return S3Backend(options)


def _azure(options: dict[str, Any] | None) -> Backend:
    from .azure import AzureBackend

    return AzureBackend(options)


register("file", _local)
register("s3", _s3, lambda text: url_location("s3", text), extra="s3")
register("az", _azure, lambda text: url_location("az", text), extra="azure")
