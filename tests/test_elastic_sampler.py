"""ElasticSampler (global data position, resume on any world size) and the batch helpers.

Ranks are simulated with ``rank=`` / ``world_size=`` arguments: the sampler needs no
process group, and what each rank yields depends only on (state, rank, world size). The
defaults taken from torch.distributed are checked on a real gloo group (sampler_cases.py).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import sampler_cases
import shardsafe
from shardsafe.data import ElasticSampler, keep_global_batch, per_rank_batch
from shardsafe.state.tree import is_stateful


def make_ranks(world: int, dataset_len: int, global_batch: int, **kw) -> list[ElasticSampler]:
    return [ElasticSampler(dataset_len, global_batch, rank=r, world_size=world, **kw) for r in range(world)]


def chunks(seq: list[int], size: int) -> list[list[int]]:
    return [seq[i: i + size] for i in range(0, len(seq), size)]


def take_global_batches(samplers: list[ElasticSampler], steps: int | None = None) -> list[list[int]]:
    """Run a simulated job: each step every rank takes its next per-rank batch (as a
    DataLoader with batch_size=global // world, drop_last=False would), the global batch is
    their concatenation in rank order, and every rank calls advance(). ``steps=None`` runs
    to the end of the epoch."""
    per_rank = [chunks(list(s), s.per_rank_batch_size) for s in samplers]
    n = max(len(p) for p in per_rank)
    if steps is not None:
        n = min(n, steps)
    batches = []
    for j in range(n):
        batches.append([i for p in per_rank for i in (p[j] if j < len(p) else [])])
        for s in samplers:
            s.advance()
    return batches


def through_json(state: dict) -> dict:
    return json.loads(json.dumps(state))


# ---------------------------------------------------------------------------- global order
def test_global_order_is_a_deterministic_permutation_per_seed_and_epoch():
    a = ElasticSampler(1000, 10, seed=7)
    b = ElasticSampler(1000, 10, seed=7, rank=3, world_size=5)  # rank / world play no part
    o0 = a.global_order(0)
    assert sorted(o0.tolist()) == list(range(1000))
    assert torch.equal(o0, b.global_order(0))
    assert torch.equal(o0, ElasticSampler(1000, 10, seed=7).global_order(0))
    o1 = a.global_order(1)
    assert sorted(o1.tolist()) == list(range(1000))
    assert not torch.equal(o0, o1)
    assert not torch.equal(o0, ElasticSampler(1000, 10, seed=8).global_order(0))
    # the documented formula, so an order can be reproduced without the library
    g = torch.Generator().manual_seed(7 * 1_000_003 + 1)
    assert torch.equal(o1, torch.randperm(1000, generator=g))
    # shuffle=False: identity order in every epoch
    plain = ElasticSampler(50, 10, shuffle=False)
    assert plain.global_order(0).tolist() == list(range(50)) == plain.global_order(3).tolist()
    # current epoch is the default
    a.set_epoch(1)
    assert torch.equal(a.global_order(), o1)


def test_huge_and_negative_seeds_work():
    for seed in (-5, 2**70):
        s = ElasticSampler(20, 4, seed=seed)
        assert sorted(s) == list(range(20))


def test_ranks_take_contiguous_parts_of_each_global_batch_in_order():
    world, g, n = 4, 12, 100
    ranks = make_ranks(world, n, g, seed=3)
    order = ranks[0].global_order().tolist()
    per_rank = [list(s) for s in ranks]
    assert all(len(p) == len(s) == 8 * 3 for p, s in zip(per_rank, ranks))  # 8 full batches, 3 each
    for j in range(8):
        parts = [p[j * 3: (j + 1) * 3] for p in per_rank]
        assert [i for part in parts for i in part] == order[j * g: (j + 1) * g]
    # drop_last=True: exactly the last 100 % 12 samples of the order are dropped
    seen = [i for p in per_rank for i in p]
    assert sorted(seen) == sorted(order[:96])
    assert set(order[96:]).isdisjoint(seen)


def test_world_one_yields_the_global_order():
    s = ElasticSampler(30, 5, seed=1, drop_last=False)
    assert list(s) == s.global_order().tolist()


# ---------------------------------------------------------------------------- resume
@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize(("saved_world", "new_world"), [(4, 2), (4, 3), (2, 4), (1, 6), (6, 1), (4, 4)])
def test_resume_on_another_world_size_continues_the_global_sequence(saved_world, new_world, drop_last):
    n, g, k = 100, 12, 3  # 8 full global batches, and a partial one of 4 when drop_last=False
    kw = dict(seed=11, drop_last=drop_last)

    # the uninterrupted run at the saved world size, over two epochs
    ref_ranks = make_ranks(saved_world, n, g, **kw)
    reference = take_global_batches(ref_ranks)
    assert len(reference) == (8 if drop_last else 9)
    for s in ref_ranks:
        s.set_epoch(1)
    reference += take_global_batches(ref_ranks)

    # the interrupted run: k steps, save, resume on new_world ranks
    ranks = make_ranks(saved_world, n, g, **kw)
    first = take_global_batches(ranks, k)
    assert first == reference[:k]
    states = [s.state_dict() for s in ranks]
    assert all(st == states[0] for st in states)  # a replicated value
    saved = through_json(states[0])
    assert saved == {"seed": 11, "epoch": 0, "consumed": k * g, "global_batch_size": g, "dataset_len": n,
                     "shuffle": True, "drop_last": drop_last}

    resumed = make_ranks(new_world, n, g, drop_last=drop_last)  # default seed: the saved one is taken
    for s in resumed:
        s.load_state_dict(saved)
    rest = take_global_batches(resumed)
    for s in resumed:
        s.set_epoch(1)
    rest += take_global_batches(resumed)
    assert first + rest == reference  # no sample repeated, none skipped, same batches


def test_resume_through_shardsafe_save_and_load(tmp_path):
    ranks = make_ranks(4, 100, 12, seed=5)
    expected = take_global_batches(make_ranks(4, 100, 12, seed=5))[2:]
    take_global_batches(ranks, 2)
    assert is_stateful(ranks[0])
    shardsafe.save({"sampler": ranks[0]}, tmp_path / "ckpt")
    resumed = make_ranks(3, 100, 12)
    for s in resumed:
        shardsafe.load({"sampler": s}, tmp_path / "ckpt")
    assert resumed[0].state_dict() == ranks[0].state_dict()
    assert take_global_batches(resumed) == expected


def test_resume_at_the_end_of_an_epoch_then_next_epoch():
    ranks = make_ranks(2, 40, 8, seed=2, drop_last=False)  # 5 global batches exactly
    take_global_batches(ranks)
    saved = through_json(ranks[0].state_dict())
    assert saved["consumed"] == 40
    (one,) = make_ranks(1, 40, 8, drop_last=False)
    one.load_state_dict(saved)
    assert len(one) == 0 and list(one) == []
    one.set_epoch(1)
    assert list(one) == one.global_order(1).tolist()


# ---------------------------------------------------------------------------- DataLoader
class CountingSampler(ElasticSampler):
    """Counts the indices a DataLoader drew from it (to prove prefetching happened)."""

    drawn = 0

    def __iter__(self):
        for i in super().__iter__():
            self.drawn += 1
            yield i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_dataloader_resume_ignores_prefetched_batches(num_workers):
    n, g, world, k = 64, 8, 2, 3
    b = g // world
    ids = TensorDataset(torch.arange(n))
    kw = dict(seed=9, drop_last=True)
    reference = [chunks(list(s), b) for s in make_ranks(world, n, g, **kw)]  # per rank, per step
    assert len(reference[0]) == 8

    states = []
    for rank in range(world):
        sampler = CountingSampler(n, g, rank=rank, world_size=world, **kw)
        loader = DataLoader(ids, batch_size=b, sampler=sampler, num_workers=num_workers)
        it = iter(loader)
        got = []
        for _ in range(k):
            (batch,) = next(it)
            got.append(batch.tolist())
            sampler.advance()  # the loop took one global batch
        assert got == reference[rank][:k]
        if num_workers:
            assert sampler.drawn > k * b  # workers had fetched ahead of the loop
        states.append(through_json(sampler.state_dict()))
        del it, loader
    assert states[0] == states[1] and states[0]["consumed"] == k * g

    # same world size: each rank continues with its own next batches
    for rank in range(world):
        sampler = ElasticSampler(n, g, rank=rank, world_size=world, drop_last=True)
        sampler.load_state_dict(states[0])
        loader = DataLoader(ids, batch_size=b, sampler=sampler, num_workers=num_workers)
        assert len(loader) == 8 - k
        assert [batch.tolist() for (batch,) in loader] == reference[rank][k:]

    # one rank: the global batches themselves continue
    single = ElasticSampler(n, g, drop_last=True)
    single.load_state_dict(states[0])
    loader = DataLoader(ids, batch_size=g, sampler=single, num_workers=num_workers)
    expected = [reference[0][j] + reference[1][j] for j in range(k, 8)]
    assert [batch.tolist() for (batch,) in loader] == expected


def test_dataloader_iterator_starts_at_the_position_when_created():
    ids = TensorDataset(torch.arange(40))
    sampler = ElasticSampler(40, 4, seed=4)
    loader = DataLoader(ids, batch_size=4, sampler=sampler)
    full = [batch.tolist() for (batch,) in loader]
    sampler.advance(3)
    assert [batch.tolist() for (batch,) in loader] == full[3:]
    # an iterator already created keeps its start; a new one starts at the new position
    it = iter(sampler)
    sampler.advance(2)
    assert list(it) == [i for batch in full[3:] for i in batch]
    assert list(sampler) == [i for batch in full[5:] for i in batch]


def test_micro_batches_with_gradient_accumulation_make_up_the_rank_part():
    n, g, world, micro = 96, 24, 3, 4
    accum = keep_global_batch(g, world, micro)
    assert accum == 2 and per_rank_batch(g, world, accum) == micro
    ids = TensorDataset(torch.arange(n))
    parts = [chunks(list(s), g // world) for s in make_ranks(world, n, g, seed=6)]
    for rank in range(world):
        sampler = ElasticSampler(n, g, rank=rank, world_size=world, seed=6)
        micro_batches = [batch.tolist() for (batch,) in DataLoader(ids, batch_size=micro, sampler=sampler)]
        steps = [micro_batches[i] + micro_batches[i + 1] for i in range(0, len(micro_batches), accum)]
        assert steps == parts[rank]


# ---------------------------------------------------------------------------- epochs and length
def test_epoch_boundary():
    ranks = make_ranks(2, 50, 10, seed=1)  # 5 global batches per epoch
    assert ranks[0].global_batches_per_epoch == 5
    epoch0 = take_global_batches(ranks)
    assert len(epoch0) == 5
    for s in ranks:
        assert s.consumed == 50 and s.global_batches_left == 0
        assert len(s) == 0 and list(s) == []  # exhausted: iteration stops
        with pytest.raises(ValueError, match="call set_epoch"):
            s.advance()
        s.set_epoch(0)  # the current epoch: nothing changes
        assert s.consumed == 50
        s.set_epoch(1)
        assert s.epoch == 1 and s.consumed == 0
    epoch1 = take_global_batches(ranks)
    assert len(epoch1) == 5 and epoch1 != epoch0
    assert sorted(i for b in epoch1 for i in b) == list(range(50))
    # rewind replays the current epoch from its start
    for s in ranks:
        s.rewind()
    assert take_global_batches(ranks) == epoch1


def test_advance_counts_global_batches_and_rejects_overrun():
    s = ElasticSampler(100, 12, rank=1, world_size=4, drop_last=False)  # 8 full + 1 partial
    s.advance(0)
    assert s.consumed == 0
    s.advance(7)
    assert s.consumed == 84 and s.global_batches_left == 2
    with pytest.raises(ValueError, match="cannot advance 3 global batches: epoch 0 has 2 left"):
        s.advance(3)
    assert s.consumed == 84
    s.advance(2)
    assert s.consumed == 100  # the partial batch counts as one, consumed stops at the end
    with pytest.raises(ValueError):
        s.advance(-1)


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_len_matches_what_iteration_yields_at_every_position(world, drop_last):
    for n in (0, 5, 12, 50):
        for s in make_ranks(world, n, 12, seed=n, drop_last=drop_last):
            while True:
                assert len(s) == len(list(s))
                if s.global_batches_left == 0:
                    break
                s.advance()


@pytest.mark.parametrize("world", [1, 2, 3, 4, 6])
def test_drop_last_false_covers_every_sample_exactly_once(world):
    n, g = 50, 12  # 4 full global batches and a partial one of 2 (fewer than some world sizes)
    ranks = make_ranks(world, n, g, seed=8, drop_last=False)
    per_rank = [list(s) for s in ranks]
    assert Counter(i for p in per_rank for i in p) == Counter(range(n))
    # the partial batch is split as evenly as possible, lower ranks first, in order
    tails = [p[4 * (g // world):] for p in per_rank]
    q, m = divmod(2, world)
    assert [len(t) for t in tails] == [q + 1] * m + [q] * (world - m)
    order = ranks[0].global_order().tolist()
    assert [i for t in tails for i in t] == order[48:]


# ---------------------------------------------------------------------------- errors
def test_global_batch_must_divide_by_world_size():
    with pytest.raises(ValueError, match=r"global batch size 10 is not divisible by world size 4"):
        ElasticSampler(100, 10, rank=0, world_size=4)
    with pytest.raises(ValueError, match="rank 4 is out of range for world size 4"):
        ElasticSampler(100, 8, rank=4, world_size=4)
    with pytest.raises(ValueError, match="global_batch_size must be at least 1"):
        ElasticSampler(100, 0)
    with pytest.raises(TypeError, match="dataset_len must be an int"):
        ElasticSampler(10.0, 2)


def test_rank_and_world_size_default_to_one_process_without_a_group():
    assert not torch.distributed.is_initialized()
    s = ElasticSampler(10, 4)
    assert (s.rank, s.world_size) == (0, 1)
    assert list(s) == list(ElasticSampler(10, 4, rank=0, world_size=1))


def test_rank_and_world_size_default_to_torch_distributed(pg_pool):
    """On a real gloo group of 2 ranks: each sampler picks up (rank, 2) and yields that
    rank's share; explicit arguments win, each on its own."""
    got = pg_pool(2).run(sampler_cases.defaults_from_the_process_group, 10, 4)
    for r, g in enumerate(got):
        assert g["found"] == (r, 2)
        assert g["found_samples"] == list(ElasticSampler(10, 4, rank=r, world_size=2, seed=3))
        assert g["explicit"] == (0, 1)
        assert g["mixed"] == (1 - r, 2)
    assert sorted(got[0]["found_samples"] + got[1]["found_samples"]) == sorted(
        ElasticSampler(10, 4, rank=0, world_size=1, seed=3))


def test_load_refuses_a_different_sequence_and_changes_nothing():
    saved = make_ranks(1, 100, 12, seed=3)[0]
    saved.advance(2)
    state = through_json(saved.state_dict())

    s = ElasticSampler(120, 12, rank=0, world_size=2, seed=5)
    with pytest.raises(ValueError, match=r"dataset of 100 samples, but this sampler's dataset_len is 120"):
        s.load_state_dict(state)
    s = ElasticSampler(100, 24, rank=0, world_size=2, seed=5)
    with pytest.raises(ValueError, match=r"global batch size 12, but this sampler's is 24"):
        s.load_state_dict(state)
    s = ElasticSampler(100, 12, seed=5, shuffle=False)
    with pytest.raises(ValueError, match=r"shuffle=True, but this sampler has shuffle=False"):
        s.load_state_dict(state)
    s = ElasticSampler(100, 12, seed=5, drop_last=False)
    with pytest.raises(ValueError, match=r"drop_last=True, but this sampler has drop_last=False"):
        s.load_state_dict(state)
    assert (s.seed, s.epoch, s.consumed) == (5, 0, 0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"consumed": 13}, "consumed=13 is not a multiple"),
        ({"consumed": 108}, "consumed=108 is not a multiple"),  # past the 96 samples of an epoch
        ({"consumed": -12}, "consumed must be at least 0"),
        ({"epoch": "1"}, "epoch must be an int"),
        ({"shuffle": 1}, "shuffle must be a bool"),
        ({"extra": 1}, "unexpected keys \\['extra'\\]"),
        ({"seed": None}, "seed must be an int"),
    ],
)
def test_load_refuses_malformed_states(change, message):
    state = ElasticSampler(100, 12).state_dict() | change
    with pytest.raises(ValueError, match=message):
        ElasticSampler(100, 12).load_state_dict(state)


