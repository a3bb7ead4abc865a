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

Limits (docs/format.md, "Limits"): a value nests at most MAX_DEPTH JSON arrays/objects,
an int has at most MAX_INT_DIGITS decimal digits, and strings are valid Unicode (no lone
surrogates). Encoding refuses values beyond them, and ints outside PICKLE_INT_BOUND, so that
everything saved can be read and exported; decoding refuses them as corrupt, before any work
that grows faster than linearly.

One decoder for every reader: :func:`decode` (whole values) and :func:`container` (one
node's children, for the tree walkers of tools) apply the same rules to typed containers
(a ``$tuple``'s payload is a list; a ``$dict``'s is a list of ``[key, value]`` pairs with
str or int keys, none twice) and raise CorruptCheckpointError naming the dotted key.
"""

from __future__ import annotations

import base64
import math
import re
import reprlib
from collections.abc import Callable
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedValueError

_SAFE_INT = 1 << 53
TENSOR_TAG = "$tensor"  # {"$tensor": key}: a tensor of the manifest
RANK_LOCAL_TAG = "$rank_local"  # {"$rank_local": key}: a rank-local value

MAX_DEPTH = 200
"""Deepest nesting of JSON arrays/objects in one typed-JSON value (the tree, a rank-local
value), counted in its JSON form: a list or str-keyed dict is one level, a tuple two
(``{"$tuple": [...]}``), any other dict three (``{"$dict": [[k, v], ...]}``), a tagged
scalar or placeholder one. Recursive code (json itself, :func:`decode`, matching) then
needs at most a few hundred of Python's 1000 frames, and real states (under 20 levels)
stay far below."""

PICKLE_INT_BOUND = 1 << (8 * 255 - 1)
"""Writers save ints ``v`` with ``-PICKLE_INT_BOUND <= v < PICKLE_INT_BOUND`` only (2039 bits
and a sign, about 614 decimal digits): every value saved must export to every target, and
torch's weights-only unpickler (``torch.load(weights_only=True)``) reads pickle's LONG1
opcode (at most 255 bytes of two's complement) but not LONG4. Readers still accept ints up
to MAX_INT_DIGITS digits (checkpoints written before this limit keep loading)."""

MAX_INT_DIGITS = 20_000
"""Most decimal digits of a ``{"$int": ...}`` (about 66,000 bits): far beyond any counter,
seed or RNG state, and small enough that converting one takes about a millisecond, so a
manifest full of them decodes in time linear in its size."""

# Python refuses int <-> decimal str conversions of more than 4300 digits by default
# (sys.set_int_max_str_digits, at least 640); big ints are converted in pieces below that.
_DIGITS = 512
_DIGITS_BASE = 10**_DIGITS
_INT_BOUND = 10**MAX_INT_DIGITS
_DECIMAL = re.compile(r"-?[0-9]+", re.ASCII)
_POW10: dict[int, int] = {}


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
    """The int written by :func:`_int_to_decimal` (strictly ``-?[0-9]+``, at most
    MAX_INT_DIGITS digits), converted by halves in about a millisecond at the limit."""
    if not isinstance(text, str):
        raise ValueError("not a decimal integer string")
    if len(text) > MAX_INT_DIGITS + 1 or len(text.lstrip("-")) > MAX_INT_DIGITS:  # before any other work
        raise ValueError(f"more than {MAX_INT_DIGITS} digits ({len(text)} characters)")
    if not _DECIMAL.fullmatch(text):
        raise ValueError("not a decimal integer string")
    value = _digits_to_int(text.lstrip("-"))
    return -value if text.startswith("-") else value


def _digits_to_int(digits: str) -> int:
    """``int(digits)`` without Python's digit limit: split in two at a power-of-two number
    of low digits, so the work is a few big multiplications instead of one per piece."""
    if len(digits) <= _DIGITS:
        return int(digits)
    low = _DIGITS
    while 2 * low < len(digits):
        low *= 2
    scale = _POW10.get(low)
    if scale is None:
        scale = _POW10[low] = 10**low
    return _digits_to_int(digits[:-low]) * scale + _digits_to_int(digits[-low:])


def _subclass_error(value: Any, path: str, base: str) -> UnsupportedValueError:
    return UnsupportedValueError(
        f"cannot save value at '{path}': type {type(value).__qualname__} (a subclass of {base}) "
        f"would come back as a plain {base}"
    )


def encode_scalar(value: Any, path: str) -> Any:
    """Encode a non-container leaf; raises UnsupportedValueError naming ``path`` for values
    the format cannot hold (see the module's limits)."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str):
        if type(value) is not str:  # StrEnum and friends would not come back as themselves
            raise _subclass_error(value, path, "str")
        if not (value.isascii() or _utf8_encodable(value)):
            raise UnsupportedValueError(
                f"cannot save value at '{path}': the string holds a lone surrogate (not valid Unicode)")
        return value
    if isinstance(value, int):
        if type(value) is not int:  # IntEnum and friends would not come back as themselves
            raise _subclass_error(value, path, "int")
        if -_SAFE_INT < value < _SAFE_INT:
            return value
        if not -PICKLE_INT_BOUND <= value < PICKLE_INT_BOUND:
            raise UnsupportedValueError(
                f"cannot save value at '{path}': an int of {value.bit_length()} bits (at most 2039 bits and a sign, "
                "about 614 decimal digits: torch.load(weights_only=True), which reads exported checkpoints, cannot "
                "read larger ones)")
        return {"$int": _int_to_decimal(value)}
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


def _utf8_encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def nesting_depth(obj: Any) -> int:
    """How many JSON arrays/objects nest in ``obj`` (a JSON value: dicts, lists, scalars),
    found without recursion: 0 for a scalar, 1 for ``[]`` or ``{"a": 1}``."""
    depth = 0
    level = [obj]
    while level:
        inner = [v for v in level if isinstance(v, (dict, list))]
        if not inner:
            break
        depth += 1
        level = [c for v in inner for c in (v.values() if isinstance(v, dict) else v)]
    return depth


def decode(obj: Any, on_ref: Callable[[str, str], Any] | None = None, key: str = "") -> Any:
    """Decode typed JSON back into Python values; anything malformed, nested deeper than
    MAX_DEPTH or beyond a limit raises CorruptCheckpointError naming the dotted key of the
    bad node under ``key`` (never RecursionError).

    ``on_ref(tag, key)`` resolves ``$tensor`` / ``$rank_local`` placeholders; without it
    a placeholder is an error."""
    try:
        return _decode(obj, on_ref, 0)
    except CorruptCheckpointError as exc:
        raise _keyed(exc, key) from None


def container(node: Any, key: str = "") -> tuple[type, list[tuple[Any, Any]]] | None:
    """(container type, [(key, typed-JSON child), ...]) of a container node (a JSON array,
    a ``$tuple``, a plain JSON object, a ``$dict``; list and tuple keys are indices), or
    None for a leaf (a scalar, a placeholder, a tagged scalar, or a malformed object that
    :func:`decode` refuses). A malformed ``$tuple`` or ``$dict`` raises the error
    :func:`decode` raises, naming ``key``."""
    if isinstance(node, list):
        return list, list(enumerate(node))
    if not isinstance(node, dict):
        return None
    if len(node) == 1:
        ((tag, payload),) = node.items()
        try:
            if tag == "$tuple":
                return tuple, list(enumerate(_tuple_payload(payload)))
            if tag == "$dict":
                return dict, _dict_pairs(payload)
        except (ValueError, TypeError) as exc:
            raise _keyed(CorruptCheckpointError(f"manifest: bad {tag} value {_short(payload)}: {exc}"), key) from None
    if any(k.startswith("$") for k in node):
        return None
    return dict, list(node.items())


def _keyed(exc: CorruptCheckpointError, key: str) -> CorruptCheckpointError:
    """``exc`` with the dotted key of the node it is about (``key`` and the parts the
    containers on the way added); its message as is when there is no key."""
    parts = ([key] if key else []) + list(reversed(getattr(exc, "parts", [])))
    if not parts:
        return exc
    shown = ".".join(parts) if len(parts) <= 12 else ".".join(parts[:12]) + "..."
    msg = str(exc)
    msg = msg[len("manifest: "):] if msg.startswith("manifest: ") else msg
    return CorruptCheckpointError(f"manifest: value at '{shown}': {msg}")


def _at(exc: CorruptCheckpointError, part: Any) -> CorruptCheckpointError:
    """Record that ``exc`` happened under child ``part`` (innermost first)."""
    parts = getattr(exc, "parts", None)
    if parts is None:
        parts = exc.parts = []  # type: ignore[attr-defined]
    parts.append(part if isinstance(part, str) else _short(part))
    return exc


def _level(depth: int) -> int:
    """The nesting level of a container inside one at ``depth``; raises past MAX_DEPTH."""
    if depth >= MAX_DEPTH:
        raise CorruptCheckpointError(f"manifest: a value nests deeper than {MAX_DEPTH} JSON arrays/objects")
    return depth + 1


def _decode(obj: Any, on_ref: Callable[[str, str], Any] | None, depth: int) -> Any:
    if obj is None or isinstance(obj, (bool, str, int, float)):
        return obj
    if isinstance(obj, list):
        return _decode_list(obj, on_ref, _level(depth))
    if isinstance(obj, dict):
        depth = _level(depth)
        if len(obj) == 1:
            ((tag, payload),) = obj.items()
            if tag.startswith("$"):
                return _decode_tagged(tag, payload, on_ref, depth)
        for k in obj:
            if k.startswith("$"):
                raise CorruptCheckpointError(f"manifest: object key {_short(k)} may not start with '$'")
        out = {}
        k = None
        try:
            for k, v in obj.items():
                out[k] = _decode(v, on_ref, depth)
        except CorruptCheckpointError as exc:
            raise _at(exc, k) from None
        return out
    raise CorruptCheckpointError(f"manifest: unexpected JSON value of type {type(obj).__name__}")


def _decode_list(items: list[Any], on_ref: Callable[[str, str], Any] | None, depth: int) -> list[Any]:
    out: list[Any] = []
    try:
        for v in items:
            out.append(_decode(v, on_ref, depth))
    except CorruptCheckpointError as exc:
        raise _at(exc, len(out)) from None  # the element that failed is the next one
    return out


def _tuple_payload(payload: Any) -> list[Any]:
    if not isinstance(payload, list):
        raise TypeError("payload is not a list")
    return payload


def _dict_pairs(payload: Any) -> list[tuple[str | int, Any]]:
    """The (decoded key, typed-JSON value) pairs of a ``$dict`` payload, validated: a list
    of ``[key, value]`` pairs, keys str or int, none twice."""
    if not isinstance(payload, list):
        raise TypeError("payload is not a list")
    out = []
    seen: set[str | int] = set()
    for pair in payload:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"entry {_short(pair)} is not a [key, value] pair")
        key = _decode_dict_key(pair[0])
        if key in seen:
            raise ValueError(f"duplicate key {_short(key)}")
        seen.add(key)
        out.append((key, pair[1]))
    return out


def _decode_tagged(tag: str, payload: Any, on_ref: Callable[[str, str], Any] | None, depth: int) -> Any:
    """A tag object at nesting level ``depth``; its payload array (if any) is one deeper."""
    if tag == TENSOR_TAG or tag == RANK_LOCAL_TAG:  # placeholders first: a state's most common tag
        if on_ref is None or not isinstance(payload, str):
            raise CorruptCheckpointError(f"manifest: unexpected {tag} reference {_short(payload)}")
        return on_ref(tag, payload)
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
            return tuple(_decode_list(_tuple_payload(payload), on_ref, _level(depth)))
        if tag == "$dict":
            pairs = _dict_pairs(payload)
            inner = _level(_level(depth))  # the list of pairs, then each pair
            out = {}
            k = None
            try:
                for k, v in pairs:
                    out[k] = _decode(v, on_ref, inner)
            except CorruptCheckpointError as exc:
                raise _at(exc, k) from None
            return out
    except (ValueError, TypeError, AttributeError, UnicodeEncodeError) as exc:
        raise CorruptCheckpointError(f"manifest: bad {tag} value {_short(payload)}: {exc}") from None
    raise CorruptCheckpointError(f"manifest: unknown tag {_short(tag)}")


def _short(value: Any) -> str:
    """A bounded repr for error messages (a hostile payload may be huge or deeply nested)."""
    try:
        return reprlib.repr(value)
    except ValueError:  # an int too long for str()
        return f"<{type(value).__name__}>"


def _decode_dict_key(key: Any) -> str | int:
    """A ``$dict`` key: a string, a JSON integer or an ``{"$int": ...}`` (what encode_dict_key writes)."""
    if isinstance(key, str) or (isinstance(key, int) and not isinstance(key, bool)):
        return key
    if isinstance(key, dict) and len(key) == 1 and "$int" in key:
        return _decimal_to_int(key["$int"])
    raise TypeError(f"dict key {_short(key)} is not a str or int")
