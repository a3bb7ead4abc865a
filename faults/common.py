"""What every part of the campaign shares: the outcome classes and their tally, the
deterministic states that are saved, sentinel-filled destinations, bitwise comparison,
and the leak checks (threads, file descriptors, temp folders)."""

from __future__ import annotations

import gc
import math
import os
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import shardsafe
from shardsafe.errors import CheckpointError

# The one bitwise comparison (tests/bitwise.py), shared with the tests: dicts compare by their
# items, tensors by dtype, shape and bytes, plain values by type and bits.
_TESTS = str(Path(__file__).resolve().parent.parent / "tests")
if _TESTS not in sys.path:
    sys.path.append(_TESTS)
from bitwise import bitwise_equal, first_difference, same_value  # noqa: E402, F401 (re-exported)

MiB = 1 << 20

# ----------------------------------------------------------------------------- outcome classes

DETECTED = "detected"
LOADED = "loaded_ok"
SILENT = "silent_wrong"
OTHER = "other_exc"
HANG = "hang"
TOUCHED = "dest_touched"
LEFTOVERS = "leftovers"
TORN = "torn_or_lost"

CLASSES = (DETECTED, LOADED, SILENT, OTHER, HANG, TOUCHED, LEFTOVERS, TORN)
BAD = (SILENT, OTHER, HANG, TOUCHED, LEFTOVERS, TORN)
# When the probes of one trial disagree, the trial takes the worst class.
SEVERITY = {SILENT: 0, TORN: 1, TOUCHED: 2, HANG: 3, OTHER: 4, LEFTOVERS: 5, DETECTED: 6, LOADED: 7}
TITLES = {DETECTED: "detected", LOADED: "loaded bitwise-correct / intact", SILENT: "silent wrong data",
          OTHER: "other exception", HANG: "hang", TOUCHED: "destination touched", LEFTOVERS: "leftovers",
          TORN: "torn or lost"}


def outcome(cls: str, method: str, detail: str = "", **extra: Any) -> dict[str, Any]:
    """One probe's result: its class, what ran, and a short detail (the error)."""
    return {"cls": cls, "method": method, "detail": detail[:600], **extra}


def worst(classes: Iterable[str]) -> str:
    """The class of a trial whose probes gave ``classes``."""
    return min(classes, key=SEVERITY.__getitem__)


def describe_error(exc: BaseException) -> str:
    """``Type: message`` of an exception, shortened."""
    return f"{type(exc).__name__}: {exc}"[:600]


def classify_error(exc: BaseException, expected: tuple[type[BaseException], ...]) -> str:
    """DETECTED when ``exc`` is one of the ``expected`` CheckpointError subclasses, else OTHER."""
    if isinstance(exc, CheckpointError) and isinstance(exc, expected):
        return DETECTED
    return OTHER


@dataclass
class Tally:
    """Counts of trial classes per fault kind, per-probe counts, and examples of bad trials."""

    kinds: dict[str, Counter[str]] = field(default_factory=dict)
    probes: dict[str, Counter[str]] = field(default_factory=dict)
    bad: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Counter[str]] = field(default_factory=dict)
    seconds: Counter[str] = field(default_factory=Counter)

    def add(self, kind: str, probes: list[dict[str, Any]], **info: Any) -> str:
        """Record one trial of ``kind`` from its probe results; returns the trial's class."""
        cls = worst(p["cls"] for p in probes) if probes else OTHER
        self.kinds.setdefault(kind, Counter())[cls] += 1
        for p in probes:
            self.probes.setdefault(f"{kind} / {p['method']}", Counter())[p["cls"]] += 1
        if cls in BAD and len(self.bad) < 200:
            self.bad.append({"kind": kind, "class": cls, **info,
                             "probes": [p for p in probes if p["cls"] in BAD][:6]})
        return cls

    def note(self, kind: str, what: str) -> None:
        """Count something worth reporting that is not a class (e.g. which state survived a kill)."""
        self.notes.setdefault(kind, Counter())[what] += 1

    def bad_total(self) -> int:
        return sum(c[b] for c in self.kinds.values() for b in BAD)

    def table(self) -> str:
        """The summary as a markdown table: one row per fault kind, one column per class."""
        head = "| fault kind | trials | " + " | ".join(TITLES[c] for c in CLASSES) + " |"
        rule = "|---|---:|" + "---:|" * len(CLASSES)
        rows = [head, rule]
        total: Counter[str] = Counter()
        for kind, counts in self.kinds.items():
            total.update(counts)
            rows.append(f"| {kind} | {sum(counts.values())} | " + " | ".join(str(counts[c]) for c in CLASSES)
                        + " |")
        rows.append(f"| **all** | **{sum(total.values())}** | "
                    + " | ".join(f"**{total[c]}**" for c in CLASSES) + " |")
        return "\n".join(rows)

    def to_json(self) -> dict[str, Any]:
        return {"kinds": {k: dict(v) for k, v in self.kinds.items()},
                "probes": {k: dict(v) for k, v in self.probes.items()},
                "notes": {k: dict(v) for k, v in self.notes.items()},
                "seconds": {k: round(v, 1) for k, v in self.seconds.items()},
                "bad_total": self.bad_total(), "bad_examples": self.bad}


