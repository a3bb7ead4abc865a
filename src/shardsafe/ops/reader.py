"""CheckpointReader: one open checkpoint from which tools read whole tensors one at a time
(files opened and headers checked once), through the same phases as a load."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..engine.memory import HostMemory
from ..engine.reader import OpenFiles, Reader
from ..state.match import Matcher
from ..storage.base import Backend
from .load import block_size, dests_of, land_phase, open_files_phase, plan_phase
from .metadata import Opened, fetch_all_indexes, fetch_indexes, fetch_plan_indexes, read_manifest_phase


class CheckpointReader:
    """One committed checkpoint, open for reading whole tensors one at a time (CPU,
    checksums verified as they land). Files are opened and headers checked once; each
    read fetches the file indexes it needs first (:meth:`fetch_all_indexes`: every one,
    for tools that look at the whole checkpoint). Memory: the tensor being read, plus
    staging of at most ``max_buffer`` bytes."""

    def __init__(self, backend: Backend, location: str, *, verify: bool = True, memory: HostMemory | None = None,
                 threads: int = 2, max_buffer: int = 16 << 20, opened: Opened | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        self.opened = opened if opened is not None else read_manifest_phase(backend, location)
        self.manifest = self.opened.manifest
        self.location = location
        self.verify = verify
        self.max_buffer = max_buffer
        self.block = block_size(self.manifest)
        self.files = OpenFiles(self.opened.folder, self.manifest, digest=self.opened.digest, spill=backend.remote,
                               siblings=self.opened.siblings)
        self.reader = Reader(self.files, memory or HostMemory(), threads, progress)
        self.fetch_threads = max(threads, 8)

    def fetch_indexes(self, files: Iterable[int]) -> None:
        """Fetch the indexes of ``files`` not fetched yet (format 3; at once)."""
        fetch_indexes(self.opened, files)

    def fetch_all_indexes(self) -> None:
        """Fetch every file index (and check the rule budget against their rows)."""
        fetch_all_indexes(self.opened)

    def read(self, key: str) -> torch.Tensor:
        """The full tensor ``key`` (a manifest tensor key) as a fresh CPU tensor."""
        return self.read_many([key])[0]

    def read_many(self, keys: list[str]) -> list[torch.Tensor]:
        """The full tensors ``keys`` (manifest tensor keys) as fresh CPU tensors, read
        together as ``load_full`` reads them: one plan, every checksum verified (the blocks
        read before landing, fresh whole chunks right after), one landing; nothing is
        returned unverified."""
        for key in keys:
            if key not in self.manifest.tensors:
                from ..hints import missing_tensor

                raise missing_tensor(self.manifest, key)
        matcher = Matcher(self.manifest)
        tensors = [matcher.fresh_tensor(key) for key in keys]
        fills = matcher.result.fills
        dests = dests_of(fills)
        geoms = fetch_plan_indexes(self.opened, dests)
        plan = plan_phase(self.manifest, fills, verify=self.verify, verify_fresh_first=False,
                          max_buffer=self.max_buffer, geoms=geoms, dests=dests)
        try:
            open_files_phase(self.files, plan, self.fetch_threads, self.reader.memory)
            plan.verify_with(self.reader)
            land_phase(self.reader, plan, fills, self.max_buffer, self.block)
        finally:
            if self.files.spill:
                self.files.forget()  # the spill holds one batch at a time
        return tensors

    def close(self) -> None:
        """Close the files and the folder."""
        self.files.close()
        self.opened.close()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



def verify_files(backend: Backend, location: str, names: Iterable[str], memory: HostMemory | None = None,
                 threads: int = 2) -> int:
    """Check the files ``names`` of the checkpoint at ``location`` against its manifest:
    each index against the manifest's digest, each data file's header and every 1 MiB
    block of its chunks against the index's checksums (other files may be absent). The
    first mismatch raises CorruptCheckpointError naming the file; returns the bytes hashed."""
    from ..errors import CorruptCheckpointError
    from ..plan.load_plan import chunk_checks

    with CheckpointReader(backend, location, memory=memory, threads=threads) as reader:
        manifest = reader.manifest
        wanted = set(names)
        files = {i for i, e in enumerate(manifest.files) if e.name in wanted or e.index_name in wanted}
        unknown = wanted - {n for i in files for n in (manifest.files[i].name, manifest.files[i].index_name)}
        if unknown:
            raise CorruptCheckpointError(f"{location}: the manifest lists no file {sorted(unknown)[0]!r}")
        reader.fetch_indexes(files)
        checks = []
        for key, entry in manifest.tensors.items():
            if entry.kind == "rank_local" or not manifest.indexed:
                chunks = [c for c in entry.chunks if c.file in files]
            else:
                chunks = manifest.resolve(entry._ord, [b for b in entry.boxes() if b[2] in files])
            for c in chunks:
                checks.extend(chunk_checks(key, c, None, reader.block))
        checks.sort(key=lambda c: (c.file, c.lo))
        for i in files:
            size = reader.files.handle(i).size
            if size != manifest.files[i].nbytes:
                raise CorruptCheckpointError(f"{manifest.files[i].name} has {size} bytes, the manifest says "
                                             f"{manifest.files[i].nbytes}")
        return reader.reader.verify(checks, headers=files)


__all__ = ["CheckpointReader", "verify_files"]
