"""shardsafe: fast, safe, sharded checkpoints for PyTorch training."""

__version__ = "0.1.0"

from .api import LoadInfo, SaveInfo, load, load_full, read_manifest, save  # noqa: E402
from .async_save import AsyncSaver, SaveFuture, async_save, wait_for_pending  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    DtypeMismatchError,
    FormatVersionError,
    KeyMismatchError,
    MissingKeysError,
    ShapeMismatchError,
    UnexpectedKeysError,
    UnsupportedValueError,
)
from .manager import CheckpointConfig, CheckpointManager  # noqa: E402
from .state.train_state import TrainState  # noqa: E402
from .state.tree import Stateful, rank_local  # noqa: E402

__all__ = [
    "__version__",
    "save",
    "load",
    "load_full",
    "async_save",
    "wait_for_pending",
    "AsyncSaver",
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
    "CheckpointExistsError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "FormatVersionError",
    "KeyMismatchError",
    "MissingKeysError",
    "ShapeMismatchError",
    "UnexpectedKeysError",
    "UnsupportedValueError",
]
