"""The storage seam: the few operations shardsafe needs from a place that holds files.

Everything above ``storage/`` reaches files only through these classes. A :class:`Folder`
is one directory (on an object store: one key prefix) whose entries are named by plain
names (no ``/``); it stays the same folder for as long as it is open, even when a path
that named it is renamed meanwhile (the local backend holds a directory descriptor).

Reads and writes are positional and may run on several threads at once. A file being
written is invisible to readers of its name until :meth:`WriteHandle.finish` returns on
backends that cannot show partial files; on a local filesystem it is visible but lives in
a save's temporary folder, which no reader opens. What counts as a committed checkpoint
or a leftover is not decided here (see ``shardsafe.checkpoint_folder``).

The seam is small on purpose: a folder stats, lists, opens for reading, creates (a file
written in parts), removes and opens sub-folders; a backend opens folders by location.
How a save becomes visible (rename of a temp folder, or a manifest published last) is not
an operation of the seam but the backend's commit strategy (``Folder.commit``, see
``shardsafe.storage.commit``), chosen once per backend.

Every failure is a :class:`~shardsafe.errors.CheckpointError`: :class:`StorageError`
(keeps ``errno``, the file name and the cause) when the backend failed, or
:class:`~shardsafe.errors.CorruptCheckpointError` when a file is not what a checkpoint
may hold (a symlink, a FIFO, a short file).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, StorageError

if TYPE_CHECKING:
    from ..budget import HostMemory
    from .commit import Commit

Kind = Literal["file", "dir", "other"]

__all__ = ["Backend", "Entry", "Folder", "Kind", "ReadHandle", "StorageError", "WriteHandle"]


class Entry(NamedTuple):
    """What :meth:`Folder.stat` tells of an entry: its kind, size (files) and modification
    time (UNIX seconds)."""

    kind: Kind
    size: int = 0
    mtime: float = 0.0


class ReadHandle(ABC):
    """An open regular file: its size, and positional reads that fill buffers exactly."""

    name: str
    size: int

    @abstractmethod
    def read_into(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Fill ``buffers`` back to back from ``offset``; a file that ends first raises
        CorruptCheckpointError naming the file and the byte."""

    def stream_to(self, lo: int, hi: int, sink: Callable[[memoryview, int], None], piece: int = 4 << 20) -> None:
        """Read bytes ``[lo, hi)`` and hand them to ``sink(bytes, offset)`` in order, in
        pieces of about ``piece`` bytes (memory stays bounded whatever the range)."""
        buf = memoryview(bytearray(min(piece, max(hi - lo, 1))))
        pos = lo
        while pos < hi:
            n = min(len(buf), hi - pos)
            self.read_into([buf[:n]], pos)
            sink(buf[:n], pos)
            pos += n

    def close(self) -> None:  # noqa: B027 - handles without resources need nothing here
        """Release the handle (idempotent)."""

    def __enter__(self) -> ReadHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class WriteHandle(ABC):
    """A new file being written with positional writes (from several threads at once)."""

    name: str

    @abstractmethod
    def write(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Write ``buffers`` back to back at ``offset`` (all of them, or raise)."""

    @abstractmethod
    def finish(self, durable: bool = True) -> None:
        """Complete the file (with ``durable``: on stable storage) and close it."""

    @abstractmethod
    def abort(self) -> None:
        """Close and remove the unfinished file (idempotent; never raises)."""


class Folder(ABC):
    """One folder of a storage backend; entries are plain names."""

    location: str  # printable, for messages: a path or URL

    def where(self, name: str) -> str:
        """The printable location of entry ``name``."""
        return f"{self.location.rstrip('/')}/{name}"

    commit: Commit  # how checkpoints become visible here (set by each backend's folder class)

    # -- entries ------------------------------------------------------------------------
    @abstractmethod
    def stat(self, name: str) -> Entry | None:
        """What entry ``name`` is, without following symlinks (None: absent)."""

    @abstractmethod
    def names(self) -> list[str]:
        """The entries of this folder (any order)."""

    def kind(self, name: str) -> Kind | None:
        """What entry ``name`` is (None: absent)."""
        st = self.stat(name)
        return None if st is None else st.kind

    def size(self, name: str) -> int:
        """The size of regular file ``name`` (CorruptCheckpointError when it is not one)."""
        st = self.stat(name)
        if st is None:
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist")
        if st.kind != "file":
            raise CorruptCheckpointError(f"{self.where(name)} is not a regular file")
        return st.size

    def mtime(self, name: str) -> float:
        """When entry ``name`` was last modified (UNIX time)."""
        st = self.stat(name)
        if st is None:
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist")
        return st.mtime

    # -- files ---------------------------------------------------------------------------
    @abstractmethod
    def open_read(self, name: str) -> ReadHandle:
        """Open regular file ``name`` for reading (never through a symlink, never a FIFO
        or device: those raise CorruptCheckpointError; an absent file raises
        CheckpointNotFoundError)."""

    @abstractmethod
    def create(self, name: str) -> WriteHandle:
        """Create file ``name`` for writing; an existing entry raises StorageError (EEXIST)."""

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The whole of regular file ``name`` (at most ``limit`` bytes, else CorruptCheckpointError)."""
        with self.open_read(name) as h:
            if h.size > limit:
                raise CorruptCheckpointError(f"{self.where(name)}: {h.size} bytes, more than the {limit} allowed")
            buf = bytearray(h.size)
            h.read_into([memoryview(buf)], 0)
            return bytes(buf)

    def publish_bytes(self, name: str, data: bytes, replace: bool) -> None:
        """Make file ``name`` hold exactly ``data``, atomically for readers (they see the old
        content or the new, never a part) and durably: the commit of a checkpoint on a
        backend that cannot rename folders. Without ``replace`` an existing file is an
        error (StorageError, EEXIST), decided atomically where the backend can. Backends
        whose commit strategy publishes in place implement it."""
        raise NotImplementedError(f"{type(self).__name__} cannot publish files")

    def write_bytes(self, name: str, data: bytes, durable: bool = True) -> None:
        """Create file ``name`` holding ``data`` (on stable storage with ``durable``)."""
        h = self.create(name)
        try:
            h.write([memoryview(data)], 0)
            h.finish(durable)
        except BaseException:
            h.abort()
            raise

    @abstractmethod
    def remove(self, name: str) -> None:
        """Delete file ``name`` (absent: nothing to do)."""

    def map_read(self, name: str) -> memoryview | None:
        """A private (copy-on-write) memory mapping of regular file ``name``, for importing
        foreign files without reading them into memory first; None when the backend
        cannot map files (read it with :meth:`read_bytes` then)."""
        return None

    def local_path(self, name: str) -> str | None:
        """The filesystem path of entry ``name`` for writers that need one (DCP's); None
        when the folder is not on the local filesystem."""
        return None

    def sync(self) -> None:  # noqa: B027 - where a finished write is durable there is nothing to do
        """Make the folder's entries (creations, renames) durable."""

    # -- folders -------------------------------------------------------------------------
    @abstractmethod
    def open_folder(self, name: str, create: bool = False) -> Folder:
        """Sub-folder ``name`` (created when ``create``), never through a symlink.
        The returned folder stays that folder while open; close it when done."""

    def remove_tree(self, name: str) -> None:
        """Delete sub-folder ``name`` and everything in it (absent: nothing to do)."""
        kind = self.kind(name)
        if kind is None:
            return
        if kind != "dir":
            self.remove(name)
            return
        with self.open_folder(name) as sub:
            for entry in sub.names():
                sub.remove_tree(entry)

    def close(self) -> None:  # noqa: B027 - backends without resources need nothing here
        """Release the folder (idempotent)."""

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend(ABC):
    """Opens folders by location (a path or URL of the backend's kind).

    ``retries`` counts the requests the backend retried after transient failures (object
    stores); saves and loads report its growth in ``SaveInfo`` / ``LoadInfo``."""

    retries: int = 0
    remote: bool = False  # reads cross a network (an object store): loads broadcast replicated tensors by default

    @abstractmethod
    def open(self, location: str, create: bool = False) -> Folder:
        """The folder at ``location`` (created, with its parents, when ``create``);
        CheckpointNotFoundError when it does not exist."""

    def open_and_read(self, location: str, name: str, limit: int) -> tuple[Folder, bytes | None]:
        """The folder at ``location`` (CheckpointNotFoundError when it does not exist) and
        the whole of its file ``name`` (None when absent; more than ``limit`` bytes:
        CorruptCheckpointError). Object stores read first and look for the folder only
        when the file is absent (one request where all is well)."""
        folder = self.open(location)
        try:
            return folder, folder.read_bytes(name, limit)
        except CheckpointNotFoundError:
            return folder, None
        except BaseException:
            folder.close()
            raise

    def use_memory(self, memory: HostMemory) -> None:  # noqa: B027 - a default no-op, not abstract
        """Lease the host buffers this backend keeps of its own (an object store's upload
        parts and blocks) from ``memory``, the Checkpointer's one budget, from now on. The
        default does nothing: a backend without such buffers has nothing to lease."""

    def split(self, location: str) -> tuple[str, str]:
        """(parent location, last name) of ``location``, normalized (``/``-separated)."""
        parent, _, name = location.rstrip("/").rpartition("/")
        return parent, name

    def exists(self, location: str) -> bool:
        """True when a folder (or file) is at ``location``."""
        parent, name = self.split(location)
        try:
            with self.open(parent) as folder:
                return folder.kind(name) is not None
        except CheckpointNotFoundError:
            return False
