"""Data files in the safetensors layout: an 8-byte little-endian header length, a JSON
header naming every chunk (dtype, shape, data offsets), then the chunks back to back.

Any safetensors reader opens our data files. Loading never needs the header (the
manifest holds absolute byte ranges), but it is checked: its checksum, and with
:func:`parse_header` / :func:`check_chunks_against_header` that it describes the chunks
the manifest claims (same byte range, dtype and shape), so that no byte is ever
reinterpreted as another dtype than the one it was written as.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import CorruptCheckpointError
from .strict_json import _STRICT

HEADER_ALIGN = 8
METADATA = {"format": "pt", "producer": "shardsafe"}
METADATA_KEY = "__metadata__"
MAX_HEADER_BYTES = 100_000_000
"""Largest JSON header :func:`parse_header` reads (the limit of the safetensors library)."""
_LIMIT = 1 << 62  # sizes stay below this, so that 64-bit arithmetic cannot overflow


@dataclass(frozen=True)
class ChunkEntry:
    """One chunk to place in a data file."""

    name: str
    code: str  # safetensors dtype code
    shape: tuple[int, ...]
    nbytes: int


class HeaderEntry(NamedTuple):
    """One tensor of a parsed safetensors header; ``begin``/``end`` are relative to the
    data area (the first byte after the header)."""

    code: str
    shape: tuple[int, ...]
    begin: int
    end: int


class ClaimedChunk(NamedTuple):
    """What the manifest says a data file holds at an absolute byte range ``[start, end)``:
    a chunk of tensor ``key`` with safetensors dtype ``code`` and ``shape`` (its box's lengths)."""

    code: str
    shape: tuple[int, ...]
    start: int
    end: int
    key: str


def chunk_name(key: str, offsets: Sequence[int], whole: bool) -> str:
    """Name of a chunk inside a data file: the key for a whole tensor, else ``key@o0,o1,...``
    (made unique within the file by :func:`unique_chunk_names`)."""
    return key if whole else f"{key}@{','.join(str(o) for o in offsets)}"


def unique_chunk_names(names: Sequence[str]) -> list[str]:
    """``names`` (in file order) with every name that is not unique made so: the first
    occurrence keeps its name, each later one gets the smallest ``~k`` (k = 1, 2, ...)
    that no name in the list has or gets, and so does ``__metadata__``, which safetensors
    reserves. The same list always gives the same result."""
    taken = set(names)
    taken.add(METADATA_KEY)
    seen: set[str] = set()
    out = []
    for name in names:
        if name in seen or name == METADATA_KEY:
            k = 1
            while f"{name}~{k}" in taken:
                k += 1
            name = f"{name}~{k}"
            taken.add(name)
        seen.add(name)
        out.append(name)
    return out


def build_header(
    entries: Sequence[ChunkEntry], metadata: dict[str, str] | None = None
) -> tuple[bytes, list[tuple[int, int]]]:
    """The header bytes (length prefix included) and each chunk's absolute byte range;
    chunk names are made unique with :func:`unique_chunk_names`."""
    body: dict[str, object] = {METADATA_KEY: METADATA if metadata is None else metadata}
    offset = 0
    relative = []
    for name, e in zip(unique_chunk_names([e.name for e in entries]), entries):
        body[name] = {"dtype": e.code, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
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


@functools.cache
def _itemsizes() -> dict[str, int]:
    """Bytes per element of every safetensors dtype code this reader knows."""
    from .dtypes import TORCH_TO_CODE

    return {code: dt.itemsize for dt, code in TORCH_TO_CODE.items()}


def parse_header(data: bytes, where: str, file_bytes: int | None = None) -> dict[str, HeaderEntry]:
    """The tensors of the safetensors header at the start of ``data`` (the 8-byte length
    and the JSON header; anything after them is ignored), by name, validated strictly.

    Promises, else CorruptCheckpointError naming ``where``: the length is at most
    MAX_HEADER_BYTES and ``data`` holds it all; the header is UTF-8 JSON, one object,
    padded with spaces only, without duplicate keys or NaN/Infinity; ``__metadata__``, if
    present, maps strings to strings; every other member is exactly ``{"dtype", "shape",
    "data_offsets"}`` with a known dtype code, a list of non-negative int dims and
    ``[begin, end]`` holding exactly ``numel x itemsize`` bytes; sorted by offset the
    tensors lie back to back from 0, without gap or overlap, and with ``file_bytes`` (the
    file's size) given, end exactly where the file does."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: safetensors header: {what}")

    if len(data) < 8:
        raise bad(f"{len(data)} bytes, shorter than the 8-byte length prefix")
    n = header_length(data) - 8
    if n > MAX_HEADER_BYTES:
        raise bad(f"claims {n} bytes of JSON (at most {MAX_HEADER_BYTES})")
    if len(data) < 8 + n:
        raise bad(f"claims {n} bytes of JSON, only {len(data) - 8} follow the prefix")
    if file_bytes is not None and file_bytes < 8 + n:
        raise bad(f"claims {n} bytes of JSON, the file has {file_bytes} bytes")
    try:
        text = data[8: 8 + n].decode("utf-8")
        body, end = _STRICT(text, 0)  # the manifest's strict decoder: no duplicate keys, NaN or Infinity
        if text[end:].strip(" "):
            raise ValueError("the JSON object is followed by something other than spaces")
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise bad(f"not valid JSON: {str(exc)[:300]}") from None
    if not isinstance(body, dict):
        raise bad("not a JSON object")
    meta = body.pop(METADATA_KEY, {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise bad(f"{METADATA_KEY} is not an object of strings")
    sizes = _itemsizes()
    entries: dict[str, HeaderEntry] = {}
    for name, info in body.items():
        label = repr(name[:200])  # for messages
        if not (isinstance(info, dict) and info.keys() == {"dtype", "shape", "data_offsets"}):
            raise bad(f"{label} is not an object of exactly dtype, shape and data_offsets")
        code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
        if not (isinstance(code, str) and code in sizes):
            raise bad(f"{label} has an unknown dtype {str(code)[:40]!r}")
        if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < _LIMIT for d in shape)):
            raise bad(f"{label} has a bad shape {str(shape)[:200]}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1] < _LIMIT):
            raise bad(f"{label} has bad data_offsets {str(offsets)[:200]}")
        nbytes = math.prod(shape) * sizes[code]
        if offsets[1] - offsets[0] != nbytes:
            raise bad(f"{label} is {code} {shape}, {nbytes} bytes, but data_offsets {offsets} hold "
                      f"{offsets[1] - offsets[0]}")
        entries[name] = HeaderEntry(code, tuple(shape), offsets[0], offsets[1])
    end = 0
    for name, e in sorted(entries.items(), key=lambda item: (item[1].begin, item[1].end)):
        if e.begin != end:
            raise bad(f"{name[:200]!r} starts at data offset {e.begin}, not where the previous tensor ends ({end}): "
                      + ("overlap" if e.begin < end else "gap"))
        end = e.end
    if file_bytes is not None and 8 + n + end != file_bytes:
        raise bad(f"the tensors end at byte {8 + n + end}, the file at {file_bytes}")
    return entries


def check_chunks_against_header(entries: Mapping[str, HeaderEntry], header_len: int,
                                chunks: Iterable[ClaimedChunk | tuple[str, tuple[int, ...], int, int, str]],
                                where: str) -> None:
    """Check that each chunk the manifest claims in a data file is a tensor of its header
    (``entries`` from :func:`parse_header`, whose prefix and JSON take ``header_len``
    bytes) at the same byte range, with the same dtype code and shape; raises
    CorruptCheckpointError naming ``where`` and the tensor key otherwise.

    Chunks are matched by byte range, never by name (names may carry ``~k``); a header
    tensor matches one chunk at most (empty tensors may share a range)."""
    at: dict[tuple[int, int], list[HeaderEntry]] = {}
    for e in entries.values():
        at.setdefault((header_len + e.begin, header_len + e.end), []).append(e)
    for code, shape, start, end, key in chunks:
        shape = tuple(shape)
        there = at.get((start, end), [])
        match = next((i for i, e in enumerate(there) if e.code == code and e.shape == shape), None)
        if match is None:
            found = ", ".join(f"{e.code} {list(e.shape)}" for e in there) or "no tensor"
            raise CorruptCheckpointError(
                f"{where}: the manifest puts a chunk of '{key}' ({code} {list(shape)}) at bytes {start}-{end}, "
                f"the file's header has {found} there")
        there.pop(match)
