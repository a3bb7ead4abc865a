"""An S3 folder: a key prefix of a bucket, its entries (objects and sub-prefixes),
single PUTs and the conditional publish of a manifest."""

from __future__ import annotations

import contextlib
import errno
import hashlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import obstore
from obstore import exceptions as obx

from ...errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError, StorageError
from ..base import Entry, Folder, ReadHandle, WriteHandle
from ..commit import IN_PLACE
from .errors import _NOT_FOUND
from .reads import S3ReadHandle
from .writes import S3WriteHandle

if TYPE_CHECKING:
    from .backend import S3Backend

T = TypeVar("T")


class S3Folder(Folder):
    """The objects and sub-prefixes below ``prefix/`` in a bucket; commits in place
    (manifest last, conditional PUT: :class:`~shardsafe.storage.commit.InPlaceCommit`)."""

    commit = IN_PLACE

    def __init__(self, backend: S3Backend, bucket: Any, prefix: str) -> None:
        self.backend = backend
        self.b = bucket
        self.prefix = prefix
        head = f"{backend.scheme}://{bucket.name}"
        self.location = f"{head}/{prefix}" if prefix else head

    def key(self, name: str) -> str:
        """The object key of entry ``name``."""
        if not name or "/" in name or name in (".", ".."):
            raise StorageError(f"bad entry name {name!r} in {self.location}", errno.EINVAL, self.where(name))
        return f"{self.prefix}/{name}" if self.prefix else name

    def _call(self, what: str, name: str | None, fn: Callable[[], T],
              passthrough: tuple[type[BaseException], ...] = ()) -> T:
        where = self.location if name is None else self.where(name)
        return self.backend.call(what, where, fn, passthrough)

    def _head(self, name: str) -> dict | None:
        key = self.key(name)
        try:
            return self._call("inspect", name, lambda: obstore.head(self.b.store, key), _NOT_FOUND)
        except _NOT_FOUND:
            return None

    def _first_under(self, key: str | None) -> list[dict]:
        """At most a few objects below ``key/`` (the whole bucket for None)."""
        def first() -> list[dict]:
            for chunk in obstore.list(self.b.store, key, chunk_size=1):
                return list(chunk)
            return []
        return self._call("list", None if key is None or key == self.prefix else key.rpartition("/")[2], first)

    def check_exists(self, files: bool = False) -> None:
        """Raise CheckpointNotFoundError unless this prefix holds something (the bucket root:
        unless the bucket exists); with ``files``, an object at the prefix counts too."""
        if not self.prefix:
            try:
                self._first_under(None)
            except StorageError as exc:
                if exc.errno == errno.ENOENT or self.backend.is_missing(exc):
                    raise self.backend.missing(self.b.name, f"no folder at {self.location}") from None
                raise
            return
        if self._first_under(self.prefix):
            return
        try:
            meta = self._call("inspect", None, lambda: obstore.head(self.b.store, self.prefix), _NOT_FOUND)
        except _NOT_FOUND:
            meta = None
        if meta is not None:
            if files:
                return
            raise CheckpointNotFoundError(f"{self.location} is a file, not a folder")
        raise CheckpointNotFoundError(f"no folder at {self.location}")

    # -- entries ------------------------------------------------------------------------
    def stat(self, name: str) -> Entry | None:
        meta = self._head(name)
        if meta is not None:
            return Entry("file", int(meta["size"]), meta["last_modified"].timestamp())
        first = self._first_under(self.key(name))
        return Entry("dir", 0, first[0]["last_modified"].timestamp()) if first else None

    def names(self) -> list[str]:
        result = self._call("list", None, lambda: obstore.list_with_delimiter(self.b.store, self.prefix or None))
        out = [p.rpartition("/")[2] for p in result["common_prefixes"]]
        out += [m["path"].rpartition("/")[2] for m in result["objects"]]
        return [n for n in dict.fromkeys(out) if n]

    def mtime(self, name: str) -> float:
        meta = self._head(name)
        if meta is not None:
            return meta["last_modified"].timestamp()
        key = self.key(name)
        objs = self._call("list", name, lambda: obstore.list(self.b.store, key).collect())
        if not objs:
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist")
        return max(m["last_modified"] for m in objs).timestamp()

    # -- files ---------------------------------------------------------------------------
    def open_read(self, name: str) -> ReadHandle:
        meta = self._head(name)
        if meta is None:
            if self._first_under(self.key(name)):
                raise CorruptCheckpointError(
                    f"{self.where(name)} is not a regular file; checkpoints hold regular files only")
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist")
        return S3ReadHandle(self, name, int(meta["size"]), meta.get("e_tag"))

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The whole object ``name`` in one GET (no HEAD first: manifests and file indexes
        are read whole); more than ``limit`` bytes is a CorruptCheckpointError, read no further."""
        key = self.key(name)

        def get() -> bytes | int:
            result = obstore.get(self.b.store, key)
            size = int(result.meta["size"])
            return size if size > limit else bytes(result.bytes())

        try:
            got = self._call("read", name, get, _NOT_FOUND)
        except _NOT_FOUND:
            if self._first_under(key):
                raise CorruptCheckpointError(
                    f"{self.where(name)} is not a regular file; checkpoints hold regular files only") from None
            raise CheckpointNotFoundError(f"{self.where(name)} does not exist") from None
        if isinstance(got, int):
            raise CorruptCheckpointError(f"{self.where(name)}: {got} bytes, more than the {limit} allowed")
        return got

    def create(self, name: str) -> WriteHandle:
        """A new object ``name``; that none exists is checked when it is completed (a
        conditional PUT or completion, If-None-Match: *), not by a HEAD first."""
        return S3WriteHandle(self, name)

    def exists_error(self, name: str) -> StorageError:
        where = self.where(name)
        return StorageError(f"cannot create {where}: it exists", errno.EEXIST, where)

    def put_new(self, name: str, data: bytes | memoryview) -> None:
        """One PUT of ``data`` at ``name`` if no object is there (If-None-Match: *; a
        retried PUT that finds its own bytes succeeded); StorageError EEXIST otherwise."""
        try:
            self.put(name, data, mode="create")
            return
        except (obx.AlreadyExistsError, obx.PreconditionError) as exc:
            if self._same(name, data):
                return
            raise self.exists_error(name) from exc
        except obx.NotSupportedError:
            pass  # a server without conditional PUTs: check, then put (not atomic)
        if self._head(name) is not None:
            raise self.exists_error(name)
        self.put(name, data)

    def put(self, name: str, data: bytes | memoryview, mode: str = "overwrite", what: str = "write") -> bool:
        """One PUT of ``data`` at ``name`` (``mode="create"``: only if absent); returns True
        when a retry happened (a "create" that then fails may have been this call's own)."""
        key = self.key(name)
        retried = []
        self.backend.call(what, self.where(name),
                          lambda: obstore.put(self.b.store, key, data, mode=mode, use_multipart=False),
                          (obx.AlreadyExistsError, obx.PreconditionError, obx.NotSupportedError),
                          on_retry=lambda: retried.append(1))
        return bool(retried)

    def publish_bytes(self, name: str, data: bytes, replace: bool) -> None:
        """One PUT; without ``replace`` a conditional create (If-None-Match: *), so that of
        two concurrent commits only one wins."""
        where = self.where(name)
        if replace:
            self.put(name, data, what="publish")
            return
        try:
            self.put(name, data, mode="create", what="publish")
            return
        except (obx.AlreadyExistsError, obx.PreconditionError) as exc:
            # A retried create whose first attempt landed sees its own object: not a conflict.
            if self._same(name, data):
                return
            err = StorageError(f"cannot publish {where}: it exists", errno.EEXIST, where)
            raise err from exc
        except obx.NotSupportedError:
            pass  # a server without conditional PUTs: check, then put (not atomic)
        if self._head(name) is not None:
            raise StorageError(f"cannot publish {where}: it exists", errno.EEXIST, where)
        self.put(name, data, what="publish")

    def _same(self, name: str, data: bytes) -> bool:
        meta = self._head(name)
        if meta is None or int(meta["size"]) != len(data):
            return False
        etag = (meta.get("e_tag") or "").strip('"')
        if etag and "-" not in etag and len(etag) == 32:
            return etag == hashlib.md5(data, usedforsecurity=False).hexdigest()
        with contextlib.suppress(CheckpointError):
            return self.read_bytes(name, len(data)) == data
        return False

    def remove(self, name: str) -> None:
        key = self.key(name)
        self._call("delete", name, lambda: obstore.delete(self.b.store, key))

    # -- folders -------------------------------------------------------------------------
    def open_folder(self, name: str, create: bool = False) -> Folder:
        folder = type(self)(self.backend, self.b, self.key(name))
        if not create:
            try:
                folder.check_exists()
            except CheckpointNotFoundError as exc:
                if "is a file" in str(exc):
                    raise CorruptCheckpointError(f"{self.where(name)} is not a folder") from None
                raise
        return folder

    def remove_tree(self, name: str) -> None:
        key = self.key(name)
        keys = [m["path"] for m in self._call("list", name, lambda: obstore.list(self.b.store, key).collect())]
        if self._head(name) is not None:
            keys.append(key)
        for i in range(0, len(keys), 1000):
            batch = keys[i: i + 1000]
            self._call("delete", name, lambda batch=batch: obstore.delete(self.b.store, batch))

