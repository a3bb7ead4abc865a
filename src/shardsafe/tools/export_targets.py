"""The writers of ``shardsafe export``'s targets: :class:`Fetcher` (each tensor of the
export, read in batches), :func:`write_file` (one ``torch.save`` or ``.safetensors`` file)
and :func:`write_dcp` (a ``torch.distributed.checkpoint`` folder written by DCP itself with
a writer of our own). The Hugging Face folder is :mod:`shardsafe.hf_folder`'s; what to
export and in which order is :mod:`shardsafe.tools.export`'s."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..engine.outputs import OutputFile, Slot, tensor_bytes, torch_save_frame
from ..errors import CheckpointError
from ..format.dtypes import NAME_ITEMSIZE
from ..ops.reader import CheckpointReader
from .common import DCP_EMPTY_DICTS, Output, UsageError


class Fetcher:
    """Hands out each slot's tensor (converted to the slot's dtype), reading the slots of a
    planned batch together on the first request for one of them and keeping the others
    until they are asked for; a request outside the current batch drops what is left of it,
    so at most one batch is held: at most ``batch_bytes`` (a larger tensor alone). ``read``
reads a batch's tensors (export's ``read_tensors``)."""

    def __init__(self, reader: CheckpointReader, read: Callable[[CheckpointReader, list[str]], list[torch.Tensor]],
                 batch_bytes: int, advance: Callable[[int], None] | None = None) -> None:
        self.reader = reader
        self.read = read
        self.batch_bytes = batch_bytes
        self.advance = advance
        self._batch_of: dict[int, list[Slot]] = {}
        self._ready: dict[int, torch.Tensor] = {}
        self._given: set[int] = set()

    def held_bytes(self, s: Slot) -> int:
        """What slot ``s`` holds while it waits in a batch: its saved bytes (or its converted
        bytes, when larger)."""
        entry = self.reader.manifest.tensors[s.key]
        return max(s.nbytes, s.nbytes // max(1, s.dtype.itemsize) * NAME_ITEMSIZE.get(entry.dtype, 1))

    def plan(self, groups: list[list[Slot]]) -> None:
        """Read the slots of each group together, in consecutive batches of at most
        ``batch_bytes`` held (a larger tensor alone)."""
        for group in groups:
            batch: list[Slot] = []
            size = 0
            for s in group:
                n = self.held_bytes(s)
                if batch and size + n > self.batch_bytes:
                    batch, size = [], 0
                batch.append(s)
                size += n
                self._batch_of[id(s)] = batch

    def __call__(self, s: Slot) -> torch.Tensor:
        t = self._ready.pop(id(s), None)
        if t is None:
            self._ready.clear()
            batch = [b for b in self._batch_of.get(id(s), [s]) if id(b) not in self._given]
            if not any(b is s for b in batch):
                batch = [s]  # asked for again: read it alone
            tensors = self.read(self.reader, [b.key for b in batch])
            self._ready = {id(b): x for b, x in zip(batch, tensors)}
            t = self._ready.pop(id(s))
        self._given.add(id(s))
        if t.dtype != s.dtype:
            t = t.to(s.dtype)
        if self.advance is not None:
            self.advance(s.nbytes)
        return t


def write_file(open_output: Callable[[], OutputFile], slots: list[Slot],
                fetch: Callable[[Slot], torch.Tensor]) -> None:
    """Open one output file, read each slot's tensor (converted if asked) and write it."""
    out = open_output()
    try:
        for s in slots:
            t = fetch(s)
            out.write(s, t)
            del t
        out.close()
    except BaseException:
        out.abort()
        raise


def dcp_empty_dicts(state: dict[Any, Any]) -> list[tuple[str | int, ...]]:
    """The DCP object paths (``str`` keys, ``int`` list positions) of the empty dicts that
    ``torch.distributed.checkpoint`` would drop from ``state``: those its traversal reaches
    (not inside a list it pickles whole, which keeps them)."""

    def terminal(v: Any) -> bool:  # as torch.distributed.checkpoint._traverse: pickled whole
        if isinstance(v, dict):
            return False
        if not isinstance(v, list):
            return True
        return all(not isinstance(e, torch.Tensor) and (not isinstance(e, (dict, list)) or terminal(e)) for e in v)

    out: list[tuple[str | int, ...]] = []

    def visit(path: tuple[str | int, ...], v: Any) -> None:
        if isinstance(v, dict):
            if not v and path:
                out.append(path)
            for k, x in v.items():
                visit(path + (str(k),), x)
        elif not terminal(v) and isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                visit(path + (i,), x)

    visit((), state)
    return out


def dcp_groups(items: list[Any], batch_bytes: int) -> list[list[Any]]:
    """DCP write items in consecutive groups of at most ``batch_bytes`` tensor bytes (a
    larger tensor alone; plain values, already in memory, count nothing)."""
    groups: list[list[Any]] = []
    size = 0
    for item in items:
        n = 0
        if item.tensor_data is not None:
            n = item.tensor_data.properties.dtype.itemsize
            for d in item.tensor_data.size:
                n *= d
        if groups and size + n <= batch_bytes:
            groups[-1].append(item)
            size += n
        else:
            groups.append([item])
            size = n
    return groups


