"""Where a load's time goes, per phase, on one rank: the phases of ``shardsafe.ops.load``
wrapped with timers (in the benchmark's worker processes only; nothing in the library
changes). :func:`install` once per process, :func:`reset` before a load, :func:`take` after.

Phases (seconds, summed over calls): manifest (open + GET manifest.json + parse),
rank_local, match (the state tree against the manifest), cut_indexes (indexes the
broadcast plan needs), broadcast_plan (an all-gather), plan_indexes (GET of the file
indexes this rank reads), plan (read plan, pure), open (the data files' HEADs), spill (the
ranged GETs into the local spill), verify (checksums of the blocks read), land (copies into
the destination, post checks), share (replicated tensors sent / received), apply, agree
(the collectives agreeing on errors). Calls made on other threads (files opened by the
spill's fetch threads) add their own time under their names too."""

from __future__ import annotations

import functools
import threading
import time
from collections import defaultdict
from typing import Any

_T: dict[str, float] = defaultdict(float)
_DONE: list[bool] = []
_LOCAL = threading.local()  # .stack: (name, seconds of timed calls inside) of this thread's calls under way


def _timed(name: str, fn: Any) -> Any:
    """``fn`` timed under ``name``: its own time only (timed calls inside it count under
    their own names; a recursive call of the same name counts once)."""
    @functools.wraps(fn)
    def run(*a: Any, **k: Any) -> Any:
        _STACK = _LOCAL.__dict__.setdefault("stack", [])
        if _STACK and _STACK[-1][0] == name:
            return fn(*a, **k)  # recursion (Matcher.match): the outer call times it
        _STACK.append([name, 0.0])
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t
            _, inner = _STACK.pop()
            _T[name] += dt - inner
            if _STACK:
                _STACK[-1][1] += dt
    return run


def install() -> None:
    """Wrap the phases (idempotent)."""
    if _DONE:
        return
    from shardsafe.comm import Comm
    from shardsafe.engine.reader import OpenFiles
    from shardsafe.ops import load as L
    from shardsafe.state.match import Matcher

    for name, attr in (("manifest", "read_manifest_phase"), ("rank_local", "fetch_rank_local"),
                       ("cut_indexes", "fetch_cut_indexes"), ("broadcast_plan", "broadcast_plan"),
                       ("plan_indexes", "fetch_plan_indexes"), ("plan", "plan_phase"), ("land", "land_phase"),
                       ("apply", "apply_phase")):
        setattr(L, attr, _timed(name, getattr(L, attr)))
    Matcher.match = _timed("match", Matcher.match)
    OpenFiles.handle = _timed("open", OpenFiles.handle)
    OpenFiles.prefetch = _timed("spill", OpenFiles.prefetch)
    L.ReadPlan.verify_with = _timed("verify", L.ReadPlan.verify_with)
    Comm.agree = _timed("agree", Comm.agree)
    Comm.share_tensor = _timed("share", Comm.share_tensor)
    _DONE.append(True)


def reset() -> None:
    _T.clear()


def take() -> dict[str, float]:
    """The seconds per phase since :func:`reset`, each phase's own time (exclusive)."""
    return dict(_T)
