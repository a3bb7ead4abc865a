"""The rule budget (issue 22 section 2; docs/format.md, limits): a reader's work on rules
grows with what it has really read (the manifest, the rows of verified file indexes), never
with sizes or counts a manifest claims. Hostile checkpoints are crafted from the committed
format-3.0 FSDP x TP checkpoint (mesh [2, 2], four files) and re-sealed; the work bound is
checked by counting the dim partitions cut (none, for every refusal here)."""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from math import prod
from pathlib import Path

import pytest

import shardsafe
from shardsafe.errors import CorruptCheckpointError
from shardsafe.format.rules import (
    RULE_SLACK,
    Mesh,
    Rule,
    allowance,
    dim_bound,
    dim_partition,
    free_boxes,
    parse_placement,
    rule_problem,
)
from shardsafe.tools.verify import verify_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from faults.hostile import ASSET3 as ASSET  # noqa: E402
from faults.hostile import craft_rules  # noqa: E402


def craft(tmp: Path, **kw: object) -> Path:
    """A crafted copy of the asset (faults.hostile.craft_rules, the campaign's own cases)."""
    craft_rules(tmp / "ck", **kw)
    return tmp / "ck"


def verified(path: Path) -> None:
    """verify_checkpoint, its first problem raised as a CorruptCheckpointError."""
    report = verify_checkpoint(path, progress=False)
    if report.problems:
        raise CorruptCheckpointError(report.problems[0].what)


def readers(path: Path) -> list[Callable[[], object]]:
    return [lambda: verified(path), lambda: shardsafe.load_full(path), lambda: shardsafe.read_manifest(path)]


def refused_without_cutting(path: Path, match: str) -> None:
    """Every reader raises CorruptCheckpointError matching ``match`` and cuts no dim."""
    for read in readers(path):
        dim_partition.cache_clear()
        with pytest.raises(CorruptCheckpointError, match=match):
            read()
        assert dim_partition.cache_info().misses == 0


def test_the_asset_loads(tmp_path):
    path = craft(tmp_path, dtype="float32")  # re-sealed, unchanged
    shardsafe.load_full(path)
    verified(path)


def test_stated_index_sizes_do_not_back_rules(tmp_path):
    # Issue 22 s2: world 2^20, strided factors 2^20 on a [2^21, 2^21] tensor (2^42 boxes) with
    # index_bytes 2^40 hung in dim_partition; an index of 2^40 bytes lists at most 2^36 rows.
    path = craft(tmp_path, dtype="uint8", shape=[1 << 21, 1 << 21], placements=[["SS", 0, 1 << 20], ["SS", 1, 1 << 20]],
                 world=1 << 20, index_bytes=1 << 40)
    refused_without_cutting(path, "rules claim more chunks than the manifest allows")


def test_a_lying_index_size_is_caught_by_a_bounded_read(tmp_path):
    # Stated 2^50 bytes: the parse cannot refuse the 2^42 boxes, so the index is read (at most
    # the stated size plus one byte) before any rule is cut, and its real size refuses it.
    path = craft(tmp_path, dtype="uint8", shape=[1 << 21, 1 << 21], placements=[["SS", 0, 1 << 20], ["SS", 1, 1 << 20]],
                 world=1 << 20, index_bytes=1 << 50)
    for read in readers(path)[:2]:
        dim_partition.cache_clear()
        with pytest.raises(CorruptCheckpointError, match="does not match the manifest"):
            read()
        assert dim_partition.cache_info().misses == 0


def test_a_padded_index_does_not_back_millions_of_boxes(tmp_path):
    # Issue 22 s2: a real 1 MiB index (padded) and a rule of 2^24 boxes: 45 s and 3.5 GiB
    # before. 1 MiB lists at most 2^16 rows: refused at the parse.
    path = craft(tmp_path, shape=[4096, 4096], placements=[["SS", 0, 2048], ["SS", 1, 2048]], world=1 << 20,
                 pad_to=1 << 20)
    refused_without_cutting(path, "rules claim more chunks than the manifest allows")


def test_rules_beyond_the_free_allowance_are_counted_in_real_rows(tmp_path):
    # 360,000 boxes: beyond the work pool of the manifest (2^16 + 16 per byte), fewer than the
    # allowance and an 8 MiB index could list; the real index lists a few dozen rows, counted
    # before anything is cut (56 tensors: at most 56 distinct rules).
    manifest_bytes = (ASSET / "manifest.json").stat().st_size
    assert free_boxes(manifest_bytes) < 600 * 600 < allowance(56) + (8 << 20) // 16
    path = craft(tmp_path, shape=[600, 600], placements=[["SS", 0, 512], ["SS", 1, 512]], world=1 << 20,
                 pad_to=8 << 20)
    refused_without_cutting(path, "rows its file indexes list")


def test_an_index_rank_of_false_is_refused(tmp_path):
    path = craft(tmp_path, index_edit=lambda raw: raw.replace(b'"rank":0,', b'"rank":false,', 1))
    for read in readers(path):
        with pytest.raises(CorruptCheckpointError, match="index of rank False, the manifest says 0"):
            read()


def test_dim_partition_work_is_its_bound():
    # A dim of 2^60 positions cut by factors of 2^10: the work is the 2^11 pieces, not n.
    levels = ((2, ("SS", 0, 1 << 10)),)
    part = dim_partition(1 << 60, levels)
    assert len(part.starts) == dim_bound(1 << 60, levels) == 1 << 11
    # Fewer positions than pieces: no empty piece is made.
    assert len(dim_partition(3, ((4, ("SS", 0, 1 << 20)), (8, ("S", 0)))).starts) <= 3


def test_the_writer_keeps_only_rules_the_budget_backs():
    rng = random.Random(22)
    for _ in range(300):
        ndim = rng.randint(1, 3)
        shape = tuple(rng.randint(1, 3000) for _ in range(ndim))
        mesh_shape = tuple(rng.choice([1, 2, 3, 4, 8]) for _ in range(rng.randint(1, 3)))
        world = 1 << 20
        placements = [rng.choice([["R"], ["S", rng.randrange(ndim)], ["SS", rng.randrange(ndim), rng.randint(1, 64)]])
                      for _ in mesh_shape]
        problem = rule_problem(shape, placements, mesh_shape, world)
        rule = Rule(shape, Mesh(mesh_shape, tuple(range(prod(mesh_shape)))),
                    tuple(parse_placement(p, ndim, world) for p in placements))
        slack = rule.count_bound() - rule.count()
        assert (problem is None) == (slack <= RULE_SLACK), (shape, mesh_shape, placements, problem)
    assert rule_problem((20, 2), [["SS", 0, 13]], (4,), 4) is not None  # a factor above the world size
    assert "above its" in rule_problem((2100,), [["S", 0]], (2048,), 1 << 20)  # bound 2048, 1050 boxes

