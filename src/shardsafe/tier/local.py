"""LocalTier: step checkpoints in a node-local folder, copied to peers, restored from the
fastest complete copy.

Save (every rank calls; collectives on the tier's own gloo group, never the training group):
1. each node's leader clears what an earlier save of the step left; barrier;
2. an ordinary save to ``LOCAL/step-N`` through the manager's Checkpointer (sync or async,
   the same budget and format), through the tier's commit strategy (storage/tier.py): every
   rank writes its files into its own node's staging folder, rank 0 writes the manifest there;
3. the manifest is broadcast and written into every node's staging folder; each rank's files
   go to its F-1 peers (:mod:`~shardsafe.tier.transfer`), each received file verified
   against the checkpoint's checksums before it counts; ranks agree;
4. each node's leader renames its staging folder into place and drops steps beyond ``keep``.
A step exists on a node only once every rank's files are written and copied as asked.

Restore: one all-gather of what each node holds (steps, manifest digests, files) finds the
newest step whose files the live nodes hold between them (one manifest digest: never a
mix of steps); each node receives the files it lacks from a peer that holds them, verified;
then an ordinary (verified, resharding) load from the node's folder. When no step is
complete, or a copy is corrupt, the caller falls back to the persistent tier and is told why.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..checkpointer import Checkpointer, SaveFuture
from ..comm import Comm, resolve
from ..errors import CheckpointError
from ..format.checksum import checksum
from ..format.manifest import MANIFEST_NAME, Manifest
from ..ops.load import LoadInfo
from ..ops.reader import verify_files
from ..steps import parse_step, step_name
from ..storage.base import Folder
from ..storage.commit import leftover_of
from ..storage.tier import TIER_SCHEME, publish_node, tier_backend, tier_location, tier_tmp
from ..workers import start_thread
from .needs import files_needed
from .topology import Topology, discover, node_id
from .transfer import Stats, Transfer, exchange

log = logging.getLogger("shardsafe.tier")
MARKER = ".shardsafe-tier.json"


@dataclass
class TierStep:
    """What one node holds of one local step: its manifest's digest, the number of files
    the manifest lists (data files and indexes) and the files present with their sizes."""

    step: int
    digest: str
    nfiles: int
    files: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "digest": self.digest, "nfiles": self.nfiles, "files": self.files}


@dataclass
class Restored:
    """A restore's outcome: the step, the tier it came from (``local``: this node's folder
    held everything; ``peers``: some files came from other nodes), the load's info and the
    bytes received from peers."""

    step: int
    tier: str
    info: LoadInfo
    received: int = 0


def manifest_files(m: Manifest) -> dict[str, int]:
    """Every file a checkpoint's manifest lists (data files and their indexes) with its size."""
    out: dict[str, int] = {}
    for e in m.files:
        out[e.name] = e.nbytes
        if m.indexed:
            out[e.index_name] = e.index_bytes
    return out


def node_holdings(folder: Folder, parsed: dict[str, Manifest] | None = None) -> list[TierStep]:
    """The committed local steps in ``folder`` (this node), newest first; unreadable ones
    skipped. ``parsed`` (when given) receives each step's manifest by digest."""
    out = []
    for name in folder.names():
        step = parse_step(name)
        if step is None or folder.kind(name) != "dir":
            continue
        try:
            with folder.open_folder(name) as f:
                data = f.read_bytes(MANIFEST_NAME, 1 << 30)
                m = Manifest.from_bytes(data, f.where(MANIFEST_NAME))
                expected = manifest_files(m)
                held = {n: e.size for n in f.names() if n in expected and (e := f.stat(n)) is not None}
        except CheckpointError:
            continue
        out.append(TierStep(step, checksum(data), len(expected), held))
        if parsed is not None:
            parsed[out[-1].digest] = m
    return sorted(out, key=lambda s: -s.step)


Found = tuple[TierStep, dict[str, list[int]]]


