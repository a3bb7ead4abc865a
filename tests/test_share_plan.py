"""plan_sharing: who reads each piece of a box several ranks need (read once, then share)."""

from __future__ import annotations

from shardsafe.format.manifest import Chunk, FileEntry, Manifest, TensorEntry
from shardsafe.layout import Box
from shardsafe.plan.share_plan import plan_sharing


def _manifest(tensors: dict[str, tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...], int]]]]
              ) -> Manifest:
    """float32 tensors of the given shapes, each chunk (offsets, lengths, saving rank)."""
    entries = {}
    pos = {r: 0 for r in range(8)}
    for key, (shape, chunks) in tensors.items():
        out = []
        for offsets, lengths, rank in chunks:
            n = 4
            for x in lengths:
                n *= x
            out.append(Chunk(offsets, lengths, rank, pos[rank], pos[rank] + n, [], rank))
            pos[rank] += n
        entries[key] = TensorEntry("float32", shape, "replicated", out)
    files = [FileEntry(f"data-r{r:05d}-00.safetensors", pos[r], r, 0, "") for r in range(8)]
    return Manifest(tree={}, tensors=entries, files=files, world_size=4)


def _req(key: str, shape: tuple[int, ...]) -> tuple:
    n = 4
    for x in shape:
        n *= x
    return (key, tuple(0 for _ in shape), shape, n)


def _plans(m: Manifest, requests: list[list[tuple]], **kw) -> list[list[tuple]]:
    return [[(s.index, s.piece, s.owner, s.members) for s in plan_sharing(m, requests, r, **kw)]
            for r in range(len(requests))]


def test_pieces_follow_the_saved_chunks_and_go_home():
    m = _manifest({"w": ((12, 5), [((0, 0), (4, 5), 0), ((4, 0), (4, 5), 1), ((8, 0), (4, 5), 2)])})
    reqs = [[_req("w", (12, 5))] for _ in range(4)]
    plans = _plans(m, reqs)
    expected = [(0, Box((0, 0), (4, 5)), 0, (0, 1, 2, 3)), (0, Box((4, 0), (4, 5)), 1, (0, 1, 2, 3)),
                (0, Box((8, 0), (4, 5)), 2, (0, 1, 2, 3))]
    assert plans == [expected] * 4


def test_a_home_that_does_not_need_the_piece_hands_it_to_the_least_loaded_member():
    m = _manifest({"a": ((8,), [((0,), (8,), 0)]), "b": ((4,), [((0,), (4,), 3)])})
    reqs = [[], [_req("a", (8,)), _req("b", (4,))], [_req("b", (4,)), _req("a", (8,))], []]
    plans = _plans(m, reqs)
    # "a" (larger, placed first) goes to rank 1 (tie on load: lower rank), "b" to rank 2
    assert plans[1] == [(0, Box((0,), (8,)), 1, (1, 2)), (1, Box((0,), (4,)), 2, (1, 2))]
    assert plans[2] == [(1, Box((0,), (8,)), 1, (1, 2)), (0, Box((0,), (4,)), 2, (1, 2))]
    assert plans[0] == plans[3] == []


def test_a_home_already_reading_more_than_the_slack_gives_way():
    m = _manifest({k: ((100,), [((0,), (100,), 0)]) for k in ("a", "b", "c")})
    reqs = [[_req(k, (100,)) for k in "abc"] for _ in range(2)]
    # slack 400 bytes = the largest box: "a" home (0), "b" home (0 leads 1 by 400, not more), "c" to 1
    owners = {(s[1].offsets, s[0]): s[2] for s in _plans(m, reqs, slack=0)[0]}
    assert sorted(owners.values()) == [0, 0, 1]
    generous = _plans(m, reqs)  # the default slack (16 MiB): everything at home
    assert [s[2] for s in generous[0]] == [0, 0, 0] and generous[0] == generous[1]


def test_chunks_that_do_not_tile_the_box_share_it_whole():
    m = _manifest({"w": ((10,), [((0,), (4,), 1), ((6,), (4,), 2)])})  # a hole at 4..6
    plans = _plans(m, [[_req("w", (10,))] for _ in range(3)])
    assert plans[0] == [(0, Box((0,), (10,)), 0, (0, 1, 2))]


def test_a_box_one_rank_needs_is_not_shared_and_scalars_are():
    m = _manifest({"step": ((), [((), (), 2)]), "own": ((4,), [((0,), (4,), 0)])})
    reqs = [[_req("step", ()), _req("own", (4,))], [_req("step", ())], [_req("step", ())]]
    plans = _plans(m, reqs)
    assert plans[0] == [(0, Box((), ()), 2, (0, 1, 2))]
    assert plans[1] == [(0, Box((), ()), 2, (0, 1, 2))]
