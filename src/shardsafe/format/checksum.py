"""Chunk checksums: XXH3-64 (the ``xxhash`` package), 16 lowercase hex digits.

XXH3-64 was measured at 12-14 GB/s per core on this machine (crc32c: 12.5 GB/s, zlib
crc32: 2 GB/s); it releases the GIL, so checksums overlap with I/O on other threads.
"""

from __future__ import annotations

import xxhash

ALGORITHM = "xxh3_64"


def checksum(buffer) -> str:
    """XXH3-64 of a bytes-like object (memoryview, numpy array, bytes), as 16 hex digits."""
    return format(xxhash.xxh3_64_intdigest(buffer), "016x")
