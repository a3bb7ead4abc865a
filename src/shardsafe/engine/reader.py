"""The one reader: opens a checkpoint's data files, verifies checksum blocks, and lands
bytes in destination tensors — for ``load``, ``load_full``, ``verify``, ``export`` and
``diff`` alike.

- Files are opened from the checkpoint's pinned folder (so a load keeps reading one
  checkpoint while another is renamed into its place), checked for size, and their
  safetensors header checked against the manifest (digest, and every chunk the manifest
  places in the file: same byte range, dtype and shape), once per file per session.
- Verification reads the bytes (``pread`` into a small reused buffer, nothing mapped: a
  file truncated meanwhile gives a CheckpointError, not SIGBUS; remote ranges fetched into
  memory are hashed where they are, or as they arrive) and hashes each block.
- Landing reads straight into the destination's memory when its layout allows, else via
  a leased staging buffer; ``post_verify`` ops (memory the loader allocated) are hashed
  after they land, in one pass.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import torch

from ..errors import CheckpointChangedError, CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from ..format.checksum import checksum
from ..format.dtypes import torch_dtype
from ..format.manifest import MANIFEST_NAME, Manifest
from ..format.zindex import LOGICAL_BASE
from ..knobs import READ_BATCH as BATCH_BYTES
from ..knobs import REMOTE_VERIFY_WINDOW, SPILL_HEADROOM, VERIFY_WINDOW
from ..layout import Box
from ..plan.load_plan import BlockCheck, ReadOp
from ..storage.base import Folder, ReadHandle
from ..storage.spill import SpilledHandle, prefetch
from ..workers import pool
from .buffers import writable_bytes
from .fetch import FetchChecks, memory_room
from .memory import HostMemory, Lease
from .parallel import split_work
from .zread import BlockCache, ReadAhead, ZHandle

IOV_MAX = 1024


class OpenFiles:
    """The data files of one checkpoint, opened on demand from its pinned folder.

    Thread-safe. ``check_header`` verifies a file's header once; missing, truncated,
    replaced and non-regular files raise CorruptCheckpointError naming the file."""

    def __init__(self, folder: Folder, manifest: Manifest, check_sizes: bool = True, digest: int | None = None,
                 spill: bool = False, siblings: Callable[[str], Folder] | None = None) -> None:
        self.folder = folder
        self.siblings = siblings  # opens a sibling checkpoint's folder by name (referenced files, format 3.1)
        self.ref_folders: dict[str, Folder] = {}
        self.spill = spill  # remote files: prefetched ranges are read back from a local spill (storage/spill.py)
        self.manifest = manifest
        self.digest = digest  # of the manifest bytes read: a different one now means the checkpoint changed
        self.check_sizes = check_sizes  # ``verify`` reports size mismatches itself
        self.handles: dict[int, ReadHandle] = {}
        self.headers_ok: set[int] = set()
        self._lock = threading.Lock()
        self.memory: HostMemory | None = None  # compressed blocks' buffers come from it (set by the Reader)
        self.blocks = BlockCache(lambda: self.memory)  # verified decompressed blocks, kept for landing
        self.checked: set[BlockCheck] = set()  # blocks verified as they were fetched (prefetch)

    def name(self, index: int) -> str:
        """The printable location of file ``index``."""
        ref = self.manifest.ref_file(index)
        if ref is not None:
            if ref.checkpoint in self.ref_folders:
                return self.ref_folders[ref.checkpoint].where(ref.name)
            return f"{ref.checkpoint or '.'}/{ref.name}"
        return self.folder.where(self.manifest.files[index].name)

    def _ref_folder(self, checkpoint: str) -> Folder:
        """The folder of referenced checkpoint ``checkpoint`` (opened once; "" is this one)."""
        if checkpoint == "":
            return self.folder
        found = self.ref_folders.get(checkpoint)
        if found is None:
            if self.siblings is None:
                raise CorruptCheckpointError(f"this checkpoint refers to checkpoint '{checkpoint}', which cannot be "
                                             "opened from here (opened without its parent folder)")
            try:
                found = self.siblings(checkpoint)
            except CheckpointNotFoundError:
                raise CorruptCheckpointError(
                    f"{self.folder.location}: refers to data in checkpoint '{checkpoint}' (a sibling in the same "
                    "folder), which is missing: it was deleted or moved; restore it, or load a self-contained "
                    "checkpoint") from None
            self.ref_folders[checkpoint] = found
        return found

    def _open_ref(self, index: int) -> ReadHandle:
        ref = self.manifest.ref_file(index)
        assert ref is not None
        folder = self._ref_folder(ref.checkpoint)
        try:
            h = folder.open_read(ref.name)
        except CheckpointNotFoundError:
            raise CorruptCheckpointError(
                f"{self.folder.location}: referenced data file {folder.where(ref.name)} (checkpoint "
                f"'{ref.checkpoint or '.'}') is missing: it was deleted; restore it, or load a self-contained "
                "checkpoint") from None
        if h.size != ref.nbytes and self.check_sizes:
            h.close()
            raise CorruptCheckpointError(
                f"referenced data file {folder.where(ref.name)} has {h.size} bytes, the manifest says {ref.nbytes} "
                "(replaced or truncated)")
        return h

    def handle(self, index: int) -> ReadHandle:
        """The open handle of file ``index`` (size checked)."""
        h = self.handles.get(index)
        if h is not None:
            return h
        with self._lock:
            h = self.handles.get(index)
            if h is None:
                h = self._open(index)
                if self.manifest.version >= (3, 2):  # compressed chunks: reads of logical ranges decompress
                    h = ZHandle(h, lambda: self.manifest.zrows(index), self.manifest.extra["checksum_block"],
                                self.name(index), lambda: self.memory, self.blocks)
                self.handles[index] = h
            return h

    def _open(self, index: int) -> ReadHandle:
        if index >= len(self.manifest.files):
            h = self._open_ref(index)
            return SpilledHandle(h) if self.spill else h
        entry = self.manifest.files[index]
        try:
            h = self.folder.open_read(entry.name)
        except CheckpointNotFoundError:
            if self.folder.kind(MANIFEST_NAME) is None or self._manifest_changed():
                raise CheckpointChangedError(
                    f"{self.folder.location}: the checkpoint was deleted or replaced while it was read") from None
            raise CorruptCheckpointError(f"data file {self.name(index)} is missing") from None
        if h.size != entry.nbytes and self.check_sizes:
            h.close()
            raise CorruptCheckpointError(
                f"data file {self.name(index)} has {h.size} bytes, the manifest says {entry.nbytes} "
                f"({'truncated' if h.size < entry.nbytes else 'replaced or appended to'})")
        if self.spill:
            try:
                return SpilledHandle(h)
            except BaseException:
                h.close()
                raise
        return h

    def prefetch(self, ranges: dict[int, list[tuple[int, int]]], threads: int, memory: HostMemory | None = None,
                 checks: list[BlockCheck] | None = None) -> int:
        """With ``spill``: fetch the ranges (per file) a load reads, once, ``threads`` requests at
        once, into ``memory`` while its room lasts, else to disk; ``checks`` arriving in memory
        are verified on the way (engine/fetch.py, ``checked``). Returns the bytes fetched."""
        if not self.spill:
            return 0
        handles = {f: self.handle(f) for f in ranges}
        for f, h in list(handles.items()):
            if isinstance(h, ZHandle):  # compressed chunks: their stored blocks (checked when decompressed)
                ranges = {**ranges, f: h.stored_ranges(ranges[f])}
                handles[f] = h.inner
        plain = {f for f, h in self.handles.items() if isinstance(h, SpilledHandle)}
        early = FetchChecks([c for c in checks or () if c.file in plain], self.name)
        self.checked = early.done
        return prefetch(handles, ranges, threads, memory, memory_room(memory), SPILL_HEADROOM,  # type: ignore[arg-type]
                        early.on_fetched)

    def held(self, index: int, lo: int, hi: int) -> memoryview | None:
        """Bytes ``[lo, hi)`` of file ``index`` when they were fetched into memory (no copy)."""
        h = self.handles.get(index)
        return h.view(lo, hi) if isinstance(h, SpilledHandle) else None

    def forget(self) -> None:
        """Drop what the spills hold (their local disk space and memory are freed)."""
        for h in self._spilled():
            h.forget()

    @property
    def fetched(self) -> int:
        """Bytes fetched from remote files (spilled handles only)."""
        return sum(h.fetched for h in self._spilled())

    @property
    def fetched_in_memory(self) -> int:
        """Of :attr:`fetched`, the bytes fetched into memory."""
        return sum(h.in_memory for h in self._spilled())

    def _spilled(self) -> list[SpilledHandle]:
        inner = [h.inner if isinstance(h, ZHandle) else h for h in self.handles.values()]
        return [h for h in inner if isinstance(h, SpilledHandle)]

    @property
    def stored_read(self) -> int:
        """Stored bytes of compressed chunks read so far (format 3.2)."""
        return sum(h.stored_read for h in self.handles.values() if isinstance(h, ZHandle))

    def _manifest_changed(self) -> bool:
        """True when the folder's manifest is no longer the one this load read (an in-place
        overwrite published a new one and deleted the old files)."""
        if self.digest is None:
            return False
        from ..checkpoint_folder import MAX_MANIFEST_BYTES

        try:
            data = self.folder.read_bytes(MANIFEST_NAME, MAX_MANIFEST_BYTES)
        except CheckpointError:
            return True
        return int(checksum(data), 16) != self.digest

    def check_header(self, index: int) -> None:
        """Verify file ``index``'s header against the manifest (once per session)."""
        if index in self.headers_ok or index >= len(self.manifest.files):
            return  # a referenced file: its chunks' block checksums (in this checkpoint's index) verify its bytes
        if self.manifest.indexed:
            self.manifest.index(index)  # format 3: the header's size and digest are in the (fetched) index
        entry = self.manifest.files[index]
        buf = bytearray(entry.header_bytes)
        self.handle(index).read_into([memoryview(buf)], 0)
        if checksum(buf) != entry.header_checksum:
            raise CorruptCheckpointError(f"checksum mismatch in the header of {self.name(index)}: the file is corrupt")
        check_header_matches(bytes(buf), self.manifest, index, self.name(index))
        self.headers_ok.add(index)

    def close(self) -> None:
        """Close every handle and every referenced checkpoint's folder."""
        with self._lock:
            for h in self.handles.values():
                h.close()
            self.handles.clear()
            self.blocks.close()
            for folder in self.ref_folders.values():
                folder.close()
            self.ref_folders.clear()

    def __enter__(self) -> OpenFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_header_matches(header: bytes, manifest: Manifest, index: int, where: str) -> None:
    """Check that data file ``index``'s safetensors header places every chunk the manifest
    puts in it at the same byte range, with the same dtype and shape (a manifest whose
    dtype contradicts the file would otherwise reinterpret its bytes)."""
    from ..format.datafile import ClaimedChunk, check_chunks_against_header, parse_header
    from ..format.dtypes import safetensors_code, torch_dtype

    if manifest.indexed and _is_canonical_header(header, manifest, index):
        return
    entries = parse_header(header, where)
    claims = []
    for key, chunk in manifest.chunks_in_file(index):
        dtype = torch_dtype(manifest.tensors[key].dtype)
        if dtype is None:
            raise CorruptCheckpointError(f"tensor '{key}': unknown dtype {manifest.tensors[key].dtype!r}")
        z = manifest.zrow(chunk) if manifest.version >= (3, 2) else None
        if z is not None:  # a compressed chunk: a U8 entry of its stored bytes
            claims.append(ClaimedChunk("U8", (z.end - z.start,), z.start, z.end, key))
            continue
        claims.append(ClaimedChunk(safetensors_code(dtype), tuple(chunk.lengths), chunk.start, chunk.end, key))
    check_chunks_against_header(entries, len(header), claims, where)


