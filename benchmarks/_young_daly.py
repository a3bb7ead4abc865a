"""Expected lost work and time to recover for a 16,384-GPU job, with and without the local
tier, from bench_recovery's measured costs (Young/Daly interval).

Model (one row per setup): a job of ``GPUS`` ranks, one failure every ``MTBF`` seconds,
``BYTES_PER_RANK`` of training state per rank (a 405B-parameter run's ~5.7 TB over 16,384
GPUs). The measured per-rank costs are scaled by bytes per rank (the benchmark's ranks
hold ~174 MB each). For each setup:

- C: training time lost per checkpoint (the blocking time of the async save, measured);
- W: the background write of one checkpoint (saves cannot overlap, so the interval is at
  least W): bytes per rank / the store's bandwidth per rank; for the local tier, the
  measured local save + replication;
- interval tau = max(sqrt(2 C MTBF), W) (Young/Daly);
- R: time to restore (persistent: the throttled load, scaled by bandwidth; local: 75% of
  failures are a process restart (DLRover's figure) restored from the node's own folder,
  25% a lost node restored from peers);
- lost work per failure: tau / 2 (recomputed steps, on average) + R;
- overhead: C / tau + (tau / 2 + R) / MTBF of the job's time (the local tier also pays
  one persistent save per hour as a backstop); GPU-hours lost per day = overhead x 24 x GPUS.

The time to relaunch processes and rebuild the process group is the same in every setup
and left out.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

GPUS = 16_384
MTBF = 3 * 3600.0  # one failure every 3 hours (Llama 3 405B: 419 in 54 days on 16,384 GPUs)
BYTES_PER_RANK = 5.7e12 / GPUS
PROCESS_RESTART_SHARE = 0.75  # DLRover: ~75% of faults needed only a process restart
BENCH_BPS = 200e6  # the benchmark's throttled persistent store, per rank
STORES = [("persistent only, store at 200 MB/s per rank (3.3 TB/s in all)", 200e6),
          ("persistent only, store at 2 TB/s in all (122 MB/s per rank)", 2e12 / GPUS),
          ("persistent only, store at 100 GB/s in all (6.1 MB/s per rank)", 100e9 / GPUS)]
BACKSTOP = 3600.0  # the local tier's persistent saves: one per hour


def _row(name: str, c: float, w: float, r: float, extra: float = 0.0) -> tuple[list[str], float]:
    tau = max(math.sqrt(2 * c * MTBF), w)
    lost = tau / 2 + r
    overhead = c / tau + lost / MTBF + extra
    return [name, f"{c:.2f}", f"{w:.1f}", f"{tau:.0f}", f"{r:.1f}", f"{lost:.0f}", f"{100 * overhead:.2f}%",
            f"{overhead * 24 * GPUS:,.0f}"], overhead


def table(m: dict[str, float]) -> str:
    """The markdown table from measured medians: ``bytes_per_rank`` (the benchmark's),
    ``async_block``, ``local_block``, ``local_total`` (save + replication), ``slow_s``
    (throttled persistent load at BENCH_BPS), ``crash_s`` and ``peers_s`` (seconds)."""
    from _common import md_table

    s = BYTES_PER_RANK / m["bytes_per_rank"]
    c_p = m["async_block"] * s
    rows = []
    for name, bps in STORES:
        rows.append(_row(name, c_p, BYTES_PER_RANK / bps, m["slow_s"] * s * BENCH_BPS / bps)[0])
    r_local = (PROCESS_RESTART_SHARE * m["crash_s"] + (1 - PROCESS_RESTART_SHARE) * m["peers_s"]) * s
    backstop = c_p / BACKSTOP  # the hourly persistent save's cost; its restores (every copy lost) are rare
    row, _ = _row("local tier every tau (+ one persistent save per hour, any store)", m["local_block"] * s,
                  m["local_total"] * s, r_local, backstop)
    rows.append(row)
    head = ["setup", "C: s lost per save", "W: s to write one", "interval tau (s)", "R: restore (s)",
            "lost per failure (s)", "overhead", "GPU-h lost / day"]
    return md_table(head, rows, "lrrrrrrr")


def measured(res: dict[str, Any]) -> dict[str, float]:
    """bench_recovery's JSON results reduced to the medians :func:`table` takes."""
    from _common import median

    reps = res["reps"]

    def med(k: str) -> float:
        return median([max(x[k] for x in r) for r in reps])

    return {"bytes_per_rank": sum(res["local_bytes"]) / len(res["local_bytes"]), "async_block": med("async_block"),
            "local_block": med("local_block"), "local_total": med("local_total"), "slow_s": med("slow_s"),
            "crash_s": med("crash_s"), "peers_s": med("peers_s")}


if __name__ == "__main__":  # python benchmarks/_young_daly.py bench-out/bench_recovery.json
    print(table(measured(json.loads(open(sys.argv[1]).read()))))
