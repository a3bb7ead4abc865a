"""Which files of a local step a rank's restore will read, told from the manifest alone.

A node restoring a local step fetches from peers only the files its ranks' load reads,
not every file it lacks: on a job of many nodes, each holding its own ranks' files and a
few peers' copies, the step's other files are not this node's business (fetching them
would move the whole checkpoint to every node). The load's own matching and the index
needs of its destinations (``plan.load_plan.index_needs``: which data files hold the
chunks a destination box meets) give the data files; each one's index comes with it; the
file holding the rank's rank-local values is always needed. Nothing is read: where that
cannot be told without the file indexes (a manifest whose rule cuts need every index, an
older format, incremental references, or a destination the load will refuse), the answer
is None and the node fetches every file it lacks, as before.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..comm import Comm
from ..errors import CheckpointError, MissingKeysError
from ..format.manifest import Manifest
from ..hints import as_keys
from ..ops.load import broadcast_plan, dests_of, reading_fills
from ..plan.load_plan import index_needs
from ..state.match import Fill, Matcher


def files_needed(manifest: Manifest, state: dict[str, Any], comm: Comm, *, broadcast: bool = False,
                 strict: bool = True, exclude: str | Iterable[str] = (), cast_dtype: bool = False,
                 **_: Any) -> set[str] | None:
    """Names of the files (data files and their indexes) that loading ``state`` on this
    rank of ``comm`` from a checkpoint with ``manifest`` reads; None when only the file
    indexes could tell (then every file is to be had). With ``broadcast`` the pieces of
    replicated boxes another rank reads and sends (the load's ``broadcast_replicated``
    plan, one all-gather: every rank of ``comm`` calls this) are left out."""
    fills = None
    if manifest.indexed and not manifest.cuts_need_indexes:
        fills = _match(manifest, state, comm, strict, exclude, cast_dtype)
    if broadcast:  # collective: called by every rank, whatever its match gave
        shared = broadcast_plan(comm, fills, manifest)
        if fills is not None:
            fills = reading_fills(fills, shared, comm.rank)
    if fills is None:
        return None
    files = set(index_needs(manifest, dests_of(fills)).files)
    own = manifest.file_of_rank.get(comm.rank)
    if own is not None:
        files.add(own)
    if any(f >= len(manifest.files) for f in files):
        return None  # a file of another checkpoint (incremental reference)
    out: set[str] = set()
    for f in files:
        entry = manifest.files[f]
        out.update((entry.name, entry.index_name))
    return out


def _match(manifest: Manifest, state: dict[str, Any], comm: Comm, strict: bool, exclude: str | Iterable[str],
           cast_dtype: bool) -> list[Fill] | None:
    """The load's fills for this rank; None when the load will refuse ``state`` (it says why)."""

    def no_rank_local(key: str) -> Any:  # the rank's own file holds them: nothing to learn here
        raise MissingKeysError(f"rank-local value '{key}' is not read while planning a fetch")

    try:
        matcher = Matcher(manifest, rank=comm.rank, strict=strict, rank_local_tree=no_rank_local,
                          exclude=as_keys(exclude, "exclude") or (), world=comm.world, cast_dtype=cast_dtype)
        matcher.match(state, manifest.tree, [], top=True)
    except CheckpointError:
        return None
    if any(not isinstance(e, MissingKeysError) for e in matcher.result.errors):
        return None
    return matcher.result.fills


__all__ = ["files_needed"]
