"""The campaign's shared setup: a temp root, the two checkpoints under test (single
process and 4-rank FSDP2, each pristine + working copy + a stale twin), the worker pools,
and running the load probes of one damaged checkpoint on all of them."""

from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import shardsafe

from .common import DETECTED, HANG, LOADED, OTHER, SILENT, Tally, outcome, single_state
from .damage import Ckpt
from .pool import Failure, Pool
from .probes import combine_ranks

WORLD = 4
MISMATCH = ("ShapeMismatchError", "DtypeMismatchError", "KeyMismatchError", "MissingKeysError",
            "UnexpectedKeysError")


@dataclass
class Context:
    """Everything the sections share; ``close()`` stops the pools and deletes the temp root."""

    root: Path
    tally: Tally
    timeout: float = 120.0
    pool4: Pool = field(default_factory=lambda: Pool(WORLD, group=True, name="4-rank pool"))
    solo: Pool = field(default_factory=lambda: Pool(1, group=False, name="1-process pool"))
    ckpts: dict[str, Ckpt] = field(default_factory=dict)
    _zygote: Any = None

    @staticmethod
    def create(tally: Tally, timeout: float = 120.0) -> Context:
        return Context(Path(tempfile.mkdtemp(prefix="shardsafe-faults-")), tally, timeout)

    def start_pools(self) -> None:
        self.pool4.start()
        self.solo.start()

    def checkpoints(self) -> dict[str, Ckpt]:
        """Save (once) the single-process checkpoint here and the FSDP2 one on the 4-rank
        pool; both are checked to load back bitwise before any damage."""
        if self.ckpts:
            return self.ckpts
        base = self.root / "ckpts"
        base.mkdir(exist_ok=True)
        single = base / "single"
        shardsafe.save(single_state(), single)
        shardsafe.save(single_state(seed=99), base / "single-alt")
        from .common import first_difference

        want = single_state()
        want["rl"] = want["rl"].value
        where = first_difference(want, shardsafe.load_full(single))
        assert where is None, f"the pristine single-process checkpoint does not load back: {where}"
        got = self.pool4.run("faults.probes:setup_fsdp", str(base / "fsdp"), str(base / "fsdp-alt"),
                             timeout=300)
        if isinstance(got, Failure):
            raise RuntimeError(f"FSDP2 setup failed: {got.detail}")
        # The campaign edits the manifest's chunk table (format 2.x, which every reader still
        # reads): the checkpoints are rewritten in that format first.
        from shardsafe.tools.format2 import write_format2

        for p in (single, base / "single-alt", base / "fsdp", base / "fsdp-alt"):
            write_format2(p)
        self.ckpts = {
            "single": Ckpt.open("single", single, base / "single-work", base / "single-alt"),
            "fsdp": Ckpt.open("fsdp", base / "fsdp", base / "fsdp-work", base / "fsdp-alt"),
        }
        return self.ckpts

    def probe(self, ck: Ckpt, errors: list[str], *, rss: bool = False, extra: bool = False,
              ranks: bool = True, compare: bool = True, verify: bool = True,
              in_place: list[str] | None = None) -> list[dict[str, Any]]:
        """Load the working copy of ``ck`` on the 4-rank pool and on one process (load,
        load_full, verify) at the same time; one outcome per probe. verify's verdict is then
        judged against the loads': passing a checkpoint that the loads refuse is silent.
        ``in_place``: further errors that count as detection for loads into a destination."""
        in_place = in_place or []
        ticket4 = self.pool4.submit("faults.probes:load4", ck.name, str(ck.pristine), str(ck.work),
                                    errors + in_place, compare) if ranks else None
        ticket1 = self.solo.submit("faults.probes:solo", ck.name, str(ck.pristine), str(ck.work), errors, rss, extra,
                                   compare, verify, in_place)
        probes: list[dict[str, Any]] = []
        got1 = self.solo.collect(ticket1, self.timeout)
        if isinstance(got1, Failure):
            probes.append(_failed("1 process", got1))
        else:
            probes.extend(got1[0])
        if ticket4 is not None:
            got4 = self.pool4.collect(ticket4, self.timeout)
            probes.append(_failed("load 4 ranks", got4) if isinstance(got4, Failure) else combine_ranks(got4))
        return judge_verify(probes)

    def zygote(self) -> Any:
        """The forking child of the kill, rlimit and process-concurrency trials (started once)."""
        if self._zygote is None:
            from .kills import Zygote

            self._zygote = Zygote(self.root)
        return self._zygote

    def close(self) -> None:
        """Stop the pools and the zygote, delete the temp root."""
        try:
            if self._zygote is not None:
                self._zygote.close()
                self._zygote = None
        finally:
            self.pool4.close()
            self.solo.close()
            shutil.rmtree(self.root, ignore_errors=True)


def _failed(method: str, failure: Failure) -> dict[str, Any]:
    return outcome(HANG if failure.kind == "hang" else OTHER, method, f"{failure.kind}: {failure.detail}")


def judge_verify(probes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """verify found nothing wrong while a load refused the checkpoint: verify missed the
    damage (silent); verify reported problems while every load succeeded: a false alarm."""
    loads = [p for p in probes if p["method"] != "verify"]
    # a load into a destination may also refuse a checkpoint for not matching it: not damage
    refused = [q for q in loads if q["cls"] == DETECTED and q.get("error") not in MISMATCH]
    for i, p in enumerate(probes):
        if p["method"] != "verify":
            continue
        if p["cls"] == LOADED and refused:
            probes[i] = outcome(SILENT, "verify", "verify reported no problem; the loads refused: " +
                                refused[0]["detail"])
        elif p["cls"] == DETECTED and loads and all(q["cls"] == LOADED for q in loads):
            probes[i] = outcome(OTHER, "verify", "false alarm (every load succeeded): " + p["detail"])
    return probes


def elapsed(t0: float) -> float:
    return time.perf_counter() - t0
