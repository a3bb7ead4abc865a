"""torch dtypes <-> the dtype codes of the safetensors format."""

from __future__ import annotations

import torch

from ..errors import UnsupportedValueError

_PAIRS: list[tuple[str, str]] = [
    ("bool", "BOOL"),
    ("uint8", "U8"),
    ("int8", "I8"),
    ("int16", "I16"),
    ("uint16", "U16"),
    ("int32", "I32"),
    ("uint32", "U32"),
    ("int64", "I64"),
    ("uint64", "U64"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("float32", "F32"),
    ("float64", "F64"),
    ("complex64", "C64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
]

TORCH_TO_CODE: dict[torch.dtype, str] = {}
NAME_TO_TORCH: dict[str, torch.dtype] = {}
for _name, _code in _PAIRS:
    _dt = getattr(torch, _name, None)
    if _dt is not None:
        TORCH_TO_CODE[_dt] = _code
        NAME_TO_TORCH[_name] = _dt


def dtype_name(dtype: torch.dtype, key: str) -> str:
    """The manifest name of a supported dtype ("float32"); raises naming ``key`` otherwise."""
    if dtype not in TORCH_TO_CODE:
        raise UnsupportedValueError(
            f"cannot save tensor '{key}': dtype {dtype} has no safetensors code "
            f"(supported: {', '.join(NAME_TO_TORCH)})"
        )
    return str(dtype).removeprefix("torch.")


def safetensors_code(dtype: torch.dtype) -> str:
    """The safetensors dtype code of a supported torch dtype ("F32", "BF16", ...)."""
    return TORCH_TO_CODE[dtype]


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype for a manifest dtype name, or None when unknown."""
    return NAME_TO_TORCH.get(name)


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element of ``dtype``."""
    return dtype.itemsize