def _is_canonical_header(header: bytes, manifest: Manifest, index: int) -> bool:
    """True when ``header`` is byte for byte the header this writer makes for the chunks
    the file's index lists (names, dtypes, shapes, back to back at the listed ranges):
    such a header places every chunk where the index says, so the full parse can be
    skipped. False sends the caller to the full check (older writers, damage).

    The expected header is the text :func:`~shardsafe.format.datafile.build_header` makes
    of the rows in file order (``json.dumps`` with its separators and ASCII escapes),
    spelt here straight from the index's columns, one formatted member per row."""
    import struct
    from json.encoder import encode_basestring_ascii

    from ..format.datafile import HEADER_ALIGN, METADATA, METADATA_KEY, chunk_name, unique_chunk_names
    from ..format.dtypes import safetensors_code, torch_dtype

    fi = manifest.index(index)
    table = fi.table
    starts, ends = table.start.tolist(), table.end.tolist()
    offs, lens, dims = table.offsets.tolist(), table.lengths.tolist(), table.dims.tolist()
    ordinals = fi.ordinals
    rows = range(len(ordinals))
    if any(a > b for a, b in zip(starts, starts[1:])):
        rows = sorted(rows, key=starts.__getitem__)  # type: ignore[assignment]
    codes: dict[str, str | None] = {}
    tensors = manifest.tensors
    key_in_file = manifest.key_in_file
    names: list[str] = []
    fields: list[tuple[str, str, int, int]] = []  # dtype code, shape, data offsets
    base = len(header)
    offset = 0
    for r in rows:
        key = key_in_file(index, ordinals[r])
        entry = tensors[key]
        code = codes.get(entry.dtype, "")
        if code == "":
            dtype = torch_dtype(entry.dtype)
            code = codes[entry.dtype] = None if dtype is None else safetensors_code(dtype)
        if code is None:
            return False
        start, end = starts[r], ends[r]
        if start != base + offset:  # not back to back from the end of the header
            return False
        a, b = dims[r], dims[r + 1]
        o, n = offs[a:b], lens[a:b]
        names.append(key if not any(o) and tuple(n) == tuple(entry.shape) else chunk_name(key, o, False))
        fields.append((code, ",".join(map(str, n)), offset, offset + end - start))
        offset += end - start
    if len(set(names)) != len(names) or METADATA_KEY in names:
        names = unique_chunk_names(names)
    enc = encode_basestring_ascii
    text = f"{{{enc(METADATA_KEY)}:{json.dumps(METADATA, separators=(',', ':'))}" + "".join([
        f',{enc(name)}:{{"dtype":"{code}","shape":[{shape}],"data_offsets":[{lo},{hi}]}}'
        for name, (code, shape, lo, hi) in zip(names, fields)]) + "}"
    data = text.encode("utf-8")
    data += b" " * (-(len(data) + 8) % HEADER_ALIGN)
    return len(data) + 8 == base and header[8:] == data and header[:8] == struct.pack("<Q", len(data))


