"""A one-line progress bar on stderr (a ``\\r`` line), shown only when stderr is a terminal."""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO

from .common import human_bytes


class Progress:
    """Count work done out of ``total`` (bytes unless ``unit`` says otherwise) and redraw
    at most ten times a second. Thread-safe. ``enabled=None`` draws only on a terminal."""

    def __init__(self, label: str, total: int | None = None, *, unit: str = "B", stream: TextIO | None = None,
                 enabled: bool | None = None) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.done = 0
        self._start = time.perf_counter()
        self._last = 0.0
        self._lock = threading.Lock()
        self._width = 0

    def _fmt(self, n: float) -> str:
        return human_bytes(n) if self.unit == "B" else f"{int(n)} {self.unit}"

    def advance(self, n: int = 1) -> None:
        """Record ``n`` more units done."""
        with self._lock:
            self.done += n
            now = time.perf_counter()
            if self.enabled and (now - self._last >= 0.1 or (self.total is not None and self.done >= self.total)):
                self._last = now
                self._draw(now)

    def status(self, label: str) -> None:
        """Change the label (for work whose size is unknown) and redraw."""
        with self._lock:
            self.label = label
            if self.enabled:
                self._draw(time.perf_counter())

    def _draw(self, now: float) -> None:
        elapsed = max(now - self._start, 1e-9)
        rate = f"{human_bytes(self.done / elapsed)}/s" if self.unit == "B" else f"{self.done / elapsed:.1f}/s"
        if self.total:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * 24)
            line = f"{self.label} [{bar:<24}] {frac * 100:5.1f}% {self._fmt(self.done)}/{self._fmt(self.total)} {rate}"
        elif self.total == 0 or self.done == 0:
            line = self.label
        else:
            line = f"{self.label} {self._fmt(self.done)} {rate}"
        pad = max(0, self._width - len(line))
        self._width = len(line)
        self.stream.write("\r" + line + " " * pad)
        self.stream.flush()

    def close(self) -> None:
        """Erase the line (the caller prints its result afterwards)."""
        with self._lock:
            if self.enabled and self._width:
                self.stream.write("\r" + " " * self._width + "\r")
                self.stream.flush()
                self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
