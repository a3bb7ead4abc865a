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


def split_work(work: list, weights: list[int], parts: int) -> list[list]:
    """Deal work items to ``parts`` lists of about equal total weight (largest first)."""
    bins: list[list] = [[] for _ in range(max(1, parts))]
    load = [0] * len(bins)
    for w, item in sorted(zip(weights, range(len(work))), key=lambda x: -x[0]):
        i = load.index(min(load))
        bins[i].append(work[item])
        load[i] += w
    return [b for b in bins if b]
