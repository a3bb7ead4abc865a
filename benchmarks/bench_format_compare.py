"""Format 3.0 against format 2.0 on real processes: ``bench_distributed.py`` run from this
tree and from the last commit that wrote format 2.0, alternately, in the same run.

    .venv/bin/python benchmarks/bench_format_compare.py [--rounds N] [--base REF] [--full]

The base commit is checked out into a temporary git worktree; each round runs both trees'
``bench_distributed.py`` (``--quick`` unless ``--full``; one timed repetition each), in an
order that alternates from round to round, with ``PYTHONPATH`` pointing at that tree's
``src`` (the spawned ranks inherit it). Reported: the median over rounds of the FSDP2
world-4 save and load seconds of shardsafe in each format, their ratio (3.0 / 2.0; below
1.0 is faster), and DCP's times as the same run's control.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BASE = "98d6641"  # the last commit whose saves write format 2.0


def run_tree(tree: Path, out: Path, full: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    cmd = [sys.executable, str(tree / "benchmarks" / "bench_distributed.py"), "--reps", "1", "--out", str(out)]
    if not full:
        cmd.append("--quick")
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, timeout=3600)
    return json.loads(out.read_text())


def times(res: dict) -> dict[str, float]:
    rep = res["fsdp"]["reps"][0]
    return {"save_ss": rep["save"]["shardsafe"]["seconds"], "load_ss": rep["load"]["shardsafe"]["seconds"],
            "save_dcp": rep["save"]["dcp"]["seconds"], "load_dcp": rep["load"]["dcp"]["seconds"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--base", default=BASE)
    ap.add_argument("--full", action="store_true", help="bench_distributed's full model instead of --quick")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="shardsafe-format2-") as tmp:
        base = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", str(base), args.base], cwd=REPO, check=True,
                       capture_output=True)
        try:
            got: dict[str, list[dict[str, float]]] = {"3.0": [], "2.0": []}
            for i in range(args.rounds):
                order = [("3.0", REPO), ("2.0", base)]
                for label, tree in order if i % 2 == 0 else reversed(order):
                    got[label].append(times(run_tree(tree, Path(tmp) / f"{label}-{i}.json", args.full)))
                    print(f"round {i + 1} {label}: {got[label][-1]}", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=REPO, capture_output=True)
    med = {label: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for label, rows in got.items()}
    print(f"\nFSDP2 world 4 ({'full' if args.full else 'quick'} model), median of {args.rounds} alternating rounds "
          "(3.0 runs first in the odd rounds, 2.0 in the even ones: use an even count):")
    for op in ("save", "load"):
        new, old = med["3.0"][f"{op}_ss"], med["2.0"][f"{op}_ss"]
        ratios = [a[f"{op}_ss"] / b[f"{op}_ss"] for a, b in zip(got["3.0"], got["2.0"])]
        print(f"  {op}: format 3.0 {new:.3f} s, format 2.0 {old:.3f} s, ratio {new / old:.3f}; per round "
              f"{', '.join(f'{r:.2f}' for r in ratios)} "
              f"(DCP in the same runs: {med['3.0'][f'{op}_dcp']:.3f} s / {med['2.0'][f'{op}_dcp']:.3f} s)")


if __name__ == "__main__":
    main()
