"""The Azure Blob backend (``shardsafe[azure]``): ``az://container/prefix`` locations, through
obstore, on the same object-store code as S3.

Folders, listings, ranged reads pinned to the ETag, conditional publishing of the manifest
(If-None-Match), counted retries and the manifest-last commit in place are S3's
(:class:`~shardsafe.storage.s3.S3Folder`, :meth:`S3Backend.call`); what differs is the
store's configuration, the missing-container error and writes: positional writes
assemble fixed-size blocks, which obstore's multipart writer uploads in order (several at
once, retried by obstore: those retries are not counted), a file within one block is a
single PUT. Blocks that complete before an earlier one wait for it in memory.

Settings come from ``storage_options`` (see :func:`parse_options`) or the usual environment
(``AZURE_STORAGE_ACCOUNT_NAME``, ``AZURE_STORAGE_ACCOUNT_KEY``, ``AZURE_STORAGE_SAS_TOKEN``,
``AZURE_STORAGE_USE_EMULATOR=true`` with ``AZURITE_BLOB_STORAGE_URL`` for Azurite, ...).
Containers are created outside shardsafe; a missing one is a :class:`ContainerNotFoundError`.
"""

from __future__ import annotations

import contextlib
import errno
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import obstore
from obstore import exceptions as obx
from obstore.store import AzureStore

from .. import workers
from ..budget import HostMemory
from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from .base import WriteHandle
from .options import Spellings, read_options
from .s3.backend import S3Backend
from .s3.errors import BucketNotFoundError, _bucket_error, _reason, _storage_error
from .s3.folder import S3Folder
from .s3.reads import _bytes_view
from .s3.writes import _Part

__all__ = ["AzureBackend", "AzureOptions", "ContainerNotFoundError", "parse_options"]

MiB = 1 << 20
MAX_BLOCKS = 50_000  # Azure's maximum number of blocks of a blob


@dataclass
class AzureOptions:
    """Connection, retry and upload settings (see :func:`parse_options` for the spellings)."""

    account_name: str | None = None
    account_key: str | None = None
    sas_token: str | None = None
    endpoint: str | None = None
    use_emulator: bool | None = None
    allow_http: bool | None = None
    anon: bool = False
    max_retries: int = 10
    retry_backoff: float = 0.1
    max_backoff: float = 5.0
    timeout: float | None = None
    connect_timeout: float | None = None
    part_size: int = 16 * MiB
    max_concurrency: int = 4
    extra: dict[str, Any] = field(default_factory=dict)  # obstore Azure config keys passed as they are


SPELLINGS = Spellings(
    "Azure",
    {
        "account_name": ("account_name", "account", "azure_storage_account_name", "storage_account_name"),
        "account_key": ("account_key", "key", "access_key", "azure_storage_account_key", "storage_account_key"),
        "sas_token": ("sas_token", "sas_key", "sas", "azure_storage_sas_token", "azure_storage_sas_key"),
        "endpoint": ("endpoint", "endpoint_url", "azure_storage_endpoint", "azure_endpoint"),
        "use_emulator": ("use_emulator", "azure_storage_use_emulator"),
        "allow_http": ("allow_http", "azure_allow_http"),
        "anon": ("anon", "skip_signature", "azure_skip_signature"),
        "max_retries": ("max_retries", "retries"),
        "retry_backoff": ("retry_backoff", "backoff"),
        "max_backoff": ("max_backoff",),
        "timeout": ("timeout", "read_timeout"),
        "connect_timeout": ("connect_timeout",),
        "part_size": ("part_size", "chunk_size", "block_size"),
        "max_concurrency": ("max_concurrency", "concurrency"),
    },
    bools=frozenset({"use_emulator", "allow_http", "anon"}),
    floats=frozenset({"retry_backoff", "max_backoff", "timeout", "connect_timeout"}),
    ints=frozenset({"max_retries", "part_size", "max_concurrency"}),
    passthrough=("client_id", "client_secret", "tenant_id", "authority_host", "token", "use_azure_cli",
                 "msi_endpoint", "object_id", "msi_resource_id", "federated_token_file", "use_fabric_endpoint",
                 "disable_tagging", "encryption_key"),
    prefix="azure_",
)


