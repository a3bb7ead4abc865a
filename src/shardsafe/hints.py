"""Helping users name keys: the saved keys nearest to one that is missing, and the one
rule for parameters that take keys or key patterns.

The rule (every such parameter: ``load(exclude=)``, ``load_full(keys=)``,
``CheckpointManager(exclude_from_loading=)``, ``diff_checkpoints(keys=)``, the CLI's
``--keys``): a ``str`` is one key or pattern, never a sequence of one-letter patterns;
otherwise an iterable of ``str``. Anything else is a TypeError naming the parameter. A
pattern that matches nothing is an error with the closest keys (:func:`unmatched`)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from .errors import MissingKeysError


def nearest(key: str, candidates: Iterable[str], n: int = 3) -> list[str]:
    """Up to ``n`` of ``candidates`` closest to ``key`` (closest first)."""
    return difflib.get_close_matches(key, list(candidates), n=n, cutoff=0.5)


def as_keys(value: str | Iterable[str] | None, param: str) -> tuple[str, ...] | None:
    """``value`` of parameter ``param`` as a tuple of keys or patterns: a ``str`` is one
    pattern (``exclude="optim"`` means ``exclude=["optim"]``), an iterable of ``str`` its
    items, None stays None. Raises TypeError naming ``param`` for anything else (bytes, a
    mapping, a number, an item that is not a ``str``)."""
    if value is None or isinstance(value, str):
        return value if value is None else (value,)
    if isinstance(value, (bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{param} takes a key or a list of keys (str), not {type(value).__name__}")
    out = tuple(value)
    for item in out:
        if not isinstance(item, str):
            raise TypeError(f"{param} takes a key or a list of keys (str); it holds {item!r} "
                            f"({type(item).__name__})")
    return out


def key_hint(pattern: str, keys: Iterable[str], where: str = "the checkpoint") -> str:
    """"; did you mean ..." with the dotted ``keys`` closest to ``pattern`` at its depth;
    when none is close, the keys below the longest prefix of ``pattern`` that exists (or
    the top-level keys)."""
    keys = set(keys)
    parts = pattern.split(".")

    def level(prefix: str, depth: int) -> list[str]:
        return sorted({".".join(k.split(".")[:depth]) for k in keys
                       if k.count(".") >= depth - 1 and (not prefix or k.startswith(prefix + "."))})

    near = nearest(pattern, level("", len(parts)))
    if near:
        return f"; did you mean {', '.join(repr(k) for k in near)}?"
    for i in range(len(parts) - 1, 0, -1):
        prefix = ".".join(parts[:i])
        below = level(prefix, i + 1)
        if below or prefix in keys:
            if not below:
                return f"; {prefix!r} has no keys below it"
            return f"; under {prefix!r} {where} has {_some(below)}"
    top = level("", 1)
    return f"; the top-level keys are {_some(top)}" if top else f"; {where} has no keys"


def _some(names: list[str], n: int = 6) -> str:
    return ", ".join(repr(k) for k in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def unmatched(what: str, pattern: str, keys: Iterable[str], where: str = "the checkpoint") -> MissingKeysError:
    """The error for a key ``pattern`` (``what``: e.g. "exclude pattern") that matches none
    of the dotted ``keys`` (of ``where``), with the closest keys (:func:`key_hint`)."""
    return MissingKeysError(f"{what} {pattern!r} matches no key of {where}{key_hint(pattern, keys, where)}")


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