def windows(checks: list[BlockCheck], limit: int = VERIFY_WINDOW) -> list[list[BlockCheck]]:
    """Group checks (sorted by file and offset) into reads: same file, back to back, at
    most ``limit`` bytes (a larger block is a window of its own)."""
    out: list[list[BlockCheck]] = []
    for c in checks:
        if out:
            first, last = out[-1][0], out[-1][-1]
            if c.file == first.file and c.lo == last.hi and c.hi - first.lo <= limit:
                out[-1].append(c)
                continue
        out.append([c])
    return out


class Problems:
    """Collects bad blocks instead of raising (``shardsafe verify``)."""

    def __init__(self) -> None:
        self.bad: list[BlockCheck] = []
        self.errors: list[tuple[int, CheckpointError]] = []  # (file, error) for unreadable windows
        self._lock = threading.Lock()

    def add(self, check: BlockCheck) -> None:
        with self._lock:
            self.bad.append(check)

    def add_error(self, file: int, error: CheckpointError) -> None:
        with self._lock:
            self.errors.append((file, error))


class Reader:
    """Runs block checks and read ops on ``threads`` threads, buffers leased from ``memory``."""

    def __init__(self, files: OpenFiles, memory: HostMemory, threads: int = 2,
                 progress: Callable[[int], None] | None = None) -> None:
        self.files = files
        if files.memory is None:
            files.memory = memory
        # remote files: fewer, larger requests for what is read without the spill
        self.window = memory.fits(REMOTE_VERIFY_WINDOW if files.spill else VERIFY_WINDOW)  # a small budget: smaller
        self.memory = memory
        self.threads = max(1, threads)
        self.progress = progress

    # -- verification -----------------------------------------------------------------------
    def verify(self, checks: list[BlockCheck], problems: Problems | None = None,
               headers: set[int] | None = None) -> int:
        """Check the headers of files ``headers`` (default: the files of ``checks``), then
        hash every checked block from its file; the first mismatch raises (or, with
        ``problems``, every block mismatch is collected). Returns the bytes hashed."""
        for f in sorted({c.file for c in checks} if headers is None else headers):
            self.files.check_header(f)
        if self.files.checked:  # verified as they were fetched
            checks = [c for c in checks if c not in self.files.checked]
        units = self._units(windows(checks, self.window))
        parts = split_work(units, [sum(w[-1].hi - w[0].lo + 4096 for w in u) for u in units], self.threads)
        return sum(self._run(self._hash_windows, parts, problems))

    def _units(self, groups: list[list[BlockCheck]]) -> list[list[list[BlockCheck]]]:
        """Windows read together: consecutive compressed windows of one file whose stored
        bytes lie back to back (small chunks), up to a window's bytes; others alone."""
        units: list[list[list[BlockCheck]]] = []
        last: tuple[int, int] | None = None  # (file, stored end) of the last window
        size = 0
        for w in groups:
            f, lo, hi = w[0].file, w[0].lo, w[-1].hi
            stored = None
            handle = self.files.handle(f) if lo >= LOGICAL_BASE and hi > lo else None
            if isinstance(handle, ZHandle):
                try:
                    found = handle.stored_ranges([(lo, hi)])
                    stored = (found[0][0], found[-1][1])
                except CheckpointError:
                    pass  # (reading the window reports it)
            if stored is not None and units and last == (f, stored[0]) and size + hi - lo <= self.window:
                units[-1].append(w)
                size += hi - lo
            else:
                units.append([w])
                size = hi - lo
            last = None if stored is None else (f, stored[1])
        return units

    def _hash_windows(self, part: list[list[list[BlockCheck]]], problems: Problems | None) -> int:
        group = [w for unit in part for w in unit]
        size = min(max((w[-1].hi - w[0].lo for w in group), default=1), max(self.window, 1))
        lease: Lease | None = None
        hashed = 0
        # compressed windows: each one's stored blocks are read while the one before is decompressed
        ahead = ReadAhead(self.files.handle, [(w[0].file, w[0].lo, w[-1].hi) for w in group],
                          units=[len(unit) for unit in part])
        try:
            for i, w in enumerate(group):
                lo, hi = w[0].lo, w[-1].hi
                view = self.files.held(w[0].file, lo, hi) if hi > lo else None  # in memory: hashed where it is
                if view is None:
                    if lease is None or lease.nbytes < hi - lo:
                        if lease is not None:
                            lease.release()
                        lease = self.memory.lease(max(size, hi - lo))
                    view = memoryview(lease.tensor.numpy())[: hi - lo]
                    try:
                        if hi > lo:
                            ahead.read_into(i, view)
                    except CheckpointError as exc:
                        if problems is None:
                            raise
                        problems.add_error(w[0].file, exc)
                        continue
                for c in w:
                    if checksum(view[c.lo - lo: c.hi - lo]) != c.expected:
                        if problems is None:
                            raise CorruptCheckpointError(
                                f"checksum mismatch in {self.files.name(c.file)}, tensor '{c.key}', "
                                f"bytes {c.lo}-{c.hi}: the data is corrupt")
                        problems.add(c)
                hashed += hi - lo
                if self.progress is not None:
                    self.progress(hi - lo)
        finally:
            ahead.close()
            if lease is not None:
                lease.release()
        return hashed

    # -- landing ----------------------------------------------------------------------------
    def land(self, ops: list[ReadOp], dests: list[torch.Tensor], boxes: list[Box], *, max_buffer: int,
             post_verify: Callable[[ReadOp], bool] | None = None, block: int = 1 << 20) -> int:
        """Land every op's bytes in its destination (``dests[op.dest]``, which holds global
        box ``boxes[op.dest]`` of its tensor); ops for which
        ``post_verify`` is true are hashed after landing (whole chunks only). Returns the
        bytes landed."""
        direct: list[tuple[ReadOp, memoryview]] = []
        staged: list[ReadOp] = []
        memory: dict[int, memoryview] = {}  # dest index -> its bytes (a dest may take several ops)
        for op in ops:
            rng = op.dest_range
            if rng is None:
                staged.append(op)
                continue
            view = memory.get(op.dest)
            if view is None:
                view = memory[op.dest] = writable_bytes(dests[op.dest])
            direct.append((op, view if rng[0] == 0 and rng[1] == len(view) else view[rng[0]: rng[1]]))
        for f in sorted({op.chunk.file for op in ops}):
            self.files.handle(f)  # open (and size-check) every file before any byte lands
        batches = _batches(direct)
        groups = split_work(batches, [sum([len(view) for _, view in b]) for b in batches], self.threads)
        with pool(len(groups) - 1, "read") as workers:
            futures = [workers.submit(self._read_batches, g) for g in groups[1:]]
            try:
                if groups:
                    self._read_batches(groups[0])
                if staged:
                    self._read_staged(staged, dests, boxes, max_buffer)
            finally:
                for fut in futures:
                    fut.result()
            if post_verify is not None:
                jobs = [(op, view) for op, view in direct if post_verify(op)]
                parts = split_work(jobs, [op.nbytes for op, _ in jobs], self.threads)
                futures = [workers.submit(self._hash_landed, part, block) for part in parts[1:]]
                try:
                    if parts:
                        self._hash_landed(parts[0], block)
                finally:
                    for fut in futures:
                        fut.result()
        return sum([len(view) for _, view in direct]) + sum([op.nbytes for op in staged])

    def _read_batches(self, batches: list[list[tuple[ReadOp, memoryview]]]) -> None:
        """Each batch: one vectored read of single-run ops back to back in a file, or one
        op whose runs (rows of a box) land one after another in its destination range."""
        for batch in batches:
            op0, view0 = batch[0]
            handle = self.files.handle(op0.file)
            if len(batch) == 1 and len(op0.runs) != 1:
                pos = 0
                for s, n in op0.runs:
                    handle.read_into([view0[pos: pos + n]], s)
                    pos += n
                done = pos
            else:
                bufs = [view for _, view in batch if len(view)]
                if bufs:
                    handle.read_into(bufs, op0.runs[0][0])
                done = sum(len(b) for b in bufs)
            if self.progress is not None:
                self.progress(done)

    def _read_staged(self, ops: list[ReadOp], dests: list[torch.Tensor], boxes: list[Box], max_buffer: int) -> None:
        """Ops whose bytes are scattered in the destination: through one leased buffer."""
        size = max(op.nbytes for op in ops)
        lease = self.memory.lease(min(max(size, 1), max(max_buffer, size)))
        try:
            raw = memoryview(lease.tensor.numpy())
            for op in ops:
                n = op.nbytes
                handle = self.files.handle(op.file)
                pos = 0
                for s, m in op.runs:
                    handle.read_into([raw[pos: pos + m]], s)
                    pos += m
                dest = dests[op.dest]
                dtype = torch_dtype(self.files.manifest.tensors[op.key].dtype)  # copy_ converts when they differ
                piece = lease.tensor[:n].view(dtype).view(op.box.lengths) if n else torch.empty(op.box.lengths,
                                                                                               dtype=dtype)
                with torch.no_grad():
                    dest[op.box.relative_to(boxes[op.dest]).slices()].copy_(piece)
                if self.progress is not None:
                    self.progress(n)
        finally:
            lease.release()

    def _hash_landed(self, jobs: list[tuple[ReadOp, memoryview]], block: int) -> None:
        for op, view in jobs:
            chunk = op.chunk
            for b, expected in enumerate(chunk.checksum):
                piece = view[b * block: (b + 1) * block]
                if checksum(piece) != expected:
                    lo = chunk.start + b * block
                    raise CorruptCheckpointError(
                        f"checksum mismatch in {self.files.name(chunk.file)}, tensor '{op.key}', "
                        f"bytes {lo}-{lo + len(piece)}: the data is corrupt")

    # -- threads ----------------------------------------------------------------------------
    def _run(self, fn: Callable, parts: list, problems: Problems | None) -> list:
        if len(parts) <= 1:
            return [fn(p, problems) for p in parts]
        with pool(len(parts) - 1, "read") as workers:
            futures = [workers.submit(fn, p, problems) for p in parts[1:]]
            out = []
            try:
                out.append(fn(parts[0], problems))
            finally:
                out.extend(f.result() for f in futures)
            return out


def _batches(items: list[tuple[ReadOp, memoryview]]) -> list[list[tuple[ReadOp, memoryview]]]:
    """Group single-run ops on adjacent byte ranges of the same file into vectored reads
    of at most IOV_MAX buffers and about BATCH_BYTES."""
    keys = [(op.chunk.file, op.runs[0][0] if op.runs else 0) for op, _ in items]
    if keys != sorted(keys):
        order = sorted(range(len(items)), key=keys.__getitem__)
        items, keys = [items[i] for i in order], [keys[i] for i in order]
    out: list[list[tuple[ReadOp, memoryview]]] = []
    size = 0
    last_end = -1  # where the last item's run ends in its file, -1 when it has not exactly one run
    last_file = -1
    for it, (file, start) in zip(items, keys):
        runs = it[0].runs
        if len(runs) == 1:
            n = runs[0][1]
            if out and last_end == start and last_file == file and len(out[-1]) < IOV_MAX and size + n <= BATCH_BYTES:
                out[-1].append(it)
                size += n
                last_end = start + n
                continue
            out.append([it])
            size = n
            last_end, last_file = start + n, file
        else:
            out.append([it])
            size = runs[0][1] if runs else 0
            last_end = -1
    return out