def complete_step(reports: list[list[TierStep]], newer_than: int | None = None) -> Found | None:
    """The newest step that the ranks' ``reports`` hold completely between them (one
    manifest digest, each file present at its listed size somewhere), with the ranks
    holding each file; None when there is none newer than ``newer_than``."""
    steps = sorted({s.step for rep in reports for s in rep}, reverse=True)
    for step in steps:
        if newer_than is not None and step <= newer_than:
            break
        by_digest: dict[str, list[tuple[int, TierStep]]] = {}
        for rank, rep in enumerate(reports):
            for s in rep:
                if s.step == step:
                    by_digest.setdefault(s.digest, []).append((rank, s))
        for digest in sorted(by_digest, key=lambda d: (-len(by_digest[d]), d)):
            held = by_digest[digest]
            nfiles = held[0][1].nfiles
            where: dict[str, list[int]] = {}
            for rank, s in held:
                for name in s.files:
                    where.setdefault(name, []).append(rank)
            if len(where) == nfiles:
                return TierStep(step, digest, nfiles, {}), where
    return None


class LocalTier:
    """The node-local tier of a CheckpointManager (see the module docstring). Every rank
    constructs it (it creates the tier's gloo group) and calls every method."""

    def __init__(self, path: str | os.PathLike, checkpointer: Checkpointer, *, keep: int = 2, replicas: int = 1,
                 stride: int | None = None, node: int | None = None, max_bytes: int | None = None,
                 process_group: Any = None, timeout: float = 600.0) -> None:
        if keep < 1:
            raise ValueError(f"local_keep must be at least 1, not {keep}")
        self.node = node_id(node)
        self.root = Path(os.fspath(path).format(node=self.node)).absolute()
        self.cp = checkpointer
        self.keep = keep
        self.max_bytes = max_bytes
        self.process_group = process_group
        comm = resolve(process_group)
        self.comm = comm
        self.group = None
        if comm.distributed:
            ranks = [dist.get_global_rank(comm.group, r) for r in range(comm.world)]
            from datetime import timedelta

            self.group = dist.new_group(ranks=ranks, backend="gloo", timeout=timedelta(seconds=timeout))
        self.tcomm = Comm(self.group, comm.rank, comm.world)
        nodes = len(set(int(b) for b in self.tcomm.all_gather_bytes(str(self.node).encode())))
        if replicas > nodes:
            log.warning("local tier: replicas=%d but the job runs on %d node(s): keeping %d copies", replicas, nodes,
                        nodes)
            replicas = nodes
        self.topo: Topology = discover(self.tcomm, self.node, replicas, stride)
        self.backend = tier_backend()
        self._parsed: dict[str, Manifest] = {}  # manifests read by the last holdings(), by digest
        checkpointer.backends[TIER_SCHEME] = self.backend
        self.leader = self.topo.leader(comm.rank) == comm.rank
        error = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if self.leader:
                with self._folder() as f:
                    f.publish_bytes(MARKER, json.dumps({"node": self.node, "world": comm.world,
                                                        "replicas": self.topo.replicas,
                                                        "stride": self.topo.stride}).encode(), replace=True)
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
        self.tcomm.agree(error)
        self._checked = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_stats: Stats | None = None

    # -- folders ------------------------------------------------------------------------
    def _folder(self) -> Folder:
        return self.backend.open(str(self.root), create=True)

    def location(self, step: int) -> str:
        """The Checkpointer location of ``step`` on this node."""
        return tier_location(self.root / step_name(step))

    def holdings(self) -> list[TierStep]:
        """The committed local steps this node holds, newest first."""
        self._parsed.clear()  # the manifests of the last look only
        with self._folder() as f:
            return node_holdings(f, self._parsed)

    # -- saving -------------------------------------------------------------------------
    def check_space(self, state: dict[str, Any]) -> None:
        """Refuse (CheckpointError on every rank, naming the node, folder and sizes) when
        the node's own files plus the copies it keeps, times ``keep + 1``, do not fit in
        the folder's free space (or ``max_bytes``). Replicated tensors count 1/world per rank."""
        mine = _state_bytes(state, self.comm.world if self.comm.distributed else 1)
        sizes = [int(b) for b in self.tcomm.all_gather_bytes(str(mine).encode())]
        node_bytes = sum(sizes[r] for r in self.topo.ranks_on(self.node))
        need = node_bytes * self.topo.replicas * (self.keep + 1)
        used = _tree_bytes(self.root)
        free = shutil.disk_usage(self.root).free + used
        if self.max_bytes is not None:
            free = min(free, self.max_bytes)
        error = None
        if need > free:
            error = CheckpointError(
                f"local tier on node {self.node} ({self.root}): {need / 1e9:.2f} GB needed (this node's "
                f"{node_bytes / 1e9:.2f} GB x {self.topo.replicas} copies x {self.keep + 1} steps: local_keep="
                f"{self.keep} plus the one being written), {free / 1e9:.2f} GB available; lower local_keep or "
                "replicas, or give a larger local folder")
        self.tcomm.agree(error)
        self._checked = True

    def save(self, step: int, state: dict[str, Any], *, async_save: bool, **kwargs: Any) -> SaveFuture | None:
        """Save ``state`` as local step ``step``: written, replicated and committed on every
        node before it counts (async: the write and replication run in the background;
        :meth:`wait` joins them). Saves the space check first, once."""
        self.wait()
        if not self._checked:
            self.check_space(state)
        name = step_name(step)
        error = None
        if self.leader:
            try:
                with self._folder() as f:
                    _clear(f, name)
            except Exception as exc:  # noqa: BLE001
                error = exc
        self.tcomm.agree(error)
        loc = self.location(step)
        pg = self.process_group
        if not async_save:
            self.cp.save(state, loc, overwrite=True, process_group=pg, **kwargs)
            self._finish(step)
            return None
        future = self.cp.async_save(state, loc, overwrite=True, process_group=pg, **kwargs)

        def background() -> None:
            try:
                future.result()
                self._finish(step)
            except BaseException as exc:  # noqa: BLE001 - raised by wait()
                self._error = exc

        self._thread = start_thread(background, f"tier-{step}")
        return future

    def wait(self) -> None:
        """Join the background save in flight; raise its error."""
        t, self._thread = self._thread, None
        if t is not None:
            t.join()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _finish(self, step: int) -> None:
        """Steps 3 and 4 of a save (module docstring)."""
        name = step_name(step)
        tmp = tier_tmp(name)
        data = None
        error: BaseException | None = None
        if self.comm.rank == 0:
            try:
                with self._folder() as f, f.open_folder(tmp) as s:
                    data = s.read_bytes(MANIFEST_NAME, 1 << 30)
            except Exception as exc:  # noqa: BLE001
                error = exc
        self.tcomm.agree(error)
        data = self.tcomm.broadcast_bytes(data, 0)
        try:
            m = Manifest.from_bytes(data, f"local step {step}'s manifest")
            if self.leader:
                with self._folder() as f, f.open_folder(tmp, create=True) as s:
                    if s.stat(MANIFEST_NAME) is None:
                        s.write_bytes(MANIFEST_NAME, data, durable=False)
        except Exception as exc:  # noqa: BLE001
            error = exc
        self.tcomm.agree(error)
        transfers = [Transfer(e.rank, p, n, size) for e in m.files for p in self.topo.peers(e.rank)
                     for n, size in ((e.name, e.nbytes), (e.index_name, e.index_bytes)) if size or n == e.name]
        self.last_stats = self._move(transfers, tmp, tmp)
        error = None
        if self.leader:
            try:
                with self._folder() as f:
                    publish_node(f, name)
                    self._prune(f)
            except Exception as exc:  # noqa: BLE001
                error = exc
        self.tcomm.agree(error)

    def _move(self, transfers: list[Transfer], tmp: str, source: str) -> Stats:
        """Run ``transfers`` (sent from this node's folder ``source``) into its staging
        folder ``tmp`` and verify what this rank received; ranks agree on errors."""
        stats = Stats(0, 0, 0.0)
        error = None
        try:
            with self._folder() as f:
                f.open_folder(tmp, create=True).close()
            sends = any(t.src == self.comm.rank for t in transfers)
            with self._folder() as f, f.open_folder(tmp) as s, \
                    (f.open_folder(source) if sends else contextlib.nullcontext()) as src:
                stats = exchange(transfers, self.comm.rank, self.group, self.cp.memory,
                                 lambda n: src.open_read(n), lambda n: _fresh(s, n))
        except Exception as exc:  # noqa: BLE001
            error = exc
        self.tcomm.agree(error)  # every file has arrived on every node before any is checked
        try:
            got = [t.name for t in transfers if t.dst == self.comm.rank]
            if got:
                verify_files(self.backend, tier_location(self.root / tmp), got, self.cp.memory)
        except Exception as exc:  # noqa: BLE001
            error = exc
        self.tcomm.agree(error)
        return stats

    def _prune(self, f: Folder) -> None:
        """Drop committed local steps beyond the ``keep`` newest, and staging folders that
        killed saves left."""
        steps = sorted((s, n) for n in f.names() if (s := parse_step(n)) is not None)
        for _, n in steps[:-self.keep]:
            f.remove_tree(n)
        for n in f.names():
            left = leftover_of(n)
            if left is not None and parse_step(left[0]) is not None and n == tier_tmp(left[0]):
                f.remove_tree(n)

    # -- restoring ----------------------------------------------------------------------
    def find(self, newer_than: int | None = None) -> tuple[TierStep, dict[str, list[int]]] | None:
        """The newest step complete across the live nodes (one all-gather on the tier group)."""
        try:
            mine = json.dumps([s.to_json() for s in self.holdings()]).encode()
        except CheckpointError:
            mine = b"[]"
        reports = [[TierStep(**d) for d in json.loads(b)] for b in self.tcomm.all_gather_bytes(mine)]
        return complete_step(reports, newer_than)

    def restore(self, state: dict[str, Any], found: tuple[TierStep, dict[str, list[int]]], **load_kwargs: Any
                ) -> Restored:
        """Fetch the files of the found step this node lacks from peers (verified), then
        load it from this node's folder (resharding as any load). Raises CheckpointError
        (the same on every rank) when a copy is missing or corrupt."""
        self.wait()
        step, where = found[0].step, found[1]
        name = step_name(step)
        src = min(r for ranks in where.values() for r in ranks)
        data = None
        error: BaseException | None = None
        if self.comm.rank == src:
            try:
                with self._folder() as f, f.open_folder(name) as s:
                    data = s.read_bytes(MANIFEST_NAME, 1 << 30)
            except Exception as exc:  # noqa: BLE001
                error = exc
        self.tcomm.agree(error)
        data = self.tcomm.broadcast_bytes(data, src)
        m = self._parsed.get(checksum(data))
        if m is None:
            m = Manifest.from_bytes(data, f"local step {step}'s manifest")
        files = manifest_files(m)
        nodes = set(self.topo.nodes)
        if all(nodes <= {self.topo.nodes[r] for r in where.get(n, ())} for n in files):
            transfers = []  # every node holds every file: nothing to plan
        else:
            if load_kwargs.get("broadcast_replicated") is None:
                # a node lacks files: replicated pieces are read by the rank whose file holds
                # them and sent (the load's broadcast), so no node fetches a file for them
                load_kwargs = {**load_kwargs, "broadcast_replicated": True}
            transfers = self._fetch_plan(files, where,
                                         self._needs(m, state, bool(load_kwargs["broadcast_replicated"]), load_kwargs))
        stats = self._fetch(transfers, name, data) if transfers else Stats(0, 0, 0.0)  # the same on every rank
        info = self.cp.load(state, self.location(step), process_group=self.process_group, **load_kwargs)
        tier = "peers" if transfers else "local"
        info.tier = tier
        info.bytes_from_peers = stats.received
        return Restored(step, tier, info, stats.received)

    def _fetch(self, transfers: list[Transfer], name: str, manifest: bytes) -> Stats:
        """Receive ``transfers`` into a staging folder beside step folder ``name``
        (verified), then merge them into it on each node."""
        tmp = tier_tmp(name)
        error: BaseException | None = None
        if self.leader:
            try:
                with self._folder() as f:
                    with contextlib.suppress(CheckpointError):
                        f.remove_tree(tmp)
                    with f.open_folder(tmp, create=True) as s:
                        s.write_bytes(MANIFEST_NAME, manifest, durable=False)
            except Exception as exc:  # noqa: BLE001
                error = exc
        self.tcomm.agree(error)
        stats = self._move(transfers, tmp, name)
        if self.leader:
            try:
                with self._folder() as f:
                    _merge(f, tmp, name, [t.name for t in transfers if self.topo.nodes[t.dst] == self.node])
            except Exception as exc:  # noqa: BLE001
                error = exc
        self.tcomm.agree(error)
        return stats

    def _needs(self, m: Manifest, state: dict[str, Any], broadcast: bool, load_kwargs: dict[str, Any]
               ) -> list[set[str] | None]:
        """Per rank, the files of the step its load reads (:func:`files_needed`; one all-gather)."""
        kwargs = {k: v for k, v in load_kwargs.items() if k in ("strict", "exclude", "cast_dtype")}
        need = files_needed(m, state, self.comm, broadcast=broadcast, **kwargs)
        wire = json.dumps(None if need is None else sorted(need)).encode()
        return [None if b == b"null" else set(json.loads(b)) for b in self.tcomm.all_gather_bytes(wire)]

    def _fetch_plan(self, files: dict[str, int], where: dict[str, list[int]],
                    needs: list[set[str] | None]) -> list[Transfer]:
        """For each node, the files of the step it lacks that its ranks' load reads
        (``needs``, per rank: :func:`files_needed`; None: every file): received by its
        ranks in turn, each sent by the holder with the fewest bytes to send so far (the
        same plan on every rank)."""
        held_on = {n: {self.topo.nodes[r] for r in ranks} for n, ranks in where.items()}
        load: dict[int, int] = {}
        out = []
        for node in sorted(set(self.topo.nodes)):
            ranks = self.topo.ranks_on(node)
            wanted = _union([needs[r] for r in ranks], files)
            missing = sorted(n for n in files if n in wanted and node not in held_on.get(n, set()))
            stems = sorted({n.split(".")[0] for n in missing})  # a data file and its index go to one rank
            for n in missing:
                src = min(where[n], key=lambda r: (load.get(r, 0), r))
                load[src] = load.get(src, 0) + files[n]
                out.append(Transfer(src, ranks[stems.index(n.split(".")[0]) % len(ranks)], n, files[n]))
        return out

    def close(self) -> None:
        """Join the background save (its error is dropped with a log line) and free the group."""
        try:
            self.wait()
        except BaseException as exc:  # noqa: BLE001
            log.warning("local tier: the last local save failed: %s", exc)
        self.cp.backends.pop(TIER_SCHEME, None)
        if self.group is not None:
            from ..comm import destroy_groups

            destroy_groups([self.group])
            self.group = None


