"""``shardsafe diff A B``: keys added and removed, dtype and shape changes, and value
differences (max abs diff per tensor, judged with ``atol``/``rtol``), plain values too.

Streaming: one tensor of A and the same tensor of B are held at a time, and they are
compared in slices of ``SLICE`` elements, so the extra memory is a few slices.
Layouts may differ (a checkpoint saved on 4 ranks equals the same state saved on 2).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..checkpointer import Checkpointer
from ..format.manifest import Manifest
from ..hints import as_keys
from ..knobs import DIFF_SLICE as SLICE
from .common import PathLike, check_prefixes_used, matches
from .entries import Leaf, brief, leaves
from .progress import Progress


@dataclass
class Change:
    """One difference at ``key``: ``what`` is added, removed, kind, dtype, shape, values or value."""

    key: str
    what: str
    a: str | None = None
    b: str | None = None
    max_abs_diff: float | None = None
    differing: int | None = None  # elements beyond tolerance
    numel: int | None = None

    def __str__(self) -> str:
        mark = {"added": "+", "removed": "-"}.get(self.what, "~")
        if self.what == "added":
            return f"{mark} added    {self.key}  {self.b}"
        if self.what == "removed":
            return f"{mark} removed  {self.key}  {self.a}"
        if self.what == "values":
            return (f"{mark} values   {self.key}  max abs diff {self.max_abs_diff:.6g} "
                    f"({self.differing} of {self.numel} elements beyond tolerance)")
        return f"{mark} {self.what:<8} {self.key}  {self.a} -> {self.b}"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (without empty members; an infinite diff is written as a string)."""
        d = asdict(self)
        if d["max_abs_diff"] is not None and not math.isfinite(d["max_abs_diff"]):
            d["max_abs_diff"] = str(d["max_abs_diff"])
        return {k: v for k, v in d.items() if v is not None}


@dataclass
class DiffReport:
    """The outcome of ``diff_checkpoints``: ``same`` when no change was found."""

    a: str
    b: str
    atol: float
    rtol: float
    compared: int = 0
    tensor_bytes: int = 0
    seconds: float = 0.0
    changes: list[Change] = field(default_factory=list)
    max_abs_diff: dict[str, float] = field(default_factory=dict)  # every compared tensor

    @property
    def same(self) -> bool:
        return not self.changes

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return {"a": self.a, "b": self.b, "atol": self.atol, "rtol": self.rtol, "same": self.same,
                "compared": self.compared, "changes": [c.to_json() for c in self.changes],
                "max_abs_diff": {k: (v if math.isfinite(v) else str(v)) for k, v in self.max_abs_diff.items()}}

    def to_text(self) -> str:
        """One line per change, then a summary."""
        tail = (f"{self.compared} keys compared (atol={self.atol:g}, rtol={self.rtol:g}): "
                + ("no differences" if self.same else f"{len(self.changes)} difference(s)"))
        return "\n".join([*(str(c) for c in self.changes), tail])


def _describe(leaf: Leaf, manifest: Manifest) -> str:
    if leaf.kind == "tensor":
        e = manifest.tensors.get(leaf.key)
        return f"tensor {e.dtype} {list(e.shape)}" if e else "tensor (not in manifest)"
    return brief(leaf.decoded())


