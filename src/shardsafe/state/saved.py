"""The one walker over a saved value tree (the manifest's typed JSON).

``children`` is the single definition of what a container node is (a plain JSON object,
a ``$dict``, a JSON array, a ``$tuple``) and of its children's keys; ``select`` cuts a
tree down to dotted key prefixes; ``walk`` visits every node with its dotted key. Loading
(``load_full``'s ``keys``), export, diff, inspect and verify all go through them, so
they agree on keys and on what a partial selection means.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..errors import MissingKeysError
from ..format.values import TENSOR_TAG, container
from .tree import join_key

_DROP = object()


def children(node: Any, key: str = "") -> tuple[type, list[tuple[Any, Any]]] | None:
    """(container type, [(key, child), ...]) of a container node (dict, list or tuple;
    list and tuple keys are indices), or None for a leaf (a scalar, a tensor or
    rank-local placeholder, or a tagged scalar such as ``$int``). A malformed ``$tuple``
    or ``$dict`` raises CorruptCheckpointError naming ``key`` (format.values.container:
    the rules of the decoder that loads use)."""
    return container(node, key)


def walk(node: Any, parts: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any, bool]]:
    """Every node in saved order as (key parts, node, is_container), containers first."""
    kids = children(node, ".".join(parts))
    yield parts, node, kids is not None
    if kids is not None:
        for k, v in kids[1]:
            yield from walk(v, parts + (str(k),))


def select(tree: Any, wanted: list[str]) -> Any:
    """The parts of a saved tree under the dotted prefixes ``wanted``. A list or tuple of
    which only some elements are selected becomes a dict keyed by their indices (so
    element 2 stays element 2). A prefix that selects nothing raises MissingKeysError."""
    found = {w: False for w in wanted}

    def visit(node: Any, parts: list[str]) -> Any:
        key = join_key(parts)
        hits = [w for w in wanted if key == w or key.startswith(w + ".")]
        if hits:
            for w in hits:
                found[w] = True
            return node
        if parts and not any(w.startswith(key + ".") for w in wanted):
            return _DROP
        kids = children(node, key)
        if kids is None:
            return _DROP
        kind, items = kids
        kept = {}
        for k, v in items:
            sub = visit(v, parts + [str(k)])
            if sub is not _DROP:
                kept[k] = sub
        if not kept:
            return _DROP
        if kind is not dict and len(kept) == len(items):
            return node
        if kind is not dict or (isinstance(node, dict) and "$dict" in node):
            from ..format.values import encode_dict_key

            return {"$dict": [[encode_dict_key(k, key), v] for k, v in kept.items()]}
        return kept

    out = visit(tree, [])
    missing = [w for w, ok in found.items() if not ok]
    if missing:
        from ..hints import key_hint

        keys = [".".join(parts) for parts, _, _ in walk(tree) if parts]
        raise MissingKeysError(f"no key or key prefix {missing[0]!r} in the checkpoint{key_hint(missing[0], keys)}")
    return {} if out is _DROP else out


def check_tree(manifest: Any) -> None:
    """Decode the manifest's whole value tree and every rank-local value once, as
    ``load_full`` would (malformed typed JSON, duplicate keys, too deep), and check that
    every placeholder names a tensor or rank-local value the manifest holds; anything else
    is a CorruptCheckpointError. Loads in place run it before matching, so they refuse
    exactly what ``load_full`` refuses. Remembered on the manifest (checked once)."""
    if getattr(manifest, "_tree_checked", False):
        return
    from ..errors import CorruptCheckpointError
    from ..format.values import decode

    def on_ref(tag: str, key: str) -> None:
        known = manifest.tensors if tag == TENSOR_TAG else manifest.rank_local
        if key not in known:
            what = "tensor" if tag == TENSOR_TAG else "rank-local value"
            raise CorruptCheckpointError(f"manifest: the value tree refers to {what} {key!r}, which it does not hold")

    decode(manifest.tree, on_ref)
    if getattr(manifest, "indexed", False):  # format 3: each rank's values are checked as its index is read
        manifest._tree_checked = True
        return
    for key, per_rank in manifest.rank_local.items():
        if not isinstance(per_rank, list):
            raise CorruptCheckpointError(f"manifest: rank-local value {key!r} is not a list of per-rank values")
        for rank, value in enumerate(per_rank):
            decode(value, on_ref, f"{key}#rank{rank}")
    manifest._tree_checked = True