def _union(needs: list[set[str] | None], files: dict[str, int]) -> set[str]:
    """The files some of ``needs`` asks for (every one of ``files`` when one says None)."""
    out: set[str] = set()
    for n in needs:
        if n is None:
            return set(files)
        out |= n
    return out


def _fresh(folder: Folder, name: str) -> Any:
    """A new file ``name`` in ``folder`` (an older one removed first)."""
    if folder.stat(name) is not None:
        folder.remove(name)
    return folder.create(name)


def _merge(f: Folder, tmp: str, name: str, fetched: list[str]) -> None:
    """Put the files fetched into staging ``tmp`` into step folder ``name`` (the staging
    folder becomes the step folder where the node held none of it)."""
    if f.kind(name) != "dir":
        publish_node(f, name)
        return
    for n in fetched:
        with f.open_folder(name) as d:
            if d.stat(n) is not None:
                d.remove(n)
        f.rename(f"{tmp}/{n}", f"{name}/{n}")  # type: ignore[attr-defined]
    f.remove_tree(tmp)
    f.sync()


def _clear(f: Folder, name: str) -> None:
    """Remove what an earlier save of ``name`` left on this node (staging and step folder)."""
    for entry in (tier_tmp(name), name):
        if f.kind(entry) is not None:
            f.remove_tree(entry)


def _state_bytes(state: Any, world: int) -> int:
    """Bytes this rank's part of ``state`` takes in a checkpoint (DTensors: the local
    shard; other tensors, written once by one rank: their size / world)."""
    from torch.distributed.tensor import DTensor

    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, DTensor):
            total += x.to_local().numel() * x.element_size()
        elif isinstance(x, torch.Tensor):
            total += x.numel() * x.element_size() // world
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif hasattr(x, "state_dict") and callable(x.state_dict):
            with contextlib.suppress(Exception):
                walk(x.state_dict())

    walk(state)
    return total


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, n)).st_size
    return total


__all__ = ["LocalTier", "Restored", "TierStep", "complete_step", "manifest_files", "node_holdings"]