def parse_options(options: dict[str, Any] | None) -> AzureOptions:
    """Read a ``storage_options`` mapping. Accepted spellings (any case): account_name /
    account, account_key / key, sas_token, endpoint, use_emulator, allow_http, anon,
    max_retries, retry_backoff, max_backoff, timeout, connect_timeout, part_size,
    max_concurrency, and obstore's Azure keys for service principals and managed
    identities (client_id, tenant_id, ...). Unknown keys raise a CheckpointError naming
    the closest accepted ones."""
    opts = read_options(AzureOptions(), options, SPELLINGS)
    if opts.part_size < 1 * MiB:
        raise CheckpointError("storage option part_size must be at least 1 MiB")
    if opts.max_retries < 0 or opts.max_concurrency < 1:
        raise CheckpointError("storage options max_retries must be >= 0 and max_concurrency >= 1")
    return opts


class ContainerNotFoundError(BucketNotFoundError):
    """The container of an ``az://`` location does not exist (``bucket`` names it)."""

    def __init__(self, container: str, context: str) -> None:
        CheckpointNotFoundError.__init__(
            self, f"container {container!r} does not exist ({context}); create it first, or check the container "
                  "name and the account (storage options account_name / endpoint, AZURE_STORAGE_ACCOUNT_NAME)")
        self.bucket = container

    def __reduce__(self):  # noqa: ANN204 - rebuilt from its own arguments (pickled across ranks)
        return _bucket_error, (self.bucket, str(self))


class _Container:
    """One container: its obstore store (no internal retries) and a retrying one for
    streamed uploads."""

    def __init__(self, opts: AzureOptions, name: str) -> None:
        self.name = name
        config: dict[str, Any] = dict(opts.extra)
        for key, value in (("account_name", opts.account_name), ("account_key", opts.account_key),
                           ("sas_key", opts.sas_token), ("endpoint", opts.endpoint)):
            if value:
                config[key] = value
        if opts.use_emulator is not None:
            config["use_emulator"] = opts.use_emulator
        if opts.anon:
            config["skip_signature"] = True
        client: dict[str, Any] = {}
        if opts.allow_http or (opts.allow_http is None and (opts.endpoint or "").lower().startswith("http://")):
            client["allow_http"] = True
        if opts.timeout:
            client["timeout"] = timedelta(seconds=opts.timeout)
        if opts.connect_timeout:
            client["connect_timeout"] = timedelta(seconds=opts.connect_timeout)
        backoff = {"init_backoff": timedelta(seconds=opts.retry_backoff),
                   "max_backoff": timedelta(seconds=opts.max_backoff)}
        try:
            self.store = AzureStore(name, config=config, client_options=client or None,
                                    retry_config={"max_retries": 0})
            self.stream_store = AzureStore(name, config=config, client_options=client or None,
                                           retry_config={"max_retries": opts.max_retries, "backoff": backoff})
        except obx.BaseError as exc:
            raise CheckpointError(f"cannot configure Azure Blob storage for container {name!r}: {_reason(exc)}") \
                from None


class AzureBackend(S3Backend):
    """``az://container/prefix`` locations. ``options`` is a ``storage_options`` mapping
    (see :func:`parse_options`); what it leaves out comes from the usual Azure environment
    variables. ``retries`` counts every request retried after a transient failure (block
    uploads aside: obstore retries those itself). ``memory``: the host-memory budget block
    buffers are leased from, as S3's parts (:meth:`use_memory`)."""

    scheme = "az"
    missing_words = ("ContainerNotFound",)

    def __init__(self, options: dict[str, Any] | None = None,  # noqa: D107 - see the class
                 memory: HostMemory | None = None) -> None:
        self.opts = parse_options(options)  # type: ignore[assignment]
        self.memory = memory if memory is not None else HostMemory()
        self.retries = 0
        self._lock = threading.Lock()
        self._buckets: dict[str, Any] = {}

    def bucket(self, name: str) -> Any:
        """The configured store of container ``name`` (made on first use)."""
        with self._lock:
            b = self._buckets.get(name)
            if b is None:
                b = self._buckets[name] = _Container(self.opts, name)  # type: ignore[arg-type]
            return b

    def missing(self, bucket: str, context: str) -> BucketNotFoundError:
        return ContainerNotFoundError(bucket, context)

    def _folder(self, bucket: str, prefix: str) -> S3Folder:
        return AzureFolder(self, self.bucket(bucket), prefix)


