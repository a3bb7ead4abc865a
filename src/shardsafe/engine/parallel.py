"""Share work between the calling thread and a pool's threads."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def run_shares(pool: ThreadPoolExecutor, fn: Callable[[T], object], shares: Sequence[T]) -> None:
    """Run ``fn(share)`` for every share: the first on the calling thread, the others on
    ``pool``; returns once all are done and raises the first error among them."""
    futures = [pool.submit(fn, share) for share in shares[1:]]
    try:
        if shares:
            fn(shares[0])
    finally:
        for f in futures:
            f.result()
