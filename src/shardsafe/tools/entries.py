"""The leaves of a saved state tree: tensors, plain values and rank-local markers, with their keys.

A leaf has a display path (``parts``), its dotted key as the manifest names it (tensors
inside rank-local values: ``rng#rank3.torch``) and its *plain* key, the dotted path
without the rank marker (``rng.torch``), which is what exports write.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..format.manifest import Manifest
from ..format.values import TENSOR_TAG, decode
from ..state.saved import children
from ..state.tree import join_key, rank_local_key, saved_ref


@dataclass(frozen=True)
class Leaf:
    """One leaf of a saved tree."""

    kind: str  # "tensor", "value", or "rank_local" (the marker of a rank-local value)
    parts: tuple[str, ...]  # display path; rank-local expansions add a "#rank<r>" part
    key: str  # dotted key; for tensors the manifest's tensor key
    plain: str  # dotted key without the "#rank<r>" marker
    node: Any  # the typed-JSON node
    rank: int | None = None  # saving rank, inside rank-local values

    def decoded(self) -> Any:
        """The Python value of a value leaf."""
        return decode(self.node)


def _is_container(node: Any) -> bool:
    return children(node) is not None


def _children(node: Any) -> list[tuple[str, Any]]:
    kids = children(node)
    return [] if kids is None else [(str(k), v) for k, v in kids[1]]


def _has_refs(node: Any) -> bool:
    if isinstance(node, list):
        return any(_has_refs(v) for v in node)
    if isinstance(node, dict):
        if saved_ref(node) is not None:
            return True
        return any(_has_refs(v) for v in node.values())
    return False


def leaves(manifest: Manifest, ranks: Iterable[int] | str | None = "all", inline: int = 0) -> Iterator[Leaf]:
    """Every leaf of the manifest's tree in saved order. A rank-local value yields its
    marker leaf, then the leaves of the saving ranks listed in ``ranks`` (``"all"``:
    every saving rank; None: none). Empty containers are value leaves; with ``inline``,
    so are lists and tuples of scalars, and containers of plain values whose repr fits
    in ``inline`` characters."""

    def walk(node: Any, parts: tuple[str, ...], keyparts: list[str], plain: list[str],
             rank: int | None) -> Iterator[Leaf]:
        key, pkey = join_key(keyparts), join_key(plain)
        ref = saved_ref(node)
        if ref is not None and ref[0] == TENSOR_TAG:
            yield Leaf("tensor", parts, ref[1], pkey, node, rank)
            return
        if ref is not None:
            per_rank = manifest.rank_local.get(ref[1]) or []
            yield Leaf("rank_local", parts, key, pkey, node, rank)
            wanted = range(len(per_rank)) if ranks == "all" else ([] if ranks is None else ranks)
            for r in wanted:
                if isinstance(r, int) and 0 <= r < len(per_rank) and per_rank[r] is not None:
                    yield from walk(per_rank[r], parts + (f"#rank{r}",), [rank_local_key(ref[1], r)], plain, r)
            return
        if _is_container(node):
            if inline and not _has_refs(node):
                try:
                    value = decode(node)
                    short = len(repr(value)) <= inline or (isinstance(value, (list, tuple)) and not any(
                        isinstance(v, (list, tuple, dict)) for v in value))
                except Exception:  # noqa: BLE001 - a bad value is walked item by item
                    short = False
                if short:
                    yield Leaf("value", parts, key, pkey, node, rank)
                    return
            kids = _children(node)
            if not kids:
                yield Leaf("value", parts, key, pkey, node, rank)
            for k, v in kids:
                yield from walk(v, parts + (k,), keyparts + [k], plain + [k], rank)
            return
        yield Leaf("value", parts, key, pkey, node, rank)

    yield from walk(manifest.tree, (), [], [], None)


def brief(value: Any, width: int = 60) -> str:
    """A short one-line description of a plain value."""
    if value is None or (isinstance(value, (list, tuple, dict)) and not value):
        return repr(value)
    text = repr(value)
    if len(text) > width:
        text = text[: width - 3] + "..."
    if isinstance(value, (list, tuple, dict)):
        return f"{type(value).__name__} of {len(value)} {text}"
    return f"{type(value).__name__} {text}"
