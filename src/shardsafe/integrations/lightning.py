"""Lightning integration: ``Trainer(plugins=[ShardsafeCheckpointIO()])``.

:class:`ShardsafeCheckpointIO` is a Lightning ``CheckpointIO``: Lightning's whole checkpoint
dict is saved with :func:`shardsafe.save` (crash-safe, checksummed, no pickle) and read
back with :func:`shardsafe.load_full`. The ``.ckpt`` path Lightning passes names the
checkpoint *folder*. :class:`ShardsafeModelParallelStrategy` is Lightning's
``ModelParallelStrategy`` (FSDP2 / tensor parallel) saving and loading shardsafe
checkpoints on every rank. See docs/lightning.md.

Values typed JSON cannot hold are converted here, without pickle, and restored on load:
``set`` / ``frozenset``, dicts with keys other than str / int, ``pathlib`` paths,
``torch.dtype`` and ``torch.device``. Anything else raises UnsupportedValueError naming
its key. Only this module imports Lightning; it uses shardsafe's public API only.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import ModelParallelStrategy

import shardsafe
from shardsafe import Checkpointer, CorruptCheckpointError, UnsupportedValueError

FORMAT_KEY = "shardsafe_lightning"
"""Top-level key saved with every checkpoint written here: the version of the value
conversions below (tags are decoded only in checkpoints that carry it); removed on load."""
FORMAT_VERSION = 1

_PLAIN_SCALARS = (type(None), bool, int, float, str, bytes)
_PLAIN_KEYS = (str, int)
_PATH_TYPES = ("PurePath", "PurePosixPath", "PureWindowsPath", "Path", "PosixPath", "WindowsPath")
_MODEL, _OPTIMIZERS = "state_dict", "optimizer_states"

MapLocation = str | torch.device | int | Mapping[str, Any] | Callable[..., Any] | None
PathLike = str | os.PathLike


# ------------------------------------------------------------------ value conversions


def to_storable(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of Lightning's ``checkpoint`` that shardsafe can save (tensors are shared, not
    copied), tagged with FORMAT_KEY. Raises UnsupportedValueError naming the dotted key of
    the first value that neither typed JSON nor a conversion here can hold."""
    out = _encode(dict(checkpoint), "")
    out[FORMAT_KEY] = FORMAT_VERSION  # a top-level tag ($literal, $items) keeps its meaning: removed on load
    return out


