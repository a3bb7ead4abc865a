"""Typed JSON: Python values <-> JSON that keeps tuples, bytes, big ints, non-finite
floats and non-string dict keys exact. No pickle, no code runs on decode.

Encoding (documented in docs/format.md):
  None, bool, str            -> JSON null / true / false / string
  int  (|x| < 2**53)         -> JSON integer;  larger -> {"$int": "<decimal>"}
  float finite               -> JSON number (shortest repr, always with '.' or 'e');
        nan / inf / -inf     -> {"$float": "nan" | "inf" | "-inf"}
  bytes                      -> {"$bytes": "<base64>"}
  list                       -> JSON array
  tuple                      -> {"$tuple": [...]}
  dict, all keys str, none starting with "$"  -> JSON object
  any other dict (int keys, "$" keys)         -> {"$dict": [[key, value], ...]}
  tensor placeholder         -> {"$tensor": "<key>"}
  rank-local placeholder     -> {"$rank_local": "<key>"}
"""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Callable
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedValueError

_SAFE_INT = 1 << 53
TAGS = ("$int", "$float", "$bytes", "$tuple", "$dict", "$tensor", "$rank_local")
# Python refuses int <-> decimal str conversions of more than 4300 digits by default
# (sys.set_int_max_str_digits, at least 640); big ints are converted in pieces below that.
_DIGITS = 512
_DIGITS_BASE = 10**_DIGITS
_DECIMAL = re.compile(r"-?[0-9]+", re.ASCII)


def _int_to_decimal(value: int) -> str:
    """``str(value)`` for ints of any size."""
    if -_DIGITS_BASE < value < _DIGITS_BASE:
        return str(value)
    sign, value = ("-", -value) if value < 0 else ("", value)
    pieces = []
    while value:
        value, low = divmod(value, _DIGITS_BASE)
        pieces.append(low)
    head = str(pieces.pop())
    return sign + head + "".join(str(p).zfill(_DIGITS) for p in reversed(pieces))


def _decimal_to_int(text: Any) -> int:
    """The int written by :func:`_int_to_decimal` (strictly ``-?[0-9]+``, any length)."""
    if not isinstance(text, str) or not _DECIMAL.fullmatch(text):
        raise ValueError("not a decimal integer string")
    digits = text.lstrip("-")
    value = 0
    for i in range(0, len(digits), _DIGITS):
        piece = digits[i: i + _DIGITS]
        value = value * 10 ** len(piece) + int(piece)
    return -value if text.startswith("-") else value


def _subclass_error(value: Any, path: str, base: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"cannot save value at '{path}': type {type(value).__qualname__} (a subclass of {base}) "
        f"would come back as a plain {base}"
    )


def encode_scalar(value: Any, path: str) -> Any:
    """Encode a non-container leaf; raises UnsupportedValueError naming ``path``."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if type(value) is not str:  # StrEnum and friends would not come back as themselves
            raise _subclass_error(value, path, "str")
        return value
    if isinstance(value, int):
        if type(value) is not int:  # IntEnum and friends would not come back as themselves
            raise _subclass_error(value, path, "int")
        return value if -_SAFE_INT < value < _SAFE_INT else {"$int": _int_to_decimal(value)}
    if isinstance(value, float):
        if type(value) is not float:
            raise _subclass_error(value, path, "float")
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, (bytes, bytearray)):
        if type(value) is not bytes:  # bytearray (mutable) and subclasses come back as bytes
            raise _subclass_error(value, path, "bytes")
        return {"$bytes": base64.b64encode(value).decode("ascii")}
    raise UnsupportedValueError(
        f"cannot save value at '{path}': type {type(value).__module__}.{type(value).__qualname__} "
        "is not a tensor, a Stateful, None, bool, int, float, str, bytes, list, tuple or dict"
    )


def encode_dict_key(key: Any, path: str) -> Any:
    """Encode a dict key (str or int only); raises UnsupportedValueError naming ``path``."""
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise UnsupportedValueError(
            f"cannot save dict at '{path}': key {key!r} of type {type(key).__qualname__} "
            "(only str and int keys are allowed)"
        )
    return encode_scalar(key, path)


def decode(obj: Any, on_ref: Callable[[str, str], Any] | None = None) -> Any:
    """Decode typed JSON back into Python values.

    ``on_ref(tag, key)`` resolves ``$tensor`` / ``$rank_local`` placeholders; without it
    a placeholder is an error."""
    if obj is None or isinstance(obj, (bool, str, int, float)):
        return obj
    if isinstance(obj, list):
        return [decode(v, on_ref) for v in obj]
    if isinstance(obj, dict):
        if len(obj) == 1:
            ((tag, payload),) = obj.items()
            if tag.startswith("$"):
                return _decode_tagged(tag, payload, on_ref)
        for k in obj:
            if k.startswith("$"):
                raise CorruptCheckpointError(f"manifest: object key {k!r} may not start with '$'")
        return {k: decode(v, on_ref) for k, v in obj.items()}
    raise CorruptCheckpointError(f"manifest: unexpected JSON value of type {type(obj).__name__}")


def _decode_tagged(tag: str, payload: Any, on_ref: Callable[[str, str], Any] | None) -> Any:
    try:
        if tag == "$int":
            return _decimal_to_int(payload)
        if tag == "$float":
            if payload not in ("nan", "inf", "-inf"):
                raise ValueError(payload)
            return float(payload)
        if tag == "$bytes":
            if not isinstance(payload, str):
                raise TypeError("payload is not a string")
            return base64.b64decode(payload.encode("ascii"), validate=True)
        if tag == "$tuple":
            if not isinstance(payload, list):
                raise TypeError("payload is not a list")
            return tuple(decode(v, on_ref) for v in payload)
        if tag == "$dict":
            if not isinstance(payload, list):
                raise TypeError("payload is not a list")
            out = {}
            for pair in payload:
                if not (isinstance(pair, list) and len(pair) == 2):
                    raise ValueError(f"entry {pair!r} is not a [key, value] pair")
                key = _decode_dict_key(pair[0])
                if key in out:
                    raise ValueError(f"duplicate key {key!r}")
                out[key] = decode(pair[1], on_ref)
            return out
    except (ValueError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"manifest: bad {tag} value {payload!r}: {exc}") from None
    if tag in ("$tensor", "$rank_local"):
        if on_ref is None or not isinstance(payload, str):
            raise CorruptCheckpointError(f"manifest: unexpected {tag} reference {payload!r}")
        return on_ref(tag, payload)
    raise CorruptCheckpointError(f"manifest: unknown tag {tag!r}")


def _decode_dict_key(key: Any) -> str | int:
    """A ``$dict`` key: a string, a JSON integer or an ``{"$int": ...}`` (what encode_dict_key writes)."""
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        return key
    if isinstance(key, dict) and len(key) == 1 and "$int" in key:
        return _decimal_to_int(key["$int"])
    raise TypeError(f"dict key {key!r} is not a str or int")
