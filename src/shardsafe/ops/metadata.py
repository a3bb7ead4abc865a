"""The metadata phases of every reader: open -> manifest -> fetch indexes.

``read_manifest_phase`` opens a committed checkpoint and hands its manifest's bytes to
the codec; the fetch-indexes phase (:func:`fetch_indexes` and the helpers that say which
indexes a reader needs) reads the bytes of file indexes — several at once on a remote
backend — and hands them to the manifest, which verifies, parses and attaches them. The
format objects never read storage: planning and executing only look things up, and every
reader (load, load_full, the CheckpointReader of the tools, an incremental save's base)
fetches through these functions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..checkpoint_folder import MAX_MANIFEST_BYTES, open_committed
from ..errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.manifest import MANIFEST_NAME, Manifest
from ..knobs import INDEX_THREADS
from ..plan.load_plan import Dest, Geometry, index_needs
from ..storage.base import Backend, Folder
from ..workers import pool

IndexReader = Callable[[list[tuple[str, int]]], list[bytes]]


@dataclass
class Opened:
    """Open and manifest phases: a committed checkpoint's pinned folder, its parsed
    manifest, its digest, and how its file indexes are read (``read_indexes``)."""

    location: str
    folder: Folder
    manifest: Manifest
    digest: int
    siblings: Callable[[str], Folder] | None = None  # opens a referenced checkpoint's folder (format 3.1)
    read_indexes: IndexReader | None = field(default=None, repr=False)

    def close(self) -> None:
        self.folder.close()


def sibling_opener(backend: Backend, location: str) -> Callable[[str], Folder]:
    """Opens, by name, a checkpoint in the same parent folder as ``location`` (the
    checkpoints that an incremental checkpoint refers to)."""
    parent_location, _ = backend.split(location)

    def open_sibling(name: str) -> Folder:
        with backend.open(parent_location) as parent:
            return parent.open_folder(name)

    return open_sibling


def read_manifest_phase(backend: Backend, location: str) -> Opened:
    """Open the committed checkpoint at ``location`` and parse its manifest."""
    folder, data = open_committed(backend, location)
    try:
        manifest = Manifest.from_bytes(data, folder.where(MANIFEST_NAME))
    except BaseException:
        folder.close()
        raise
    digest = int(checksum(data), 16)
    return Opened(location, folder, manifest, digest, sibling_opener(backend, location),
                  index_reader(folder, digest, backend.remote))


def index_reader(folder: Folder, digest: int, remote: bool) -> IndexReader:
    """Reads (name, expected size) file indexes from ``folder`` (several at once on a
    remote backend; each read bounded by the stated size plus one byte). A missing index
    is a corrupt checkpoint, or, when the folder's manifest is no longer the one read
    (``digest``), a checkpoint replaced meanwhile."""

    def one(item: tuple[str, int]) -> bytes:
        name, size = item
        try:
            return folder.read_bytes(name, size + 1)
        except CheckpointNotFoundError:
            try:
                now = folder.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
            except CheckpointError:
                now = b""
            if int(checksum(now), 16) != digest:
                raise CheckpointChangedError(
                    f"{folder.location}: the checkpoint was deleted or replaced while it was read") from None
            raise CorruptCheckpointError(f"file index {folder.where(name)} is missing") from None

    def read(items: list[tuple[str, int]]) -> list[bytes]:
        if remote and len(items) > 1:
            with pool(min(INDEX_THREADS, len(items)), "index") as workers:
                return list(workers.map(one, items))
        return [one(i) for i in items]

    return read


def fetch_indexes(opened: Opened, files: Iterable[int]) -> None:
    """The fetch-indexes phase: read the indexes of ``files`` not attached yet, all at
    once, then hand their bytes to the manifest (verified and parsed in file order). A
    no-op before format 3."""
    manifest = opened.manifest
    wanted = manifest.index_requests(files)
    if not wanted:
        return
    if opened.read_indexes is None:
        raise CorruptCheckpointError("this manifest was read without its checkpoint: its file indexes cannot be read")
    datas = opened.read_indexes([(name, size) for _, name, size in wanted])
    manifest.attach_indexes([(f, data) for (f, _, _), data in zip(wanted, datas)])


def fetch_all_indexes(opened: Opened) -> None:
    """Fetch every file index (readers that look at the whole checkpoint), then check that
    their rows back the rules (the rule budget)."""
    fetch_indexes(opened, range(len(opened.manifest.files)))
    opened.manifest.check_rule_budget()


def fetch_cut_indexes(opened: Opened, dests: list[Dest]) -> None:
    """Before any rule a destination meets is cut: when the manifest's rules claim more
    than its work pool, every index (their rows back the claim: the rule budget)."""
    manifest = opened.manifest
    if not manifest.cuts_need_indexes:
        return
    tensors = manifest.tensors
    for d in dests:
        entry = tensors.get(d.key)
        if entry is not None and entry.rule is not None and 0 not in d.box.lengths:
            fetch_all_indexes(opened)
            return


def fetch_plan_indexes(opened: Opened, dests: list[Dest]) -> Geometry:
    """The indexes a plan for ``dests`` needs (those of the files holding the chunks they
    meet), fetched at once; returns the boxes each destination meets, for the planner."""
    fetch_cut_indexes(opened, dests)
    needs = index_needs(opened.manifest, dests)
    fetch_indexes(opened, needs.files)
    return needs.geoms


def fetch_rank_local(opened: Opened, rank: int) -> None:
    """The index holding saving rank ``rank``'s rank-local values and tensors (format 3,
    when the manifest lists any), before matching decodes them."""
    manifest = opened.manifest
    if manifest.indexed and len(manifest.rank_local):
        f = manifest.file_of_rank.get(rank)
        if f is not None:
            fetch_indexes(opened, [f])


__all__ = ["INDEX_THREADS", "Opened", "fetch_all_indexes", "fetch_cut_indexes", "fetch_indexes",
           "fetch_plan_indexes", "fetch_rank_local", "index_reader", "read_manifest_phase", "sibling_opener"]
