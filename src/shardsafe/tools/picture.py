"""``shardsafe inspect --layout KEY``: which saving rank holds which box of a tensor.

Drawn over the tensor's first two dimensions (a 1-D tensor is one row; later dimensions
are projected away, and chunks that only split those overlap in the picture): as a
character grid with one symbol per rank, and as a PNG (matplotlib, Agg backend).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..format.manifest import Manifest
from ..hints import missing_tensor
from .common import PathLike, UsageError, human_bytes
from .inspect import tensor_bytes

SYMBOLS = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclass(frozen=True)
class LayoutBox:
    """One saved chunk: the rank that wrote it, its box in the global tensor, and the
    rectangle it covers over the first two dimensions."""

    rank: int
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    file: str
    nbytes: int

    @property
    def row0(self) -> int:
        return self.offsets[0] if len(self.offsets) >= 2 else 0

    @property
    def rows(self) -> int:
        return self.lengths[0] if len(self.lengths) >= 2 else 1

    @property
    def col0(self) -> int:
        if len(self.offsets) >= 2:
            return self.offsets[1]
        return self.offsets[0] if self.offsets else 0

    @property
    def cols(self) -> int:
        if len(self.lengths) >= 2:
            return self.lengths[1]
        return self.lengths[0] if self.lengths else 1


def symbol(rank: int) -> str:
    """The grid symbol of ``rank`` (``#`` past the 62nd rank)."""
    return SYMBOLS[rank] if 0 <= rank < len(SYMBOLS) else "#"


def _manifest(source: Manifest | PathLike) -> Manifest:
    if isinstance(source, Manifest):
        return source
    from ..api import read_manifest

    return read_manifest(source)


def plane(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, cols) of the drawn plane of a tensor of ``shape``."""
    if len(shape) >= 2:
        return shape[0], shape[1]
    if len(shape) == 1:
        return 1, shape[0]
    return 1, 1


def layout_boxes(source: Manifest | PathLike, key: str) -> list[LayoutBox]:
    """The chunks of tensor ``key`` as boxes labeled with their writing rank."""
    manifest = _manifest(source)
    entry = manifest.tensors.get(key)
    if entry is None:
        raise missing_tensor(manifest, key)
    return [LayoutBox(c.rank, tuple(c.offsets), tuple(c.lengths), manifest.files[c.file].name, c.end - c.start)
            for c in entry.chunks]


def layout_text(source: Manifest | PathLike, key: str, width: int = 64, height: int = 16) -> str:
    """A character grid of tensor ``key`` over its first two dimensions: each cell shows
    the rank whose chunk holds the cell's center element (``*`` several, ``.`` none),
    followed by a legend of every chunk."""
    manifest = _manifest(source)
    boxes = layout_boxes(manifest, key)
    entry = manifest.tensors[key]
    shape = tuple(entry.shape)
    nrows, ncols = plane(shape)
    head = (f"{key}: {entry.dtype} {list(shape)}, {entry.kind}, {len(boxes)} chunk"
            f"{'s' if len(boxes) != 1 else ''} written by {len({b.rank for b in boxes})} rank(s), "
            f"{human_bytes(tensor_bytes(entry))}")
    lines = [head]
    if nrows == 0 or ncols == 0:
        lines.append("(empty tensor: nothing to draw)")
    else:
        gr, gc = min(nrows, height), min(ncols, width)
        lines.append(f"grid: {gr} x {gc} cells over dims 0-1 ({nrows} x {ncols}; "
                     f"one cell = {nrows / gr:.3g} x {ncols / gc:.3g} elements)"
                     if len(shape) >= 2 else f"grid: 1 x {gc} cells over dim 0 ({ncols} elements)")
        for i in range(gr):
            r = int((i + 0.5) * nrows / gr)
            row = []
            for j in range(gc):
                c = int((j + 0.5) * ncols / gc)
                ranks = {b.rank for b in boxes if b.row0 <= r < b.row0 + b.rows and b.col0 <= c < b.col0 + b.cols}
                row.append(symbol(next(iter(ranks))) if len(ranks) == 1 else ("*" if ranks else "."))
            lines.append("  " + "".join(row))
        if len(shape) > 2:
            lines.append(f"(dims 2..{len(shape) - 1} are not drawn; '*' marks cells held by several ranks)")
    lines.append("legend:")
    for b in sorted(boxes, key=lambda b: (b.rank, b.offsets)):
        span = ", ".join(f"{o}:{o + n}" for o, n in zip(b.offsets, b.lengths)) or "scalar"
        lines.append(f"  {symbol(b.rank)}  rank {b.rank}: [{span}] {human_bytes(b.nbytes)} in {b.file}")
    return "\n".join(lines)


def layout_png(source: Manifest | PathLike, key: str, out: PathLike) -> Path:
    """Draw tensor ``key``'s chunks as rectangles labeled with their rank into the PNG ``out``."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError:
        raise UsageError("drawing a PNG needs matplotlib: pip install matplotlib") from None
    manifest = _manifest(source)
    boxes = layout_boxes(manifest, key)
    entry = manifest.tensors[key]
    nrows, ncols = plane(tuple(entry.shape))
    ranks = sorted({b.rank for b in boxes})
    fig = Figure(figsize=(7, 6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    palette = "tab10" if len(ranks) <= 10 else "tab20"
    import matplotlib

    cmap = matplotlib.colormaps[palette]
    color = {r: cmap(i % cmap.N) for i, r in enumerate(ranks)}
    for b in boxes:
        ax.add_patch(Rectangle((b.col0, b.row0), b.cols, b.rows, facecolor=color[b.rank], edgecolor="black",
                               linewidth=1.0, alpha=0.85))
        ax.text(b.col0 + b.cols / 2, b.row0 + b.rows / 2, f"rank {b.rank}", ha="center", va="center",
                fontsize=9)
    ax.set_xlim(0, max(ncols, 1))
    ax.set_ylim(max(nrows, 1), 0)
    ax.set_xlabel("dim 1" if len(entry.shape) >= 2 else "dim 0")
    ax.set_ylabel("dim 0" if len(entry.shape) >= 2 else "")
    ax.set_title(f"{key}  {entry.dtype} {list(entry.shape)}  ({entry.kind}, {len(boxes)} chunks)", fontsize=10)
    if len(ranks) <= 20:
        ax.legend(handles=[Patch(facecolor=color[r], label=f"rank {r}") for r in ranks], loc="upper left",
                  bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png", dpi=100)
    return out
