"""Reading a ``storage_options`` mapping into an object store's settings: accepted spellings
(aliases, any case), typed values, keys passed through to the client as they are, and a
did-you-mean error for misspelt names. Shared by the object-store backends (s3, az)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointError

__all__ = ["Spellings", "read_options"]


@dataclass(frozen=True)
class Spellings:
    """The option names one backend accepts: ``aliases`` (setting -> accepted spellings),
    the typed settings, and client keys passed through (with an optional prefix such as
    ``aws_``). ``label`` names the backend in messages."""

    label: str
    aliases: dict[str, tuple[str, ...]]
    bools: frozenset[str] = frozenset()
    floats: frozenset[str] = frozenset()
    ints: frozenset[str] = frozenset()
    passthrough: tuple[str, ...] = ()
    prefix: str = ""  # a vendor prefix the pass-through keys may carry
    canonical: dict[str, str] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "canonical",
                           {alias: name for name, aliases in self.aliases.items() for alias in aliases})

    def known(self) -> list[str]:
        """Every accepted name, for messages."""
        return sorted(self.canonical) + ["client_kwargs"] + sorted(self.passthrough)


def as_bool(name: str, value: Any) -> bool:
    """``value`` as a bool (true/false, yes/no, on/off, 1/0); a CheckpointError otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise CheckpointError(f"storage option {name!r} must be true or false, not {value!r}")


def _typed(spell: Spellings, name: str, raw: str, value: Any) -> Any:
    try:
        if name in spell.bools:
            return as_bool(raw, value)
        if name in spell.floats:
            return float(value)
        if name in spell.ints:
            return int(value)
        return str(value)
    except (TypeError, ValueError):
        raise CheckpointError(f"storage option {raw!r} has a bad value {value!r}") from None


def read_options(target: Any, options: dict[str, Any] | None, spell: Spellings) -> Any:
    """Set the attributes of ``target`` (a settings dataclass with an ``extra`` dict) from
    ``options``: each key under any accepted spelling (any case; ``client_kwargs``, s3fs
    style, is read as more keys); pass-through keys go to ``target.extra``. Unknown keys
    raise a CheckpointError naming the closest accepted names. Returns ``target``."""
    if not options:
        return target
    items = dict(options)
    nested = items.pop("client_kwargs", None)
    if nested is not None:
        if not isinstance(nested, dict):
            raise CheckpointError("storage option 'client_kwargs' must be a dict")
        items.update(nested)
    unknown = []
    seen: dict[str, str] = {}
    for raw, value in items.items():
        key = str(raw).lower()
        bare = key.removeprefix(spell.prefix) if spell.prefix else key
        if key in spell.passthrough or bare in spell.passthrough:
            target.extra[bare] = value
            continue
        name = spell.canonical.get(key)
        if name is None:
            unknown.append(str(raw))
            continue
        if name in seen:
            raise CheckpointError(f"storage options {seen[name]!r} and {raw!r} both set {name}")
        seen[name] = str(raw)
        if value is not None:
            setattr(target, name, _typed(spell, name, str(raw), value))
    if unknown:
        raise CheckpointError(unknown_options(sorted(unknown), spell))
    return target


def unknown_options(unknown: list[str], spell: Spellings) -> str:
    """The error message for misspelt or unknown storage option names: the closest
    accepted names of each first, then every accepted name."""
    from ..hints import nearest

    known = spell.known()
    guesses = []
    for raw in unknown:
        near = nearest(raw.lower(), known)
        guesses.append(f"{raw!r}: did you mean {' or '.join(map(repr, near))}?" if near else f"{raw!r}: no close name")
    return (f"unknown {spell.label} storage option(s) {', '.join(map(repr, unknown))} ({'; '.join(guesses)}); "
            f"accepted: {', '.join(known)}")
