"""Every error shardsafe raises on purpose is a :class:`CheckpointError`."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class: something about a checkpoint (or a request for one) is wrong."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """There is no committed checkpoint at the path."""


class CheckpointExistsError(CheckpointError, FileExistsError):
    """A committed checkpoint already sits at the path and ``overwrite`` was not given."""


class StorageError(CheckpointError, OSError):
    """The storage failed an operation (disk full, I/O error, permission, a failed rename).

    ``errno`` and ``filename`` say what and where; ``__cause__`` is the original error."""

    def __init__(self, message: str, errno: int | None = None, filename: str | None = None) -> None:
        super().__init__(message)
        self.errno = errno  # type: ignore[misc]
        self.filename = filename
        self.strerror = _strerror(errno)  # type: ignore[misc]

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""

    def __reduce__(self):  # keep the message (OSError would rebuild from errno)
        return (type(self), (str(self), self.errno, self.filename))


def _strerror(errno: int | None) -> str | None:
    import os

    return os.strerror(errno) if errno else None


class CorruptCheckpointError(CheckpointError):
    """Bytes on disk do not match what the manifest promises (checksum, size, header)."""


class CheckpointChangedError(CorruptCheckpointError):
    """The checkpoint was deleted or replaced while it was being read (loads retry)."""


class BaseCheckpointError(CheckpointError):
    """An incremental save's base checkpoint cannot be used (missing, corrupt, or a file it
    would refer to is missing or resized); nothing was written. A CheckpointManager then
    saves in full."""


class FormatVersionError(CheckpointError):
    """The checkpoint was written in a format version this reader does not understand."""


class UnsupportedValueError(CheckpointError, TypeError):
    """A value in the state cannot be saved without pickle."""


class KeyMismatchError(CheckpointError, KeyError):
    """Keys of the destination and of the checkpoint disagree."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class MissingKeysError(KeyMismatchError):
    """The destination asks for keys that the checkpoint does not hold."""


class UnexpectedKeysError(KeyMismatchError):
    """The checkpoint holds a different kind of value than the destination at a key
    (for example a tensor where the destination has a nested dict), or keys were
    requested that are not in the checkpoint."""


class ShapeMismatchError(CheckpointError, ValueError):
    """A tensor's saved global shape differs from the destination's."""


class DtypeMismatchError(CheckpointError, TypeError):
    """A tensor's saved dtype differs from the destination's."""


__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "CheckpointExistsError",
    "CorruptCheckpointError",
    "StorageError",
    "CheckpointChangedError",
    "FormatVersionError",
    "UnsupportedValueError",
    "KeyMismatchError",
    "MissingKeysError",
    "UnexpectedKeysError",
    "ShapeMismatchError",
    "DtypeMismatchError",
]
