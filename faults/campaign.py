"""The fault campaign (issue 10): run every kind of fault against shardsafe, classify each
trial, print a markdown summary and write JSON (default ``bench-out/faults.json``).

    python -m faults.campaign                # the full run (1,000 flips, 200 ranges, 200 kills, ...)
    python -m faults.campaign --quick        # a few of each, for development
    python faults/campaign.py --flips 100 --only flips,hostile

Classes (faults.common): detected / loaded bitwise-correct (or, after a kill, the old or
new checkpoint intact) / silent wrong data / other exception / hang / destination touched
/ leftovers / torn or lost. Every column after the second must be 0. Not part of
``make test`` (tests/test_faults_quick.py runs a few trials of each kind).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faults.common import BAD, TITLES, Tally  # noqa: E402
from faults.context import Context  # noqa: E402

SECTIONS = ("flips", "ranges", "hostile", "kills", "failures", "concurrency", "controls", "exit")
FULL = {"flips": 1000, "ranges": 200, "kills": 200, "failures": 24, "rlimit": 24, "concurrent": 6,
        "concurrent_seconds": 3.0, "hostile_limit": None, "exit_runs": 50}
QUICK = {"flips": 40, "ranges": 16, "kills": 16, "failures": 2, "rlimit": 3, "concurrent": 2,
         "concurrent_seconds": 1.5, "hostile_limit": 40, "exit_runs": 2}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m faults.campaign", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="few trials of each kind (development)")
    p.add_argument("--flips", type=int, help="random single-bit flips (full: 1000)")
    p.add_argument("--ranges", type=int, help="byte-range damages (full: 200)")
    p.add_argument("--kills", type=int, help="SIGKILLed saves, manager saves and retention (full: 200)")
    p.add_argument("--failures", type=int, help="trials per injected-failure kind (full: 24; ENOSPC twice)")
    p.add_argument("--rlimit", type=int, help="saves under RLIMIT_FSIZE in a child (full: 24)")
    p.add_argument("--concurrent", type=int, help="concurrency trials, threads and processes each (full: 6)")
    p.add_argument("--concurrent-seconds", type=float, dest="concurrent_seconds",
                   help="length of one concurrency trial (full: 3)")
    p.add_argument("--hostile-limit", type=int, dest="hostile_limit",
                   help="run only the first N hostile cases (full: all; quick: a sample)")
    p.add_argument("--exit-runs", type=int, dest="exit_runs",
                   help="runs of each end-of-job variant on 4 ranks under torchrun (faults.exit_stress; full: 50)")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run (default all: {','.join(SECTIONS)})")
    p.add_argument("--seed", type=int, default=20240610, help="random seed")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before a probe counts as a hang")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "bench-out" / "faults.json"),
                   help="where to write the JSON report")
    args = p.parse_args(argv)
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    args.sections = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def run(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Run the chosen sections; returns the report (also what is written as JSON)."""
    from faults.concurrency import run_concurrency
    from faults.failures import run_failures
    from faults.hostile import cases, run_hostile
    from faults.kills import run_kills
    from faults.sections import run_controls, run_flips, run_ranges

    t0 = time.perf_counter()
    tally = Tally()
    ctx = Context.create(tally, timeout=args.timeout)
    report: dict[str, Any] = {"args": {k: v for k, v in vars(args).items() if k != "sections"},
                              "sections": args.sections, "machine": f"{platform.node()} {os.cpu_count()} CPUs"}
    try:
        needs_pools = {"flips", "ranges", "hostile", "controls"} & set(args.sections)
        if needs_pools:
            ctx.start_pools()
            ctx.checkpoints()
        else:
            ctx.solo.start()
        log(f"setup: {time.perf_counter() - t0:.1f} s")
        if "controls" in args.sections:
            report["controls"] = run_controls(ctx, args.seed)
            log(f"controls: {report['controls']['verdict']}")
        if "flips" in args.sections:
            run_flips(ctx, args.flips, args.seed)
            log(f"flips: {args.flips} in {tally.seconds['bit flips']:.0f} s")
        if "ranges" in args.sections:
            run_ranges(ctx, args.ranges, args.seed)
            log(f"ranges: {args.ranges} in {tally.seconds['range damage']:.0f} s")
        if "hostile" in args.sections:
            every = cases()
            limit = args.hostile_limit
            if args.quick and limit is not None:  # a spread-out sample rather than the first ones
                step = max(1, len(every) // limit)
                names = [c.name for c in every[::step]][:limit]
                hostile = run_hostile(ctx, only=names, exact=True)
            else:
                hostile = run_hostile(ctx, limit=limit)
            report["hostile"] = hostile
            report["hostile_rss"] = rss_bound(hostile)
            log(f"hostile: {len(hostile)} cases in {tally.seconds['hostile']:.0f} s")
        if "kills" in args.sections:
            run_kills(ctx, args.kills, args.seed)
            log(f"kills: {args.kills} in {tally.seconds['kills']:.0f} s")
        if "failures" in args.sections:
            run_failures(ctx, args.failures, args.rlimit, args.seed)
            log(f"injected failures in {tally.seconds['injected failures']:.0f} s")
        if "concurrency" in args.sections:
            run_concurrency(ctx, args.concurrent, args.concurrent_seconds, args.seed)
            log(f"concurrency in {tally.seconds['concurrency']:.0f} s")
        if "exit" in args.sections:  # issue 28: abnormal exits at the end of a job
            from faults.exit_stress import VARIANTS, stress

            report["exit"] = stress(list(VARIANTS), args.exit_runs, timeout=args.timeout, log=log)
            counted = [r for r in report["exit"].values() if r["expect_clean"]]
            log(f"exit: {sum(r['abnormal'] for r in counted)} abnormal of {sum(r['runs'] for r in counted)} runs "
                f"with shardsafe; torch alone (the control): "
                f"{sum(r['abnormal'] for r in report['exit'].values() if not r['expect_clean'])} abnormal")
    finally:
        report["pool_starts"] = {"4-rank": ctx.pool4.starts, "1-process": ctx.solo.starts}
        ctx.close()
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report.update(tally.to_json())
    report["table"] = tally.table()
    if "exit" in report:
        report["exit_abnormal"] = sum(r["abnormal"] for r in report["exit"].values() if r["expect_clean"])
        report["bad_total"] += report["exit_abnormal"]
    return report


def rss_bound(hostile: list[dict[str, Any]]) -> dict[str, Any]:
    """The peak RSS growth of the hostile cases (worst probe of each), as bounds: for the
    refused cases an absolute one (manifests under 1 MiB) and one per manifest byte (larger
    manifests); accepted cases grow with the value they load and are listed apart."""
    refused = [h for h in hostile if h["class"] != "loaded_ok"]
    accepted = [h for h in hostile if h["class"] == "loaded_ok"]
    small = [h for h in refused if h["manifest_bytes"] < (1 << 20)]
    large = [h for h in refused if h["manifest_bytes"] >= (1 << 20)]
    worst_small = max(small, key=lambda h: h["rss_kib"], default=None)
    worst_ratio = max(((h["rss_kib"] * 1024 / h["manifest_bytes"], h) for h in large), key=lambda r: r[0],
                      default=None)
    worst_abs = max(refused, key=lambda h: h["rss_kib"], default=None)
    worst_acc = max(accepted, key=lambda h: h["rss_kib"], default=None)

    def mib(h: dict[str, Any]) -> str:
        return f"{h['rss_kib'] / 1024:.1f} MiB ({h['case']}, {h['manifest_bytes'] / (1 << 20):.1f} MiB manifest)"

    parts = []
    if worst_small is not None:
        parts.append(f"refused cases: peak RSS growth <= {worst_small['rss_kib'] / 1024:.1f} MiB for the "
                     f"{len(small)} manifests under 1 MiB")
    if worst_ratio is not None:
        parts.append(f"<= {worst_ratio[0]:.1f} x the manifest's size for the {len(large)} larger ones "
                     f"(largest growth {mib(worst_abs) if worst_abs else '-'})")
    if worst_acc is not None:
        parts.append(f"accepted cases grow with the value they load: largest {mib(worst_acc)}")
    return {"statement": "; ".join(parts), "refused_small_max_kib": worst_small["rss_kib"] if worst_small else 0,
            "refused_large_max_ratio": round(worst_ratio[0], 2) if worst_ratio else None,
            "max_kib": max((h["rss_kib"] for h in hostile), default=0)}


def summary(report: dict[str, Any]) -> str:
    """The markdown summary printed at the end of a run."""
    lines = [f"## shardsafe fault campaign ({report['wall_s']:.0f} s wall)", "", report["table"], ""]
    bad = report["bad_total"]
    lines.append(f"bad trials ({', '.join(TITLES[c] for c in BAD)}): **{bad}**")
    if "hostile" in report:
        lines.append(f"hostile cases: {len(report['hostile'])}; {report['hostile_rss']['statement']}")
    if "controls" in report:
        lines.append(f"controls: {report['controls']['verdict']}")
    if "exit" in report:
        lines.append(f"end-of-job exits (4 ranks, torchrun): **{report['exit_abnormal']}** abnormal; "
                     + ", ".join(f"{n} {r['abnormal']}/{r['runs']}" for n, r in report["exit"].items()))
        for name, r in report["exit"].items():
            for ex in r["examples"][:2]:
                lines.append(f"- exit {name} run {ex['run']}: {'; '.join(ex['problems'])}")
    for ex in report["bad_examples"][:40]:
        probe = ex["probes"][0] if ex["probes"] else {}
        what = {k: v for k, v in ex.items() if k not in ("probes", "kind", "class")}
        lines.append(f"- {ex['kind']}: {ex['class']} — {probe.get('method')}: {str(probe.get('detail'))[:300]} "
                     f"({json.dumps(what)[:300]})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    report = run(args, log=lambda msg: print(msg, file=sys.stderr, flush=True))
    text = summary(report)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1, default=str))
    print(f"\nJSON: {out}")
    return 1 if report["bad_total"] else 0


if __name__ == "__main__":
    sys.exit(main())
