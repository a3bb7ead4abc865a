"""Small helpers shared by the tools: the usage error, byte sizes, key prefixes, output paths."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable

from ..checkpoint_folder import TMP_MARK, hidden_name, publish
from ..checkpointer import Checkpointer
from ..errors import CheckpointError, MissingKeysError
from ..storage.base import Folder

PathLike = str | os.PathLike

_UNITS = {
    "": 1, "B": 1,
    "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
    "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40,
    "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40,
}
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*")


class UsageError(CheckpointError, ValueError):
    """A request to a tool is wrong (bad option value, output already exists, ...)."""


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"`` (10**9, as Hugging Face), ``"200MiB"`` (2**20), ``"64M"``
    (2**20) or a plain number of bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(text)
    unit = m.group(2).upper() if m else ""
    if not m or unit not in _UNITS:
        raise UsageError(f"cannot read size {text!r}: write it like 5GB, 200MB, 512MiB or 1000000")
    value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UsageError(f"size {text!r} must be positive")
    return value


def human_bytes(n: float) -> str:
    """``1536`` -> ``"1.5 KiB"``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def matches(key: str, prefixes: Iterable[str] | None) -> bool:
    """True when ``key`` equals one of the dotted ``prefixes`` or lies below one (all keys when None)."""
    if prefixes is None:
        return True
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def check_prefixes_used(prefixes: Iterable[str] | None, keys: Iterable[str]) -> None:
    """Raise MissingKeysError for a prefix that selects none of ``keys``."""
    if prefixes is None:
        return
    keys = list(keys)
    for p in prefixes:
        if not any(matches(k, [p]) for k in keys):
            raise MissingKeysError(f"no key or key prefix {p!r} in the checkpoint (see `shardsafe inspect`)")


class Output:
    """An output entry (file or folder) of a tool, built under a hidden temporary name
    beside ``out`` and published atomically by :meth:`publish` (replacing what was there
    only with ``overwrite``); :meth:`abort` removes the temporary entry. All through the
    storage seam of ``checkpointer``."""

    def __init__(self, checkpointer: Checkpointer, out: PathLike, overwrite: bool, what: str) -> None:
        backend, location = checkpointer.locate(out)
        parent_location, self.name = backend.split(location)
        self.location = location
        self.parent = backend.open(parent_location, create=True)
        if self.parent.kind(self.name) is not None and not overwrite:
            self.parent.close()
            raise UsageError(f"{location} already exists; pass --overwrite to replace it or choose another {what}")
        self.tmp = hidden_name(self.name, TMP_MARK)

    def folder(self) -> Folder:
        """The temporary folder to build a folder output in (created)."""
        return self.parent.open_folder(self.tmp, create=True)

    def publish(self) -> None:
        """Put the finished temporary entry at the output's name."""
        publish(self.parent, self.tmp, self.name)

    def abort(self) -> None:
        """Remove the temporary entry (never raises)."""
        with contextlib.suppress(Exception):
            self.parent.remove_tree(self.tmp)

    def close(self) -> None:
        self.parent.close()
