"""shardsafe: fast, safe, sharded checkpoints for PyTorch training.

The public names are imported on first use (PEP 562), so ``import shardsafe`` stays
cheap: torch is imported only when a name that needs it is used (the ``shardsafe``
command's ``--version`` and ``ls`` never do).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> the module (relative to this package) that defines it
_WHERE: dict[str, str] = {
    **dict.fromkeys(["async_save", "default_checkpointer", "delete", "load", "load_full", "read_manifest", "save",
                     "wait_for_pending"], ".api"),
    **dict.fromkeys(["Checkpointer", "SaveFuture"], ".checkpointer"),
    **dict.fromkeys(["BaseCheckpointError", "CheckpointChangedError", "CheckpointError", "CheckpointExistsError",
                     "CheckpointNotFoundError",
                     "CorruptCheckpointError", "DtypeMismatchError", "FormatVersionError", "KeyMismatchError",
                     "MissingKeysError", "ShapeMismatchError", "StorageError", "UnexpectedKeysError",
                     "UnsupportedValueError"], ".errors"),
    "LoadInfo": ".ops.load",
    "CheckpointConfig": ".manager",
    "CheckpointManager": ".manager",
    "SaveInfo": ".ops.save",
    "TrainState": ".state.train_state",
    "Stateful": ".state.tree",
    "rank_local": ".state.tree",
}

__all__ = [
    "__version__",
    "save",
    "load",
    "load_full",
    "delete",
    "async_save",
    "wait_for_pending",
    "Checkpointer",
    "default_checkpointer",
    "SaveFuture",
    "read_manifest",
    "SaveInfo",
    "LoadInfo",
    "Stateful",
    "rank_local",
    "TrainState",
    "CheckpointManager",
    "CheckpointConfig",
    "BaseCheckpointError",
    "CheckpointError",
    "CheckpointChangedError",
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "FormatVersionError",
    "KeyMismatchError",
    "MissingKeysError",
    "ShapeMismatchError",
    "StorageError",
    "UnexpectedKeysError",
    "UnsupportedValueError",
]


def __getattr__(name: str) -> Any:
    """A public name (importing its module on first use) or a submodule (``shardsafe.tools``)."""
    where = _WHERE.get(name)
    if where is not None:
        value = getattr(importlib.import_module(where, __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:  # the names above, for type checkers and IDEs
    from .api import (
        async_save,
        default_checkpointer,
        delete,
        load,
        load_full,
        read_manifest,
        save,
        wait_for_pending,
    )
    from .checkpointer import Checkpointer, SaveFuture
    from .errors import (
        BaseCheckpointError,
        CheckpointChangedError,
        CheckpointError,
        CheckpointExistsError,
        CheckpointNotFoundError,
        CorruptCheckpointError,
        DtypeMismatchError,
        FormatVersionError,
        KeyMismatchError,
        MissingKeysError,
        ShapeMismatchError,
        StorageError,
        UnexpectedKeysError,
        UnsupportedValueError,
    )
    from .manager import CheckpointConfig, CheckpointManager
    from .ops.load import LoadInfo
    from .ops.save import SaveInfo
    from .state.train_state import TrainState
    from .state.tree import Stateful, rank_local
