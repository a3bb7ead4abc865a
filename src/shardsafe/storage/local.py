"""Local filesystem storage: positional writes and reads, fsync, and crash-safe commit.

Commit protocol: every file is written into a hidden temporary sibling directory and
fsync'd, the manifest last; the directory is fsync'd and then renamed into place. When
a committed checkpoint already sits at the path (``overwrite=True``), the two directories
are swapped atomically with ``renameat2(RENAME_EXCHANGE)`` and the old one is deleted
afterwards, so the path always names a complete checkpoint.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import uuid
from pathlib import Path

from ..errors import CheckpointError, CheckpointExistsError, CheckpointNotFoundError
from ..format.manifest import MANIFEST_NAME

TMP_MARK = ".shardsafe-tmp-"
OLD_MARK = ".shardsafe-old-"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def is_committed(path: Path) -> bool:
    """True when ``path`` holds a manifest (committed checkpoint)."""
    return (path / MANIFEST_NAME).is_file()


def check_target(path: Path, overwrite: bool) -> None:
    """Refuse a save target that holds a committed checkpoint (unless ``overwrite``) or
    anything that is not a shardsafe checkpoint."""
    if not path.exists():
        return
    if not path.is_dir():
        raise CheckpointError(f"cannot save to {path}: it exists and is not a directory")
    if is_committed(path):
        if not overwrite:
            raise CheckpointExistsError(
                f"a checkpoint already exists at {path}; pass overwrite=True to replace it"
            )
        return
    if any(path.iterdir()):
        raise CheckpointError(
            f"cannot save to {path}: the directory is not empty and holds no shardsafe checkpoint"
        )


def temp_sibling(path: Path) -> Path:
    """A fresh hidden directory next to ``path`` to build a checkpoint in."""
    tmp = path.parent / f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:12]}"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    return tmp


def lock_dir(path: Path) -> int:
    """Hold an exclusive flock on directory ``path`` (a save in progress owns its temp
    directory this way); returns the fd to close when done."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


def in_use(path: Path) -> bool:
    """True when a live save holds ``path``'s lock (its temp directory is being written)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def stale_siblings(path: Path) -> list[Path]:
    """Temporary or superseded directories left next to ``path`` by interrupted saves."""
    prefix_tmp = f".{path.name}{TMP_MARK}"
    prefix_old = f".{path.name}{OLD_MARK}"
    if not path.parent.is_dir():
        return []
    return [p for p in path.parent.iterdir() if p.name.startswith((prefix_tmp, prefix_old))]


def fsync_dir(path: Path) -> None:
    """fsync a directory, so that entries created or renamed in it are durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_small_file(path: Path, data: bytes) -> None:
    """Write a whole file and fsync it (O_EXCL: never replaces an existing file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        write_all(fd, memoryview(data), 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, view: memoryview, offset: int) -> None:
    """``pwrite`` all of ``view`` at ``offset`` (loops over short writes)."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    done = 0
    total = len(view)
    while done < total:
        n = os.pwrite(fd, view[done: done + (1 << 30)], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def read_into(fd: int, view: memoryview, offset: int, name: str) -> None:
    """Fill ``view`` from ``offset``; a short file raises naming ``name``."""
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    done = 0
    total = len(view)
    while done < total:
        n = os.preadv(fd, [view[done: done + (1 << 30)]], offset + done)
        if n == 0:
            from ..errors import CorruptCheckpointError

            raise CorruptCheckpointError(f"{name}: file ends at byte {offset + done}, expected {offset + total}")
        done += n


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths; False when the system cannot."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def commit(tmp: Path, path: Path, overwrite: bool = True) -> None:
    """Publish the fully written ``tmp`` directory at ``path``, atomically. Without
    ``overwrite``, a checkpoint committed at ``path`` meanwhile (by another save) wins."""
    fsync_dir(tmp)
    if not overwrite and is_committed(path):
        raise CheckpointExistsError(
            f"a checkpoint was committed at {path} while this save was running; pass overwrite=True to replace it"
        )
    if path.exists():
        if _renameat2_exchange(tmp, path):
            fsync_dir(path.parent)
            shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old checkpoint
            return
        # Fallback without an atomic swap: the old checkpoint is parked beside the path
        # and found again by `recover` should a crash fall between the two renames.
        old = path.parent / f".{path.name}{OLD_MARK}{uuid.uuid4().hex[:12]}"
        os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(path.parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    os.rename(tmp, path)
    fsync_dir(path.parent)


def require_checkpoint(path: Path) -> Path:
    """The manifest path of the committed checkpoint at ``path``, or a clear error."""
    manifest = path / MANIFEST_NAME
    if not manifest.is_file():
        parked = [p for p in stale_siblings(path) if OLD_MARK in p.name and is_committed(p)]
        hint = f" (a previous checkpoint was left at {parked[0]} by an interrupted overwrite)" if parked else ""
        raise CheckpointNotFoundError(f"no checkpoint at {path}{hint}")
    return manifest
