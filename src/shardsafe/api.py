"""The module-level functions: ``save``, ``load``, ``load_full``, ``async_save``,
``read_manifest`` and ``wait_for_pending``, each on a default :class:`Checkpointer`
(created on first use). Use a :class:`Checkpointer` of your own to choose the memory
budget, I/O threads or storage backend, or to keep several jobs' state apart.

Every function takes a path or URL (``s3://bucket/prefix`` needs ``shardsafe[s3]``) and a
``storage_options`` mapping for object stores (endpoint, region, credentials, retries,
part size; see ``shardsafe.storage.s3.parse_options``). Without it, they come from the
usual AWS environment variables.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from .checkpointer import Checkpointer, PathLike, SaveFuture
from .format.manifest import Manifest
from .ops.load import DEFAULT_MAX_BUFFER, LoadInfo
from .ops.save import CHECKSUM_BLOCK, SaveInfo

_DEFAULT: Checkpointer | None = None
_DEFAULT_LOCK = threading.Lock()


def default_checkpointer() -> Checkpointer:
    """The Checkpointer the module-level functions use (created on first use)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None or _DEFAULT._closed:
            _DEFAULT = Checkpointer()
        return _DEFAULT


def save(state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False, process_group: Any = None,
         check_replicas: bool | None = None, storage_options: dict[str, Any] | None = None,
         base: PathLike | None = None, version_skip: bool = False, compression: str = "off") -> SaveInfo:
    """Save ``state_dict`` as a checkpoint folder at ``path``, crash-safely.

    With a process group (default: the world group when initialized) every rank calls
    ``save``; each writes only what it owns and replicated values are written once.
    The checkpoint becomes visible only once complete; an existing checkpoint at
    ``path`` is replaced only with ``overwrite=True`` and stays intact until the new one
    is committed. Values that cannot be saved without pickle raise
    UnsupportedValueError naming their key on every rank, before anything is written.

    Replicated tensors are written from one rank. ``check_replicas=True`` first compares
    every rank's copy (a digest each) and refuses the save, naming the key and ranks, when
    they differ (default: the SHARDSAFE_CHECK_REPLICAS environment variable; it costs one
    hash pass over the replicated bytes).

    ``base``: an incremental save. ``base`` is another checkpoint in the same folder as
    ``path``; every chunk whose bytes equal the base's (same key, box and dtype; compared
    by a 128-bit digest) is not written: the new checkpoint refers to the file that holds
    it (never to a reference), and loads verify those bytes like their own. The new
    checkpoint then needs the files it refers to: delete checkpoints through a
    :class:`CheckpointManager` (it keeps referenced files) or make a self-contained copy
    with ``shardsafe copy``. ``version_skip=True`` (with ``base``) trusts tensors' ``_version``
    counters: a chunk whose source tensor kept its storage and counter since this
    Checkpointer's last save is not hashed again. Unsafe with fused optimizers
    (``fused=True``: their steps leave ``_version`` unchanged) and with writes through
    ``.data``, numpy or DLPack views or other code that bypasses the counter
    (docs/incremental.md).

    ``compression``: ``"off"`` (the default: raw, format 3.1), ``"zstd"`` (byte-shuffle then
    zstd: the better ratio), ``"lz4"`` (shuffle then lz4: faster) or ``"auto"`` (compress
    only when the codec is measured to be faster than the storage). Each 1 MiB checksum
    block is stored compressed or raw, whichever is smaller; checksums, chunk digests,
    resharded reads and references keep their meaning. A compressed checkpoint is format
    3.2: shardsafe before 3.2 refuses it (docs/format.md)."""
    return default_checkpointer().save(state_dict, path, overwrite=overwrite, process_group=process_group,
                                       check_replicas=check_replicas, storage_options=storage_options, base=base,
                                       version_skip=version_skip, compression=compression)


