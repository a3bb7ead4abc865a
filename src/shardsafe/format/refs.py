"""References (format 3.1): data files of other checkpoints that a checkpoint's chunks live in.

An incremental save does not rewrite a chunk whose bytes equal its base's: the new
checkpoint's index lists the chunk under ``refs``, with the byte range, block checksums and
identity digest it has in the data file that physically holds it, and the manifest lists
that file (checkpoint name, file name, size). A reference never points at a reference:
the file named is the one that holds the bytes, so a reader follows nothing further.

Identity: the *chunk digest* is the XXH3-128 of the concatenation of the XXH3-128 digests
(16 bytes each, big-endian) of the chunk's checksum blocks; two chunks are taken as equal
only when their chunk digests (128 bits) are, never on the 64-bit block checksums alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError
from .strict_json import SIZE_LIMIT, _count, _show, plain_name

DIGEST_HEX = 32  # hex digits of a chunk digest (XXH3-128)


@dataclass(frozen=True)
class RefFile:
    """A data file this checkpoint refers to: in checkpoint ``checkpoint`` (a sibling's
    name in the same parent folder, or "" for this checkpoint's own folder), named
    ``name``, of ``nbytes`` bytes."""

    checkpoint: str
    name: str
    nbytes: int


def block_digest(buffer: Any) -> bytes:
    """The XXH3-128 of one checksum block (16 bytes, big-endian)."""
    return xxhash.xxh3_128_digest(buffer)


def chunk_digest(block_digests: list[bytes]) -> str:
    """A chunk's identity digest from its blocks' XXH3-128 digests, as 32 hex digits."""
    return xxhash.xxh3_128_hexdigest(b"".join(block_digests))


def refs_json(refs: list[RefFile]) -> dict[str, Any]:
    """The manifest's ``refs`` member: checkpoints, then files as columns."""
    checkpoints: list[str] = []
    where: dict[str, int] = {}
    for r in refs:
        if r.checkpoint not in where:
            where[r.checkpoint] = len(checkpoints)
            checkpoints.append(r.checkpoint)
    return {"checkpoints": checkpoints, "c": [where[r.checkpoint] for r in refs], "name": [r.name for r in refs],
            "bytes": [r.nbytes for r in refs]}


def parse_refs(d: Any) -> list[RefFile]:
    """The manifest's ``refs`` member, validated (names plain, files distinct, sizes >= 8)."""
    if type(d) is not dict:
        raise CorruptCheckpointError("inconsistent manifest: refs is not an object")
    checkpoints, cs, names, sizes = d.get("checkpoints"), d.get("c"), d.get("name"), d.get("bytes")
    if not (type(checkpoints) is list and all(plain_name(c, allow_empty=True) for c in checkpoints)
            and len(set(checkpoints)) == len(checkpoints)):
        raise CorruptCheckpointError("inconsistent manifest: refs 'checkpoints' is not a list of distinct plain "
                                     "folder names")
    count = len(names) if type(names) is list else -1
    if not (count >= 0 and all(plain_name(n) for n in names)):
        raise CorruptCheckpointError("inconsistent manifest: refs 'name' is not a list of plain file names")
    if not (type(cs) is list and len(cs) == count and all(type(c) is int and 0 <= c < len(checkpoints) for c in cs)):
        raise CorruptCheckpointError(f"inconsistent manifest: refs 'c' is not a list of {count} checkpoint indices")
    if not (type(sizes) is list and len(sizes) == count and all(_count(n) and 8 <= n < SIZE_LIMIT for n in sizes)):
        raise CorruptCheckpointError(f"inconsistent manifest: refs 'bytes' is not a list of {count} file sizes "
                                     "(at least 8)")
    out = [RefFile(checkpoints[c], n, z) for c, n, z in zip(cs, names, sizes)]
    if len({(r.checkpoint, r.name) for r in out}) != len(out):
        raise CorruptCheckpointError("inconsistent manifest: refs lists a file twice")
    return out


def check_digests(digests: Any, rows: int, what: str) -> str:
    """A column of chunk digests (32 lowercase hex digits per row), or raise."""
    if not (type(digests) is str and len(digests) == DIGEST_HEX * rows):
        raise CorruptCheckpointError(f"{what} 'h' is not one {DIGEST_HEX}-hex digest per row (got "
                                     f"{_show(digests)[:40]})")
    try:
        ok = 2 * len(bytes.fromhex(digests)) == len(digests) and digests == digests.lower()
    except ValueError:
        ok = False
    if not ok:
        raise CorruptCheckpointError(f"{what} 'h' is not lowercase hexadecimal")
    return digests


__all__ = ["DIGEST_HEX", "RefFile", "block_digest", "check_digests", "chunk_digest", "parse_refs", "refs_json"]
