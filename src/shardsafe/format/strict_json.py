"""Strict JSON for the manifest and the file indexes: no duplicate keys, no NaN or
Infinity, no lone surrogates, bounded nesting; big flat members parsed without hooks."""

from __future__ import annotations

import json
import re
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError
from .values import MAX_DEPTH

MAX_MEMBER_DEPTH = MAX_DEPTH + 2
SIZE_LIMIT = 1 << 62
"""Sizes, dims and counts stay below this, so that 64-bit arithmetic cannot overflow."""
MAX_NAME_BYTES = 255
"""The longest file or folder name a checkpoint may list (the common file system limit)."""
NOT_IN_NAME = re.compile(r"[/\\\x00-\x1f\x7f-\x9f\ud800-\udfff]")
"""Characters a listed name may not hold: path separators, C0/C1 controls, lone surrogates."""


def plain_name(name: Any, allow_empty: bool = False) -> bool:
    """True for a plain file or folder name (docs/format.md): a str without path separators,
    control characters or lone surrogates, not ``.`` or ``..``, at most 255 bytes in UTF-8;
    the empty name only with ``allow_empty``."""
    return (type(name) is str and (name != "" or allow_empty) and name not in (".", "..")
            and not NOT_IN_NAME.search(name) and len(name.encode("utf-8")) <= MAX_NAME_BYTES)
"""Deepest nesting of any top-level member (``rank_local``: object, list, then a value of
at most MAX_DEPTH levels; the ``tree`` itself is held to MAX_DEPTH)."""

#
# The manifest is ordinary JSON, read strictly: no duplicate object keys (json.loads keeps
# the last one silently, another reader might keep the first), no NaN/Infinity (Python
# accepts them), no string with a lone surrogate (it cannot be encoded again, as a file
# name or a safetensors header), and no member nested deeper than MAX_MEMBER_DEPTH. The
# top level and the chunk table are read member by member; most values go through a
# decoder whose hook refuses duplicate keys. ``tensors`` (100k+ small objects in a big
# checkpoint) and a 2.x ``files`` list go through the plain (hook-free, faster) decoder
# instead: the members in their raw text are counted (every ':' outside strings starts one)
# and compared with the members parsed, and only a difference costs a strict re-parse. The
# chunk table's columns (and a 3.x ``files`` table's, and a file index's) are flat lists
# and strings, validated as such, and are not scanned.


class _Refused(ValueError):
    """JSON the manifest may not hold (a duplicate key, NaN or Infinity, too deep)."""


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Refused(f"duplicate key {_show(key)}")
            seen.add(key)
    return obj


def _no_constant(name: str) -> Any:
    raise _Refused(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """A JSON number as a float, refusing one that overflows to infinity (``1e400``):
    non-finite floats are written only as ``$float`` tags."""
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _Refused(f"number {text[:40]} is out of the float range")
    return value


_Decode = Callable[[str, int], tuple[Any, int]]
_STRICT: _Decode = json.JSONDecoder(object_pairs_hook=_unique, parse_constant=_no_constant,
                                    parse_float=_finite_float).raw_decode
_PLAIN: _Decode = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float).raw_decode
_WS = re.compile(r"[ \t\n\r]*")
_COLUMNS = ("o", "n", "f", "b", "x", "t", "rank", "bytes", "index_bytes")  # flat columns: no hook, no scan
# A \u escape of a high surrogate with or without the low one that must follow, or a low alone.
_SURROGATE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(\\u[dD][c-fC-F][0-9a-fA-F]{2})?|\\u[dD][c-fC-F][0-9a-fA-F]{2}")
_SKELETON = bytes(c for c in range(256) if c not in b'"[]{}:')  # translate() deletes all other bytes


_COUNTED = ("tensors", "files")  # top-level members parsed without the hook; their members are counted


@dataclass
class _Spans:
    """Where each top-level member's value lies in the manifest text, and how many object
    members the raw text of each _COUNTED member holds."""

    of: dict[str, tuple[int, int]] = field(default_factory=dict)
    counted: dict[str, int] = field(default_factory=dict)


