"""Bytes <-> Manifest: the integrity trailer, the strict JSON parse and the dispatch on
the format version to the current codec (manifest_v3.py) or the legacy readers
(manifest_legacy.py). Pure: bytes in, objects out."""

from __future__ import annotations

import json
from typing import Any

from ..errors import CorruptCheckpointError, FormatVersionError
from ..gcpause import gc_paused
from .checksum import ALGORITHM, checksum
from .manifest import FORMAT_NAME, MANIFEST_NAME, READABLE_MAJORS, Manifest
from .manifest_legacy import decode_legacy, encode_v2
from .manifest_v3 import decode_v3, encode_v3
from .strict_json import _duplicate, _parse_json

_TRAILER = b', "manifest_xxh3_64": "'


def encode_manifest(manifest: Manifest) -> bytes:
    """The manifest's bytes (format 3 for an indexed manifest, else 2) with the trailer."""
    with gc_paused():
        return _seal(encode_v3(manifest) if manifest.indexed else encode_v2(manifest))


KNOWN_FEATURES = ("compression",)
"""Features a manifest's ``requires`` may list (format 3.2+): a reader refuses any other,
so a later minor step that readers must understand is refused cleanly, never misread."""


def decode_manifest(data: bytes, where: str = MANIFEST_NAME) -> Manifest:
    """Parse and verify a manifest (format 1.x, 2.x or 3.x); errors name ``where``."""
    with gc_paused():
        return _decode(data, where)


def _decode(data: bytes, where: str) -> Manifest:
    cut = data.rfind(_TRAILER)
    if cut < 0:
        raise CorruptCheckpointError(f"{where}: manifest has no integrity trailer (truncated or not ours)")
    head = data[:cut]
    stored = data[cut + len(_TRAILER): cut + len(_TRAILER) + 16].decode("ascii", "replace")
    if data[cut + len(_TRAILER) + 16:].rstrip(b"\n") != b'"}' or checksum(head) != stored:
        raise CorruptCheckpointError(f"{where}: manifest checksum mismatch (the file is corrupt)")
    body, spans = _parse_json(head + b"}", where)
    if body.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{where}: not a shardsafe manifest")
    version = body.get("version")
    if not (isinstance(version, list) and len(version) == 2 and all(type(v) is int for v in version)):
        raise CorruptCheckpointError(f"{where}: bad format version {version!r}")
    if version[0] not in READABLE_MAJORS:
        raise FormatVersionError(
            f"{where}: format version {version[0]}.{version[1]} is not readable by this shardsafe "
            f"(reads {', '.join(f'{m}.x' for m in READABLE_MAJORS)}); upgrade shardsafe to load it"
        )
    requires = body.get("requires", [])
    if not (type(requires) is list and all(type(r) is str for r in requires)):
        raise CorruptCheckpointError(f"{where}: 'requires' is not a list of feature names")
    unknown = [r for r in requires if r not in KNOWN_FEATURES]
    if unknown:
        raise FormatVersionError(
            f"{where}: format version {version[0]}.{version[1]} requires {', '.join(map(repr, unknown[:5]))}, which "
            f"this shardsafe does not support (it knows {', '.join(KNOWN_FEATURES)}); upgrade shardsafe to load it")
    if body.get("checksum_algorithm") != ALGORITHM:
        raise CorruptCheckpointError(f"{where}: unknown checksum algorithm {body.get('checksum_algorithm')!r}")
    try:
        if version[0] >= 3:
            return decode_v3(body, spans, head, (version[0], version[1]), where)
        return decode_legacy(body, spans, head, (version[0], version[1]), where)
    except CorruptCheckpointError as exc:
        # A duplicate key in tensors or files can break a rule; say so rather than what it broke.
        duplicate = _duplicate(head, spans)
        msg = f"manifest is not valid JSON: {duplicate}" if duplicate else str(exc)
        raise CorruptCheckpointError(msg if msg.startswith(where) else f"{where}: {msg}") from None
    except (KeyError, TypeError, IndexError, AttributeError, ValueError, OverflowError, MemoryError) as exc:
        duplicate = _duplicate(head, spans)
        msg = f"manifest is not valid JSON: {duplicate}" if duplicate else \
            f"a manifest field is missing or mistyped: {exc!r}"
        raise CorruptCheckpointError(f"{where}: {msg}") from None


def _seal(body: dict[str, Any]) -> bytes:
    """The manifest's bytes: compact JSON whose last member is the integrity trailer."""
    text = json.dumps(body, separators=(",", ":"), allow_nan=False).encode("utf-8")
    head = text[:-1]  # drop the closing brace; the trailer closes the object
    return head + _TRAILER + checksum(head).encode("ascii") + b'"}\n'


# strict JSON parsing lives in strict_json.py
