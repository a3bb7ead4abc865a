"""State trees: flatten a live state (tensors, Statefuls, plain values) into typed JSON
plus named tensors for saving, and match a destination tree against a saved one for
loading.

Tensor keys are the dotted paths of their positions ("model.layers.0.weight"): dict
keys, and list / tuple indices as decimal strings, joined by ".".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import UnsupportedValueError
from ..format.values import (
    MAX_DEPTH,
    RANK_LOCAL_TAG,
    TENSOR_TAG,
    container,
    encode_dict_key,
    encode_scalar,
    nesting_depth,
)


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict(sd)`` (modules, optimizers,
    schedulers, user objects)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any: ...


def is_stateful(obj: Any) -> bool:
    """True for objects with callable ``state_dict`` and ``load_state_dict`` (not containers or tensors)."""
    if isinstance(obj, (dict, list, tuple, str, bytes, int, float, torch.Tensor)) or obj is None:
        return False
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


class RankLocal:
    """Marks a value that differs per rank on purpose; see :func:`shardsafe.rank_local`."""

    __slots__ = ("value", "missing")

    def __init__(self, value: Any, missing: str = "error") -> None:
        if missing not in ("error", "keep"):
            raise ValueError(f"missing must be 'error' or 'keep', not {missing!r}")
        self.value = value
        self.missing = missing

    def __repr__(self) -> str:
        return f"rank_local({self.value!r})"


def rank_local(value: Any, *, missing: str = "error") -> RankLocal:
    """Mark ``value`` as rank-local: every rank stores its own copy and gets it back.

    On load, rank ``r`` receives what saving rank ``r`` stored. A rank that has no saved
    counterpart (the job grew) raises MissingKeysError, or with ``missing="keep"`` keeps
    the destination value as it is."""
    return RankLocal(value, missing)


def join_key(parts: list[str]) -> str:
    """The dotted key of a path in the state tree."""
    return ".".join(parts)


def _plain_keys(d: dict) -> bool:
    return all(isinstance(k, str) and not k.startswith("$") for k in d)


@dataclass
class FlatState:
    """A flattened state: typed-JSON tree with placeholders, tensors and rank-local values by key."""

    tree: Any
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    rank_local: dict[str, Any] = field(default_factory=dict)  # key -> this rank's typed JSON
    rank_local_tensors: set[str] = field(default_factory=set)  # tensor keys inside rank-local values


def rank_local_key(key: str, rank: int) -> str:
    """The tensor-key prefix under which rank ``rank`` stores its part of rank-local ``key``."""
    return f"{key}#rank{rank}"


def flatten(state: Any, rank: int = 0) -> FlatState:
    """Flatten ``state``; Statefuls are replaced by their ``state_dict()``.

    Rank-local values are flattened too: their tree goes to ``rank_local[key]`` and
    their tensors are named under :func:`rank_local_key`. Raises UnsupportedValueError
    naming the key path of any value that cannot be saved without pickle, or of two
    positions whose dotted keys collide."""
    flat = FlatState(tree=None)
    seen: dict[str, str] = {}

    def claim(parts: list[str]) -> str:
        key = join_key(parts)
        if key in seen:
            raise UnsupportedValueError(f"two values map to the same key '{key}' (dotted paths collide)")
        seen[key] = key
        return key

    active: set[int] = set()  # ids of the containers on the path being walked (cycle check)

    def walk(obj: Any, parts: list[str], local: bool = False, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise UnsupportedValueError(f"cannot save value at '{join_key(parts[:8])}...': the state nests deeper "
                                        f"than {MAX_DEPTH} levels")
        if isinstance(obj, (dict, list, tuple)):
            if id(obj) in active:
                raise UnsupportedValueError(f"cannot save value at '{join_key(parts) or '<root>'}': it contains "
                                            "itself (a cyclic reference)")
            active.add(id(obj))
            try:
                return walk_container(obj, parts, local, depth + 1)
            finally:
                active.discard(id(obj))
        if isinstance(obj, torch.Tensor):
            key = claim(parts)
            flat.tensors[key] = obj
            if local:
                flat.rank_local_tensors.add(key)
            return {TENSOR_TAG: key}
        if isinstance(obj, RankLocal):
            key = claim(parts)
            flat.rank_local[key] = walk(obj.value, [rank_local_key(key, rank)], True, depth + 1)
            return {RANK_LOCAL_TAG: key}
        if is_stateful(obj):
            return walk(obj.state_dict(), parts, local, depth)
        return encode_scalar(obj, join_key(parts))

    def walk_container(obj: Any, parts: list[str], local: bool, depth: int) -> Any:
        if isinstance(obj, dict):
            path = join_key(parts)
            if _plain_keys(obj):
                return {k: walk(v, parts + [k], local, depth) for k, v in obj.items()}
            return {
                "$dict": [[encode_dict_key(k, path), walk(v, parts + [str(k)], local, depth)] for k, v in obj.items()]
            }
        if type(obj) is list:
            return [walk(v, parts + [str(i)], local, depth) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            return {"$tuple": [walk(v, parts + [str(i)], local, depth) for i, v in enumerate(obj)]}
        if isinstance(obj, (list, tuple)):
            raise UnsupportedValueError(
                f"cannot save value at '{join_key(parts)}': type {type(obj).__qualname__} "
                "(a subclass of list/tuple would come back as a plain one)"
            )
        return encode_scalar(obj, join_key(parts))

    flat.tree = walk(state, [])
    for tree in (flat.tree, *flat.rank_local.values()):
        if nesting_depth(tree) > MAX_DEPTH:
            raise UnsupportedValueError(f"cannot save this state: its saved form nests deeper than {MAX_DEPTH} "
                                        "levels (readers refuse deeper manifests)")
    return flat


def saved_items(saved: Any, key: str = "") -> list[tuple[Any, Any]] | None:
    """The (key, typed-JSON value) pairs of a saved dict node, or None if it is not a dict.
    A malformed ``$dict`` (an entry not a pair, a key neither str nor int, a key twice)
    raises CorruptCheckpointError naming ``key``, as decoding it would."""
    kids = container(saved, key) if isinstance(saved, dict) else None
    return kids[1] if kids is not None and kids[0] is dict else None


def saved_sequence(saved: Any, kind: type, key: str = "") -> list[Any] | None:
    """The elements of a saved list (kind=list) or tuple (kind=tuple) node, else None. A
    ``$tuple`` whose payload is not a list raises CorruptCheckpointError naming ``key``."""
    if kind is list and isinstance(saved, list):
        return saved
    if kind is tuple and isinstance(saved, dict) and len(saved) == 1 and "$tuple" in saved:
        kids = container(saved, key)
        assert kids is not None
        return [v for _, v in kids[1]]
    return None


def saved_ref(saved: Any) -> tuple[str, str] | None:
    """(tag, key) when a saved node is a tensor or rank-local placeholder."""
    if isinstance(saved, dict) and len(saved) == 1:
        ((tag, key),) = saved.items()
        if tag in (TENSOR_TAG, RANK_LOCAL_TAG) and isinstance(key, str):
            return tag, key
    return None

