"""Byte copies between buffers with the GIL released.

A memoryview slice assignment (``dst[:] = src``) holds the GIL for the whole copy, so
threads copying fetched bytes (S3 pieces into their destination, spilled ranges out of
memory) would take turns; numpy's copy releases it for large buffers."""

from __future__ import annotations

import numpy as np

SMALL = 65536  # below this, the plain assignment costs less than the arrays around it


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """``dst[:] = src`` (both 1-D byte views of one length), the GIL released when large."""
    if len(src) < SMALL:
        dst[:] = src
    else:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
