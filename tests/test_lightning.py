"""The Lightning integration on the real ``lightning`` package (CPU, tiny models).

Single-process Trainers run in this process: a run stopped after two epochs and resumed
with ``trainer.fit(..., ckpt_path=...)`` must end bitwise equal (parameters, optimizer and
scheduler state) to an uninterrupted run, and the checkpoint dict Lightning handed to the
plugin must come back equal, value types included. The ModelParallelStrategy (FSDP2)
and DDP cases run on 2 gloo processes of the session's worker pool.
"""

from __future__ import annotations

import copy
import enum
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from bitwise import assert_bitwise

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import shardsafe  # noqa: E402
from shardsafe.integrations.lightning import (  # noqa: E402
    FORMAT_KEY,
    ShardsafeCheckpointIO,
    ShardsafeModelParallelStrategy,
)
from shardsafe.tools import verify_checkpoint  # noqa: E402

LIGHTNING_CHATTER = ("LeafSpec", "is not empty", "does not have many workers", "dirpath has changed",
                     "ended before the epoch ended", "callbacks used to create the checkpoint")
pytestmark = [pytest.mark.filterwarnings(f"ignore:.*{text}") for text in LIGHTNING_CHATTER]

QUIET = dict(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
STEPS_PER_EPOCH = 4  # 32 samples, batch 8 (per process)


# ----------------------------------------------------------------------------- a tiny job


class Tiny(L.LightningModule):
    """A small MLP with AdamW and a per-step StepLR; weights depend only on ``seed``."""

    def __init__(self, lr: float = 0.05, tags: set | None = None, seed: int = 0, layout: str = "plain",
                 extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["extra"])
        self.extra = extra
        with torch.random.fork_rng(devices=[]):  # leave this process's RNG as it was
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def configure_model(self) -> None:
        """Under ModelParallelStrategy: FSDP2 over the data-parallel ranks, or tensor parallel."""
        if self.hparams.layout == "fsdp":
            from torch.distributed.fsdp import fully_shard

            fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
        elif self.hparams.layout == "tp":
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                               {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["user"] = {"seen": {1, 2, 3}, "pair": (1, "a"), 7: [None, 1.5], (0, 1): torch.bfloat16,
                              "where": pathlib.PurePosixPath("/data/x"), "$set": "a plain key", "bad": self.extra}


def loader(samples: int = 32) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 4, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


class RecordingIO(ShardsafeCheckpointIO):
    """Keeps a deep copy of every checkpoint dict Lightning hands over, by path."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.saved: dict[str, dict[str, Any]] = {}

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        self.saved[os.fspath(path)] = copy.deepcopy(checkpoint)
        super().save_checkpoint(checkpoint, path, storage_options)


def assert_same(a: Any, b: Any, where: str = "checkpoint") -> None:
    """Equal values of equal types, keys in the same order (dict subclasses compare as dicts),
    tensors bitwise."""
    assert_bitwise(a, b, where, ordered=True)


def final_state(trainer: Any) -> dict[str, Any]:
    """What must match between a resumed and an uninterrupted run."""
    return {"params": trainer.lightning_module.state_dict(), "optim": trainer.optimizers[0].state_dict(),
            "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(), "step": trainer.global_step}


# ----------------------------------------------------------------------------- one process


@pytest.mark.parametrize("mode", ["sync", "async", "lightning-async"])
def test_resume_matches_uninterrupted_run(tmp_path: Path, mode: str) -> None:
    io = RecordingIO(async_save=(mode == "async"))
    plugin = AsyncCheckpointIO(io) if mode == "lightning-async" else io
    ckpt_dir = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_epochs=1, save_top_k=-1, save_last=True)
    first = L.Trainer(max_epochs=2, plugins=[plugin], callbacks=[callback], **QUIET)
    first.fit(Tiny(tags={"a", "b"}), loader())

    path = ckpt_dir / f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt"
    assert path.is_dir() and (ckpt_dir / "last.ckpt").is_dir()
    assert FORMAT_KEY in shardsafe.read_manifest(path).tree
    assert verify_checkpoint(path).ok

    # The whole dict Lightning handed over comes back: weights, optimizer, schedulers, loops,
    # callbacks, hyper-parameters (a set in them), counters, version and on_save_checkpoint's values.
    loaded = ShardsafeCheckpointIO().load_checkpoint(path)
    expected = io.saved[str(path)]
    assert_same(expected, loaded)
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "callbacks", "hyper_parameters",
                "epoch", "global_step", "pytorch-lightning_version", "user"):
        assert key in loaded, key
    assert loaded["hyper_parameters"]["tags"] == {"a", "b"}
    assert isinstance(loaded["optimizer_states"][0]["param_groups"][0]["betas"], tuple)

    resumed = L.Trainer(max_epochs=4, plugins=[RecordingIO()], enable_checkpointing=False, **QUIET)
    resumed.fit(Tiny(seed=1), loader(), ckpt_path=path)  # other initial weights: all must come from the checkpoint
    straight = L.Trainer(max_epochs=4, enable_checkpointing=False, **QUIET)
    straight.fit(Tiny(), loader())
    assert resumed.global_step == 4 * STEPS_PER_EPOCH
    assert_same(final_state(straight), final_state(resumed), "final state")


def test_checkpoint_retention_last_link_and_remove(tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    callback = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=1, monitor="step",
                               mode="max", save_last="link")
    io = ShardsafeCheckpointIO()
    trainer = L.Trainer(max_steps=6, plugins=[io], callbacks=[callback], **QUIET)
    trainer.fit(Tiny(), loader())
    # top-1 kept (older ones removed through remove_checkpoint); last.ckpt is a link to it
    assert sorted(os.listdir(ckpt_dir)) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert (ckpt_dir / "last.ckpt").is_symlink()
    assert ShardsafeCheckpointIO().load_checkpoint(ckpt_dir / "last.ckpt")["global_step"] == 6

    again = L.Trainer(max_steps=8, plugins=[ShardsafeCheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=100)], **QUIET)
    again.fit(Tiny(), loader(), ckpt_path="last")  # Lightning finds last.ckpt itself
    assert again.global_step == 8

    io.remove_checkpoint(ckpt_dir / "last.ckpt")  # a link: only the link goes
    assert not os.path.lexists(ckpt_dir / "last.ckpt") and (ckpt_dir / "epoch=1-step=6.ckpt").is_dir()
    io.remove_checkpoint(ckpt_dir / "epoch=1-step=6.ckpt")
    assert not (ckpt_dir / "epoch=1-step=6.ckpt").exists()
    io.remove_checkpoint(ckpt_dir / "missing.ckpt")  # nothing there: nothing to do
    other = tmp_path / "not-a-checkpoint.ckpt"
    other.mkdir()
    (other / "data").write_text("keep me")
    with pytest.raises(shardsafe.CheckpointError, match="not a shardsafe checkpoint"):
        io.remove_checkpoint(other)
    assert (other / "data").read_text() == "keep me"


def test_resave_same_path_replaces_checkpoint(tmp_path: Path) -> None:
    io = ShardsafeCheckpointIO()
    path = tmp_path / "x.ckpt"
    io.save_checkpoint({"global_step": 1, "w": torch.zeros(3)}, path)
    io.save_checkpoint({"global_step": 2, "w": torch.ones(3)}, path)
    got = io.load_checkpoint(path)
    assert got["global_step"] == 2 and torch.equal(got["w"], torch.ones(3))
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({"a": 1}, path, storage_options={"x": 1})


def test_values_typed_json_cannot_hold_round_trip(tmp_path: Path) -> None:
    value = {
        "sets": [set(), {1, "a", (2, 3)}, frozenset({b"x", None})],
        "keys": {(1, 2): "tuple key", 1.5: "float key", True: "bool key", None: "none key", "s": 1, 3: 4},
        "paths": [pathlib.Path("rel/p"), pathlib.PurePosixPath("/abs"), pathlib.PureWindowsPath(r"C:\x")],
        "torch": [torch.float16, torch.int64, torch.device("cpu"), torch.device("meta")],
        "looks_like_tags": [{"$set": [1, 2]}, {"$items": []}, {"$x": {"$path": ["Path", "/"]}}],
        "nested": {frozenset({1}): {"t": torch.arange(3), "s": {4.5}}},
        "plain": {"big": 2**70, "nan_free": [0.1, -0.0], "bytes": b"\x00\xff", "tuple": (1, (2, [3]))},
    }
    io = ShardsafeCheckpointIO()
    io.save_checkpoint({"user": value}, tmp_path / "v.ckpt")
    assert_same({"user": value}, io.load_checkpoint(tmp_path / "v.ckpt"))


class Color(enum.Enum):
    RED = 1


@pytest.mark.parametrize(("bad", "where"), [
    (object(), "user.bad"),
    (Color.RED, "user.bad"),
    ({"inner": [1, lambda: 0]}, "user.bad.inner.1"),
    ({"k": {object(): 1}}, "user.bad.k (a dict key)"),
])
def test_unsupported_value_names_its_key(tmp_path: Path, bad: Any, where: str) -> None:
    path = tmp_path / "bad.ckpt"
    trainer = L.Trainer(max_steps=1, plugins=[ShardsafeCheckpointIO()], enable_checkpointing=False, **QUIET)
    trainer.fit(Tiny(extra=bad), loader())
    with pytest.raises(shardsafe.CheckpointError, match=f"'{re.escape(where)}'.*never pickles") as info:
        trainer.save_checkpoint(path)
    assert isinstance(info.value, shardsafe.UnsupportedValueError)
    assert not path.exists()  # nothing was written


def test_map_location(tmp_path: Path) -> None:
    io = ShardsafeCheckpointIO()
    path = tmp_path / "m.ckpt"
    io.save_checkpoint({"w": torch.arange(4.0)[1:], "n": {"b": torch.ones(2, 2).t()}}, path)
    for where in ("meta", torch.device("meta"), {"cpu": "meta"}):
        got = io.load_checkpoint(path, map_location=where)
        assert got["w"].device.type == "meta" and got["n"]["b"].shape == (2, 2), where
    kept = io.load_checkpoint(path, map_location={"cuda:0": "cpu"})
    assert torch.equal(kept["w"], torch.arange(1.0, 4.0))
    for fn in (lambda storage, loc: storage, lambda storage, loc: None, lambda storage, loc: storage.clone()):
        got = io.load_checkpoint(path, map_location=fn)
        assert torch.equal(got["w"], torch.arange(1.0, 4.0)) and torch.equal(got["n"]["b"], torch.ones(2, 2))


def test_plain_shardsafe_checkpoint_loads_without_conversion(tmp_path: Path) -> None:
    shardsafe.save({"state_dict": {"w": torch.ones(2)}, "x": {"$set": [1]}}, tmp_path / "p")
    got = ShardsafeCheckpointIO().load_checkpoint(tmp_path / "p")
    assert got["x"] == {"$set": [1]}  # no FORMAT_KEY: no tags are interpreted


def test_model_parallel_strategy_refuses_full_checkpoints() -> None:
    with pytest.raises(ValueError, match="save_distributed_checkpoint=False"):
        ShardsafeModelParallelStrategy(save_distributed_checkpoint=False)


def test_shardsafe_does_not_import_lightning(tmp_path: Path) -> None:
    code = ("import sys, torch, shardsafe, shardsafe.integrations, shardsafe.tools\n"
            f"shardsafe.save({{'a': torch.ones(1)}}, {str(tmp_path / 'c')!r})\n"
            f"shardsafe.load_full({str(tmp_path / 'c')!r}); shardsafe.tools.verify_checkpoint\n"
            "assert not [m for m in sys.modules if m.split('.')[0] in ('lightning', 'pytorch_lightning')]")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ----------------------------------------------------------------------------- 2 gloo processes


@contextmanager
def lightning_rank(rank: int, world: int) -> Iterator[None]:
    """Let Lightning use this worker's process group (LOCAL_RANK: processes made elsewhere);
    the environment is restored afterwards, since the pool's workers run other tests too."""
    saved = dict(os.environ)
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def model_parallel_case(rank: int, world: int, root: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    def strategy(dp: int) -> ShardsafeModelParallelStrategy:
        return ShardsafeModelParallelStrategy(data_parallel_size=dp, tensor_parallel_size=world // dp)

    def final(trainer: Any) -> dict[str, Any]:
        model, optim = get_state_dict(trainer.lightning_module, trainer.optimizers[0],
                                      options=StateDictOptions(full_state_dict=True))
        return {"params": model, "optim": optim, "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "step": trainer.global_step}

    with lightning_rank(rank, world):
        callback = ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=-1, save_last=True)
        first = L.Trainer(strategy=strategy(world), devices=world, max_epochs=2, callbacks=[callback], **QUIET)
        first.fit(Tiny(layout="fsdp"), loader(64))
        saved = final(first)
        path = os.path.join(root, f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt")
        resumed = L.Trainer(strategy=strategy(world), devices=world, max_epochs=4, enable_checkpointing=False, **QUIET)
        resumed.fit(Tiny(layout="fsdp", seed=1), loader(64), ckpt_path=path)
        straight = L.Trainer(strategy=strategy(world), devices=world, max_epochs=4, enable_checkpointing=False, **QUIET)
        straight.fit(Tiny(layout="fsdp"), loader(64))
        assert_same(final(straight), final(resumed), f"rank {rank} final state")
        assert resumed.global_step == 4 * STEPS_PER_EPOCH
        # another layout: FSDP2 shards (dim 0 over 2 ranks) read into tensor-parallel shards
        # (column- then row-wise); max_epochs=2 is already reached, so nothing trains after the load
        other = L.Trainer(strategy=strategy(1), devices=world, max_epochs=2, enable_checkpointing=False, **QUIET)
        other.fit(Tiny(layout="tp", seed=2), loader(64), ckpt_path=path)
        assert_same(saved, final(other), f"rank {rank} state loaded into a tensor-parallel layout")
    return {"path": path, "params": saved["params"]}


def ddp_case(rank: int, world: int, root: str) -> str:
    with lightning_rank(rank, world):
        callback = ModelCheckpoint(dirpath=root, every_n_epochs=1, save_top_k=1, monitor="step", mode="max")
        first = L.Trainer(strategy="ddp", devices=world, max_epochs=2, plugins=[ShardsafeCheckpointIO()],
                          callbacks=[callback], **QUIET)
        first.fit(Tiny(), loader(64))  # saves and removes on rank 0 alone
        path = os.path.join(root, f"epoch=1-step={2 * STEPS_PER_EPOCH}.ckpt")
        resumed = L.Trainer(strategy="ddp", devices=world, max_epochs=3, plugins=[ShardsafeCheckpointIO()],
                            enable_checkpointing=False, **QUIET)
        resumed.fit(Tiny(seed=1), loader(64), ckpt_path=path)
        straight = L.Trainer(strategy="ddp", devices=world, max_epochs=3, enable_checkpointing=False, **QUIET)
        straight.fit(Tiny(), loader(64))
        assert_same(final_state(straight), final_state(resumed), f"rank {rank} final state")
    return path


def test_model_parallel_strategy_two_processes(pg_pool: Any, tmp_path: Path) -> None:
    results = pg_pool(2).run(model_parallel_case, str(tmp_path / "mp"), timeout=240)
    path = results[0]["path"]
    manifest = shardsafe.read_manifest(path)
    assert manifest.world_size == 2
    chunks = manifest.tensors["state_dict.net.0.weight"].chunks
    assert sorted(c.rank for c in chunks) == [0, 1]  # each rank wrote its own shard
    assert verify_checkpoint(path).ok
    assert sorted(os.listdir(tmp_path / "mp")) == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    # one process reads the sharded checkpoint as full tensors
    loaded = ShardsafeCheckpointIO().load_checkpoint(path)
    assert_same(dict(results[0]["params"]), loaded["state_dict"])
    assert loaded["hyper_parameters"]["layout"] == "fsdp" and loaded["global_step"] == 8


def test_ddp_plugin_two_processes(pg_pool: Any, tmp_path: Path) -> None:
    path = pg_pool(2).run(ddp_case, str(tmp_path / "ddp"), timeout=240)[0]
    assert os.listdir(tmp_path / "ddp") == [os.path.basename(path)]  # the older one was removed
    assert shardsafe.read_manifest(path).world_size == 1  # rank 0 saved alone