# ----------------------------------------------------------------------------- states


def single_state(seed: int = 1234) -> dict[str, Any]:
    """The single-process checkpoint's state: many dtypes and shapes (a 2.5 MiB tensor over
    three checksum blocks, a non-contiguous source, 0-d and empty tensors), nested
    containers, every kind of typed-JSON value and a rank-local value. Another ``seed``
    gives the same layout with other values."""
    g = torch.Generator().manual_seed(seed)

    def ints(lo: int, hi: int, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(dtype)

    return {
        "big": torch.randn(640 * 1024, generator=g),
        "mat": torch.randn(300, 129, generator=g).t(),
        "f64": torch.randn(1000, generator=g, dtype=torch.float64),
        "f16": torch.randn(33, 17, generator=g).to(torch.float16),
        "bf16": torch.randn(4, 5, 6, generator=g).to(torch.bfloat16),
        "c64": torch.randn(50, generator=g, dtype=torch.complex64),
        "f8": {"e4m3": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
               "e5m2": torch.randn(64, generator=g).to(torch.float8_e5m2)},
        "ints": {"i8": ints(-128, 128, 99, torch.int8), "u8": ints(0, 256, 101, torch.uint8),
                 "i16": ints(-(2 ** 15), 2 ** 15, 300, torch.int16), "u16": ints(0, 2 ** 16, 70, torch.uint16),
                 "i32": ints(-(2 ** 31), 2 ** 31, 4097, torch.int32), "u32": ints(0, 2 ** 32, 33, torch.uint32),
                 "i64": ints(-(2 ** 62), 2 ** 62, 513, torch.int64), "u64": ints(0, 2 ** 62, 9, torch.uint64)},
        "mask": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 7),
        "hollow": torch.zeros(3, 0, 5, dtype=torch.int32),
        "layers": [{"w": torch.randn(48, 40, generator=g), "b": torch.randn(48, generator=g)} for _ in range(3)],
        "values": {"step": 12, "big_int": 2 ** 80 + 7, "neg": -(2 ** 63), "lr": 3e-4, "nan": math.nan,
                   "inf": -math.inf, "neg_zero": -0.0, "name": "run-é中\U0001F600\\\"", "blob": bytes(range(256)),
                   "tup": (1, "a", None, (2.5,)), "intkeys": {1: "a", 2: [3]}, "flag": True, "none": None,
                   "dollar": {"$x": 1, "y": 2}, "empty_list": [], "empty_dict": {}},
        "rl": shardsafe.rank_local({"seed": 42, "gen": torch.Generator().manual_seed(7).get_state()}),
    }


KILL_TENSORS = 4
KILL_NUMEL = 512 * 1024  # 4 x 2 MiB float32 per state


def seq_state(seq: int) -> dict[str, Any]:
    """The state saved as number ``seq`` by kill and concurrency trials (8 MiB): every
    tensor is a function of ``seq``, so a checkpoint that mixes two saves is caught."""
    base = torch.arange(KILL_NUMEL, dtype=torch.float32)
    return {"t": {f"w{i}": base * (i + 1) + float(seq) for i in range(KILL_TENSORS)},
            "tag": torch.full((16,), seq, dtype=torch.int64), "seq": seq, "meta": {"kind": "seq", "n": KILL_TENSORS}}


def dist_state(seq: int, rank: int) -> dict[str, Any]:
    """Rank ``rank``'s state in a multi-rank kill trial: the replicated ``seq_state`` (the
    ranks share its writing) and a rank-local tensor that names the rank and ``seq``."""
    state = seq_state(seq)
    state["mine"] = shardsafe.rank_local({"t": torch.full((4096,), 1000 * rank + seq, dtype=torch.int64)})
    return state


def dist_seq_of(tree: Any, rank: int) -> int | None:
    """``seq_of`` for a tree loaded from a multi-rank kill trial (rank-local part of ``rank``)."""
    try:
        mine = tree.pop("mine")
        seq = seq_of(tree)
        if seq is None or not torch.equal(mine["t"], torch.full((4096,), 1000 * rank + seq, dtype=torch.int64)):
            return None
        return seq
    except (KeyError, TypeError, AttributeError):
        return None


