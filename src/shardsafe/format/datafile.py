"""Data files in the safetensors layout: an 8-byte little-endian header length, a JSON
header naming every chunk (dtype, shape, data offsets), then the chunks back to back.

Any safetensors reader opens our data files; we never need its header on load (the
manifest holds absolute byte ranges), but we check the header's checksum.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass

HEADER_ALIGN = 8
METADATA = {"format": "pt", "producer": "shardsafe"}


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk to place in a data file."""

    name: str
    code: str  # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int


def chunk_name(key: str, offsets: Sequence[int], whole: bool) -> str:
    """Name of a chunk inside a data file: the key for a whole tensor, else ``key@o0,o1,...``."""
    return key if whole else f"{key}@{','.join(str(o) for o in offsets)}"


def build_header(
    entries: Sequence[ChunkEntry], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """The header bytes (length prefix included) and each chunk's absolute byte range."""
    body: dict[str, object] = {"__metadata__": METADATA if metadata is None else metadata}
    offset = 0
    relative = []
    for e in entries:
        body[e.name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        relative.append((offset, offset + e.nbytes))
        offset += e.nbytes
    text = json.dumps(body, separators=(",", ":")).encode("utf-8")
    text += b" " * (-(len(text) + 8) % HEADER_ALIGN)
    header = struct.pack("<Q", len(text)) + text
    base = len(header)
    return header, [(base + s, base + e) for s, e in relative]


def header_length(prefix: bytes) -> int:
    """Total header size (prefix + JSON) from the first 8 bytes of a data file."""
    (n,) = struct.unpack("<Q", prefix[:8])
    return 8 + n
