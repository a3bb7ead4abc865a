"""A remote load's byte ranges, fetched once: where they are kept, and blocks checked as they arrive.

:meth:`OpenFiles.prefetch <shardsafe.engine.reader.OpenFiles.prefetch>` fetches every byte
range a load will read before anything is verified or lands (storage/spill.py). The
requests go into host memory leased from the load's budget while its free room lasts
(:func:`memory_room`), the rest into a local spill file. A block whose bytes arrive in
memory within one request is hashed right there, on the fetch thread
(:class:`FetchChecks`), so the verify phase only checks what was not: a mismatch fails the
fetch, before any destination byte is written, exactly as verification would.
"""

from __future__ import annotations

import bisect
import threading

from ..budget import HostMemory
from ..errors import CorruptCheckpointError
from ..format.checksum import checksum
from ..knobs import SPILL_MEMORY
from ..plan.load_plan import BlockCheck
from ..storage.spill import Fetched


def memory_room(memory: HostMemory | None) -> int:
    """Bytes of fetched ranges a load may keep in memory: the budget's free room; with no
    budget limit, ``SPILL_MEMORY``. (When not everything fits, the spill leaves
    ``SPILL_HEADROOM`` of it to the reader's buffers.)"""
    if memory is None:
        return 0
    if memory.limit is None:
        return SPILL_MEMORY
    return max(0, memory.limit - memory.in_use)


class FetchChecks:
    """The blocks to verify, checked on the fetch threads when a request brings them into
    memory whole; ``done`` holds those that passed."""

    def __init__(self, checks: list[BlockCheck], name: object) -> None:
        self.by_file: dict[int, list[BlockCheck]] = {}
        for c in sorted(checks, key=lambda c: (c.file, c.lo)):
            self.by_file.setdefault(c.file, []).append(c)
        self.starts = {f: [c.lo for c in cs] for f, cs in self.by_file.items()}
        self.name = name  # file index -> printable name
        self.done: set[BlockCheck] = set()
        self._lock = threading.Lock()

    def on_fetched(self, file: int) -> Fetched | None:
        """The callback checking file ``file``'s blocks in a range fetched into memory."""
        checks = self.by_file.get(file)
        if not checks:
            return None
        starts = self.starts[file]

        def check(lo: int, hi: int, data: memoryview) -> None:
            passed = []
            for c in checks[bisect.bisect_left(starts, lo):]:
                if c.lo >= hi:
                    break
                if c.hi > hi:
                    continue  # across the end of this request: the verify phase checks it
                if checksum(data[c.lo - lo: c.hi - lo]) != c.expected:
                    raise CorruptCheckpointError(f"checksum mismatch in {self.name(c.file)}, tensor '{c.key}', "
                                                 f"bytes {c.lo}-{c.hi}: the data is corrupt")
                passed.append(c)
            with self._lock:
                self.done.update(passed)

        return check