def from_storable(tree: dict[str, Any], map_location: MapLocation = None) -> dict[str, Any]:
    """The checkpoint dict ``to_storable`` was given (sets, paths ... restored, FORMAT_KEY
    removed), with every tensor moved as ``map_location`` says (see :func:`tensor_mapper`).
    A tree saved without FORMAT_KEY (a plain shardsafe checkpoint) is returned with its
    values as they are."""
    tree = dict(tree)
    version = tree.pop(FORMAT_KEY, None)
    if version is not None and version != FORMAT_VERSION:
        raise shardsafe.FormatVersionError(
            f"Lightning values were saved in conversion version {version!r}; this reader knows {FORMAT_VERSION}")
    return _decode(tree, tensor_mapper(map_location), version is not None)


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def _encode(value: Any, path: str) -> Any:
    if isinstance(value, torch.Tensor) or type(value) in _PLAIN_SCALARS:
        return value
    if isinstance(value, dict):  # OrderedDict and other dict subclasses come back as plain dicts
        items = [(k, _encode(v, _join(path, k))) for k, v in value.items()]
        if all(type(k) in _PLAIN_KEYS for k, _ in items):
            out = dict(items)
            if len(out) == 1 and isinstance(next(iter(out)), str) and next(iter(out)).startswith("$"):
                return {"$literal": out}  # so that a user's {"$set": ...} is not read back as a tag
            return out
        return {"$items": [[_encode(k, f"{path} (a dict key)"), v] for k, v in items]}
    if type(value) is list:
        return [_encode(v, _join(path, i)) for i, v in enumerate(value)]
    if type(value) is tuple:
        return tuple(_encode(v, _join(path, i)) for i, v in enumerate(value))
    if type(value) in (set, frozenset):
        return {f"${type(value).__name__}": [_encode(v, path) for v in value]}
    if isinstance(value, pathlib.PurePath) and type(value).__name__ in _PATH_TYPES:
        return {"$path": [type(value).__name__, str(value)]}
    if isinstance(value, torch.dtype):
        return {"$dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"$device": str(value)}
    raise _unsupported(value, path)


def _unsupported(value: Any, path: str) -> UnsupportedValueError:
    """The error for a value nothing here can save, with a hint at what to do."""
    kind = type(value)
    if (value if isinstance(value, type) else kind).__module__.split(".")[0] == "omegaconf":
        hint = "save plain hyper-parameters: self.save_hyperparameters(OmegaConf.to_container(cfg, resolve=True))"
    elif isinstance(value, type):
        hint = "store its name (a str) and look the class up yourself when loading"
    else:
        hint = ("convert it in on_save_checkpoint / state_dict, or keep it out of the hyper-parameters with "
                "self.save_hyperparameters(ignore=[...])")
    return UnsupportedValueError(
        f"cannot save the Lightning checkpoint value at '{path}': type {kind.__module__}.{kind.__qualname__} is "
        "not a tensor, None, bool, int, float, str, bytes, list, tuple, dict, set, frozenset, pathlib path, "
        f"torch.dtype or torch.device, and shardsafe never pickles. Store a plain value there instead: {hint}."
    )


def _decode(value: Any, move: Callable[[torch.Tensor], torch.Tensor], tags: bool) -> Any:
    if isinstance(value, torch.Tensor):
        return move(value)
    if isinstance(value, dict):
        if tags and len(value) == 1:
            ((tag, payload),) = value.items()
            if isinstance(tag, str) and tag in _TAGS:
                try:
                    return _TAGS[tag](payload, move)
                except (TypeError, ValueError, AttributeError, RuntimeError) as exc:
                    raise CorruptCheckpointError(f"bad Lightning value {tag}: {exc}") from None
        return {k: _decode(v, move, tags) for k, v in value.items()}
    if type(value) is list:
        return [_decode(v, move, tags) for v in value]
    if type(value) is tuple:
        return tuple(_decode(v, move, tags) for v in value)
    return value


def _decode_path(payload: Any) -> pathlib.PurePath:
    name, text = payload
    if name not in _PATH_TYPES or not isinstance(text, str):
        raise ValueError(f"not a pathlib path: {payload!r}")
    try:
        return getattr(pathlib, name)(text)
    except NotImplementedError:  # e.g. a WindowsPath read on Linux: keep the pure path
        return (pathlib.PureWindowsPath if "Windows" in name else pathlib.PurePosixPath)(text)


def _decode_dtype(payload: Any) -> torch.dtype:
    # looked up among torch's dtype attributes only: a name never makes getattr import anything
    dtypes = {name: v for name, v in vars(torch).items() if isinstance(v, torch.dtype)}
    if not isinstance(payload, str) or payload not in dtypes:
        raise ValueError(f"not a torch dtype: {payload!r}")
    return dtypes[payload]


def _decode_items(payload: Any, move: Callable[[torch.Tensor], torch.Tensor]) -> dict[Any, Any]:
    out = {}
    for key, value in payload:
        out[_decode(key, move, True)] = _decode(value, move, True)
    return out


_TAGS: dict[str, Callable[[Any, Callable[[torch.Tensor], torch.Tensor]], Any]] = {
    "$literal": lambda p, move: {k: _decode(v, move, True) for k, v in p.items()},
    "$items": _decode_items,
    "$set": lambda p, move: {_decode(v, move, True) for v in p},
    "$frozenset": lambda p, move: frozenset(_decode(v, move, True) for v in p),
    "$path": lambda p, move: _decode_path(p),
    "$dtype": lambda p, move: _decode_dtype(p),
    "$device": lambda p, move: torch.device(p),
}


def tensor_mapper(map_location: MapLocation) -> Callable[[torch.Tensor], torch.Tensor]:
    """What ``map_location`` (as ``torch.load`` takes it) does to one loaded CPU tensor:
    None keeps it on the CPU; a device (str, int, torch.device) moves it there; a dict
    maps the location ``"cpu"``; a callable is called as ``fn(storage, "cpu")`` and its
    storage (None: unchanged) holds the tensor."""
    if map_location is None:
        return lambda t: t
    if isinstance(map_location, (str, int, torch.device)):
        device = torch.device(map_location)
        return lambda t: t.to(device)
    if isinstance(map_location, Mapping):
        target = map_location.get("cpu")
        return tensor_mapper(target) if target is not None else (lambda t: t)
    if callable(map_location):
        def move(t: torch.Tensor) -> torch.Tensor:
            storage = map_location(t.untyped_storage(), "cpu")
            if storage is None:
                return t
            out = torch.empty(0, dtype=t.dtype, device=storage.device)
            return out.set_(storage, t.storage_offset(), t.size(), t.stride())

        return move
    raise TypeError(f"unsupported map_location {map_location!r}")


# ------------------------------------------------------------------ the CheckpointIO

_SOLO: dict[int, tuple[Any, Any]] = {}  # id(world group) -> (world group, this rank's one-process group)


def _solo_group() -> Any:
    """None without a multi-process job; else a one-process gloo group of this rank (made
    once), since Lightning calls CheckpointIO saves on global rank 0 alone."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    world = dist.group.WORLD
    cached = _SOLO.get(id(world))
    if cached is None or cached[0] is not world:
        group = dist.new_group([dist.get_rank()], backend="gloo", use_local_synchronization=True)
        cached = _SOLO[id(world)] = (world, group)
    return cached[1]


class ShardsafeCheckpointIO(CheckpointIO):
    """Lightning checkpoints as shardsafe folders: ``Trainer(plugins=[ShardsafeCheckpointIO()])``.

    ``async_save``: return once the state is staged in host memory and write it in the
    background (one save in flight; errors surface at the next save, load or teardown).
    ``verify``: check every checksum on load. ``checkpointer``: a shardsafe Checkpointer to
    use (default: one owned by this plugin, released at teardown)."""

    def __init__(self, *, async_save: bool = False, verify: bool = True,
                 checkpointer: Checkpointer | None = None, compression: str = "off") -> None:
        from ..ops.compression import check_choice

        self.compression = check_choice(compression)  # "off", "auto", "zstd", "lz4" (see shardsafe.save)
        self.async_save = async_save
        self.verify = verify
        self._given = checkpointer
        self._own: Checkpointer | None = None
        self._pending_path: str | None = None

    @property
    def checkpointer(self) -> Checkpointer:
        """The shardsafe Checkpointer this plugin saves and loads with."""
        if self._given is not None:
            return self._given
        if self._own is None:
            self._own = Checkpointer()
        return self._own

    def save_checkpoint(self, checkpoint: dict[str, Any], path: PathLike, storage_options: Any | None = None) -> None:
        """Save Lightning's ``checkpoint`` dict as a shardsafe checkpoint folder at ``path``,
        from this process alone (Lightning calls it on global rank 0). A checkpoint already
        there is replaced atomically: it stays intact until the new one is committed."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        self.write(to_storable(checkpoint), path, _solo_group())

    def write(self, state: dict[str, Any], path: PathLike, process_group: Any) -> None:
        """Save an already converted ``state`` at ``path`` (overwriting) on ``process_group``,
        sync or async as configured; every rank of the group calls it."""
        location = os.fspath(path)
        if self.async_save:
            self.checkpointer.async_save(state, location, overwrite=True, process_group=process_group,
                                         compression=self.compression)
            self._pending_path = os.path.abspath(location)
        else:
            self.checkpointer.save(state, location, overwrite=True, process_group=process_group,
                                   compression=self.compression)

    def load_checkpoint(self, path: PathLike, map_location: MapLocation = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's checkpoint dict from the shardsafe checkpoint at ``path`` (checksums
        verified), tensors as ``map_location`` says (default: CPU). ``weights_only`` is
        accepted and ignored: nothing is unpickled, whatever it says."""
        self.wait()
        tree = self.checkpointer.load_full(os.fspath(path), verify=self.verify)
        return from_storable(tree, map_location)

    def remove_checkpoint(self, path: PathLike) -> None:
        """Delete the checkpoint at ``path`` crash-safely (nothing when there is none). A
        symlink (``ModelCheckpoint(save_last="link")``) is unlinked, its target kept; anything
        else that is not a shardsafe checkpoint is refused with CheckpointError."""
        location = os.fspath(path)
        if self._pending_path == os.path.abspath(location):
            self.wait()
        backend, where = self.checkpointer.locate(location)
        parent, name = backend.split(where)
        with backend.open(parent) as folder:
            if folder.kind(name) == "other":  # a symlink: unlink it, keep its target
                folder.remove(name)
                return
        self.checkpointer.delete(location)

    def wait(self) -> None:
        """Block until the async save in flight (if any) has committed; raises its error."""
        self._pending_path = None
        self.checkpointer.wait()

    def teardown(self) -> None:
        """Wait for the async save in flight (raising its error) and release the
        Checkpointer this plugin owns (a later save makes a new one)."""
        self._pending_path = None
        own, self._own = self._own, None
        if own is not None:
            own.close()
        elif self._given is not None:
            self._given.wait()


# ------------------------------------------------------------------ model parallel


class ShardsafeModelParallelStrategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` (FSDP2 / tensor parallel through ``configure_model``) whose
    checkpoints are shardsafe folders: every rank saves the shards it owns (replicated
    values once), and a load reshards onto the current world size and layout.

    Lightning's plain ModelParallelStrategy bypasses CheckpointIO for sharded saves and for
    every load, so a ShardsafeCheckpointIO plugin alone cannot serve it. Pass options as
    ``checkpoint_io=ShardsafeCheckpointIO(...)`` (not in ``plugins``). Only
    ``save_distributed_checkpoint=True`` is supported: a sharded shardsafe checkpoint
    already loads on one process (``ShardsafeCheckpointIO().load_checkpoint``) and exports
    to one file (``shardsafe export``)."""

    def __init__(self, *args: Any, checkpoint_io: ShardsafeCheckpointIO | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError(f"{type(self).__name__} saves sharded checkpoints only "
                             "(save_distributed_checkpoint=False is not supported)")
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else ShardsafeCheckpointIO()

    @property
    def _io(self) -> ShardsafeCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, ShardsafeCheckpointIO):
            raise TypeError(f"{type(self).__name__} needs a ShardsafeCheckpointIO, not {type(io).__name__}")
        return io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: PathLike,
                        storage_options: Any | None = None) -> None:
        """Save Lightning's ``checkpoint`` dict (DTensor shards) at ``filepath`` on every rank
        (all ranks call it), replacing a checkpoint there atomically."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} takes no storage_options")
        path = self.broadcast(os.fspath(filepath))
        self._io.write(to_storable(checkpoint), path, None)

    def load_checkpoint(self, checkpoint_path: PathLike, weights_only: bool | None = None) -> dict[str, Any]:
        """Load model and optimizer shards from ``checkpoint_path`` in place (all ranks call
        it, whatever world size saved it) and return the rest of the checkpoint dict."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        path = self.broadcast(os.fspath(checkpoint_path))
        io = self._io
        io.wait()
        assert self.model is not None and self.lightning_module is not None
        strict = self.lightning_module.strict_loading
        model_sd = get_model_state_dict(self.model)
        optim_sds = [get_optimizer_state_dict(self.model, opt) for opt in self.optimizers]
        state: dict[str, Any] = {_MODEL: model_sd}
        if optim_sds:
            state[_OPTIMIZERS] = optim_sds
        io.checkpointer.load(state, path, strict=strict, verify=io.verify)
        set_model_state_dict(self.model, model_sd, options=StateDictOptions(strict=strict))
        for opt, osd in zip(self.optimizers, state.get(_OPTIMIZERS, [])):
            set_optimizer_state_dict(self.model, opt, optim_state_dict=_decode(osd, lambda t: t, True))
        saved = io.checkpointer.read_manifest(path, indexes=False).tree
        rest = [k for k in saved if k not in (_MODEL, _OPTIMIZERS)] if isinstance(saved, dict) else []
        return from_storable(io.checkpointer.load_full(path, rest, verify=io.verify) if rest else {})

    def teardown(self) -> None:
        """Lightning's teardown, then the checkpoint plugin's (waits for an async save)."""
        super().teardown()
        self.checkpoint_io.teardown()


__all__ = ["FORMAT_KEY", "ShardsafeCheckpointIO", "ShardsafeModelParallelStrategy", "from_storable",
           "tensor_mapper", "to_storable"]
