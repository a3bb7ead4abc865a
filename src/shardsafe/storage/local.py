"""The local filesystem backend: positional vectored I/O, fsync, rename, flock.

Its folders commit by renaming (:class:`~shardsafe.storage.commit.RenameCommit`): the
filesystem-only operations (rename, exchange, lock) are theirs, not the generic seam's.

A :class:`LocalFolder` holds an open directory descriptor and does everything relative to
it (``openat``, ``renameat2``, ...), never through a symlink and never opening anything
but a regular file for reading (a FIFO would block forever; ``O_NONBLOCK`` and a check on
the open descriptor refuse it). A load that opened a checkpoint folder therefore keeps
reading that folder even when a concurrent overwrite renames another one into its place.
The path given by the user is followed as the system follows it (it names the folder);
symlinks are refused only inside.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import mmap
import os
import shutil
import stat
import threading
from collections.abc import Sequence

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError
from .base import Backend, Entry, Folder, ReadHandle, WriteHandle
from .commit import RENAME, Lock, Renaming

_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_MAX_IO = 1 << 30  # bytes per system call
_IOV_MAX = 1024
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def storage_error(exc: OSError, what: str, where: str) -> StorageError:
    """A StorageError saying ``what`` failed at ``where``, keeping errno (chain ``exc``)."""
    reason = exc.strerror or str(exc)
    err = StorageError(f"cannot {what} {where}: {reason}", exc.errno, where)
    err.__cause__ = exc
    return err


def _chunks(buffers: Sequence[memoryview]) -> list[memoryview]:
    out = []
    for b in buffers:
        b = b.cast("B") if (b.format != "B" or b.ndim != 1) else b
        if len(b) <= _MAX_IO:
            if len(b):
                out.append(b)
            continue
        for i in range(0, len(b), _MAX_IO):
            out.append(b[i: i + _MAX_IO])
    return out


class LocalReadHandle(ReadHandle):
    """A regular file opened read-only."""

    def __init__(self, fd: int, name: str, where: str, size: int) -> None:
        self.fd = fd
        self.name = name
        self.where = where
        self.size = size

    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Fill ``buffers`` from ``offset`` (short reads continue; end of file is an error)."""
        views = _chunks(buffers)
        pos = offset
        i, count = 0, len(views)
        while i < count:
            try:
                got = os.preadv(self.fd, views[i: i + _IOV_MAX] if i or count > _IOV_MAX else views, pos)
            except OSError as exc:
                raise storage_error(exc, "read", self.where) from exc
            if got == 0:
                raise CorruptCheckpointError(
                    f"{self.where}: file ends at byte {pos}, expected at least {pos + sum(map(len, views[i:]))}")
            pos += got
            while i < count and got >= len(views[i]):
                got -= len(views[i])
                i += 1
            if got:
                views[i] = views[i][got:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class LocalWriteHandle(WriteHandle):
    """A new file opened for positional writes."""

    def __init__(self, folder: LocalFolder, fd: int, name: str) -> None:
        self.folder = folder
        self.fd = fd
        self.name = name
        self.where = folder.where(name)

    def write(self, buffers: Sequence[memoryview], offset: int) -> None:
        """``pwritev`` every byte of ``buffers`` at ``offset`` (short writes continue)."""
        views = _chunks(buffers)
        pos = offset
        i = 0  # the first view not wholly written (an index: thousands of buffers stay linear)
        while i < len(views):
            try:
                done = os.pwritev(self.fd, views[i: i + _IOV_MAX], pos)
            except OSError as exc:
                raise storage_error(exc, "write", self.where) from exc
            if done <= 0:
                raise StorageError(f"cannot write {self.where}: no progress", errno.EIO, self.where)
            pos += done
            while i < len(views) and done >= len(views[i]):
                done -= len(views[i])
                i += 1
            if done:
                views[i] = views[i][done:]

    def finish(self, durable: bool = True) -> None:
        """fsync (with ``durable``) and close."""
        try:
            if durable:
                os.fsync(self.fd)
        except OSError as exc:
            raise storage_error(exc, "fsync", self.where) from exc
        finally:
            self._close()

    def _close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def abort(self) -> None:
        """Close and unlink the file."""
        self._close()
        try:
            self.folder.remove(self.name)
        except Exception:  # noqa: BLE001 - best effort on a failure path
            pass


class _Flock(Lock):
    def __init__(self, fd: int) -> None:
        self.fd = fd

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # closing the descriptor drops the flock


def _renameat2(fd: int, a: str, b: str, flags: int) -> bool:
    """renameat2 within directory ``fd``; False when the system lacks it or the flag."""
    fn = _libc_renameat2()
    if fn is None:
        return False
    rc = fn(fd, os.fsencode(a), fd, os.fsencode(b), flags)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


_RENAMEAT2: list = []


def _libc_renameat2():  # noqa: ANN202 - a ctypes function or None
    if not _RENAMEAT2:
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            fn = libc.renameat2
            fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
            _RENAMEAT2.append(fn)
        except (OSError, AttributeError):
            _RENAMEAT2.append(None)
    return _RENAMEAT2[0]


class LocalFolder(Renaming):
    """A directory of the local filesystem, held open by a descriptor."""

    commit = RENAME

    def __init__(self, fd: int, location: str) -> None:
        self.fd = fd
        self.location = location

    # -- entries ------------------------------------------------------------------------
    def _stat(self, name: str) -> os.stat_result | None:
        try:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise storage_error(exc, "inspect", self.where(name)) from exc

    def stat(self, name: str) -> Entry | None:
        st = self._stat(name)
        if st is None:
            return None
        kind = "file" if stat.S_ISREG(st.st_mode) else "dir" if stat.S_ISDIR(st.st_mode) else "other"
        return Entry(kind, st.st_size, st.st_mtime)

    def names(self) -> list[str]:
        try:
            return os.listdir(self.fd)
        except OSError as exc:
            raise storage_error(exc, "list", self.location) from exc

    # -- files ---------------------------------------------------------------------------
    def open_read(self, name: str) -> ReadHandle:
        where = self.where(name)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=self.fd)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{where} does not exist") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise CorruptCheckpointError(f"{where} is a symlink; checkpoints hold regular files only") from None
            st = self._stat(name)
            if st is not None and not stat.S_ISREG(st.st_mode):  # a socket (ENXIO), ...
                raise CorruptCheckpointError(
                    f"{where} is not a regular file; checkpoints hold regular files only") from None
            raise storage_error(exc, "open", where) from exc
        try:
            st = os.fstat(fd)
        except OSError as exc:
            os.close(fd)
            raise storage_error(exc, "inspect", where) from exc
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CorruptCheckpointError(f"{where} is not a regular file; checkpoints hold regular files only")
        return LocalReadHandle(fd, name, where, st.st_size)

    def create(self, name: str) -> WriteHandle:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=self.fd)
        except OSError as exc:
            raise storage_error(exc, "create", self.where(name)) from exc
        return LocalWriteHandle(self, fd, name)

    def map_read(self, name: str) -> memoryview | None:
        h = self.open_read(name)
        try:
            if h.size == 0:
                return memoryview(b"")
            assert isinstance(h, LocalReadHandle)
            try:
                return memoryview(mmap.mmap(h.fd, 0, access=mmap.ACCESS_COPY))
            except OSError as exc:
                raise storage_error(exc, "map", self.where(name)) from exc
        finally:
            h.close()

    def local_path(self, name: str) -> str | None:
        return self.where(name)

    def publish_bytes(self, name: str, data: bytes, replace: bool) -> None:
        tmp = f".{name}.publish-{os.getpid()}-{threading.get_ident()}"
        self.remove(tmp)
        self.write_bytes(tmp, data)
        try:
            if replace:
                try:
                    os.rename(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
                except OSError as exc:
                    raise storage_error(exc, "replace", self.where(name)) from exc
            else:
                self.rename(tmp, name)
            self.sync()
        except BaseException:
            self.remove(tmp)
            raise

    def remove(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise storage_error(exc, "delete", self.where(name)) from exc

    # -- folders -------------------------------------------------------------------------
    def open_folder(self, name: str, create: bool = False) -> Folder:
        where = self.where(name)
        if create:
            try:
                os.mkdir(name, 0o755, dir_fd=self.fd)
            except FileExistsError:
                pass
            except OSError as exc:
                raise storage_error(exc, "create folder", where) from exc
        try:
            fd = os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no folder at {where}") from None
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise CorruptCheckpointError(f"{where} is not a folder (or is a symlink)") from None
            raise storage_error(exc, "open folder", where) from exc
        return type(self)(fd, where)

    def remove_tree(self, name: str) -> None:
        kind = self.kind(name)
        if kind is None:
            return
        if kind != "dir":
            self.remove(name)
            return
        errors: list[OSError] = []
        shutil.rmtree(name, dir_fd=self.fd, onerror=lambda fn, p, info: errors.append(info[1]))
        real = [e for e in errors if not isinstance(e, FileNotFoundError)]
        if real and self.kind(name) is not None:
            raise storage_error(real[0], "delete", self.where(name)) from real[0]

    def rename(self, src: str, dst: str) -> None:
        try:
            if _renameat2(self.fd, src, dst, _RENAME_NOREPLACE):
                return
            if self._stat(dst) is not None:
                raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), dst)
            os.rename(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)
        except OSError as exc:
            raise storage_error(exc, f"rename {src} to", self.where(dst)) from exc

    def exchange(self, a: str, b: str) -> bool:
        try:
            return _renameat2(self.fd, a, b, _RENAME_EXCHANGE)
        except OSError as exc:
            raise storage_error(exc, f"swap {a} with", self.where(b)) from exc

    def sync(self) -> None:
        try:
            os.fsync(self.fd)
        except OSError as exc:
            raise storage_error(exc, "fsync", self.location) from exc

    def _open_dir(self, name: str) -> int | None:
        try:
            return os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=self.fd)
        except OSError:
            return None

    def lock(self, name: str) -> Lock | None:
        fd = self._open_dir(name)
        if fd is None:
            raise StorageError(f"cannot lock {self.where(name)}: not a folder", errno.ENOENT, self.where(name))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in _NO_LOCKS:
                return None
            raise storage_error(exc, "lock", self.where(name)) from exc
        return _Flock(fd)

    def locked(self, name: str) -> bool | None:
        fd = self._open_dir(name)
        if fd is None:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        except OSError as exc:
            if exc.errno in _NO_LOCKS:
                return None
            return True
        finally:
            os.close(fd)
        return False

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)

    def __del__(self) -> None:  # a folder dropped without close() must not leak its descriptor
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass


class LocalBackend(Backend):
    """Plain paths (and ``file://`` URLs, already stripped by the URL layer)."""

    folder_class: type[LocalFolder] = LocalFolder

    def open(self, location: str, create: bool = False) -> Folder:
        path = os.path.abspath(location)
        if create:
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise storage_error(exc, "create folder", path) from exc
        try:
            fd = os.open(path, _DIR_FLAGS)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"no folder at {path}") from None
        except NotADirectoryError:
            raise CheckpointNotFoundError(f"{path} is a file, not a folder") from None
        except OSError as exc:
            raise storage_error(exc, "open folder", path) from exc
        return self.folder_class(fd, path)

    def split(self, location: str) -> tuple[str, str]:
        path = os.path.abspath(location)  # lexical: "a/b/.." names "a"
        parent, name = os.path.split(path)
        return parent, name

    def exists(self, location: str) -> bool:
        return os.path.lexists(os.path.abspath(location))
