"""Hostile checkpoints, failing disks and misuse end in a clear CheckpointError with nothing
lost (issue 10): Statefuls that do not fit are refused before any byte lands, raw errors
become CheckpointErrors, loads during overwrites see one whole checkpoint, deletions are
atomic for readers."""

from __future__ import annotations

import errno
import threading

import pytest
import torch

import hardening_cases
import shardsafe
from bitwise import assert_bitwise
from shardsafe.data import ElasticSampler
from shardsafe.storage.faults import Fault, FaultyBackend


def snapshot(obj) -> dict:
    return {k: v.detach().clone() for k, v in obj.state_dict().items()}


def opt_snapshot(opt) -> list:
    return [{k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)} for s in opt.state.values()]


def trained(model, opt, steps: int = 2):
    for i in range(steps):
        opt.zero_grad()
        model(torch.full((2, model.in_features if hasattr(model, "in_features") else 4), float(i))).sum().backward()
        opt.step()


# ----------------------------------------------------------------------------- Statefuls that do not fit


def test_module_with_extra_saved_keys_is_refused_untouched(tmp_path):
    big = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    shardsafe.save({"model": big}, tmp_path / "ck")
    small = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = snapshot(small)
    with pytest.raises(shardsafe.UnexpectedKeysError, match=r"key 'model'.*'1.weight'"):
        shardsafe.load({"model": small}, tmp_path / "ck")
    assert_bitwise(before, snapshot(small))
    shardsafe.load({"model": small}, tmp_path / "ck", strict=False)  # explicitly allowed
    assert torch.equal(small[0].weight, big[0].weight)


def test_optimizer_with_other_param_groups_is_refused_untouched(tmp_path):
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    trained(model, opt)
    shardsafe.save({"model": model, "opt": opt}, tmp_path / "ck")
    model2 = torch.nn.Linear(4, 3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=0.1)  # one group
    trained(model2, opt2, 1)
    before, before_opt = snapshot(model2), opt_snapshot(opt2)
    with pytest.raises(shardsafe.CheckpointError, match="key 'opt': the checkpoint's optimizer has 2 param group"):
        shardsafe.load({"model": model2, "opt": opt2}, tmp_path / "ck")
    assert_bitwise(before, snapshot(model2))
    assert_bitwise(before_opt, opt_snapshot(opt2))


def test_train_state_checks_model_optimizer_and_sampler_before_landing(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trained(model, opt)
    sampler = ElasticSampler(100, global_batch_size=8, rank=0, world_size=1)
    shardsafe.save({"train": shardsafe.TrainState(model, opt, data=sampler)}, tmp_path / "ck")
    # The same model, but the sampler's global batch differs: refused before any tensor lands.
    model2 = torch.nn.Linear(4, 4)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    other = ElasticSampler(100, global_batch_size=16, rank=0, world_size=1)
    before = snapshot(model2)
    with pytest.raises(shardsafe.CheckpointError, match="key 'train.data': .*global batch size 8"):
        shardsafe.load({"train": shardsafe.TrainState(model2, opt2, data=other)}, tmp_path / "ck")
    assert_bitwise(before, snapshot(model2))
    # A model with a parameter the checkpoint lacks / an extra one: refused, untouched.
    model3 = torch.nn.Sequential(torch.nn.Linear(4, 4))
    before = snapshot(model3)
    with pytest.raises(shardsafe.CheckpointError) as ei:
        shardsafe.load({"train": shardsafe.TrainState(model3, torch.optim.SGD(model3.parameters(), lr=0.1),
                                                      data=sampler)}, tmp_path / "ck")
    assert "train.model" in str(ei.value)
    assert_bitwise(before, snapshot(model3))


class Picky:
    """A user Stateful whose load_state_dict refuses what it gets."""

    def __init__(self) -> None:
        self.w = torch.zeros(3)

    def state_dict(self) -> dict:
        return {"w": self.w, "version": 2}

    def load_state_dict(self, sd: dict) -> None:
        raise RuntimeError("version 2 states are not supported")


def test_user_stateful_error_is_wrapped_naming_the_key(tmp_path):
    shardsafe.save({"user": Picky()}, tmp_path / "ck")
    with pytest.raises(shardsafe.CheckpointError, match="key 'user': Picky.load_state_dict failed: RuntimeError") as ei:
        shardsafe.load({"user": Picky()}, tmp_path / "ck")
    assert isinstance(ei.value.__cause__, RuntimeError)


def test_grad_scaler_saved_disabled_into_enabled_is_refused(tmp_path):
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    shardsafe.save({"scaler": disabled}, tmp_path / "ck")
    with pytest.raises(shardsafe.MissingKeysError, match="key 'scaler.scale' is not in the checkpoint"):
        shardsafe.load({"scaler": torch.amp.GradScaler("cpu", enabled=True)}, tmp_path / "ck")



# ----------------------------------------------------------------------------- raw exceptions


@pytest.mark.parametrize("value,match", [
    (torch.eye(3).to_sparse(), "dense"),
    (torch.empty(3, device="meta"), "meta device"),
    (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "dense|nested"),
])
def test_unsavable_tensors_are_refused_naming_the_key(tmp_path, value, match):
    with pytest.raises(shardsafe.UnsupportedValueError, match=f"tensor 'bad'.*({match})"):
        shardsafe.save({"ok": torch.ones(2), "bad": value}, tmp_path / "ck")
    assert list(tmp_path.iterdir()) == []


def test_cyclic_state_and_path_inside_a_file_are_checkpoint_errors(tmp_path):
    d: dict = {"w": torch.ones(2)}
    d["self"] = d
    with pytest.raises(shardsafe.UnsupportedValueError, match="key|'self'.*cyclic"):
        shardsafe.save(d, tmp_path / "ck")
    (tmp_path / "file").write_text("x")
    with pytest.raises(shardsafe.CheckpointError):
        shardsafe.save({"w": torch.ones(2)}, tmp_path / "file" / "ck")


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EFBIG])
@pytest.mark.parametrize("how", ["save", "async", "manager"])
def test_write_failures_are_storage_errors_keeping_errno(tmp_path, code, how):
    backend = FaultyBackend(faults=[Fault("write", code, name="data-r", skip=1)])
    cp = shardsafe.Checkpointer(storage=backend)
    state = {"w": torch.randn(1 << 18)}
    with pytest.raises(shardsafe.StorageError) as ei:
        if how == "save":
            cp.save(state, tmp_path / "ck")
        elif how == "async":
            cp.async_save(state, tmp_path / "ck").result(60)
        else:
            with shardsafe.CheckpointManager(tmp_path / "run", interval=1, checkpointer=cp) as mgr:
                mgr.save(1, state)
    cp.close()
    assert ei.value.errno == code and "data-r00000-00.safetensors" in ei.value.filename
    assert isinstance(ei.value.__cause__, OSError)
    leftovers = [p.name for p in tmp_path.rglob("*") if "shardsafe-tmp" in p.name]
    assert leftovers == []


