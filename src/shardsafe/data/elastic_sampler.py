"""A sampler whose position is global, so a job can resume on a different world size.

Semantics (what the docs promise):

* **One global order per epoch.** For epoch ``e`` the whole job visits the dataset in the
  order ``torch.randperm(dataset_len, generator=g)`` where ``g`` is a CPU
  ``torch.Generator`` seeded with ``(seed * 1_000_003 + e) % 2**64``; with
  ``shuffle=False`` the order is ``0, 1, ..., dataset_len - 1``. The order depends only on
  ``(seed, epoch, dataset_len, shuffle)``, never on the world size or rank.
* **Global batches.** The order is cut into consecutive global batches of
  ``global_batch_size`` samples. With ``drop_last=True`` a final partial global batch is
  dropped; with ``drop_last=False`` it is kept.
* **Each rank takes a contiguous part of every global batch.** With ``W`` ranks each rank
  gets ``b = global_batch_size // W`` samples (the global batch must divide by ``W``):
  rank ``r`` gets positions ``r*b ... r*b + b - 1`` of the global batch. A final partial
  global batch of ``p`` samples (``drop_last=False``) is split as evenly as possible, in
  rank order: with ``q, m = divmod(p, W)``, ranks ``0 .. m-1`` get ``q + 1`` samples and
  the others ``q`` (so some ranks may get none when ``p < W``); rank ``r``'s part starts at
  position ``r*q + min(r, m)``. Ranks then see batches of different sizes in that last
  step — a loop that must run the same collectives on every rank should use
  ``drop_last=True``.
* **The position is global.** The state is how many samples of the current epoch the
  whole job has *consumed* (a multiple of ``global_batch_size``, or the epoch's end), plus
  the epoch and seed. It holds no rank and no world size, so it is the same on every rank
  (a replicated value) and a job saved on N ranks resumes on M ranks at the same place in
  the same global sequence: no sample repeated, none skipped. The global batch size is
  part of the sequence and must stay the same (see :func:`shardsafe.data.keep_global_batch`
  for keeping it by changing gradient accumulation).
* **Consumed means taken by the training loop.** A DataLoader with workers iterates the
  sampler ahead of the loop (prefetch), so the sampler cannot tell what was trained on.
  The loop tells it: call :meth:`ElasticSampler.advance` once after each optimizer step.
  A checkpoint taken after step ``k`` then resumes at global batch ``k``, whatever the
  DataLoader had prefetched.

A training loop::

    sampler = ElasticSampler(len(dataset), global_batch_size=256, seed=1234)
    accum = keep_global_batch(256, world_size, micro_batch=8)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=4)
    state = {"model": model, "optim": optim, "sampler": sampler}
    load_if_any(state)                           # restores epoch and position
    for epoch in range(sampler.epoch, num_epochs):
        sampler.set_epoch(epoch)                 # keeps a restored mid-epoch position
        micro_batches = iter(loader)             # starts at the sampler's position now
        for step_batches in zip(*[micro_batches] * accum):
            ...                                  # forward/backward each micro-batch, then optim.step()
            sampler.advance()                    # one global batch consumed
            maybe_save(state)

Each rank's part of a global batch is contiguous, so ``accum`` consecutive micro-batches of
``global_batch_size // (world_size * accum)`` samples make up exactly that part.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Sampler

__all__ = ["ElasticSampler"]

_SEED_MULTIPLIER = 1_000_003
_SEED_MODULUS = 1 << 64
_STATE_KEYS = ("seed", "epoch", "consumed", "global_batch_size", "dataset_len", "shuffle", "drop_last")
_CHUNK = 1 << 16  # indices converted to Python ints at a time while iterating


def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__qualname__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__qualname__}")
    return value


class ElasticSampler(Sampler[int]):
    """Yields this rank's indices of a fixed global sample order; its state is global.

    Args:
        dataset_len: number of samples in the dataset (``>= 0``).
        global_batch_size: samples per optimizer step over all ranks (``>= 1``); must be
            divisible by ``world_size`` (``ValueError`` naming both otherwise).
        rank, world_size: this process's place in the job; each defaults to
            torch.distributed's when a default process group is initialized, else 0 / 1.
        seed: seeds the global order of every epoch (any int).
        shuffle: permute the order each epoch; ``False`` keeps ``0 .. dataset_len - 1``.
        drop_last: drop the epoch's final partial global batch; ``False`` keeps it,
            split across ranks as described in the module docs.

    ``iter(sampler)`` yields, from the position at the moment ``iter`` is called to the end
    of the epoch, this rank's part of each remaining global batch in order; ``len(sampler)``
    is the number of indices it would yield. Use it with
    ``DataLoader(dataset, batch_size=global_batch_size // world_size, sampler=sampler)``
    (or a smaller micro-batch dividing that, with gradient accumulation); the sampler is
    iterated in the main process, so any ``num_workers`` works.

    The training loop must call :meth:`advance` after each optimizer step and
    :meth:`set_epoch` to move to the next epoch; the sampler never advances by itself.
    """

    def __init__(
        self,
        dataset_len: int,
        global_batch_size: int,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        self._dataset_len = _check_int("dataset_len", dataset_len, 0)
        self._global_batch_size = _check_int("global_batch_size", global_batch_size, 1)
        distributed = dist.is_available() and dist.is_initialized()
        if world_size is None:
            world_size = dist.get_world_size() if distributed else 1
        if rank is None:
            rank = dist.get_rank() if distributed else 0
        self._world_size = _check_int("world_size", world_size, 1)
        self._rank = _check_int("rank", rank, 0)
        if self._rank >= self._world_size:
            raise ValueError(f"rank {self._rank} is out of range for world size {self._world_size}")
        if self._global_batch_size % self._world_size:
            raise ValueError(
                f"global batch size {self._global_batch_size} is not divisible by world size {self._world_size}: "
                "every rank must take an equal part of each global batch; keep the global batch and choose a "
                "world size that divides it (see shardsafe.data.keep_global_batch)"
            )
        self._seed = _check_int("seed", seed)
        self._shuffle = _check_bool("shuffle", shuffle)
        self._drop_last = _check_bool("drop_last", drop_last)
        self._epoch = 0
        self._consumed = 0

    # ------------------------------------------------------------------ properties
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def dataset_len(self) -> int:
        return self._dataset_len

    @property
    def global_batch_size(self) -> int:
        return self._global_batch_size

    @property
    def per_rank_batch_size(self) -> int:
        """Samples this rank takes from each full global batch (``global_batch_size // world_size``)."""
        return self._global_batch_size // self._world_size

    @property
    def seed(self) -> int:
        return self._seed

    @property
    def shuffle(self) -> bool:
        return self._shuffle

    @property
    def drop_last(self) -> bool:
        return self._drop_last

    @property
    def epoch(self) -> int:
        """The current epoch."""
        return self._epoch

    @property
    def consumed(self) -> int:
        """Samples of the current epoch consumed by the whole job (all ranks together)."""
        return self._consumed

    @property
    def epoch_samples(self) -> int:
        """Samples one epoch visits over all ranks: ``dataset_len``, less a dropped partial batch."""
        if self._drop_last:
            return self._dataset_len - self._dataset_len % self._global_batch_size
        return self._dataset_len

    @property
    def global_batches_per_epoch(self) -> int:
        """Global batches (optimizer steps) in one epoch, a final partial one included."""
        return -(-self.epoch_samples // self._global_batch_size)

    @property
    def global_batches_left(self) -> int:
        """Global batches of the current epoch not yet consumed."""
        return -(-(self.epoch_samples - self._consumed) // self._global_batch_size)

    # ------------------------------------------------------------------ the order
    def global_order(self, epoch: int | None = None) -> torch.Tensor:
        """The whole job's sample order for ``epoch`` (default: the current one), an int64 tensor.

        A permutation of ``range(dataset_len)`` that depends only on seed, epoch,
        dataset_len and shuffle. It includes any samples a ``drop_last`` drops at the end.
        """
        epoch = self._epoch if epoch is None else _check_int("epoch", epoch, 0)
        if not self._shuffle:
            return torch.arange(self._dataset_len, dtype=torch.int64)
        generator = torch.Generator()
        generator.manual_seed((self._seed * _SEED_MULTIPLIER + epoch) % _SEED_MODULUS)
        return torch.randperm(self._dataset_len, generator=generator, dtype=torch.int64)

    def _rank_indices(self, consumed: int, epoch: int) -> torch.Tensor:
        """This rank's indices from global position ``consumed`` to the end of ``epoch``."""
        g, w, r = self._global_batch_size, self._world_size, self._rank
        end = self.epoch_samples
        if consumed >= end:
            return torch.empty(0, dtype=torch.int64)
        order = self.global_order(epoch)
        b = g // w
        full_end = end - end % g
        parts = []
        if consumed < full_end:
            parts.append(order[consumed:full_end].view(-1, w, b)[:, r, :].reshape(-1))
        if end > full_end:  # the partial last global batch (drop_last=False), not yet consumed
            start, count = _tail_part(end - full_end, w, r)
            parts.append(order[full_end + start: full_end + start + count])
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def __iter__(self) -> Iterator[int]:
        # The position is read here, when iter() is called, not at the first next():
        # a DataLoader iterator created after load_state_dict / advance starts there.
        indices = self._rank_indices(self._consumed, self._epoch)
        return _yield_ints(indices)

    def __len__(self) -> int:
        """Indices this rank yields from the current position to the end of the epoch."""
        end = self.epoch_samples
        if self._consumed >= end:
            return 0
        g = self._global_batch_size
        full_end = end - end % g
        n = max(full_end - self._consumed, 0) // self._world_size
        if end > full_end:
            n += _tail_part(end - full_end, self._world_size, self._rank)[1]
        return n

    # ------------------------------------------------------------------ position
    def advance(self, global_batches: int = 1) -> None:
        """Record that the training loop consumed ``global_batches`` more global batches.

        Call it once after each optimizer step (every rank, the same number). Adds
        ``global_batches * global_batch_size`` to :attr:`consumed`, stopping at the end of
        the epoch (a final partial batch counts as one). Raises ``ValueError`` if fewer
        than ``global_batches`` global batches are left in the epoch: move on with
        :meth:`set_epoch`.
        """
        global_batches = _check_int("global_batches", global_batches, 0)
        left = self.global_batches_left
        if global_batches > left:
            raise ValueError(
                f"cannot advance {global_batches} global batches: epoch {self._epoch} has {left} left "
                f"({self._consumed} of {self.epoch_samples} samples consumed); call set_epoch(epoch + 1) "
                "to start the next epoch"
            )
        self._consumed = min(self._consumed + global_batches * self._global_batch_size, self.epoch_samples)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (consumed = 0).

        Setting the epoch the sampler is already in changes nothing: a loop written
        ``for epoch in range(sampler.epoch, n): sampler.set_epoch(epoch)`` resumes a restored
        mid-epoch position instead of restarting that epoch. To replay the current epoch
        from its start, call :meth:`rewind`.
        """
        epoch = _check_int("epoch", epoch, 0)
        if epoch != self._epoch:
            self._epoch = epoch
            self._consumed = 0

    def rewind(self) -> None:
        """Go back to the start of the current epoch (consumed = 0)."""
        self._consumed = 0

    # ------------------------------------------------------------------ Stateful
    def state_dict(self) -> dict[str, Any]:
        """The global position, identical on every rank; plain ints and bools (JSON-able).

        ``{"seed", "epoch", "consumed", "global_batch_size", "dataset_len", "shuffle",
        "drop_last"}``; no rank or world size, so it loads on any world size.
        """
        return {
            "seed": self._seed,
            "epoch": self._epoch,
            "consumed": self._consumed,
            "global_batch_size": self._global_batch_size,
            "dataset_len": self._dataset_len,
            "shuffle": self._shuffle,
            "drop_last": self._drop_last,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the saved global sequence, on this sampler's rank and world size.

        Takes the saved seed, epoch and consumed count. The saved ``dataset_len``,
        ``global_batch_size``, ``shuffle`` and ``drop_last`` define that sequence and must
        equal this sampler's: a difference raises ``ValueError`` naming the saved and the
        current value (nothing is changed then). Raises ``ValueError`` for a malformed state
        (missing or unexpected keys, wrong types, a consumed count that is not a position
        between global batches of the epoch).
        """
        self._seed, self._epoch, self._consumed = self.validate_state_dict(state_dict)

    def validate_state_dict(self, state_dict: dict[str, Any]) -> tuple[int, int, int]:
        """(seed, epoch, consumed) of ``state_dict`` when :meth:`load_state_dict` would take
        it; else the ``ValueError`` it would raise. Changes nothing (``shardsafe.load``
        calls it before any byte of a load lands)."""
        if not isinstance(state_dict, dict):
            raise ValueError(f"ElasticSampler state must be a dict, got {type(state_dict).__qualname__}")
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        unexpected = sorted(str(k) for k in state_dict if k not in _STATE_KEYS)
        if missing or unexpected:
            raise ValueError(f"ElasticSampler state has missing keys {missing} and unexpected keys {unexpected}")
        try:
            seed = _check_int("seed", state_dict["seed"])
            epoch = _check_int("epoch", state_dict["epoch"], 0)
            consumed = _check_int("consumed", state_dict["consumed"], 0)
            saved_g = _check_int("global_batch_size", state_dict["global_batch_size"], 1)
            saved_len = _check_int("dataset_len", state_dict["dataset_len"], 0)
            shuffle = _check_bool("shuffle", state_dict["shuffle"])
            drop_last = _check_bool("drop_last", state_dict["drop_last"])
        except TypeError as e:
            raise ValueError(f"malformed ElasticSampler state: {e}") from None

        if saved_len != self._dataset_len:
            raise ValueError(
                f"saved sampler state is for a dataset of {saved_len} samples, but this sampler's dataset_len is "
                f"{self._dataset_len}: the global sample order would differ"
            )
        if saved_g != self._global_batch_size:
            raise ValueError(
                f"saved sampler state has global batch size {saved_g}, but this sampler's is "
                f"{self._global_batch_size}: keep the global batch when resuming (change the micro-batch or "
                "gradient accumulation instead, see shardsafe.data.keep_global_batch)"
            )
        for name, saved, current in (("shuffle", shuffle, self._shuffle), ("drop_last", drop_last, self._drop_last)):
            if saved != current:
                raise ValueError(
                    f"saved sampler state has {name}={saved}, but this sampler has {name}={current}: "
                    "the global sample sequence would differ"
                )
        end = self.epoch_samples
        if consumed > end or (consumed % saved_g and consumed != end):
            raise ValueError(
                f"malformed ElasticSampler state: consumed={consumed} is not a multiple of the global batch size "
                f"{saved_g} nor the epoch's end ({end} samples)"
            )
        return seed, epoch, consumed

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(dataset_len={self._dataset_len}, global_batch_size={self._global_batch_size}, "
            f"rank={self._rank}, world_size={self._world_size}, seed={self._seed}, shuffle={self._shuffle}, "
            f"drop_last={self._drop_last}, epoch={self._epoch}, consumed={self._consumed})"
        )


def _tail_part(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """(start, count) of ``rank``'s part of a partial global batch of ``size`` samples.

    Ranks below ``size % world_size`` get one sample more; parts follow in rank order.
    """
    q, m = divmod(size, world_size)
    return rank * q + min(rank, m), q + (1 if rank < m else 0)


def _yield_ints(indices: torch.Tensor) -> Iterator[int]:
    for chunk in indices.split(_CHUNK):
        yield from chunk.tolist()
