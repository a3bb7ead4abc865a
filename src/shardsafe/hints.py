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


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside shardsafe (the user's line
    that called into shardsafe), however deep inside shardsafe the warning arises."""
    import sys
    import warnings

    frame = sys._getframe(1)
    level = 2  # 1 is this function; 2 its caller
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("shardsafe"):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
