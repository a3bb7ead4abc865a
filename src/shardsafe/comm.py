"""The few collectives a save or load needs, and agreement on errors across ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from . import errors as _errors
from .errors import CheckpointError


@dataclass
class Comm:
    """A process group (or none: one process) with this rank's place in it."""

    group: Any
    rank: int
    world: int

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world > 1

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if not self.distributed:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        dist.gather_object(obj, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None) -> None:
        """Raise the same CheckpointError on every rank when any rank had an error.

        Plain tensor collectives, no object pickling: one all-reduce of a flag when every
        rank succeeded (the common case), and an all-gather of the error descriptions
        only when one failed (the lowest failing rank's error is raised everywhere)."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        import torch

        device = self._device()
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        if int(flag.item()) == 0:
            return
        mine = _encode(None if error is None else describe(error, self.rank), ERROR_BYTES).to(device)
        bufs = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(bufs, mine, group=self.group)
        found = [d for d in (_decode(b.cpu()) for b in bufs) if d is not None]
        if found:
            raise rebuild(found[0]) from error

    def _device(self) -> str:
        """Where this group's collectives need their tensors (NCCL: the current GPU)."""
        if dist.get_backend(self.group) == "nccl":
            import torch

            return f"cuda:{torch.cuda.current_device()}"
        return "cpu"

    def broadcast_status(self, status: tuple[str, str] | None) -> tuple[str, str] | None:
        """Rank 0's status (None = success, else an error description) on every rank.

        A plain tensor broadcast (not an object collective): the description travels as
        at most STATUS_BYTES of UTF-8."""
        if not self.distributed:
            return status
        buf = _encode(status if self.rank == 0 else None).to(self._device())
        dist.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group)
        return _decode(buf.cpu())


STATUS_BYTES = 4096
ERROR_BYTES = 64 << 10  # error descriptions gathered only when a rank failed


def _encode(status: tuple[str, str] | None, size: int = STATUS_BYTES) -> Any:
    """A status as a ``size``-byte uint8 tensor: byte 0 says whether there is one, then
    "name\nmessage" in UTF-8 (cut to fit)."""
    import torch

    buf = torch.zeros(size, dtype=torch.uint8)
    if status is not None:
        data = f"{status[0]}\n{status[1]}".encode()[: size - 1]
        buf[0] = 1
        buf[1: 1 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return buf


def _decode(buf: Any) -> tuple[str, str] | None:
    """The inverse of :func:`_encode`."""
    if int(buf[0]) == 0:
        return None
    text = bytes(buf[1:].numpy()).rstrip(b"\0").decode("utf-8", "replace")
    name, _, message = text.partition("\n")
    return name, message


def describe(error: BaseException, rank: int) -> tuple[str, str]:
    """A picklable (class name, message) naming the rank where it happened."""
    name = type(error).__name__ if isinstance(error, CheckpointError) else "CheckpointError"
    text = str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"
    return name, f"rank {rank}: {text}"


def rebuild(desc: tuple[str, str]) -> CheckpointError:
    """The CheckpointError (subclass by name, else the base class) that ``describe`` described."""
    name, message = desc
    cls = getattr(_errors, name, CheckpointError)
    if not (isinstance(cls, type) and issubclass(cls, CheckpointError)):
        cls = CheckpointError
    return cls(message)


def resolve(process_group: Any = None) -> Comm:
    """The group to use: the given one, else the world group when initialized, else none."""
    if process_group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return Comm(None, 0, 1)
        process_group = dist.group.WORLD
    return Comm(process_group, dist.get_rank(process_group), dist.get_world_size(process_group))
