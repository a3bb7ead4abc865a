"""Read once, then share: which rank reads each piece of a box that several ranks need.

When several ranks need the same box of a saved tensor (DDP weights, the replicated
dimension of HSDP, TP-replicated parts), one of them reads and verifies it and sends it to
the others. The box is cut along the saved chunks it meets (a large replicated tensor is
saved as row blocks in several ranks' files), and each piece goes to its *home*: the rank
whose file holds it. When the layout did not change, that rank reads that file anyway, so a
remote load makes a few large requests per file instead of small ones into every file, and
the bytes stay balanced as the save balanced them. A piece goes elsewhere (to the member
reading the fewest bytes) when its home does not need it, or already reads more than
``slack`` bytes beyond another member.

Deterministic: every rank computes the same plan from the same gathered requests and the
same manifest.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from ..format.manifest import Manifest
from ..knobs import SHARE_SLACK
from ..layout import Box, intersect

Request = tuple[str, tuple[int, ...], tuple[int, ...], int]  # key, offsets, lengths, bytes


class Shared(NamedTuple):
    """Piece ``piece`` (global coordinates) of this rank's request ``index``: ``owner``
    reads it (and verifies it), then sends it to the other ``members`` (sorted group ranks)."""

    index: int
    piece: Box
    owner: int
    members: tuple[int, ...]


def _pieces(manifest: Manifest, key: str, box: Box) -> list[tuple[Box, int]]:
    """``box`` cut along the saved chunks it meets, each with the rank whose file holds it,
    in chunk order; the whole box (home -1) when the chunks do not tile it."""
    entry = manifest.tensors.get(key)
    out: list[tuple[Box, int]] = []
    covered = 0
    files = manifest.files
    for o, n, f in entry.boxes_meeting(box.offsets, box.lengths) if entry is not None else ():
        part = intersect(box, Box(o, n))  # boxes only: planning reads no file index
        if part is not None and part.numel:
            out.append((part, files[f].rank))
            covered += part.numel
    return out if out and covered == box.numel else [(box, -1)]


def plan_sharing(manifest: Manifest, requests: Sequence[Sequence[Request]], rank: int,
                 slack: int = SHARE_SLACK) -> list[Shared]:
    """The pieces this rank shares, given every rank's requests (``requests[r]``: the boxes
    rank ``r`` needs, each once), in the order every rank processes them."""
    need: dict[tuple, list[int]] = {}
    size: dict[tuple, int] = {}
    index: dict[tuple, int] = {}
    for r, reqs in enumerate(requests):
        for i, (key, offsets, lengths, nbytes) in enumerate(reqs):
            box = (key, tuple(offsets), tuple(lengths))
            need.setdefault(box, []).append(r)
            size[box] = nbytes
            if r == rank:
                index[box] = i
    boxes = sorted((b for b in need if len(need[b]) > 1), key=lambda b: (-size[b], b))
    slack = max([slack, *(size[b] for b in boxes[:1])])
    load = [0] * len(requests)
    out: list[tuple[tuple, Shared]] = []
    for box in boxes:
        key, offsets, lengths = box
        whole = Box(offsets, lengths)
        members = tuple(sorted(need[box]))
        per_element = size[box] // max(whole.numel, 1)
        for n, (piece, home) in enumerate(_pieces(manifest, key, whole)):
            least = min(members, key=lambda m: (load[m], m))
            owner = home if home in members and load[home] <= load[least] + slack else least
            load[owner] += piece.numel * per_element
            if rank in members:
                out.append(((box, n), Shared(index[box], piece, owner, members)))
    out.sort(key=lambda x: x[0])
    return [s for _, s in out]
