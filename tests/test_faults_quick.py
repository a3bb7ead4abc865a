"""A few trials of each kind of the fault campaign (faults/), so ``make test`` exercises its
code: damaged checkpoints loaded on 4 ranks and one process, hostile manifests, SIGKILLed
saves, injected storage failures, concurrent saves and loads, and the negative controls
that prove the classifier sees what it must. Every trial must land in a good class.

The defects the full campaign found (all fixed) are reproduced by faults/repro_defects.py;
each runs here as a regression test: it fails if its defect comes back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faults import repro_defects  # noqa: E402
from faults.campaign import parse, summary  # noqa: E402
from faults.common import Tally  # noqa: E402
from faults.context import Context  # noqa: E402

HOSTILE_SAMPLE = [
    "nesting: tree 100k arrays", "int: $int of 2M digits", "int: plain literal of 5000 digits",
    "duplicate key: tensor entry", "NaN: chunk column", "lone surrogate: file name \\ud800",
    "shape: product overflow", "checksum_block: 0", "chunks: byte range aliases another tensor",
    "file name: parent escape", "special file: data file is a fifo", "special file: manifest is a symlink",
    "version: 4.0", "trailer: a second trailer after it", "header: length prefix 2^63",
    "header: dtype code differs", "members: unknown top-level member (accepted)",
    # issue 22's classes: bound arithmetic in Python ints, one typed-value decoder for every reader
    "blocks: 8 tensors of 2^61 bytes at checksum_block 1 (2^64 blocks, 0 mod 2^64), no digests",
    "tags: $tuple not a list", "tags: $dict duplicate keys", "index: rank false",
]


@pytest.fixture(scope="module")
def ctx():
    context = Context.create(Tally(), timeout=90)
    try:
        context.start_pools()
        context.checkpoints()
        yield context
    finally:
        context.close()


@pytest.fixture(autouse=True)
def fresh_tally(request):
    """Each test counts its own trials."""
    if "ctx" in request.fixturenames:
        request.getfixturevalue("ctx").tally = Tally()


def assert_no_bad(tally: Tally) -> None:
    bad = tally.bad_total()
    assert bad == 0, summary({"wall_s": 0, "table": tally.table(), "bad_total": bad, "bad_examples": tally.bad})


@pytest.mark.timeout(300)
def test_controls_are_classified_as_bad(ctx):
    from faults.sections import run_controls

    got = run_controls(ctx, 1)
    assert got["got"] == got["expected"], got


@pytest.mark.timeout(300)
def test_flips_and_range_damage(ctx):
    from faults.damage import RANGE_KINDS
    from faults.sections import run_flips, run_ranges

    run_flips(ctx, 6, 1)
    run_ranges(ctx, 2 * len(RANGE_KINDS), 1)
    assert_no_bad(ctx.tally)
    assert sum(ctx.tally.kinds["bit flip (fsdp)"].values()) == 3


@pytest.mark.timeout(300)
def test_hostile_sample(ctx):
    from faults.hostile import cases, run_hostile

    names = {c.name for c in cases()}
    assert set(HOSTILE_SAMPLE) <= names
    report = run_hostile(ctx, only=HOSTILE_SAMPLE, exact=True)
    assert len(report) == len(HOSTILE_SAMPLE)
    assert_no_bad(ctx.tally)
    assert max(r["rss_kib"] for r in report) < 256 * 1024


@pytest.mark.timeout(300)
def test_kills(ctx):
    from faults.kills import KINDS, run_kills

    run_kills(ctx, 6, 1)
    assert_no_bad(ctx.tally)
    assert all(any(kind in k for k in ctx.tally.kinds) for kind, _ in KINDS)


@pytest.mark.timeout(300)
def test_injected_failures(ctx):
    from faults.failures import run_failures

    run_failures(ctx, 1, 1, 1)
    assert_no_bad(ctx.tally)
    assert any("RLIMIT_FSIZE" in k for k in ctx.tally.kinds)


@pytest.mark.timeout(300)
def test_concurrent_saves_and_loads(ctx):
    from faults.concurrency import run_concurrency

    run_concurrency(ctx, 1, 1.0, 1)
    assert_no_bad(ctx.tally)
    assert any(k.startswith("concurrent processes") for k in ctx.tally.kinds)


def test_command_line():
    args = parse(["--quick", "--only", "flips,kills"])
    assert args.sections == ["flips", "kills"] and args.flips == 40
    full = parse([])
    assert (full.flips, full.ranges, full.kills) == (1000, 200, 200)


@pytest.mark.parametrize("name", sorted(repro_defects.REPROS))
def test_defect_found_by_the_campaign_stays_fixed(name, tmp_path):
    reproduced, evidence = repro_defects.REPROS[name](tmp_path)
    assert not reproduced, evidence
