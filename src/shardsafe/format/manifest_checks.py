"""Checks that every manifest codec (3.x and the legacy 1.x/2.x readers) applies to the
manifest's top-level members, file names and tensor heads."""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from typing import Any

from ..errors import CorruptCheckpointError
from .strict_json import MAX_NAME_BYTES, NOT_IN_NAME, SIZE_LIMIT, _count, _show

MAX_CHECKSUM_BLOCK = 1 << 26
"""Largest ``extra.checksum_block`` a reader accepts (64 MiB, the default staging buffer;
shardsafe writes 1 MiB): a partial read never hashes more than that beyond what it needs,
and tools may allocate one block."""
MAX_FILE_NAME_BYTES = MAX_NAME_BYTES
MAX_CREATED = 1 << 35
"""``created`` lies in ``[0, 2^35)`` seconds (before the year 3058), so every tool can show it."""

_NOT_IN_NAME = NOT_IN_NAME


def _file_names_problem(names: list[Any]) -> str | None:
    """What makes a data file name other than a plain, unique one (docs/format.md,
    "files"), or None; all names are checked at once, one by one only to say which."""
    if (set(map(type, names)) <= {str} and not _NOT_IN_NAME.search("".join(names))
            and not {"", ".", ".."} & set(names) and len(set(names)) == len(names)
            and max(map(len, names), default=0) * 4 <= MAX_FILE_NAME_BYTES):  # at most 4 bytes a character
        return None
    seen: set[str] = set()
    for i, name in enumerate(names):
        if not (isinstance(name, str) and name not in ("", ".", "..") and not _NOT_IN_NAME.search(name)
                and len(name.encode("utf-8")) <= MAX_FILE_NAME_BYTES):
            return (f"file {i}: name {_show(name)} is not a plain file name (no path separators, control "
                    f"characters or lone surrogates, at most {MAX_FILE_NAME_BYTES} bytes)")
        if name in seen:
            return f"file {i}: name {name!r} is listed twice"
        seen.add(name)
    return None


def _header_problem(world_size: Any, extra: Any, writer: Any, rank_local: Any, files: list[Any]) -> str | None:
    """What is wrong with the manifest's top-level members and file list, or None."""
    if not (_count(world_size) and world_size >= 1):
        return f"world_size {world_size!r}"
    for name, part in (("extra", extra), ("writer", writer), ("rank_local", rank_local)):
        if not isinstance(part, dict):
            return f"{name} is not an object"
    block = extra.get("checksum_block")
    if not (_count(block) and 1 <= block <= MAX_CHECKSUM_BLOCK):
        return f"extra.checksum_block {_show(block)} is not an integer from 1 to {MAX_CHECKSUM_BLOCK} (64 MiB)"
    problem = _file_names_problem([f.name for f in files])
    if problem:
        return problem
    for f in files:
        if not (_count(f.nbytes) and _count(f.rank) and _count(f.header_bytes)
                and 8 <= f.header_bytes <= f.nbytes < _LIMIT):
            return f"file {f.name!r}: bad sizes (bytes {f.nbytes!r}, header_bytes {f.header_bytes!r})"
        if not isinstance(f.header_checksum, str):
            return f"file {f.name!r}: bad header checksum"
    return None


_LIMIT = SIZE_LIMIT



def _head_itemsize(key: str, dtype: Any, shape: Any, name_itemsize: Callable[[str], int | None]) -> int:
    """The itemsize of a tensor entry's dtype (0 when unknown) once its dtype and shape are
    valid (a str; non-negative int dims with a total size below 2^62)."""
    if not (isinstance(dtype, str) and isinstance(shape, list) and all(_count(s) and s < _LIMIT for s in shape)):
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': bad dtype {dtype!r} or shape {shape!r}")
    size = name_itemsize(dtype)
    if not size:
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': unknown dtype {dtype!r}")
    if prod(shape) * size >= _LIMIT:
        raise CorruptCheckpointError(f"inconsistent manifest: tensor '{key}': shape {shape!r} is too large")
    return size


def _object_members(value: Any) -> int:
    """Members of all JSON objects in ``value`` (without recursion)."""
    count = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if type(v) is dict:
            count += len(v)
            stack.extend(v.values())
        elif type(v) is list:
            stack.extend(v)
    return count
