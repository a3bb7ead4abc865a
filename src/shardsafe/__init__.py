"""shardsafe: fast, safe, sharded checkpoints for PyTorch training."""

__version__ = "0.1.0"

from .api import (  # noqa: E402
    async_save,
    default_checkpointer,
    delete,
    load,
    load_full,
    read_manifest,
    save,
    wait_for_pending,
)
from .checkpointer import Checkpointer, SaveFuture  # noqa: E402
from .errors import (  # noqa: E402
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
from .loading import LoadInfo  # noqa: E402
from .manager import CheckpointConfig, CheckpointManager  # noqa: E402
from .saving import SaveInfo  # noqa: E402
from .state.train_state import TrainState  # noqa: E402
from .state.tree import Stateful, rank_local  # noqa: E402

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
