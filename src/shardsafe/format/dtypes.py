"""torch dtypes <-> the dtype codes of the safetensors format.

The name tables (manifest dtype name, safetensors code, bytes per element) need no torch,
so that reading a manifest (``shardsafe ls``, ``inspect``) does not import it; the maps to
torch dtypes (``TORCH_TO_CODE``, ``NAME_TO_TORCH``) are built on first use.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..errors import UnsupportedValueError

if TYPE_CHECKING:
    import torch

# (manifest / torch name, safetensors code, bytes per element)
_TABLE: list[tuple[str, str, int]] = [
    ("bool", "BOOL", 1),
    ("uint8", "U8", 1),
    ("int8", "I8", 1),
    ("int16", "I16", 2),
    ("uint16", "U16", 2),
    ("int32", "I32", 4),
    ("uint32", "U32", 4),
    ("int64", "I64", 8),
    ("uint64", "U64", 8),
    ("float16", "F16", 2),
    ("bfloat16", "BF16", 2),
    ("float32", "F32", 4),
    ("float64", "F64", 8),
    ("complex64", "C64", 8),
    ("float8_e4m3fn", "F8_E4M3", 1),
    ("float8_e5m2", "F8_E5M2", 1),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ", 1),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ", 1),
]

NAME_TO_CODE: dict[str, str] = {name: code for name, code, _ in _TABLE}
CODE_TO_NAME: dict[str, str] = {code: name for name, code, _ in _TABLE}
NAME_ITEMSIZE: dict[str, int] = {name: size for name, _, size in _TABLE}


@functools.cache
def _maps() -> tuple[dict[torch.dtype, str], dict[str, torch.dtype]]:
    """(torch dtype -> code, name -> torch dtype) for the dtypes this torch has."""
    import torch

    to_code: dict[torch.dtype, str] = {}
    by_name: dict[str, torch.dtype] = {}
    for name, code, _ in _TABLE:
        dt = getattr(torch, name, None)
        if dt is not None:
            to_code[dt] = code
            by_name[name] = dt
    return to_code, by_name


def __getattr__(name: str) -> Any:
    """``TORCH_TO_CODE`` and ``NAME_TO_TORCH``, built (importing torch) on first access."""
    if name == "TORCH_TO_CODE":
        return _maps()[0]
    if name == "NAME_TO_TORCH":
        return _maps()[1]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The manifest name of a supported dtype ("float32"); raises naming ``key`` otherwise."""
    to_code, by_name = _maps()
    if dtype not in to_code:
        raise UnsupportedValueError(
            f"cannot save tensor '{key}': dtype {dtype} has no safetensors code "
            f"(supported: {', '.join(by_name)})"
        )
    return str(dtype).removeprefix("torch.")


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a supported torch dtype ("F32", "BF16", ...)."""
    return _maps()[0][dtype]


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype for a manifest dtype name, or None when unknown."""
    return _maps()[1].get(name)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize


def name_itemsize(name: str) -> int | None:
    """Bytes per element of the dtype with manifest name ``name`` (None when unknown);
    needs no torch."""
    return NAME_ITEMSIZE.get(name)
