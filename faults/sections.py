"""The damage sections: bit flips and byte-range damage over every file of both
checkpoints, each damaged copy loaded on 4 ranks and on one process and verified."""

from __future__ import annotations

import random
import time
from typing import Any

from .context import Context
from .damage import RANGE_KINDS, flip, range_damage


def run_flips(ctx: Context, n: int, seed: int) -> None:
    """``n`` single-bit flips, alternating between the two checkpoints."""
    rng = random.Random(seed)
    ckpts = list(ctx.checkpoints().values())
    t0 = time.perf_counter()
    for i in range(n):
        ck = ckpts[i % len(ckpts)]
        damage = flip(ck, rng)
        try:
            probes = ctx.probe(ck, damage.errors)
        finally:
            ck.restore(damage.touched)
        ctx.tally.add(f"bit flip ({ck.name})", probes, trial=i, **damage.info)
    ctx.tally.seconds["bit flips"] += time.perf_counter() - t0


def run_ranges(ctx: Context, n: int, seed: int) -> None:
    """``n`` byte-range damages, cycling through the kinds and the two checkpoints."""
    rng = random.Random(seed + 1)
    ckpts = list(ctx.checkpoints().values())
    t0 = time.perf_counter()
    for i in range(n):
        ck = ckpts[(i // len(RANGE_KINDS)) % len(ckpts)]
        kind = RANGE_KINDS[i % len(RANGE_KINDS)]
        damage = range_damage(ck, rng, kind)
        try:
            probes = ctx.probe(ck, damage.errors)
        finally:
            ck.restore(damage.touched)
        ctx.tally.add(f"range: {kind}", probes, trial=i, **damage.info)
    ctx.tally.seconds["range damage"] += time.perf_counter() - t0


def run_controls(ctx: Context, seed: int) -> dict[str, Any]:
    """Negative controls (not counted in the table): the classifier must see silent wrong
    data in a ``verify=False`` load of flipped data, a destination written by a failing
    load, a leaked descriptor, a hang, and a torn checkpoint after a kill."""
    from .common import HANG, LEFTOVERS, SILENT, TORN, TOUCHED, seq_state
    from .pool import Failure

    ck = ctx.checkpoints()["single"]
    lo, hi, _ = next(r for r in ck.regions[ck.files[1]] if r[2] == "big")
    path = ck.work / ck.files[1]
    with open(path, "r+b") as f:
        f.seek((lo + hi) // 2)
        byte = f.read(1)[0]
        f.seek((lo + hi) // 2)
        f.write(bytes([byte ^ 0x40]))
    try:
        unverified = ctx.probe(ck, [], ranks=False, verify=False)
    finally:
        ck.restore({ck.files[1]})
    got = {"verify=False load of flipped data": [p["cls"] for p in unverified]}
    expect = {"verify=False load of flipped data": [SILENT, SILENT]}
    probes = ctx.solo.run("faults.sections:control_probes", timeout=60)
    got.update(probes[0] if not isinstance(probes, Failure) else {"probes": probes.detail})
    expect.update({"load that writes then fails": TOUCHED, "load that leaks a descriptor": LEFTOVERS})
    hang = ctx.solo.run("faults.sections:control_sleep", 30, timeout=2)
    got["probe that sleeps past its timeout"] = HANG if isinstance(hang, Failure) and hang.kind == "hang" else "?"
    expect["probe that sleeps past its timeout"] = HANG
    kill_root = ctx.root / "control-kill"
    kill_root.mkdir(exist_ok=True)
    import shardsafe

    shardsafe.save(seq_state(3), kill_root / "ckpt")
    torn = ctx.solo.run("faults.kills:check_save", str(kill_root / "ckpt"), [5, 6], 9, timeout=60)
    got["path holding another state than allowed"] = torn[0][0]["cls"] if not isinstance(torn, Failure) else "?"
    expect["path holding another state than allowed"] = TORN
    verdict = "every control classified as expected" if got == expect else "A CONTROL WAS MISCLASSIFIED"
    return {"verdict": verdict, "got": got, "expected": expect}


def control_probes(rank: int, world: int) -> dict[str, Any]:
    """Run in the 1-process pool: fake loads that misbehave on purpose."""
    import torch

    from shardsafe.errors import CorruptCheckpointError

    from .probes import try_load

    dest = {"t": torch.zeros(4)}

    def writes_then_fails() -> None:
        dest["t"][1] = 5.0
        raise CorruptCheckpointError("control")

    kept: list[Any] = []

    def leaks() -> None:
        kept.append(open(__file__, "rb"))  # noqa: SIM115 - leaked on purpose
        raise CorruptCheckpointError("control")

    out = {"load that writes then fails": try_load("control", writes_then_fails, dest, None,
                                                   (CorruptCheckpointError,))["cls"],
           "load that leaks a descriptor": try_load("control", leaks, None, None, (CorruptCheckpointError,))["cls"]}
    for f in kept:
        f.close()
    return out


def control_sleep(rank: int, world: int, seconds: float) -> None:
    time.sleep(seconds)