# ----------------------------------------------------------------------------- concurrent overwrite


def test_loads_during_overwrites_see_one_whole_checkpoint(tmp_path):
    """One thread overwrites a checkpoint with A, B, A, ...; two others load it the whole
    time: every load succeeds and returns exactly A or exactly B."""
    path = tmp_path / "ck"
    a = {"x": torch.full((1 << 16,), 1.0), "y": torch.full((7,), 1.0), "tag": "a"}
    b = {"x": torch.full((1 << 16,), 2.0), "y": torch.full((7,), 2.0), "tag": "b"}
    shardsafe.save(a, path)
    stop = threading.Event()
    errors: list[BaseException] = []
    loads = [0]

    def writer() -> None:
        i = 0
        while not stop.is_set():
            shardsafe.save(b if i % 2 == 0 else a, path, overwrite=True)
            i += 1

    def reader(full: bool) -> None:
        while not stop.is_set():
            try:
                if full:
                    got = shardsafe.load_full(path)
                else:
                    got = {"x": torch.zeros(1 << 16), "y": torch.zeros(7), "tag": ""}
                    shardsafe.load(got, path)
                ref = a if got["tag"] == "a" else b
                assert torch.equal(got["x"], ref["x"]) and torch.equal(got["y"], ref["y"]), "mixed checkpoint"
                loads[0] += 1
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
                return

    threads = [threading.Thread(target=writer), threading.Thread(target=reader, args=(True,)),
               threading.Thread(target=reader, args=(False,))]
    for t in threads:
        t.start()
    threading.Event().wait(3.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert not errors, errors[:1]
    assert loads[0] > 10


# ----------------------------------------------------------------------------- deletion


def test_interrupted_deletion_never_leaves_a_checkpoint_looking_committed(tmp_path):
    """Retention whose file deletion fails half way: the step is already out of sight (no
    folder with a manifest at its name), the manager loads the newest kept step, and the
    next save removes the leftover."""
    folder = tmp_path / "run"
    backend = FaultyBackend(faults=[Fault("remove_tree", errno.EIO, times=1)])
    cp = shardsafe.Checkpointer(storage=backend)
    with pytest.warns(UserWarning, match="retention could not delete"), \
            shardsafe.CheckpointManager(folder, interval=1, keep_last=1, checkpointer=cp) as mgr:
        mgr.save(1, {"w": torch.full((4,), 1.0)})
        mgr.save(2, {"w": torch.full((4,), 2.0)})
    names = sorted(p.name for p in folder.iterdir())
    assert names[0].startswith(".step-00000001.shardsafe-del-") and names[1:] == ["step-00000002"], names
    with shardsafe.CheckpointManager(folder, interval=1, keep_last=1) as mgr:
        assert mgr.steps() == [2]
        dest = {"w": torch.zeros(4)}
        assert mgr.load(dest) == 2
        mgr.save(3, {"w": torch.full((4,), 3.0)})  # cleans the leftover; keeps 2 (loaded) and 3
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000003"]
    cp.close()


# ----------------------------------------------------------------------------- distributed


def test_partial_placement_is_refused_naming_the_key(pg_pool, tmp_path):
    results = pg_pool(2).run(hardening_cases.save_partial, str(tmp_path / "ck"))
    assert all("tensor 'p'" in r and "Partial" in r for r in results), results
