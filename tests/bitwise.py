"""The one bitwise comparison of the tests, ``faults/`` and ``benchmarks/``.

Tensors are the same when they have the same dtype, the same shape and the same bytes in
row-major order: NaN payloads and the sign of zero count, a tensor matches itself whatever
its strides, conjugate or negative bit (the logical values are compared), on any devices.
A DTensor matches a DTensor of the same global shape and placements whose local shard is
the same (each rank checks its own shard: no collective). Trees are the same when their
dicts have the same keys (of the same types; their order and dict classes only when asked),
their lists and tuples the same types and lengths, and their leaves are the same: plain values
of the same type (``1``, ``1.0`` and ``True`` differ), floats bit for bit except that any
NaN matches any NaN (a checkpoint keeps a Python float NaN, not its payload).

Imported as ``bitwise``: the tests have ``tests/`` on their path (pytest puts it there; the
workers that ``tests/distributed.py`` spawns inherit it); ``faults/common.py`` and
``benchmarks/gpu_check.py`` append ``tests/`` to theirs.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch

__all__ = ["assert_bitwise", "bitwise_equal", "first_difference", "same_value", "tensor_bytes",
           "tensor_difference", "tensors_equal"]


def _dtensor_type() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s logical values in row-major order as a flat uint8 tensor on ``t``'s device (a
    DTensor: its local shard's)."""
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(t, dtensor):
        t = t.to_local()
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    # a clone in standard strides: a "contiguous" tensor with a size-1 dim may have any stride there
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def tensor_difference(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """How two tensors differ (type, dtype, shape, placements or the first differing
    element), or None when they are bitwise the same."""
    if type(a) is not type(b):
        return f"{type(a).__name__} vs {type(b).__name__}"
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    dtensor = _dtensor_type()
    if dtensor is not None and isinstance(a, dtensor):
        if tuple(a.placements) != tuple(b.placements) or a.device_mesh.shape != b.device_mesh.shape:
            return f"placements {a.placements} on mesh {a.device_mesh.shape} vs {b.placements} on {b.device_mesh.shape}"
        if tuple(a.to_local().shape) != tuple(b.to_local().shape):
            return f"local shards {list(a.to_local().shape)} vs {list(b.to_local().shape)}"
    ra, rb = tensor_bytes(a), tensor_bytes(b)
    rb = rb.to(ra.device)
    if torch.equal(ra, rb):
        return None
    at = int((ra != rb).nonzero()[0, 0])
    size = max(1, a.element_size())
    i = at // size
    return (f"bytes differ: first at element {i} of {ra.numel() // size} "
            f"({ra[i * size:(i + 1) * size].tolist()} vs {rb[i * size:(i + 1) * size].tolist()})")


def tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when ``a`` and ``b`` are tensors of the same type, dtype, shape and bytes."""
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and tensor_difference(a, b) is None


def _float_same(a: float, b: float) -> bool:
    return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))


def same_value(a: Any, b: Any) -> bool:
    """Plain values equal bitwise: the same type, floats bit for bit (any NaN matches any
    NaN; -0.0 differs from 0.0), complex numbers part by part, anything else by ``==``."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return _float_same(a, b)
    if isinstance(a, complex):
        return _float_same(a.real, b.real) and _float_same(a.imag, b.imag)
    return bool(a == b)


def _step(path: str, key: Any) -> str:
    if isinstance(key, str):
        return f"{path}.{key}" if path else key
    return f"{path}[{key!r}]"


def _key_difference(a: dict, b: dict, path: str, ordered: bool) -> str | None:
    ka, kb = [(type(k), k) for k in a], [(type(k), k) for k in b]
    if ka == kb or (not ordered and set(ka) == set(kb)):
        return None
    sa, sb = set(ka), set(kb)
    missing = [k for t, k in ka if (t, k) not in sb]
    extra = [k for t, k in kb if (t, k) not in sa]
    if not missing and not extra:
        return f"{path or '<root>'}: key order {list(a)[:8]} vs {list(b)[:8]}"
    return f"{path or '<root>'}: keys only in the first {sorted(missing, key=repr)[:5]}, " \
           f"only in the second {sorted(extra, key=repr)[:5]}"


def first_difference(a: Any, b: Any, path: str = "", *, ordered: bool = False, dict_types: bool = False) -> str | None:
    """Where and how two trees first differ (``"model.w: bytes differ: ..."``), or None.

    By default dicts compare by their items: ``ordered=True`` also compares the order of
    their keys, ``dict_types=True`` their classes (a dict differs from an OrderedDict)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return f"{path or '<root>'}: {type(a).__name__} vs {type(b).__name__}"
        found = tensor_difference(a, b)
        return None if found is None else f"{path or '<root>'}: {found}"
    if isinstance(a, dict) and isinstance(b, dict) and (not dict_types or type(a) is type(b)):
        found = _key_difference(a, b, path, ordered)
        if found:
            return found
        for k in a:
            found = first_difference(a[k], b[k], _step(path, k), ordered=ordered, dict_types=dict_types)
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and type(a) is type(b):
        if len(a) != len(b):
            return f"{path or '<root>'}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, f"{path}[{i}]", ordered=ordered, dict_types=dict_types)
            if found:
                return found
        return None
    if same_value(a, b):
        return None
    if type(a) is not type(b):
        return f"{path or '<root>'}: {type(a).__name__} vs {type(b).__name__} ({a!r:.60} vs {b!r:.60})"
    return f"{path or '<root>'}: {a!r:.60} vs {b!r:.60}"


def bitwise_equal(a: Any, b: Any, *, ordered: bool = False, dict_types: bool = False) -> bool:
    """True when the trees ``a`` and ``b`` are the same (see :func:`first_difference`)."""
    return first_difference(a, b, ordered=ordered, dict_types=dict_types) is None


def assert_bitwise(a: Any, b: Any, what: str = "", *, ordered: bool = False, dict_types: bool = False) -> None:
    """Raise AssertionError naming where ``a`` and ``b`` first differ (``what`` prefixes the
    path)."""
    found = first_difference(a, b, what, ordered=ordered, dict_types=dict_types)
    if found is not None:
        raise AssertionError(found)