def _parse_json(data: bytes, where: str, what: str = "manifest") -> tuple[dict[str, Any], _Spans]:
    """The manifest object and the spans of its members; anything that is not strict JSON
    (see above) raises CorruptCheckpointError naming what and where."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(f"{where}: {what} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    spans = _Spans()
    try:
        pos = _WS.match(text).end()
        if not text.startswith("{", pos):
            raise json.JSONDecodeError("Expecting a JSON object", text, pos)
        body, spans.of, pos = _object(text, pos, lambda key: _body_decoder(key, spans))
        if _WS.match(text, pos).end() != len(text):
            raise json.JSONDecodeError("Extra data", text, pos)
    except ValueError as exc:  # JSONDecodeError and _Refused
        raise CorruptCheckpointError(f"{where}: {what} is not valid JSON: {exc}") from None
    return body, spans


def _body_decoder(key: str, spans: _Spans) -> _Decode:
    """How to parse the top-level member ``key`` (and check its raw text)."""
    if key == "chunks":
        return _chunk_table
    if key in _COUNTED:
        def counted(text: str, pos: int) -> tuple[Any, int]:
            if key == "files" and text.startswith("{", pos):  # format 3: a table of columns
                return _chunk_table(text, pos)
            value, end = _PLAIN(text, pos)
            spans.counted[key] = _checked(text, pos, end, MAX_MEMBER_DEPTH)
            return value, end
        return counted
    limit = MAX_DEPTH if key == "tree" else MAX_MEMBER_DEPTH
    return lambda text, pos: _strict(text, pos, limit)


def _strict(text: str, pos: int, limit: int) -> tuple[Any, int]:
    value, end = _STRICT(text, pos)
    if isinstance(value, (dict, list, str)):
        _checked(text, pos, end, limit)
    return value, end


def _chunk_table(text: str, pos: int) -> tuple[Any, int]:
    """The chunk table: an object whose columns are read without a hook or a scan."""
    if not text.startswith("{", pos):
        return _strict(text, pos, MAX_MEMBER_DEPTH)
    table, _, end = _object(text, pos, lambda key: _PLAIN if key in _COLUMNS else
                            (lambda text, pos: _strict(text, pos, MAX_MEMBER_DEPTH - 1)))
    return table, end


def _object(text: str, pos: int, decoder: Callable[[str], _Decode]) -> tuple[dict[str, Any], dict[str, tuple[int, int]],
                                                                              int]:
    """The JSON object at ``text[pos]``, read member by member (each value by
    ``decoder(name)``), the span of each value, and where the object ends."""
    obj: dict[str, Any] = {}
    spans: dict[str, tuple[int, int]] = {}
    pos = _WS.match(text, pos + 1).end()
    if text.startswith("}", pos):
        return obj, spans, pos + 1
    while True:
        if not text.startswith('"', pos):
            raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, pos)
        key, pos = _PLAIN(text, pos)
        if key in obj:
            raise _Refused(f"duplicate key {_show(key)}")
        if not (key.isascii() or _encodable(key)):
            raise _Refused(f"key {_show(key)} holds a lone surrogate")
        pos = _WS.match(text, pos).end()
        if not text.startswith(":", pos):
            raise json.JSONDecodeError("Expecting ':' delimiter", text, pos)
        start = _WS.match(text, pos + 1).end()
        try:
            obj[key], pos = decoder(key)(text, start)
        except _Refused as exc:
            raise _Refused(f"{exc} in '{key}'") from None
        except RecursionError:
            if _nesting(text[start:].encode("utf-8"))[0] <= MAX_MEMBER_DEPTH:
                raise  # not the manifest: the caller's stack is nearly exhausted
            raise _Refused(f"'{key}' nests deeper than {MAX_MEMBER_DEPTH} arrays/objects") from None
        spans[key] = (start, pos)
        pos = _WS.match(text, pos).end()
        if text.startswith(",", pos):
            pos = _WS.match(text, pos + 1).end()
        elif text.startswith("}", pos):
            return obj, spans, pos + 1
        else:
            raise json.JSONDecodeError("Expecting ',' delimiter", text, pos)


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _checked(text: str, start: int, end: int, limit: int) -> int:
    """Check the raw JSON value ``text[start:end]``: it nests at most ``limit``
    arrays/objects and no string in it has a lone surrogate; returns its object members."""
    raw = text[start:end]
    if "\\" in raw:
        for m in _SURROGATE.finditer(raw.replace("\\\\", "\0\0")):
            if m.group(1) is None:  # a high surrogate without its low one, or a low one alone
                raise _Refused(f"a string holds a lone surrogate ({m.group(0)[:6]})")
    depth, members = _nesting(raw.encode("utf-8"))
    if depth > limit:
        raise _Refused(f"nests {depth} arrays/objects deep (at most {limit})")
    return members


def _nesting(raw: bytes) -> tuple[int, int]:
    """(deepest nesting of arrays/objects, number of object members) of the JSON text
    ``raw``, counting only the brackets and ':' outside strings (of a prefix of valid JSON,
    a lower bound of both)."""
    if b"\\" in raw:  # drop escaped backslashes, then escaped quotes: every '"' left delimits a string
        raw = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    # Keep only quotes, brackets and ':'; then drop adjacent quotes (strings with none of
    # those inside, or the end of one and the start of the next: either way no character
    # changes sides), which usually leaves no string at all.
    skeleton = raw.translate(None, _SKELETON).replace(b'""', b"")
    if b'"' in skeleton:  # some string holds a bracket or ':': keep what an even number of quotes precede
        chars = np.frombuffer(skeleton, dtype=np.uint8)
        quote = chars == ord('"')
        chars = chars[(np.cumsum(quote, dtype=np.uint8) & 1 | quote) == 0]  # the sum wraps, its parity holds
        skeleton = chars.tobytes()
    members = skeleton.count(b":")
    brackets = np.frombuffer(skeleton.translate(None, b":"), dtype=np.int8)
    step = (brackets & 2) - 1  # '[' 0x5B and '{' 0x7B: +1; ']' 0x5D and '}' 0x7D: -1
    return int(np.cumsum(step, dtype=np.int64).max(initial=0)), members


def _duplicate(head: bytes, spans: _Spans) -> str | None:
    """A duplicate key in a _COUNTED member, found by a strict re-parse, or None. (The
    text is decoded again from ``head``, the manifest before its trailer: keeping it
    meanwhile would cost more than decoding it in this rare case.)"""
    text = (head + b"}").decode("utf-8")
    for key in spans.counted:
        try:
            _STRICT(text, spans.of[key][0])
        except _Refused as exc:
            return f"{exc} in '{key}'"
    return None


def _count(v: Any) -> bool:
    """A non-negative JSON integer (not a bool)."""
    return type(v) is int and v >= 0


def _show(v: Any) -> str:
    """A short repr for error messages (hostile values may be huge)."""
    try:
        return reprlib.repr(v)
    except ValueError:  # an int too long for str()
        return f"<{type(v).__name__}>"


