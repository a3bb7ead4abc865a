"""CheckpointManager.retain(keep): an outside policy (Ray Train's CheckpointConfig through
shardsafe.integrations.ray) decides which steps stay; references never dangle."""

from __future__ import annotations

from pathlib import Path

import torch

import shardsafe
from bitwise import assert_bitwise
from shardsafe.tools import verify_checkpoint


def test_retain_keeps_referenced_files_of_dropped_steps(tmp_path: Path) -> None:
    frozen = torch.arange(4096, dtype=torch.float32)
    states = {}
    with shardsafe.CheckpointManager(tmp_path, interval=1, incremental=True) as mgr:
        for step in range(1, 5):
            states[step] = {"frozen": frozen, "w": torch.full((64,), float(step))}
            mgr.save(step, states[step])
        assert mgr.retain([2, 4]) == [1, 3]
        assert mgr.steps() == [2, 4]
        assert mgr.retain([2, 4]) == []
        # step 1 wrote the frozen tensor, 2 and 4 refer to it: retired, not deleted
        assert (tmp_path / "step-00000001" / "retired.json").is_file()
        assert not (tmp_path / "step-00000003").exists()
        for step in (2, 4):
            assert verify_checkpoint(mgr.path(step)).ok
            assert_bitwise(states[step], shardsafe.load_full(mgr.path(step)), f"step {step}")
        assert mgr.retain([4]) == [2]
        assert_bitwise(states[4], shardsafe.load_full(mgr.path(4)), "step 4")
        assert mgr.retain([]) == [4] and mgr.steps() == []


def test_retain_keeps_the_loaded_step(tmp_path: Path) -> None:
    with shardsafe.CheckpointManager(tmp_path, interval=1) as mgr:
        for step in (1, 2):
            mgr.save(step, {"w": torch.ones(3) * step})
        dest = {"w": torch.zeros(3)}
        assert mgr.load(dest, step=1) == 1
        assert mgr.retain([2]) == []  # step 1 was loaded: kept
        assert mgr.steps() == [1, 2]
