"""shardsafe: fast, safe, sharded checkpoints for PyTorch training.

The public names are imported on first use (PEP 562), so ``import shardsafe`` stays
cheap: torch is imported only when a name that needs it is used (the ``shardsafe``
command's ``--version`` and ``ls`` never do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_names

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
    "CheckpointConfig": ".manager_config",
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


__getattr__, __dir__ = lazy_names(__name__, _WHERE, __all__, submodules=True)


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
    from .manager import CheckpointManager
    from .manager_config import CheckpointConfig
    from .ops.load import LoadInfo
    from .ops.save import SaveInfo
    from .state.train_state import TrainState
    from .state.tree import Stateful, rank_local
