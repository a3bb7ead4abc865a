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

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return box[0]

    def agree(self, error: BaseException | None, digest: int | None = None, what: str = "") -> None:
        """Raise the same CheckpointError on every rank when any rank had an error.

        Plain tensor collectives, no object pickling, O(1) bytes per rank either way: one
        all-reduce (MIN) finds the lowest failing rank (and, when ``digest`` is given,
        checks that every rank passed the same 64-bit digest, e.g. of the manifest it
        read); only on failure does that rank broadcast its error description (at most
        STATUS_BYTES)."""
        if not self.distributed:
            if error is not None:
                raise error
            return
        import torch

        device = self._device()
        d = 0 if digest is None else digest & ((1 << 64) - 1)
        hi, lo = d >> 32, d & 0xFFFFFFFF
        vals = torch.tensor([self.world if error is None else self.rank, hi, lo, -hi, -lo], dtype=torch.int64,
                            device=device)
        dist.all_reduce(vals, op=dist.ReduceOp.MIN, group=self.group)
        first, min_hi, min_lo, neg_max_hi, neg_max_lo = (int(v) for v in vals.cpu())
        if first >= self.world:
            if digest is not None and (min_hi != -neg_max_hi or min_lo != -neg_max_lo):
                raise CheckpointError(f"ranks read different manifests{what} (was the checkpoint replaced while "
                                      "it was being loaded?)")
            return
        buf = _encode(describe(error, self.rank) if self.rank == first and error is not None else None).to(device)
        dist.broadcast(buf, src=dist.get_global_rank(self.group, first), group=self.group)
        found = _decode(buf.cpu())
        if found is not None:
            raise rebuild(found) from error
        raise CheckpointError(f"rank {first} failed") from error

    def same(self, value: int) -> bool:
        """True when every rank passed the same 64-bit ``value`` (one all-reduce)."""
        if not self.distributed:
            return True
        import torch

        d = value & ((1 << 64) - 1)
        hi, lo = d >> 32, d & 0xFFFFFFFF
        vals = torch.tensor([hi, lo, -hi, -lo], dtype=torch.int64, device=self._device())
        dist.all_reduce(vals, op=dist.ReduceOp.MIN, group=self.group)
        a, b, c, e = (int(v) for v in vals.cpu())
        return a == -c and b == -e

    def broadcast_tensor(self, t: Any, src: int) -> None:
        """Group rank ``src``'s ``t`` into ``t`` on every rank (contiguous tensors in place,
        others through a contiguous copy)."""
        if not self.distributed:
            return
        root = dist.get_global_rank(self.group, src)
        if t.is_contiguous():
            dist.broadcast(t, src=root, group=self.group)
            return
        tmp = t.contiguous()
        dist.broadcast(tmp, src=root, group=self.group)
        if self.rank != src:
            t.copy_(tmp)

    def share_tensor(self, t: Any, owner: int, members: tuple[int, ...]) -> int:
        """Group rank ``owner``'s ``t`` into ``t`` on the other ``members`` (a broadcast when
        every rank is a member, else point-to-point sends); ranks outside ``members`` must
        not call it. Returns the bytes this rank received."""
        if not self.distributed or len(members) < 2:
            return 0
        if len(members) == self.world:
            self.broadcast_tensor(t, owner)
            return 0 if self.rank == owner else t.numel() * t.element_size()
        buf = t if t.is_contiguous() else t.contiguous()
        if self.rank == owner:
            for m in members:
                if m != owner:
                    dist.send(buf, dst=dist.get_global_rank(self.group, m), group=self.group)
            return 0
        dist.recv(buf, src=dist.get_global_rank(self.group, owner), group=self.group)
        if buf is not t:
            t.copy_(buf)
        return t.numel() * t.element_size()

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data`` on every rank (two tensor all-gathers, no pickle)."""
        if not self.distributed:
            return [data]
        import torch

        dev = self._device()
        sizes = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=dev), group=self.group)
        n = [int(x.item()) for x in sizes]
        width = max(max(n), 1)
        mine = torch.zeros(width, dtype=torch.uint8, device=dev)
        if data:
            mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(width, dtype=torch.uint8, device=dev) for _ in range(self.world)]
        dist.all_gather(out, mine, group=self.group)
        return [bytes(o[:k].cpu().numpy().tobytes()) for o, k in zip(out, n, strict=True)]

    def gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """Every rank's int64 ``values`` (the same count on every rank) on rank 0, None
        elsewhere: one fixed-size tensor gather, no pickle."""
        if not self.distributed:
            return [list(values)]
        import torch

        dev = self._device()
        mine = torch.tensor(values, dtype=torch.int64, device=dev)
        out = [torch.empty_like(mine) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(mine, out, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if out is None:
            return None
        return torch.stack(out).cpu().tolist()

    def all_max(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's int64 ``values`` (the same count on
        every rank), on every rank: one all-reduce, no pickle."""
        if not self.distributed or not values:
            return list(values)
        import torch

        buf = torch.tensor(values, dtype=torch.int64, device=self._device())
        dist.all_reduce(buf, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in buf.cpu()]

    def broadcast_bytes(self, data: bytes | None, src: int) -> bytes:
        """Group rank ``src``'s ``data`` on every rank (two tensor broadcasts, no pickle)."""
        if not self.distributed:
            assert data is not None
            return data
        import torch

        dev = self._device()
        root = dist.get_global_rank(self.group, src)
        size = torch.tensor([len(data) if self.rank == src and data is not None else 0], dtype=torch.int64,
                            device=dev)
        dist.broadcast(size, src=root, group=self.group)
        n = int(size.item())
        if self.rank == src:
            assert data is not None
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev) if n else \
                torch.zeros(0, dtype=torch.uint8, device=dev)
        else:
            buf = torch.empty(n, dtype=torch.uint8, device=dev)
        if n:
            dist.broadcast(buf, src=root, group=self.group)
        return data if self.rank == src and data is not None else bytes(buf.cpu().numpy().tobytes())

    def broadcast_ints(self, values: list[int] | None, count: int) -> list[int]:
        """Rank 0's ``count`` int64 values on every rank (a plain tensor broadcast)."""
        if not self.distributed:
            assert values is not None
            return list(values)
        import torch

        buf = torch.tensor(values if self.rank == 0 else [0] * count, dtype=torch.int64, device=self._device())
        dist.broadcast(buf, src=dist.get_global_rank(self.group, 0), group=self.group)
        return [int(v) for v in buf.cpu()]

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


def destroy_groups(groups: list[Any]) -> None:
    """Destroy process groups this process created (``dist.new_group``), each once, while
    the interpreter is whole: shut down (their gloo worker threads joined) and removed from
    torch's registry. Groups torch no longer knows (the user already called
    ``dist.destroy_process_group()``, which shut every group down) are left alone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    from torch.distributed import distributed_c10d as c10d

    for group in groups:
        if group is not None and group in c10d._world.pg_map:
            dist.destroy_process_group(group)