def test_load_refuses_missing_keys():
    state = ElasticSampler(100, 12).state_dict()
    del state["consumed"]
    with pytest.raises(ValueError, match=r"missing keys \['consumed'\]"):
        ElasticSampler(100, 12).load_state_dict(state)


# ---------------------------------------------------------------------------- batch helpers
def test_keep_global_batch_values():
    assert keep_global_batch(96, 4, 4) == 6
    assert keep_global_batch(96, 3, 4) == 8
    assert keep_global_batch(96, 96, 1) == 1
    assert keep_global_batch(12, 1, 12) == 1
    for world in (1, 2, 3, 4, 6, 8):
        accum = keep_global_batch(48, world, 2)
        assert 2 * world * accum == 48


def test_keep_global_batch_errors():
    with pytest.raises(ValueError) as e:
        keep_global_batch(96, 5, 4)
    assert str(e.value).startswith(
        "global batch 96 cannot be kept on 5 ranks with micro-batch 4: 96 is not divisible by 20"
    )
    assert "choose 4 or 6 ranks with micro-batch 4" in str(e.value)
    with pytest.raises(ValueError, match="choose micro-batch 4 or 6 on 4 ranks"):
        keep_global_batch(96, 4, 5)
    with pytest.raises(ValueError, match="choose a world size that divides 10"):
        keep_global_batch(10, 3, 3)
    with pytest.raises(ValueError, match="micro_batch must be at least 1"):
        keep_global_batch(96, 4, 0)
    with pytest.raises(TypeError, match="world_size must be an int"):
        keep_global_batch(96, 4.0, 4)


def test_per_rank_batch_values_and_errors():
    assert per_rank_batch(96, 4) == 24
    assert per_rank_batch(96, 4, 2) == 12
    assert per_rank_batch(12, 3) == 4
    assert per_rank_batch(7, 1) == 7
    with pytest.raises(ValueError, match=r"global batch 96 cannot be split over 5 ranks with accumulation steps 1: "
                                         r"96 is not divisible by 5"):
        per_rank_batch(96, 5)
    with pytest.raises(ValueError, match="choose accumulation steps 4 or 6 on 4 ranks"):
        per_rank_batch(96, 4, 5)
    with pytest.raises(ValueError, match="accum_steps must be at least 1"):
        per_rank_batch(96, 4, 0)
