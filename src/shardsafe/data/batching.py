"""Keeping the global batch when the world size changes.

A job's global batch (samples per optimizer step, summed over all ranks) is part of its
training recipe: changing it changes the optimization. When a job resumes on a different
number of ranks, the global batch is kept by changing how it is split:

    global_batch == micro_batch * world_size * accum_steps

where ``micro_batch`` is what one rank feeds through one forward/backward pass and
``accum_steps`` is the number of gradient-accumulation passes per optimizer step. The two
functions here solve that equation for one unknown and raise a ``ValueError`` that says
what to choose instead when it has no integer solution. They never round, pad or change
the global batch.
"""

from __future__ import annotations

__all__ = ["keep_global_batch", "per_rank_batch"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__qualname__}")
    if value < 1:
        raise ValueError(f"{name} must be at least 1, got {value}")
    return value


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _nearest(candidates: list[int], target: int) -> list[int]:
    """The largest candidate below ``target`` and the smallest above it (those that exist)."""
    below = [c for c in candidates if c < target]
    above = [c for c in candidates if c > target]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def _or_list(values: list[int]) -> str:
    return " or ".join(str(v) for v in values)


def _advice(global_batch: int, world_size: int, factor: int, factor_text: str) -> str:
    """``"; choose ..."`` for ``global_batch == world_size * factor * x`` having no solution.

    ``factor`` is the fixed factor besides the world size (micro-batch or accumulation
    steps), ``factor_text`` names values of it ("micro-batch {}", "accumulation steps {}").
    Suggests the nearest values of that factor on this world size and the nearest world
    sizes with this value of it; failing both, world sizes that divide the global batch.
    """
    reason = ""
    choices = []
    if global_batch % world_size == 0:
        values = _nearest(_divisors(global_batch // world_size), factor)
        choices.append(f"{factor_text.format(_or_list(values))} on {world_size} ranks")
    elif factor > 1:
        reason = f", and {global_batch} is not divisible by {world_size} at all"
    if global_batch % factor == 0:
        worlds = _nearest(_divisors(global_batch // factor), world_size)
        choices.append(f"{_or_list(worlds)} ranks with {factor_text.format(factor)}")
    if not choices:
        worlds = _nearest(_divisors(global_batch), world_size)
        choices.append(f"a world size that divides {global_batch} (such as {_or_list(worlds)}) "
                       f"and {factor_text.format('x')} with x dividing its share")
    return f"{reason}; choose {'; or '.join(choices)}"


def keep_global_batch(global_batch: int, world_size: int, micro_batch: int) -> int:
    """The gradient-accumulation steps that keep ``global_batch`` on ``world_size`` ranks.

    Returns ``accum`` with ``micro_batch * world_size * accum == global_batch`` exactly.
    Raises ``ValueError`` when no such integer exists; the message names the three numbers
    and suggests the nearest micro-batches (on this world size) and the nearest world sizes
    (with this micro-batch) that would keep the global batch. Raises ``TypeError`` /
    ``ValueError`` for arguments that are not positive ints.

    >>> keep_global_batch(96, 4, 4)
    6
    """
    global_batch = _positive_int("global_batch", global_batch)
    world_size = _positive_int("world_size", world_size)
    micro_batch = _positive_int("micro_batch", micro_batch)
    per_step = micro_batch * world_size
    if global_batch % per_step == 0:
        return global_batch // per_step
    raise ValueError(
        f"global batch {global_batch} cannot be kept on {world_size} ranks with micro-batch {micro_batch}: "
        f"{global_batch} is not divisible by {per_step} ({micro_batch} x {world_size} ranks)"
        + _advice(global_batch, world_size, micro_batch, "micro-batch {}")
    )


def per_rank_batch(global_batch: int, world_size: int, accum_steps: int = 1) -> int:
    """The samples each rank feeds per forward pass so that ``global_batch`` is kept.

    Returns ``micro`` with ``micro * world_size * accum_steps == global_batch`` exactly; with
    ``accum_steps=1`` that is each rank's share of a global batch (the ``batch_size`` to give
    a DataLoader over an :class:`~shardsafe.data.ElasticSampler`). Raises ``ValueError``
    naming the numbers when ``global_batch`` is not divisible by ``world_size * accum_steps``,
    with the nearest accumulation steps / world sizes that would work. Raises ``TypeError`` /
    ``ValueError`` for arguments that are not positive ints.

    >>> per_rank_batch(96, 4, 2)
    12
    """
    global_batch = _positive_int("global_batch", global_batch)
    world_size = _positive_int("world_size", world_size)
    accum_steps = _positive_int("accum_steps", accum_steps)
    split = world_size * accum_steps
    if global_batch % split == 0:
        return global_batch // split
    raise ValueError(
        f"global batch {global_batch} cannot be split over {world_size} ranks with accumulation steps "
        f"{accum_steps}: {global_batch} is not divisible by {split} ({world_size} ranks x {accum_steps} steps)"
        + _advice(global_batch, world_size, accum_steps, "accumulation steps {}")
    )
