"""The pieces of bench_compression.py that do not touch shardsafe's save/load: the trained
state (a GPT trained with AdamW, so weights and Adam moments have real statistics), its
bytes cut into 1 MiB blocks by kind of tensor, and the codecs measured on those blocks
(zstd / lz4 on the raw bytes, after a numpy byte-shuffle, blosc2's shuffle, ZipNN, and
shardsafe's own block codec when the installed shardsafe has one)."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

MiB = 1 << 20
BLOCK = 1 * MiB  # shardsafe's CHECKSUM_BLOCK default: compression works per block

# ============================================================================ the trained state


def _batch(cfg: dict, g: torch.Generator, device: str) -> torch.Tensor:
    """A batch with learnable structure, so the loss falls and the weights move away from
    their initialization the way training moves them: tokens drawn Zipf-like (a few ids
    common, most rare, as in text), each followed by a fixed successor with probability
    1/2 (a bigram to learn)."""
    v = cfg["vocab"]
    probs = 1.0 / (torch.arange(v, dtype=torch.float64) + 10.0)
    succ = torch.randperm(v, generator=torch.Generator().manual_seed(7))
    draws = torch.multinomial(probs, cfg["batch"] * (cfg["seq"] + 1), replacement=True, generator=g)
    tokens = draws.view(cfg["batch"], cfg["seq"] + 1)
    follow = torch.rand(tokens.shape, generator=g) < 0.5
    for i in range(1, tokens.shape[1]):
        tokens[:, i] = torch.where(follow[:, i], succ[tokens[:, i - 1]], tokens[:, i])
    return tokens.to(device)


def train(cfg: dict, steps: int, autocast: bool, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                                          list[float], float]:
    """The benchmark GPT (bench_distributed.GPT) after ``steps`` AdamW steps (lr 1e-3,
    weight decay 0.1), fp32 master weights; with ``autocast`` the forward and backward run
    under bf16 autocast (on CUDA when present, else on the CPU: slow without bf16 units).
    Returns (model on CPU, optimizer, losses, seconds)."""
    from bench_distributed import GPT

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(seed)
    model = GPT(**cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1000 + seed)
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = _batch(cfg, g, device)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    secs = time.perf_counter() - t0
    model.cpu()
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v):
                st[k] = v.cpu()
    return model, opt, losses, secs


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, weights_dtype: torch.dtype) -> dict[str, Any]:
    """The checkpointed tree: {"model": {fqn: weight (as ``weights_dtype``)}, "optim":
    {fqn: {"exp_avg", "exp_avg_sq", "step"}}}; tensors detached and contiguous."""
    names = {p: n for n, p in model.named_parameters()}
    msd = {n: p.detach().to(weights_dtype).contiguous() for n, p in model.named_parameters()}
    osd = {}
    for p, st in opt.state.items():
        osd[names[p]] = {"exp_avg": st["exp_avg"].detach().contiguous(),
                         "exp_avg_sq": st["exp_avg_sq"].detach().contiguous(), "step": float(st["step"])}
    return {"model": msd, "optim": osd}


def kinds_of(state: dict[str, Any]) -> dict[str, list[torch.Tensor]]:
    """The state's tensors by kind: weights (named by dtype: "weights fp32" / "weights
    bf16"), "exp_avg", "exp_avg_sq"."""
    out: dict[str, list[torch.Tensor]] = {}
    for t in state["model"].values():
        out.setdefault("weights " + ("bf16" if t.dtype == torch.bfloat16 else "fp32"), []).append(t)
    for st in state["optim"].values():
        out.setdefault("exp_avg", []).append(st["exp_avg"])
        out.setdefault("exp_avg_sq", []).append(st["exp_avg_sq"])
    return out


@dataclass
class Blocks:
    """The bytes of some tensors, each cut into BLOCK-sized pieces (a tensor's last piece
    shorter), as numpy uint8 views, with the element size of each."""

    views: list[np.ndarray] = field(default_factory=list)
    itemsizes: list[int] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.views)

    def __add__(self, other: Blocks) -> Blocks:
        return Blocks(self.views + other.views, self.itemsizes + other.itemsizes)


