"""Match a destination state (what ``load`` fills in place) against a saved tree.

Everything is checked before any byte is written: the result lists the tensors to fill,
the container assignments and the Stateful ``load_state_dict`` calls to make after the
data has been read, and every problem found (missing keys, kind, shape and dtype
mismatches). Rules (docs/format.md, "Loading"):

- a destination tensor is filled in place from the saved tensor at the same key;
- a destination dict receives every entry the checkpoint holds for it, except at the
  top level, where only the requested keys are loaded (partial loads);
- a plain value in the destination is replaced by the saved value; a list or tuple of a
  different length is replaced whole;
- a Stateful is asked for its ``state_dict()``, that tree is filled by these rules, and
  ``load_state_dict`` is called with it once all data is in;
- a key equal to or below an ``exclude`` pattern (a dotted key or prefix) is left as the
  destination has it, and not added where the destination lacks it; a pattern that
  matches no key of the destination and none of the checkpoint is an error
  (:meth:`Matcher.check_exclude`), so a typo never loads everything silently.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    DtypeMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    UnexpectedKeysError,
)
from ..format.dtypes import torch_dtype
from ..format.manifest import Manifest
from ..format.values import RANK_LOCAL_TAG, TENSOR_TAG, decode
from ..hints import as_keys, nearest, unmatched
from ..layout import Box
from .fit import fit_problems
from .sharding import dtensor_pieces, is_dtensor, local_of
from .tree import RankLocal, is_stateful, join_key, saved_items, saved_ref, saved_sequence


@dataclass
class Fill:
    """Fill ``tensor`` (a local tensor covering ``box`` of the saved tensor ``key``).

    A fresh tensor (made by the loader, seen by nobody until the load succeeds) is created
    empty and given its memory by :meth:`allocate` only once every check has passed, so a
    bad checkpoint never makes the loader allocate what it claims."""

    key: str
    tensor: torch.Tensor
    box: Box
    fresh: bool
    cast: bool = False  # the saved dtype differs and the load converts (cast_dtype=True)
    lands_direct: bool | None = field(default=None, repr=False)  # ``direct``, when known already

    def allocate(self) -> None:
        """Give a fresh tensor its memory (its shape is its box's); no-op otherwise."""
        if self.fresh and tuple(self.tensor.shape) != self.box.lengths:
            self.tensor.resize_(self.box.lengths)

    @property
    def direct(self) -> bool:
        """True when bytes can land straight in the tensor's memory (dense CPU, no lazy view)."""
        if self.fresh:
            return True
        if self.lands_direct is not None:
            return self.lands_direct
        if self.cast:
            return False  # saved bytes go through staging, then copy_ converts them
        t = self.tensor
        return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


@dataclass
class MatchResult:
    """What a load must do once checks pass: fills, assignments, Stateful calls; or its errors."""

    fills: list[Fill] = field(default_factory=list)
    assigns: list[Callable[[], None]] = field(default_factory=list)
    statefuls: list[tuple[Any, Callable[[], Any], str]] = field(default_factory=list)  # (obj, its tree, key)
    errors: list[CheckpointError] = field(default_factory=list)

    def raise_errors(self) -> None:
        """Raise one error (of the first problem's class) that lists every problem."""
        if not self.errors:
            return
        first = self.errors[0]
        if len(self.errors) == 1:
            raise first
        lines = [str(e) for e in self.errors[:20]]
        more = f"\n  ... and {len(self.errors) - 20} more" if len(self.errors) > 20 else ""
        raise type(first)(f"{len(self.errors)} problems:\n  " + "\n  ".join(lines) + more)


def tensor_view(t: torch.Tensor) -> tuple[list[tuple[torch.Tensor, Box]], tuple[int, ...], torch.dtype]:
    """A destination tensor as (local views with their global boxes, global shape, dtype).

    A plain tensor is one view of the whole; a DTensor gives the pieces its local tensor
    holds on this rank (none when this rank holds nothing)."""
    if is_dtensor(t):
        local = local_of(t)
        views = [(local[p.local_slices], p.box) for p in dtensor_pieces(t)]
        return views, tuple(t.shape), local.dtype
    shape = t.shape  # each torch attribute costs about a microsecond: read once (thousands of tensors)
    return [(t.detach(), Box.whole(shape))], shape, t.dtype


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the manifest's spelling)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


class Matcher:
    """Walks a destination against a saved tree; see the module docstring for the rules."""

    def __init__(
        self,
        manifest: Manifest,
        rank: int = 0,
        strict: bool = True,
        rank_local_tree: Callable[[str], Any] | None = None,
        exclude: list[str] | tuple[str, ...] = (),
        world: int = 1,
        cast_dtype: bool = False,
    ) -> None:
        self.cast_dtype = cast_dtype
        self.exclude = as_keys(exclude, "exclude") or ()
        self._used: set[str] = set()  # excluded patterns that met a key of the destination
        self._seen: set[str] = set()  # destination keys met (only while excluding: for hints)
        self.manifest = manifest
        self.rank = rank
        self.world = world
        self.strict = strict
        self.rank_local_tree = rank_local_tree
        self.result = MatchResult()

    # -- fresh values -------------------------------------------------------------
    def fresh_tensor(self, key: str) -> torch.Tensor:
        entry = self.manifest.tensors.get(key)
        if entry is None:
            raise CorruptCheckpointError(f"manifest references tensor '{key}' that it does not describe")
        dtype = torch_dtype(entry.dtype)
        if dtype is None:
            raise CheckpointError(f"tensor '{key}': dtype {entry.dtype!r} is not supported by this torch")
        if self.world > 1 and entry.kind == "sharded":
            raise CheckpointError(
                f"tensor '{key}' was saved sharded over {self.manifest.world_size} ranks and the destination has "
                "no tensor there: loading it would allocate the whole tensor on every rank. Give the destination "
                "its (sharded) tensors first — for an optimizer, build its state with "
                "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer) or use "
                "shardsafe.TrainState — or read full tensors with shardsafe.load_full")
        t = torch.empty(0, dtype=dtype)  # memory comes in Fill.allocate, after every check
        self.result.fills.append(Fill(key, t, Box.whole(entry.shape), fresh=True))
        return t

    def materialize(self, saved: Any) -> Any:
        """A fresh Python value for a saved node, tensors allocated and queued for reading."""

        def on_ref(tag: str, key: str) -> Any:
            if tag == TENSOR_TAG:
                return self.fresh_tensor(key)
            return self.materialize(self._rank_local(key))

        return decode(saved, on_ref)

    def _rank_local(self, key: str) -> Any:
        if self.rank_local_tree is None:
            per_rank = self.manifest.rank_local.get(key)
            if not per_rank or self.rank >= len(per_rank) or per_rank[self.rank] is None:
                raise MissingKeysError(f"rank-local value '{key}' has no entry for rank {self.rank}")
            return per_rank[self.rank]
        return self.rank_local_tree(key)

    def _excluded(self, path: str) -> bool:
        """True when ``path`` is one of the excluded keys or lies below one (and remembers
        which patterns met a key)."""
        if not self.exclude:
            return False
        self._seen.add(path)
        hits = [e for e in self.exclude if path == e or path.startswith(e + ".")]
        self._used.update(hits)
        return bool(hits)

    def check_exclude(self, saved_tree: Any, what: str = "exclude pattern") -> None:
        """Record an error (first in the list) for each excluded pattern that matched no key
        of the destination met while matching and no key of ``saved_tree``: a typo would
        otherwise load everything, silently. Call it after :meth:`match`."""
        unused = [e for e in self.exclude if e not in self._used]
        if not unused:
            return
        from .saved import walk

        saved = {".".join(parts) for parts, _, _ in walk(saved_tree) if parts}
        errors = [unmatched(what, e, saved | self._seen, "the checkpoint or the destination") for e in unused
                  if not any(k == e or k.startswith(e + ".") for k in saved)]
        self.result.errors[:0] = errors

    # -- matching -----------------------------------------------------------------
    def match(self, dest: Any, saved: Any, parts: list[str], top: bool = False, private: bool = False) -> Any:
        """Return the value that should stand at this position after the load.

        Outside Statefuls the caller's own dicts and lists are updated in place (after the
        data is read). Inside a Stateful's ``state_dict()`` tree (``private``) containers
        are rebuilt instead: such trees often alias live attributes (a scheduler's
        ``_last_lr`` list is shared with its sub-scheduler), which in-place writes would
        corrupt; only tensors are filled in place there."""
        path = join_key(parts) or "<root>"
        if parts and self._excluded(path):
            return dest
        ref = saved_ref(saved)
        if ref is not None and ref[0] == RANK_LOCAL_TAG:
            try:
                saved = self._rank_local(ref[1])
            except CheckpointError as exc:
                if not (isinstance(dest, RankLocal) and dest.missing == "keep"):
                    self.result.errors.append(exc)
                return dest
            ref = saved_ref(saved)
        if isinstance(dest, RankLocal):
            new = self.match(dest.value, saved, parts, private=private)
            if new is not dest.value:
                self.result.assigns.append(_attr_setter(dest, new))
            return dest
        if isinstance(dest, torch.Tensor):
            if ref is None or ref[0] != TENSOR_TAG:
                self.result.errors.append(
                    UnexpectedKeysError(f"key '{path}': the destination holds a tensor, the checkpoint does not")
                )
                return dest
            self._match_tensor(dest, ref[1], path)
            return dest
        if is_stateful(dest):
            return self._match_stateful(dest, saved, parts, path)
        if isinstance(dest, dict):
            return self._match_dict(dest, saved, parts, path, top, private)
        if isinstance(dest, (list, tuple)):
            return self._match_sequence(dest, saved, parts, path, private)
        return self._fresh_or_error(saved, path)

    def _match_stateful(self, dest: Any, saved: Any, parts: list[str], path: str) -> Any:
        """A Stateful: its ``state_dict()`` matched as a private tree, loaded back at apply."""
        sub = dest.state_dict()
        holder = [self.match(sub, saved, parts, private=True)]
        self.result.errors.extend(fit_problems(dest, holder[0], sub, path, self.strict))
        if not self.strict and isinstance(dest, torch.nn.Module) and isinstance(holder[0], dict):
            for k in [k for k in holder[0] if k not in sub]:  # strict=False: saved extras are ignored
                del holder[0][k]
        self.result.statefuls.append((dest, lambda: holder[0], path))
        return dest

    def _match_dict(self, dest: dict, saved: Any, parts: list[str], path: str, top: bool, private: bool) -> Any:
        """A dict: each destination key matched with the saved one (missing ones are errors
        when strict); below the top, saved keys the destination lacks are added fresh."""
        items = saved_items(saved)
        if items is None:
            self.result.errors.append(
                UnexpectedKeysError(f"key '{path}': the destination holds a dict, the checkpoint does not")
            )
            return dest
        saved_map = dict(items)
        target = copy.copy(dest) if private else dest  # keeps the type and e.g. _metadata
        plain = not self.exclude  # no key is excluded: plain tensors take the short way below
        for k, v in list(dest.items()):
            if k not in saved_map:
                child = join_key(parts + [str(k)])
                if not self._excluded(child) and self.strict:
                    self.result.errors.append(MissingKeysError(
                        f"key '{child}' is not in the checkpoint{_nearby(str(k), saved_map, parts)}"))
                continue
            sv = saved_map[k]
            if plain and type(v) is torch.Tensor and type(sv) is dict and len(sv) == 1 and TENSOR_TAG in sv \
                    and type(sv[TENSOR_TAG]) is str:
                # What match() does for a plain tensor saved as a tensor (the bulk of a
                # state, thousands of times): fill it in place; its key is spelt only on error.
                self._match_tensor(v, sv[TENSOR_TAG], (parts, k))
                continue
            new = self.match(v, sv, parts + [str(k)], private=private)
            if new is not v:
                if private:
                    target[k] = new
                else:
                    self.result.assigns.append(_setter(dest, k, new))
        if not top:
            for k, v in items:
                if k not in dest and not self._excluded(join_key(parts + [str(k)])):
                    fresh = self._fresh_or_error(v, join_key(parts + [str(k)]))
                    if private:
                        target[k] = fresh
                    else:
                        self.result.assigns.append(_setter(dest, k, fresh))
        return target

    def _match_sequence(self, dest: list | tuple, saved: Any, parts: list[str], path: str, private: bool) -> Any:
        """A list or tuple of the saved length: matched item by item (a tuple rebuilt)."""
        kind = list if isinstance(dest, list) else tuple
        seq = saved_sequence(saved, kind)
        if seq is None or len(seq) != len(dest):
            return self._fresh_or_error(saved, path)
        new_items = [self.match(d, s, parts + [str(i)], private=private) for i, (d, s) in enumerate(zip(dest, seq))]
        if kind is tuple:
            return tuple(new_items)
        if private:
            return new_items
        for i, (old, new) in enumerate(zip(dest, new_items)):
            if new is not old:
                self.result.assigns.append(_setter(dest, i, new))
        return dest

    def _fresh_or_error(self, saved: Any, path: str) -> Any:
        try:
            return self.materialize(saved)
        except CheckpointError as exc:
            self.result.errors.append(type(exc)(f"key '{path}': {exc}"))
            return None

    def _match_tensor(self, dest: torch.Tensor, key: str, path: str | tuple[list[str], Any]) -> None:
        """Fill ``dest`` from saved tensor ``key``; ``path``: its dotted key, or (parts,
        key) to spell it from only when there is a problem."""
        entry = self.manifest.tensors.get(key)
        if entry is None:
            self.result.errors.append(CorruptCheckpointError(
                f"key '{_spelt(path)}': tensor '{key}' is not in the manifest"))
            return
        if type(dest) is torch.Tensor:  # a plain tensor: one view of the whole (tensor_view, fewer torch calls)
            views = None
            global_shape = dest.shape
            dtype = dest.dtype
        else:
            views, global_shape, dtype = tensor_view(dest)
        if tuple(entry.shape) != global_shape:
            self.result.errors.append(
                ShapeMismatchError(
                    f"key '{_spelt(path)}': saved shape {list(entry.shape)}, destination shape {list(global_shape)}"
                )
            )
            return
        expected = dtype_name(dtype)
        cast = entry.dtype != expected
        if cast and not self.cast_dtype:
            self.result.errors.append(DtypeMismatchError(
                f"key '{_spelt(path)}': saved dtype {entry.dtype}, destination dtype {expected} (pass cast_dtype=True "
                "to convert on load)"))
            return
        if views is None:  # a plain tensor: its checks and whether bytes land in it directly, at once
            local = dest.detach() if dest.requires_grad else dest  # (without autograd history: the same)
            contiguous = local.is_contiguous()  # (no internal overlap then)
            if not contiguous and local.numel() > 1 and torch._debug_has_internal_overlap(local) == 1:
                self.result.errors.append(_overlap_error(path))
                return
            direct = not cast and contiguous and local.is_cpu and not local.is_conj() and not local.is_neg()
            self.result.fills.append(Fill(key, local, Box.whole(global_shape), False, cast, direct))
            return
        for local, _ in views:
            if local.numel() > 1 and torch._debug_has_internal_overlap(local) == 1:
                self.result.errors.append(_overlap_error(path))
                return
        for local, box in views:
            self.result.fills.append(Fill(key, local, box, fresh=False, cast=cast))


def _overlap_error(path: str | tuple[list[str], Any]) -> CheckpointError:
    return CheckpointError(f"key '{_spelt(path)}': the destination tensor has overlapping memory (an expand()ed "
                           "view?); load into a tensor whose elements are distinct")


def _spelt(path: str | tuple[list[str], Any]) -> str:
    """A dotted key, given as is or as (parts of its container, its own key)."""
    if isinstance(path, str):
        return path
    parts, k = path
    return join_key(parts + [str(k)])


def _attr_setter(holder: RankLocal, v: Any) -> Callable[[], None]:
    def assign() -> None:
        holder.value = v

    return assign


def _setter(container: Any, k: Any, v: Any) -> Callable[[], None]:
    def assign() -> None:
        container[k] = v

    return assign


def _nearby(key: str, saved: dict, parts: list[str]) -> str:
    """"; the checkpoint has ..." naming the saved keys at that level, closest first."""
    names = [str(k) for k in saved]
    if not names:
        return "; the checkpoint has nothing there"
    close = nearest(key, names, n=3)
    rest = [n for n in sorted(names) if n not in close]
    shown = close + rest[: max(0, 6 - len(close))]
    where = f"under '{join_key(parts)}'" if parts else "at the top level"
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    return f"; {where} the checkpoint has {', '.join(repr(n) for n in shown)}{more}"