class AzureFolder(S3Folder):
    """The blobs and virtual directories below ``prefix/`` in a container."""

    def create(self, name: str) -> WriteHandle:
        if self._head(name) is not None:
            raise StorageError(f"cannot create {self.where(name)}: it exists", errno.EEXIST, self.where(name))
        return AzureWriteHandle(self, name)


class AzureWriteHandle(WriteHandle):
    """A new blob written by positional writes from any number of threads: bytes land in
    blocks of ``part_size``; complete blocks stream, in order, to obstore's multipart
    writer on a background thread; ``finish`` sends the rest (a blob within one block:
    one PUT). Block buffers are leased from the backend's
    :class:`~shardsafe.budget.HostMemory` (as S3's parts: without waiting, kept for the
    next blocks) and given back once obstore no longer holds them: obstore sends a block
    without copying it, holding a view of its buffer until the block is uploaded."""

    def __init__(self, folder: AzureFolder, name: str) -> None:
        self.folder, self.name = folder, name
        self.where, self.key = folder.where(name), folder.key(name)
        opts = folder.backend.opts
        self.part_size, self.concurrency = opts.part_size, opts.max_concurrency
        self.memory: HostMemory = folder.backend.memory
        self._lock = threading.Lock()  # blocks, sizes and leases
        self._order = threading.Lock()  # hands blocks over in order
        self._blocks: dict[int, _Part] = {}  # being filled
        self._ready: dict[int, tuple[_Part, int]] = {}  # complete (block, bytes), not yet handed over
        self._taken: list[tuple[_Part, memoryview]] = []  # handed to obstore, its buffer not yet back
        self._current: tuple[_Part, memoryview] | None = None  # yielded to obstore, not yet taken
        self._next = 0  # the next block to hand over
        self._size = 0
        self._q: queue.Queue[tuple[_Part, memoryview] | BaseException | None] = queue.Queue(maxsize=2)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._state = "open"  # open -> finished | aborted
        self._finishing = False

    # -- the streaming thread ---------------------------------------------------------------
    def _blocks_out(self) -> Iterator[memoryview]:
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            self._current = item  # obstore may not hold a view of it yet: not released until it asks again
            yield item[1]
            with self._lock:  # obstore asks for the next block: it holds this one (or is done with it)
                self._taken.append(item)
                self._current = None

    def _run(self) -> None:
        try:
            obstore.put(self.folder.b.stream_store, self.key, self._blocks_out(), use_multipart=True,
                        chunk_size=self.part_size, max_concurrency=self.concurrency)
        except BaseException as exc:  # noqa: BLE001 - reported by finish()
            self._error = exc
            with contextlib.suppress(queue.Empty):
                while True:
                    item = self._q.get_nowait()
                    if isinstance(item, tuple):
                        item[0].release()

    def _push(self, item: tuple[_Part, memoryview] | BaseException | None) -> None:
        if self._thread is None:
            self._thread = workers.start_thread(self._run, "az-upload")
        while self._thread.is_alive():
            try:
                self._q.put(item, timeout=0.1)
                return
            except queue.Full:
                continue
        if isinstance(item, tuple):  # the upload ended: nobody takes this block
            item[0].release()

    def _hand_over(self) -> None:
        """Send the complete blocks that are next in order; give back the buffers obstore
        is done with."""
        with self._order:
            while True:
                with self._lock:
                    ready = self._ready.pop(self._next, None)
                    if ready is None:
                        break
                    self._next += 1
                part, n = ready
                assert part.buf is not None
                self._push((part, part.buf[:n]))
        self._give_back()

    def _give_back(self, all_of_them: bool = False) -> None:
        """Release the leases of the blocks obstore no longer holds (a view of a buffer it
        still holds cannot be released); ``all_of_them`` once the upload has ended."""
        with self._lock:
            taken, self._taken = self._taken, []
        kept = []
        for part, view in taken:
            try:
                view.release()
            except BufferError:
                if not all_of_them:
                    kept.append((part, view))
                    continue
            part.release()
        if kept:
            with self._lock:
                self._taken[:0] = kept

    def _release_all(self) -> None:
        """Give every buffer back to the budget (the upload thread has ended)."""
        self._give_back(all_of_them=True)
        with self._lock:
            parts = list(self._blocks.values()) + [p for p, _ in self._ready.values()]
            if self._current is not None:
                parts.append(self._current[0])
                self._current = None
            self._blocks.clear()
            self._ready.clear()
        for part in parts:
            part.release()

    def _check(self) -> None:
        if self._error is not None:
            raise _storage_error(self._error, "upload", self.where)

    def _block(self, index: int) -> tuple[_Part, memoryview]:
        if self._state != "open":
            raise StorageError(f"cannot write {self.where}: the file is {self._state}", errno.EBADF, self.where)
        if index < self._next or index in self._ready:
            raise StorageError(f"cannot write {self.where}: block {index + 1} was already sent", errno.EINVAL,
                               self.where)
        if index >= MAX_BLOCKS:
            raise StorageError(f"cannot write {self.where}: more than {MAX_BLOCKS} blocks of {self.part_size} "
                               "bytes (raise the part_size storage option)", errno.EFBIG, self.where)
        part = self._blocks.get(index)
        if part is None:
            part = self._blocks[index] = _Part(self.memory, self.part_size)
        assert part.buf is not None
        return part, part.buf

    # -- WriteHandle ------------------------------------------------------------------------
    def write(self, buffers: Sequence[memoryview], offset: int) -> None:
        """Copy ``buffers`` into their blocks at ``offset``; send every block this completes."""
        self._check()
        pos, ps = offset, self.part_size
        for buf in buffers:
            view = _bytes_view(memoryview(buf))
            i, n = 0, len(view)
            while i < n:
                index, off = divmod(pos, ps)
                m = min(ps - off, n - i)
                with self._lock:
                    block, dest = self._block(index)
                dest[off: off + m] = view[i: i + m]
                with self._lock:
                    self._size = max(self._size, pos + m)
                    if block.add(off, off + m) == ps and self._blocks.get(index) is block:
                        del self._blocks[index]
                        self._ready[index] = (block, ps)
                pos += m
                i += m
        self._hand_over()
        self._check()

    def finish(self, durable: bool = True) -> None:
        """Send what is left and complete the blob; any failure aborts it and raises."""
        if self._state == "finished":
            return
        self._finishing = True
        try:
            self._check()
            size = self._size
            if self._thread is None and not self._ready and size <= self.part_size:
                block = self._blocks.get(0)
                if block is not None and block.buf is not None:
                    block.zero_gaps(size)
                self.folder.put(self.name, block.buf[:size] if block and block.buf else memoryview(b""))
            else:
                self._send_rest(size)
                self._push(None)
                assert self._thread is not None
                self._thread.join()
                self._check()
            self._state = "finished"
        except BaseException:
            self.abort()
            raise
        finally:
            if self._thread is None or not self._thread.is_alive():
                self._release_all()

    def _send_rest(self, size: int) -> None:
        """Queue every block not yet sent, up to ``size`` (holes read as zeros, as in a
        sparse file), and hand them over."""
        last = (size - 1) // self.part_size
        with self._lock:
            for index in range(self._next, last + 1):
                if index not in self._ready:
                    block = self._blocks.pop(index, None) or _Part(self.memory, self.part_size)
                    n = min(self.part_size, size - index * self.part_size)
                    block.zero_gaps(n)
                    self._ready[index] = (block, n)
        self._hand_over()

    def abort(self) -> None:
        """Stop the upload and remove anything written (idempotent; never raises)."""
        with self._lock:
            state, self._state = self._state, "aborted"
        if state == "aborted":
            return
        with contextlib.suppress(Exception):
            if self._thread is not None and self._thread.is_alive():
                self._push(RuntimeError("aborted"))
                self._thread.join()
            if state == "finished" or self._finishing:
                self.folder.remove(self.name)
        if self._thread is None or not self._thread.is_alive():
            self._release_all()