def seq_of(tree: Any) -> int | None:
    """The ``seq`` a loaded tree claims, when every tensor agrees with it; None otherwise."""
    try:
        seq = tree["seq"]
        if not isinstance(seq, int) or not bitwise_equal(tree, seq_state(seq)):
            return None
        return seq
    except (KeyError, TypeError):
        return None


# ----------------------------------------------------------------------------- trees and sentinels


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def fill_sentinel(t: torch.Tensor) -> None:
    """Fill a destination tensor (a DTensor: its local shard) with a recognisable pattern."""
    t = local(t)
    with torch.no_grad():
        if t.dtype == torch.bool:
            t.fill_(True)
        elif t.is_complex():
            t.fill_(complex(-7.25, 3.0))
        elif t.is_floating_point():
            t.fill_(-7.25)
        elif t.dtype in (torch.uint8, torch.uint16, torch.uint32, torch.uint64):
            t.fill_(77)
        else:
            t.fill_(-77)


def sentinel_value(v: Any) -> Any:
    """A plain value of the same type that no saved state holds."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return -123456789
    if isinstance(v, float):
        return -1.25e-7
    if isinstance(v, str):
        return "<sentinel>"
    if isinstance(v, bytes):
        return b"<sentinel>"
    return v


def sentinel_tree(template: Any) -> Any:
    """A destination built from ``template``: the same containers, its tensors (the same
    objects) filled with the sentinel, plain values replaced by sentinels."""
    if isinstance(template, torch.Tensor):
        fill_sentinel(template)
        return template
    if isinstance(template, dict):
        return {k: sentinel_tree(v) for k, v in template.items()}
    if isinstance(template, list):
        return [sentinel_tree(v) for v in template]
    if isinstance(template, tuple):
        return tuple(sentinel_tree(v) for v in template)
    return sentinel_value(template)


def snapshot(tree: Any) -> Any:
    """A deep copy of a destination (tensors cloned, DTensors as their local shards)."""
    if isinstance(tree, torch.Tensor):
        return local(tree).detach().clone()
    if isinstance(tree, dict):
        return {k: snapshot(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [snapshot(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(snapshot(v) for v in tree)
    return tree


def fresh_full_tensors(tree: Any) -> Any:
    """A copy of ``tree`` with new tensors (for templates built from a loaded tree)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: fresh_full_tensors(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [fresh_full_tensors(v) for v in tree]
    if isinstance(tree, tuple):
        return tuple(fresh_full_tensors(v) for v in tree)
    return tree


# ----------------------------------------------------------------------------- leak checks


def open_fds() -> set[str]:
    """This process's open file descriptors, as ``fd -> target`` strings."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(f"{fd}->{os.readlink(f'/proc/self/fd/{fd}')}")
        except OSError:
            pass
    return out


def live_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t is not threading.current_thread()}


@dataclass
class LeakCheck:
    """Threads and file descriptors before an operation, compared after it (waiting a
    moment for threads that are finishing, and collecting garbage first)."""

    fds: set[str] = field(default_factory=open_fds)
    threads: set[threading.Thread] = field(default_factory=live_threads)

    def leaks(self, grace: float = 2.0) -> str:
        """A description of what leaked ('' when nothing did)."""
        deadline = time.monotonic() + grace
        while True:
            new_threads = [t for t in live_threads() - self.threads if t.is_alive()]
            if not new_threads or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        new_fds = open_fds() - self.fds
        if new_fds:
            gc.collect()
            new_fds = open_fds() - self.fds
        # the descriptor listing itself and pipes of this process's queues come and go
        new_fds = {f for f in new_fds if "/proc/" not in f}
        parts = []
        if new_threads:
            parts.append("threads left: " + ", ".join(sorted(t.name for t in new_threads)))
        if new_fds:
            parts.append("descriptors left: " + ", ".join(sorted(new_fds))[:300])
        return "; ".join(parts)


def temp_siblings(path: str | Path, marks: tuple[str, ...] = (".shardsafe-tmp-",)) -> list[str]:
    """Hidden siblings of checkpoint ``path`` that a save or deletion left (``marks``)."""
    p = Path(path)
    try:
        names = os.listdir(p.parent)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(f".{p.name}.") and any(m in n for m in marks))


ALL_MARKS = (".shardsafe-tmp-", ".shardsafe-old-", ".shardsafe-del-")


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - t0
