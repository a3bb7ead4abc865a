"""Small helpers shared by the tools: the usage error, byte sizes, key prefixes, output paths."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ..checkpoint_folder import output_entry, publish
from ..errors import CheckpointError, MissingKeysError
from ..storage.base import Backend, Folder

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer

PathLike = str | os.PathLike


class UsageError(CheckpointError, ValueError):
    """A request to a tool is wrong (bad option value, output already exists, ...)."""


DCP_EMPTY_DICTS = ("shardsafe", "empty_dicts")
"""The DCP ``planner_data`` key (a tuple: never a flattened DCP key, which are strings) under
which ``export --to dcp`` lists the paths of the empty dicts DCP's flattening drops;
``import`` restores them."""


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"`` (10**9, as Hugging Face), ``"200MiB"`` (2**20), ``"64M"``
    (2**20) or a plain number of bytes; UsageError for anything else."""
    from ..hf_folder import HFFolderError
    from ..hf_folder import parse_size as parse

    try:
        return parse(text)
    except HFFolderError as exc:
        raise UsageError(str(exc)) from None


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


def key_prefixes(keys: Iterable[str]) -> list[str]:
    """Every dotted prefix of every key (``a.b.c`` -> ``a``, ``a.b``, ``a.b.c``), in first-seen order."""
    out: dict[str, None] = {}
    for key in keys:
        parts = key.split(".")
        for i in range(1, len(parts) + 1):
            out.setdefault(".".join(parts[:i]))
    return list(out)


def suggest(prefix: str, candidates: Iterable[str], top: Iterable[str]) -> str:
    """A hint for errors: the ``candidates`` (dotted keys) nearest to ``prefix``, and the
    top-level keys ``top``."""
    from ..hints import nearest

    near = nearest(prefix, list(candidates))
    top = list(top)
    hint = f"did you mean {', '.join(repr(k) for k in near)}? " if near else ""
    shown = ", ".join(top[:12]) + (", ..." if len(top) > 12 else "")
    return f"{hint}top-level keys: {shown or '(none)'} (`shardsafe inspect` lists them all)"


def no_match(flag: str, prefix: str, candidates: Iterable[str], top: Iterable[str] | None = None) -> MissingKeysError:
    """The error for a ``--keys`` / ``--strip`` prefix that selects nothing: it suggests the
    nearest of ``candidates`` (every dotted key; each key's dotted prefixes when ``top`` is
    None, which then are the keys' first parts)."""
    candidates = list(candidates)
    if top is None:
        candidates = key_prefixes(candidates)
        top = [k for k in candidates if "." not in k]
    hint = suggest(prefix, candidates, top)
    if flag.startswith("--") and "," in prefix and flag != "--config-key":
        parts = [p.strip() for p in prefix.split(",") if p.strip()]
        hint += (f"; {flag} takes one prefix per flag, never a comma-separated list: "
                 + " ".join(f"{flag} {p}" for p in parts))
    return MissingKeysError(f"{flag} {prefix!r} selects nothing in the checkpoint; {hint}")


def check_prefixes_used(prefixes: Iterable[str] | None, keys: Iterable[str]) -> None:
    """Raise MissingKeysError (with suggestions) for a prefix that selects none of ``keys``."""
    if prefixes is None:
        return
    keys = list(keys)
    for p in prefixes:
        if not any(matches(k, [p]) for k in keys):
            raise no_match("--keys", p, keys)


def locate(path: PathLike, checkpointer: Checkpointer | None = None) -> tuple[Backend, str]:
    """The backend for ``path`` and the location there: ``checkpointer``'s, or the default
    backends when None (without importing torch)."""
    if checkpointer is not None:
        return checkpointer.locate(path)
    from ..storage.urls import default_backends, resolve

    return resolve(path, default_backends())


class Output:
    """An output entry (file or folder) of a tool, built under a hidden temporary name
    beside ``out`` and published atomically by :meth:`publish` (replacing what was there
    only with ``overwrite``); :meth:`abort` removes the temporary entry. All through the
    storage seam of ``checkpointer``. On a backend without renames (an object store) the
    output is written in place under its own name instead (an older output there is
    deleted first; a failed export leaves nothing)."""

    def __init__(self, checkpointer: Checkpointer, out: PathLike, overwrite: bool, what: str) -> None:
        backend, location = checkpointer.locate(out)
        self.backend = backend
        parent_location, self.name = backend.split(location)
        self.location = location
        self.parent = backend.open(parent_location, create=True)
        if self.parent.kind(self.name) is not None and not overwrite:
            self.parent.close()
            raise UsageError(f"{location} already exists; pass --overwrite to replace it or choose another {what}")
        self.tmp = output_entry(self.parent, self.name)

    def folder(self) -> Folder:
        """The temporary folder to build a folder output in (created)."""
        return self.parent.open_folder(self.tmp, create=True)

    def local_path(self) -> str:
        """The file-system path of the temporary entry, for writers that need one (DCP's);
        UsageError when the output is not on the local file system."""
        path = self.parent.local_path(self.tmp)
        if path is None:
            raise UsageError(f"{self.location}: this output needs a local path")
        return path

    def publish(self) -> None:
        """Put the finished temporary entry at the output's name."""
        publish(self.parent, self.tmp, self.name)  # built in place (object stores): already there

    def abort(self) -> None:
        """Remove the temporary entry (never raises)."""
        with contextlib.suppress(Exception):
            self.parent.remove_tree(self.tmp)

    def close(self) -> None:
        self.parent.close()
