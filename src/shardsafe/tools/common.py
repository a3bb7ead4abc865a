"""Small helpers shared by the tools: the usage error, byte sizes, key prefixes, output paths."""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from ..errors import CheckpointError, MissingKeysError

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


def prepare_output(out: Path, overwrite: bool, what: str) -> None:
    """Refuse to clobber ``out`` unless ``overwrite``; create its parent folder."""
    if out.exists() or out.is_symlink():
        if not overwrite:
            raise UsageError(f"{out} already exists; pass --overwrite to replace it or choose another {what}")
    out.parent.mkdir(parents=True, exist_ok=True)


def temp_path(out: Path) -> Path:
    """A hidden sibling of ``out`` to build it in before the final rename."""
    return out.parent / f".{out.name}.shardsafe-export-{uuid.uuid4().hex[:12]}"


def publish(tmp: Path, out: Path) -> None:
    """Move the finished ``tmp`` (file or folder) to ``out``, replacing what was there."""
    if out.is_dir() and not out.is_symlink():
        old = temp_path(out)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fd = os.open(out.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: Path) -> None:
    """Delete a file or folder, ignoring what is already gone."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