def _same_json(a: Any, b: Any) -> bool:
    """Typed-JSON equality that tells 1 from 1.0 and True from 1."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return a == b


def compare_tensors(a: torch.Tensor, b: torch.Tensor, atol: float = 0.0, rtol: float = 0.0) -> tuple[float, int]:
    """(max abs diff, number of elements with ``|a - b| > atol + rtol * |b|``) of two
    tensors of the same dtype and shape. NaN equals NaN; a NaN or infinity facing a
    different value counts as an infinite difference."""
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    fa, fb = a.reshape(-1), b.reshape(-1)
    floating = a.is_floating_point()
    worst, bad = 0.0, 0
    for s in range(0, fa.numel(), SLICE):
        x, y = fa[s: s + SLICE], fb[s: s + SLICE]
        if a.dtype == torch.bool:
            x, y = x.to(torch.uint8), y.to(torch.uint8)
        xd, yd = x.double(), y.double()
        if floating:
            same = (xd == yd) | (torch.isnan(xd) & torch.isnan(yd))
        else:
            same = x == y
        d = (xd - yd).abs()
        if not floating:
            d = d.clamp_min(1.0)  # two different huge ints can round to the same double
        d = torch.where(same, torch.zeros((), dtype=d.dtype), d)
        d = torch.nan_to_num(d, nan=math.inf)
        tol = atol + rtol * torch.nan_to_num(yd.abs(), nan=0.0)
        over = (d > tol) | torch.isinf(d)
        bad += int(over.sum())
        if d.numel():
            worst = max(worst, float(d.max()))
    return worst, bad


def diff_checkpoints(a: PathLike, b: PathLike, *, atol: float = 0.0, rtol: float = 0.0,
                     keys: str | Iterable[str] | None = None, verify: bool = True, progress: bool | None = None,
                     checkpointer: Checkpointer | None = None) -> DiffReport:
    """Compare the checkpoints ``a`` and ``b`` key by key (restricted to the dotted
    ``keys`` prefixes when given: one ``str`` or a list of them; a prefix that selects no
    key of either checkpoint raises MissingKeysError naming the closest keys). Tensors
    with the same dtype and shape are read one at a time from each and compared;
    rank-local values are compared per saving rank. Each checkpoint is opened once."""
    keys = as_keys(keys, "keys")
    cp = checkpointer if checkpointer is not None else Checkpointer()
    try:
        with cp.open_reader(a, verify=verify) as reader_a, cp.open_reader(b, verify=verify) as reader_b:
            return _diff(reader_a, reader_b, atol, rtol, keys, progress)
    finally:
        if checkpointer is None:
            cp.close()


def _diff(reader_a: Any, reader_b: Any, atol: float, rtol: float, keys: tuple[str, ...] | None,
          progress: bool | None) -> DiffReport:
    t0 = time.perf_counter()
    man_a, man_b = reader_a.manifest, reader_b.manifest
    for reader in (reader_a, reader_b):
        if reader.manifest.rank_local:  # format 3: each saving rank's values are in its file's index
            reader.fetch_indexes(range(len(reader.manifest.files)))
    report = DiffReport(str(reader_a.location), str(reader_b.location), atol, rtol)
    la = {leaf.key: leaf for leaf in leaves(man_a) if leaf.kind != "rank_local"}
    lb = {leaf.key: leaf for leaf in leaves(man_b) if leaf.kind != "rank_local"}
    check_prefixes_used(keys, [leaf.plain for leaf in la.values()] + [leaf.plain for leaf in lb.values()])
    la = {k: v for k, v in la.items() if matches(v.plain, keys)}
    lb = {k: v for k, v in lb.items() if matches(v.plain, keys)}
    order = list(la) + [k for k in lb if k not in la]
    pairs: list[tuple[str, Leaf, Leaf]] = []
    for key in order:
        x, y = la.get(key), lb.get(key)
        if y is None:
            report.changes.append(Change(key, "removed", a=_describe(x, man_a)))
        elif x is None:
            report.changes.append(Change(key, "added", b=_describe(y, man_b)))
        elif x.kind != y.kind:
            report.changes.append(Change(key, "kind", _describe(x, man_a), _describe(y, man_b)))
        elif x.kind == "value":
            report.compared += 1
            if not _same_json(x.node, y.node):
                report.changes.append(Change(key, "value", brief(x.decoded()), brief(y.decoded())))
        else:
            ea, eb = man_a.tensors.get(x.key), man_b.tensors.get(y.key)
            report.compared += 1
            if ea is None or eb is None:
                report.changes.append(Change(key, "kind", _describe(x, man_a), _describe(y, man_b)))
            elif ea.dtype != eb.dtype:
                report.changes.append(Change(key, "dtype", ea.dtype, eb.dtype))
            elif tuple(ea.shape) != tuple(eb.shape):
                report.changes.append(Change(key, "shape", str(list(ea.shape)), str(list(eb.shape))))
            else:
                pairs.append((key, x, y))
    total = sum(_nbytes(man_a, x.key) for _, x, _ in pairs)
    with Progress("diff", total, enabled=progress) as bar:
        for key, x, y in pairs:
            ta = reader_a.read(x.key)
            tb = reader_b.read(y.key)
            worst, bad = compare_tensors(ta, tb, atol, rtol)
            report.max_abs_diff[key] = worst
            if bad:
                report.changes.append(Change(key, "values", max_abs_diff=worst, differing=bad, numel=ta.numel()))
            n = ta.numel() * ta.element_size()
            report.tensor_bytes += n
            del ta, tb
            bar.advance(n)
    position = {k: i for i, k in enumerate(order)}
    report.changes.sort(key=lambda c: position[c.key])
    report.seconds = time.perf_counter() - t0
    return report


def _nbytes(manifest: Manifest, key: str) -> int:
    from .inspect import tensor_bytes

    return tensor_bytes(manifest.tensors[key])