def blocks_of(tensors: list[torch.Tensor], block: int = BLOCK) -> Blocks:
    out = Blocks()
    for t in tensors:
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        for lo in range(0, raw.nbytes, block):
            out.views.append(raw[lo: lo + block])
            out.itemsizes.append(t.element_size())
    return out


# ============================================================================ codecs


def shuffle(data: np.ndarray, itemsize: int) -> bytes:
    """Byte-shuffle (numpy): byte 0 of every element, then byte 1, ...; a tail shorter than
    an element follows unchanged."""
    whole = data.nbytes - data.nbytes % itemsize
    if itemsize <= 1 or whole == 0:
        return data.tobytes()
    return data[:whole].reshape(-1, itemsize).T.tobytes() + data[whole:].tobytes()


def unshuffle(data: bytes, itemsize: int, n: int) -> bytes:
    src = np.frombuffer(data, np.uint8)
    whole = n - n % itemsize
    if itemsize <= 1 or whole == 0:
        return bytes(src)
    return src[:whole].reshape(itemsize, -1).T.tobytes() + src[whole:].tobytes()


@dataclass
class Codec:
    """``compress(block, itemsize) -> bytes`` (None: stored raw) and ``decompress(stored,
    itemsize, n) -> bytes``; both must be safe to call from several threads at once."""

    name: str
    compress: Callable[[np.ndarray, int], bytes | None]
    decompress: Callable[[bytes, int, int], bytes]
    note: str = ""


def _per_thread(factory: Callable[[], Any]) -> Callable[[], Any]:
    local = threading.local()

    def get() -> Any:
        obj = getattr(local, "obj", None)
        if obj is None:
            obj = local.obj = factory()
        return obj

    return get


def library_codecs() -> tuple[list[Codec], list[str]]:
    """The reference codecs that are installed, and a line for each one that is not."""
    out: list[Codec] = []
    missing: list[str] = []
    try:
        import zstandard

        zc = _per_thread(lambda: zstandard.ZstdCompressor(level=1))
        zd = _per_thread(zstandard.ZstdDecompressor)
        out.append(Codec("zstd-1", lambda b, k: zc().compress(b),
                         lambda c, k, n: zd().decompress(c, max_output_size=n)))
        out.append(Codec("shuffle+zstd-1", lambda b, k: zc().compress(shuffle(b, k)),
                         lambda c, k, n: unshuffle(zd().decompress(c, max_output_size=n), k, n), "numpy shuffle"))
    except ImportError as exc:
        missing.append(f"zstandard not installed ({exc}): no zstd rows")
    try:
        import lz4.block as lzb

        out.append(Codec("lz4", lambda b, k: lzb.compress(b, store_size=False),
                         lambda c, k, n: lzb.decompress(c, uncompressed_size=n)))
        out.append(Codec("shuffle+lz4", lambda b, k: lzb.compress(shuffle(b, k), store_size=False),
                         lambda c, k, n: unshuffle(lzb.decompress(c, uncompressed_size=n), k, n), "numpy shuffle"))
    except ImportError as exc:
        missing.append(f"lz4 not installed ({exc}): no lz4 rows")
    out += _blosc2_codecs(missing)
    out += _zipnn_codecs(missing)
    return out, missing


def _blosc2_codecs(missing: list[str]) -> list[Codec]:
    try:
        import blosc2
    except ImportError as exc:
        missing.append(f"blosc2 not installed ({exc}): no blosc2 rows")
        return []
    blosc2.set_nthreads(1)  # parallelism comes from our threads, as for every other codec
    out = []
    shuffle_filter = blosc2.Filter.SHUFFLE
    for name, codec in (("zstd-1", blosc2.Codec.ZSTD), ("lz4", blosc2.Codec.LZ4)):
        out.append(Codec(f"blosc2 shuffle+{name}",
                         lambda b, k, codec=codec: blosc2.compress(b, typesize=k, clevel=1, filter=shuffle_filter,
                                                                   codec=codec, _ignore_multiple_size=True),
                         lambda c, k, n: blosc2.decompress(c), f"blosc2 {blosc2.__version__}, clevel 1"))
    return out


