"""Shared helpers for the shardsafe benchmarks: timing, statistics, raw vectored I/O,
RSS measurement (in a child process), machine description and table printing.

Only the standard library, numpy and psutil (optional) are used here, so the helpers
can be imported by child processes before torch is."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

IOV_MAX = 1024  # Linux UIO_MAXIOV
MAX_RW = 0x7FFFF000  # Linux MAX_RW_COUNT: the most one read/write call transfers

REPO = Path(__file__).resolve().parent.parent


# --------------------------------------------------------------------------- timing


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Run ``fn`` once after a garbage collection; (seconds, result). The result is
    returned (and so freed by the caller) after the clock stops."""
    gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def median(xs: Sequence[float]) -> float:
    """The median of the non-NaN values (NaN if there are none)."""
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Sequence[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    if not xs:
        nan = float("nan")
        return nan, nan, nan
    return statistics.median(xs), min(xs), max(xs)


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


def rotated(items: Sequence[Any], k: int) -> list[Any]:
    """``items`` rotated left by ``k`` (so every contender gets every slot across reps)."""
    if not items:
        return []
    k %= len(items)
    return list(items[k:]) + list(items[:k])


# --------------------------------------------------------------------------- raw I/O


def _iov_batches(views: Sequence[memoryview]) -> Iterator[list[memoryview]]:
    batch: list[memoryview] = []
    size = 0
    for v in views:
        if not v.nbytes:
            continue
        if batch and (len(batch) == IOV_MAX or size + v.nbytes > MAX_RW):
            yield batch
            batch, size = [], 0
        batch.append(v)
        size += v.nbytes
    if batch:
        yield batch


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes of a buffer list (after a short transfer)."""
    out = []
    for b in bufs:
        if n >= b.nbytes:
            n -= b.nbytes
            continue
        out.append(b[n:] if n else b)
        n = 0
    return out


def pwritev_all(fd: int, views: Sequence[Any], offset: int = 0) -> int:
    """Write the buffers back to back from ``offset`` with ``pwritev`` (IOV_MAX-sized
    batches, short writes resumed). Returns the bytes written."""
    mvs = [memoryview(v).cast("B") for v in views]
    pos = offset
    for batch in _iov_batches(mvs):
        while batch:
            n = os.pwritev(fd, batch, pos)
            if n <= 0:
                raise OSError("pwritev wrote nothing")
            pos += n
            batch = _advance(batch, n)
    return pos - offset


def preadv_all(fd: int, views: Sequence[Any], offset: int = 0) -> int:
    """Fill the buffers back to back from ``offset`` with ``preadv``. Returns bytes read."""
    mvs = [memoryview(v).cast("B") for v in views]
    pos = offset
    for batch in _iov_batches(mvs):
        while batch:
            n = os.preadv(fd, batch, pos)
            if n <= 0:
                raise OSError(f"unexpected end of file at byte {pos}")
            pos += n
            batch = _advance(batch, n)
    return pos - offset


def fsync_path(path: str | os.PathLike, directory: bool = False) -> None:
    flags = os.O_RDONLY | (os.O_DIRECTORY if directory else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove(path: str | os.PathLike) -> None:
    """Delete a file or a directory tree if present."""
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            p.unlink()


def read_file_untimed(path: str | os.PathLike) -> int:
    """Read every file under ``path`` once (to warm the page cache); returns bytes read."""
    p = Path(path)
    files = [f for f in p.rglob("*") if f.is_file()] if p.is_dir() else [p]
    total = 0
    buf = bytearray(16 << 20)
    for f in files:
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                total += n
    return total


@contextlib.contextmanager
def bench_dir(base: str | None = None, prefix: str = "shardsafe-bench-") -> Iterator[Path]:
    """A temporary working directory, removed at the end even on failure or SIGTERM."""
    if base is not None:
        Path(base).mkdir(parents=True, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=base))

    def _term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, _term)
    try:
        yield d
    finally:
        signal.signal(signal.SIGTERM, old)
        shutil.rmtree(d, ignore_errors=True)


# --------------------------------------------------------------------------- memory

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_now() -> tuple[int, int]:
    """(resident bytes, resident anonymous bytes) of this process, from /proc/self/statm
    (anonymous = resident - file-backed/shared, i.e. excludes mapped page-cache pages)."""
    with open("/proc/self/statm", "rb") as f:
        fields = f.read().split()
    resident, shared = int(fields[1]), int(fields[2])
    return resident * _PAGE, (resident - shared) * _PAGE


def reset_peak_rss() -> bool:
    """Reset the kernel's RSS high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def vm_hwm() -> int | None:
    """The kernel's RSS high-water mark (VmHWM) in bytes, or None."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def ru_maxrss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


class RssSampler:
    """Samples this process's RSS every ``interval`` seconds on a daemon thread and keeps
    the peak resident and peak anonymous bytes."""

    def __init__(self, interval: float = 0.001) -> None:
        self.interval = interval
        self.peak = 0
        self.peak_anon = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> None:
        rss, anon = rss_now()
        self.peak = max(self.peak, rss)
        self.peak_anon = max(self.peak_anon, anon)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


def run_child(argv: list[str], timeout: float = 300) -> dict[str, Any]:
    """Run ``python argv...`` (this interpreter) and parse the JSON object on the last
    line of its stdout."""
    proc = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {argv} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


# --------------------------------------------------------------------------- machine noise


class CpuMonitor:
    """How busy the CPUs were with *other* work over an interval: system-wide busy time
    (/proc/stat, steal included) minus this process's and its waited-for children's CPU
    time, in CPUs on average. Kernel threads doing this process's I/O (writeback,
    journal) count as "other" too, so expect ~0.1-0.3 during fsync-heavy phases."""

    _TCK = os.sysconf("SC_CLK_TCK")

    @classmethod
    def snapshot(cls) -> tuple[float, float, float]:
        """(wall seconds, system busy CPU seconds, own CPU seconds)."""
        busy = 0.0
        with contextlib.suppress(OSError), open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
            # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
            busy = (v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)) / cls._TCK
        t = os.times()
        return time.perf_counter(), busy, t.user + t.system + t.children_user + t.children_system

    @staticmethod
    def foreign(a: tuple[float, float, float], b: tuple[float, float, float]) -> float:
        wall = b[0] - a[0]
        if wall <= 0:
            return 0.0
        return max(0.0, ((b[1] - a[1]) - (b[2] - a[2])) / wall)


def wait_for_quiet(max_wait: float, threshold: float, probe: float = 2.0) -> float:
    """Wait (up to ``max_wait`` s) until other work uses fewer than ``threshold`` CPUs over
    a ``probe``-second window; returns the last measured load."""
    deadline = time.perf_counter() + max_wait
    while True:
        a = CpuMonitor.snapshot()
        time.sleep(probe)
        load = CpuMonitor.foreign(a, CpuMonitor.snapshot())
        if load < threshold or time.perf_counter() >= deadline:
            return load


# --------------------------------------------------------------------------- reporting


def _mount_of(path: Path) -> tuple[str, str, str]:
    """(device, mount point, fs type) of the mount holding ``path``."""
    best = ("?", "/", "?")
    try:
        real = str(path.resolve())
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, fstype = line.split()[:3]
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                    best = (dev, mnt, fstype)
    except OSError:
        pass
    return best


def machine_info(workdir: Path) -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    dev, mnt, fstype = _mount_of(workdir)
    return {
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "mem_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "dir": str(workdir),
        "device": dev,
        "mount": mnt,
        "fstype": fstype,
    }


def md_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one of l/r/c per column (default: first
    column left, the rest right)."""
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(3, *(len(r[i]) for r in cells)) for i in range(len(headers))]
    align = align or ("l" + "r" * (len(headers) - 1))

    def fmt(row: list[str]) -> str:
        out = []
        for c, w, a in zip(row, widths, align):
            out.append(c.ljust(w) if a == "l" else c.rjust(w) if a == "r" else c.center(w))
        return "| " + " | ".join(out) + " |"

    rule = []
    for w, a in zip(widths, align):
        rule.append(":" + "-" * (w - 1) if a == "l" else "-" * (w - 1) + ":" if a == "r" else ":" + "-" * (w - 2) + ":")
    lines = [fmt(cells[0]), "| " + " | ".join(rule) + " |"]
    lines += [fmt(r) for r in cells[1:]]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, obj: Any) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")
    os.replace(tmp, p)
    return p


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"
