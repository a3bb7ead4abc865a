"""Suggestions that make errors helpful: the saved keys nearest to one that is missing."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

from .errors import MissingKeysError


def nearest(key: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``candidates`` closest to ``key`` (closest first)."""
    return difflib.get_close_matches(key, list(candidates), n=n, cutoff=0.5)


def missing_tensor(manifest, key: str) -> MissingKeysError:  # noqa: ANN001 - a format.manifest.Manifest
    """A MissingKeysError for tensor ``key`` that suggests the nearest tensor keys."""
    near = nearest(key, manifest.tensors)
    hint = f"; did you mean {', '.join(repr(k) for k in near)}?" if near else "; `shardsafe inspect` lists them"
    return MissingKeysError(f"no tensor {key!r} in the checkpoint{hint}")