def _zipnn_codecs(missing: list[str]) -> list[Codec]:
    try:
        from zipnn import ZipNN
    except ImportError as exc:
        missing.append(f"zipnn not installed ({exc}): no ZipNN row")
        return []
    dtypes = {4: "float32", 2: "bfloat16"}
    per = {k: _per_thread(lambda d=d: ZipNN(bytearray_dtype=d, threads=1)) for k, d in dtypes.items()}

    def comp(b: np.ndarray, k: int) -> bytes | None:
        if k not in per:
            return None
        # a private copy: ZipNN reorders the bytes of its input in place (even of a bytes object)
        return per[k]().compress(bytearray(b.tobytes()))

    def decomp(c: bytes, k: int, n: int) -> bytes:
        return bytes(per[k]().decompress(c))

    return [Codec("ZipNN", comp, decomp, "zipnn defaults (byte grouping, AUTO method), threads=1")]


def shardsafe_codecs() -> tuple[list[Codec], str]:
    """shardsafe's own block codecs (``shardsafe.format.codecs``: ``compress(codec, data,
    itemsize)`` and ``decompress_into(codec, stored, itemsize, out)``), guarded: an
    installed shardsafe without them gives [] and a line saying so."""
    try:
        mod = importlib.import_module("shardsafe.format.codecs")
        names = tuple(mod.CODECS)
        comp, dec = mod.compress, mod.decompress_into
    except (ImportError, AttributeError) as exc:
        import shardsafe

        return [], f"shardsafe at {shardsafe.__file__} has no block codecs ({exc}): no shardsafe rows"
    out = []
    for name in names:
        def decompress(c: bytes, k: int, n: int, name: str = name) -> bytes:
            buf = bytearray(n)
            dec(name, c, k, memoryview(buf))
            return bytes(buf)

        out.append(Codec(f"shardsafe {name}", lambda b, k, name=name: comp(name, memoryview(b), k), decompress,
                         "shardsafe.format.codecs (shuffle + codec, raw below its gain threshold)"))
    return out, f"shardsafe block codecs found: {', '.join(names)} (shardsafe.format.codecs)"


# ============================================================================ measuring


def compress_all(codec: Codec, blocks: Blocks) -> list[bytes | None]:
    return [codec.compress(v, k) for v, k in zip(blocks.views, blocks.itemsizes)]


def stored_bytes(blocks: Blocks, packed: list[bytes | None]) -> list[int]:
    """Bytes stored per block: the compressed size, or the raw size when that is not smaller
    (stored raw, as shardsafe does: a block never grows)."""
    return [v.nbytes if c is None else min(len(c), v.nbytes) for v, c in zip(blocks.views, packed)]


def check_round_trip(codec: Codec, blocks: Blocks, packed: list[bytes | None]) -> None:
    for i, (v, k, c) in enumerate(zip(blocks.views, blocks.itemsizes, packed)):
        if c is None or len(c) >= v.nbytes:
            continue
        if codec.decompress(c, k, v.nbytes) != v.tobytes():
            raise SystemExit(f"{codec.name}: block {i} does not decompress to its bytes")


def timed_pass(fn: Callable[[int], Any], n: int, threads: int, pool: Any) -> float:
    """Seconds to run ``fn(i)`` for i in range(n): on this thread (threads == 1) or spread
    over ``pool`` (``threads`` workers, interleaved so each gets a fair share)."""
    t0 = time.perf_counter()
    if threads == 1:
        for i in range(n):
            fn(i)
    else:
        list(pool.map(lambda j: [fn(i) for i in range(j, n, threads)], range(threads)))
    return time.perf_counter() - t0