def _dcp_file(folder: Any, name: str, items: list[Any], planner: Any) -> list[Any]:
    """Write DCP write items ``items`` as file ``name`` of ``folder`` (fsync'd), each at its
    offset as DCP's ``FileSystemWriter`` writes it (a plain value: the bytes DCP's planner
    pickled; a tensor: the ``torch.save`` stream of it, made from a cached frame); returns
    DCP's ``WriteResult`` for each, which its ``.metadata`` records."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult

    results = []
    parts: list[Any] = []
    pos = 0
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            pieces = [data.getbuffer()]
        else:
            if data.requires_grad or not (data.is_cpu and data.is_contiguous()):
                data = data.detach().cpu().contiguous()
            before, after = torch_save_frame(data.dtype, tuple(data.shape))
            pieces = [memoryview(before), tensor_bytes(data), memoryview(after)]
        n = sum(len(x) for x in pieces)
        results.append(WriteResult(index=item.index, size_in_bytes=n, storage_data=_StorageInfo(name, pos, n)))
        parts.extend(x for x in pieces if len(x))
        pos += n
    handle = folder.create(name)
    try:
        handle.write(parts, 0)
        handle.finish(True)
    except BaseException:
        handle.abort()
        raise
    return results


def write_dcp(target: Output, skeleton: Any, fetch: Fetcher) -> list[str]:
    """Write ``skeleton`` (Slots for tensors) as a DCP folder at the output's temporary
    path with ``torch.distributed.checkpoint.save`` (no process group): DCP plans from
    meta-tensor stand-ins; its ``FileSystemWriter`` writes one file per group of
    consecutive items (``dcp_groups``), each fsync'd, and the tensors of a group are read
    together when DCP asks for the first of them."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.futures import Future

    if not isinstance(skeleton, dict):
        raise UsageError("--to dcp needs a dict at the top of the exported state (choose --strip accordingly)")
    slots: dict[int, Slot] = {}

    def stand_in(node: Any) -> Any:
        if isinstance(node, Slot):
            t = torch.empty(node.shape, dtype=node.dtype, device="meta")
            slots[id(t)] = node
            return t
        if isinstance(node, dict):
            return {k: stand_in(v) for k, v in node.items()}
        if isinstance(node, tuple) and any(isinstance(v, (Slot, dict, list, tuple)) for v in node):
            return [stand_in(v) for v in node]  # DCP pickles tuples whole: walk it as a list
        if isinstance(node, (list, tuple)):
            return type(node)(stand_in(v) for v in node)
        return node

    state = stand_in(skeleton)
    empties = dcp_empty_dicts(state)

    class _Planner(DefaultSavePlanner):
        def resolve_data(self, write_item: Any) -> Any:
            obj = self.lookup_object(write_item.index)
            slot = slots.get(id(obj))
            return super().resolve_data(write_item) if slot is None else fetch(slot)

        def create_global_plan(self, all_plans: Any) -> Any:
            plans, metadata = super().create_global_plan(all_plans)
            if empties:  # DCP keeps no empty dict: their paths ride in planner_data (import restores them)
                metadata.planner_data[DCP_EMPTY_DICTS] = empties
            return plans, metadata

    class _Writer(FileSystemWriter):
        """DCP's writer with its file layout (``.metadata`` written by DCP; each item a
        ``torch.save`` stream, or DCP's pickled bytes, at an offset of a ``.distcp`` file),
        but one file per group of items (``dcp_groups``), fsync'd, its tensors read together,
        and each tensor's ``torch.save`` stream made from a cached frame
        (:func:`~shardsafe.engine.outputs.torch_save_frame`) instead of one ``torch.save``
        call per tensor (~0.1 ms each)."""

        def write_data(self, plan: Any, planner: Any) -> Any:
            results: list[Any] = []
            prefix = plan.storage_data.prefix
            with target.folder() as folder:
                for i, items in enumerate(dcp_groups(plan.items, fetch.batch_bytes)):
                    fetch.plan([[slots[id(obj)] for obj in (planner.lookup_object(item.index) for item in items)
                                 if id(obj) in slots]])
                    results.extend(_dcp_file(folder, f"{prefix}{i}.distcp", items, planner))
            done: Future = Future()
            done.set_result(results)
            return done

    with target.folder():
        pass  # created here, filled by DCP's writer
    writer = _Writer(target.local_path(), sync_files=True)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "no process group: saving on this rank alone"
            dcp_save(state, storage_writer=writer, planner=_Planner(), no_dist=True)
    except CheckpointException as exc:  # DCP wraps what its writer raised: a corrupt chunk is ours to report
        inner = [e for e, _ in exc.failures.values()]
        if len(inner) == 1 and isinstance(inner[0], (CheckpointError, OSError, KeyboardInterrupt)):
            raise inner[0] from None
        raise
    with target.folder() as folder:
        folder.sync()
        return sorted(folder.names())
