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
from collections.abc import Callable
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedValueError

_SAFE_INT = 1 << 53
TAGS = ("$int", "$float", "$bytes", "$tuple", "$dict", "$tensor", "$rank_local")


def encode_scalar(value: Any, path: str) -> Any:
    """Encode a non-container leaf; raises UnsupportedValueError naming ``path``."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        if type(value) is not int:  # IntEnum and friends would not come back as themselves
            raise UnsupportedValueError(
                f"cannot save value at '{path}': type {type(value).__qualname__} (a subclass of int)"
            )
        return value if -_SAFE_INT < value < _SAFE_INT else {"$int": str(value)}
    if isinstance(value, float):
        if type(value) is not float:
            raise UnsupportedValueError(
                f"cannot save value at '{path}': type {type(value).__qualname__} (a subclass of float)"
            )
        if math.isfinite(value):
            return value
        return {"$float": "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")}
    if isinstance(value, (bytes, bytearray)):
        return {"$bytes": base64.b64encode(bytes(value)).decode("ascii")}
    raise UnsupportedValueError(
        f"cannot save value at '{path}': type {type(value).__module__}.{type(value).__qualname__} "
        "is not a tensor, a Stateful, None, bool, int, float, str, bytes, list, tuple or dict"
    )


def encode_dict_key(key: Any, path: str) -> Any:
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
            return int(payload)
        if tag == "$float":
            if payload not in ("nan", "inf", "-inf"):
                raise ValueError(payload)
            return float(payload)
        if tag == "$bytes":
            return base64.b64decode(payload.encode("ascii"), validate=True)
        if tag == "$tuple":
            return tuple(decode(v, on_ref) for v in payload)
        if tag == "$dict":
            return {decode(k): decode(v, on_ref) for k, v in payload}
    except (ValueError, TypeError, AttributeError) as exc:
        raise CorruptCheckpointError(f"manifest: bad {tag} value {payload!r}: {exc}") from None
    if tag in ("$tensor", "$rank_local"):
        if on_ref is None or not isinstance(payload, str):
            raise CorruptCheckpointError(f"manifest: unexpected {tag} reference {payload!r}")
        return on_ref(tag, payload)
    raise CorruptCheckpointError(f"manifest: unknown tag {tag!r}")
