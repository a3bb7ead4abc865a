"""Load planning: for every destination box, the byte runs it needs from saved chunks."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CorruptCheckpointError, MissingKeysError
from ..format.dtypes import itemsize, torch_dtype
from ..format.manifest import Chunk, Manifest
from ..layout import Box, byte_runs, intersect
from ..state.match import Fill


@dataclass
class ReadOp:
    """Read part ``box`` (global coordinates) of ``fill`` from ``chunk``.

    ``runs`` are absolute (offset, length) byte ranges in the chunk's file whose
    concatenation is ``box`` in row-major order."""

    fill: Fill
    chunk: Chunk
    box: Box
    runs: list[tuple[int, int]]

    @property
    def nbytes(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def whole_chunk(self) -> bool:
        return self.box == Box(self.chunk.offsets, self.chunk.lengths)

    @property
    def direct(self) -> bool:
        """The runs can land straight in the destination's memory."""
        t = self.fill.tensor
        return self.box == self.fill.box and t.device.type == "cpu" and t.is_contiguous()


def plan_reads(manifest: Manifest, fills: list[Fill]) -> list[ReadOp]:
    """Read ops covering every fill; raises if the saved chunks leave a hole."""
    ops: list[ReadOp] = []
    for fill in fills:
        entry = manifest.tensors[fill.key]
        dtype = torch_dtype(entry.dtype)
        if dtype is None:
            raise CorruptCheckpointError(f"tensor '{fill.key}': unknown dtype {entry.dtype!r}")
        size = itemsize(dtype)
        covered = 0
        for chunk in entry.chunks:
            cbox = Box(tuple(chunk.offsets), tuple(chunk.lengths))
            if fill.box.is_empty():
                break
            part = intersect(fill.box, cbox)
            if part is None:
                continue
            base = chunk.start
            runs = [(base + s, n) for s, n in byte_runs(part, cbox, size)]
            ops.append(ReadOp(fill, chunk, part, runs))
            covered += part.numel
        if covered != fill.box.numel:
            raise MissingKeysError(
                f"tensor '{fill.key}': saved chunks cover {covered} of the {fill.box.numel} elements needed"
            )
    return ops