def async_save(state_dict: dict[str, Any], path: PathLike, *, overwrite: bool = False, process_group: Any = None,
               max_staging_bytes: int | None = None, check_replicas: bool | None = None,
               storage_options: dict[str, Any] | None = None, base: PathLike | None = None,
               version_skip: bool = False, compression: str = "off") -> SaveFuture:
    """Save like :func:`save`, but return once the state is staged in host memory; the
    write and commit run in the background. All ranks call it.

    ``max_staging_bytes`` bounds the staging slots (default: this rank's share of the
    state); a larger state streams through them and the call waits longer. Slots are
    kept for later saves. At most one async save per Checkpointer is in flight: a new one
    first waits for the previous one, and raises its error if it failed unobserved.
    ``base``, ``version_skip`` and ``compression``: as for :func:`save` (decided while staging)."""
    return default_checkpointer().async_save(state_dict, path, overwrite=overwrite, process_group=process_group,
                                             max_staging_bytes=max_staging_bytes, check_replicas=check_replicas,
                                             storage_options=storage_options, base=base, version_skip=version_skip,
                                             compression=compression)


def wait_for_pending() -> SaveInfo | None:
    """Block until the default Checkpointer's async save in flight has committed (raises its error)."""
    return default_checkpointer().wait()


def load(state_dict: dict[str, Any], path: PathLike, *, strict: bool = True, verify: bool = True,
         process_group: Any = None, max_buffer: int = DEFAULT_MAX_BUFFER,
         exclude: str | Iterable[str] = (), cast_dtype: bool = False,
         broadcast_replicated: bool | None = None, storage_options: dict[str, Any] | None = None) -> LoadInfo:
    """Load the checkpoint at ``path`` into ``state_dict`` in place, on one process or on
    every rank of a process group, whatever world size or layout saved it.

    Tensors (plain or DTensor) are filled in place with only the bytes they need,
    Statefuls get ``load_state_dict`` with their filled tree, other values are replaced.
    Keys, shapes and dtypes are validated — and with ``verify`` the checksum of every
    needed block — before any destination byte is written, so a failed load leaves the
    destination untouched; every rank raises the same error. Dotted keys or prefixes in
    ``exclude`` (a list, or one ``str``: ``exclude="optim"`` is ``exclude=["optim"]``) are
    left as they are in the destination (and may be missing from the checkpoint); a
    pattern that matches no key of the checkpoint and none of the destination raises
    MissingKeysError naming the closest keys (a typo never loads everything). A saved
    dtype that differs from the destination's is an error, unless ``cast_dtype=True``
    (then the values are converted as ``Tensor.copy_`` converts).

    ``broadcast_replicated``: on a process group, each replicated tensor that every rank
    needs whole is read (and verified) by one rank and sent to the others, so storage is
    read once whatever the number of replicas (default: on for object stores, off for
    local paths)."""
    return default_checkpointer().load(state_dict, path, strict=strict, verify=verify, process_group=process_group,
                                       max_buffer=max_buffer, exclude=exclude, cast_dtype=cast_dtype,
                                       broadcast_replicated=broadcast_replicated, storage_options=storage_options)


def load_full(path: PathLike, keys: str | Iterable[str] | None = None, *, verify: bool = True,
              rank: int = 0, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """A fresh tree of full CPU tensors and values from the checkpoint at ``path``
    (rank-local values: those of saving rank ``rank``). Needs no process group.

    ``keys`` restricts the result to the given dotted keys or key prefixes (one ``str``,
    for example ``"model"`` or ``"model.layers.0.weight"``, or a list of them); a key that
    matches nothing raises MissingKeysError naming the closest keys. A list partly
    selected comes back as a dict keyed by index."""
    return default_checkpointer().load_full(path, keys, verify=verify, rank=rank, storage_options=storage_options)


def delete(path: PathLike, *, storage_options: dict[str, Any] | None = None) -> bool:
    """Delete the checkpoint at ``path`` crash-safely (readers never see it half deleted);
    False when there was none. Anything that is not a checkpoint is refused, not deleted."""
    return default_checkpointer().delete(path, storage_options)


def read_manifest(path: PathLike, *, storage_options: dict[str, Any] | None = None, indexes: bool = True) -> Manifest:
    """Parse and verify the manifest of the committed checkpoint at ``path`` (with
    ``indexes``, every file index too; see :meth:`Checkpointer.read_manifest`)."""
    return default_checkpointer().read_manifest(path, storage_options, indexes=indexes)


__all__ = ["CHECKSUM_BLOCK", "Checkpointer", "LoadInfo", "SaveFuture", "SaveInfo", "async_save", "delete",
           "default_checkpointer", "load", "load_full", "read_manifest", "save", "wait_for_pending"]
