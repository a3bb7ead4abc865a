"""The tools (shardsafe.tools and the ``shardsafe`` command) on real checkpoints and files."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import shardsafe
import tools_cases
from bitwise import assert_bitwise, tensors_equal
from dist_cases import tensors_of
from shardsafe.tools import (
    compare_tensors,
    diff_checkpoints,
    export_checkpoint,
    import_checkpoint,
    inspect_checkpoint,
    layout_boxes,
    layout_png,
    layout_text,
    list_checkpoints,
    parse_size,
    verify_checkpoint,
)
from shardsafe.tools.cli import main
from shardsafe.tools.progress import Progress

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_state() -> dict:
    """A small state with every kind of value: float32/bf16/int64/bool tensors, a 0-d and an
    empty tensor, nested dicts, a list, plain values and a rank-local value."""
    g = torch.Generator().manual_seed(0)
    return {
        "model": {
            "embed.weight": torch.randn(64, 48, generator=g),
            "layers": [
                {"w": torch.randn(48, 48, generator=g), "b": torch.randn(48, generator=g)},
                {"w": torch.randn(48, 48, generator=g).bfloat16(), "b": torch.randn(48, generator=g)},
            ],
            "head.weight": torch.randn(10, 48, generator=g),
        },
        "buffers": {
            "ids": torch.arange(100, dtype=torch.int64),
            "mask": torch.rand(33, generator=g) > 0.5,
            "scale": torch.tensor(0.125),
            "empty": torch.empty(0, 4),
        },
        "optim": {"lr": 1e-3, "betas": (0.9, 0.999), "name": "adamw", "step": 7, "blob": b"\x00\x01"},
        "rng": shardsafe.rank_local({"seed": 3, "state": torch.arange(5, dtype=torch.uint8)}),
    }


def plain(state: dict) -> dict:
    """``state`` without its rank-local values."""
    return {k: v for k, v in state.items() if not isinstance(v, shardsafe.state.tree.RankLocal)}


def run_cli(*args: str, capsys) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> tuple[Path, dict]:
    state = make_state()
    path = tmp_path_factory.mktemp("small") / "ckpt"
    shardsafe.save(state, path)
    return path, state


@pytest.fixture(scope="module")
def fsdp(pg_pool, tmp_path_factory) -> dict[str, Path]:
    """A 4-rank FSDP2 state saved by DCP and by shardsafe, with a full torch.save reference."""
    base = tmp_path_factory.mktemp("fsdp")
    paths = {"dcp": base / "dcp", "ours": base / "ours", "ref": base / "ref.pt"}
    pg_pool(4).run(tools_cases.save_fsdp_both, str(paths["dcp"]), str(paths["ours"]), str(paths["ref"]))
    return paths


# ------------------------------------------------------------------------------------------------ export


def test_export_hf_shards_are_bitwise_and_indexed(small, tmp_path, capsys):
    path, state = small
    out = tmp_path / "hf"
    code, text, _ = run_cli("export", path, out, "--to", "hf", "--max-shard-size", "12KB", capsys=capsys)
    assert code == 0, text
    assert "rank-local values skipped: rng" in text and "non-tensor values skipped" in text
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    expected = tensors_of(plain(state))
    assert set(index["weight_map"]) == set(expected)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in expected.values())
    seen = {}
    for shard in shards:
        with safe_open(out / shard, framework="pt") as f:
            names = list(f.keys())
            assert f.metadata() == {"format": "pt"}
            size = sum(f.get_tensor(n).numel() * f.get_tensor(n).element_size() for n in names)
            for n in names:
                assert index["weight_map"][n] == shard
                seen[n] = f.get_tensor(n)
        assert size <= 12_000 or len(names) == 1
    assert set(seen) == set(expected)
    for k, t in expected.items():
        assert tensors_equal(seen[k], t), k


def test_export_torch_loads_weights_only_bitwise(small, tmp_path, capsys):
    path, state = small
    out = tmp_path / "state.pt"
    code, text, _ = run_cli("export", path, out, "--to", "torch", capsys=capsys)
    assert code == 0, text
    got = torch.load(out, weights_only=True)
    assert_bitwise(plain(state), got)
    # saving rank 0's copy of the rank-local value, under its plain key
    code, _, _ = run_cli("export", path, out, "--to", "torch", "--rank", "0", "--overwrite", capsys=capsys)
    assert code == 0
    got = torch.load(out, weights_only=True)
    assert_bitwise(state["rng"].value, got["rng"])
    # flat: dotted keys
    report = export_checkpoint(path, tmp_path / "flat.pt", "torch", flat=True, keys=["model"])
    flat = torch.load(tmp_path / "flat.pt", weights_only=True)
    assert report.tensors == 6
    assert_bitwise(tensors_of({"model": state["model"]}), flat)


def test_export_dtype_converts_floats_only(small, tmp_path):
    path, state = small
    out = tmp_path / "bf16.safetensors"
    export_checkpoint(path, out, "safetensors", dtype="bfloat16")
    expected = tensors_of(plain(state))
    with safe_open(out, framework="pt") as f:
        assert set(f.keys()) == set(expected)
        for k, src in expected.items():
            got = f.get_tensor(k)
            if src.dtype in (torch.float32, torch.bfloat16):
                assert got.dtype == torch.bfloat16, k
                assert tensors_equal(got, src.to(torch.bfloat16)), k
            else:
                assert tensors_equal(got, src), k


def test_export_keys_and_strip(small, tmp_path):
    path, state = small
    out = tmp_path / "model.safetensors"
    report = export_checkpoint(path, out, "safetensors", keys=["model"], strip="model")
    assert report.tensors == 6 and report.skipped_rank_local == []
    with safe_open(out, framework="pt") as f:
        assert set(f.keys()) == set(tensors_of(state["model"]))
        assert tensors_equal(f.get_tensor("layers.1.w"), state["model"]["layers"][1]["w"])
    with pytest.raises(shardsafe.CheckpointError, match="selects nothing|no key"):
        export_checkpoint(path, tmp_path / "x.safetensors", "safetensors", keys=["nope"])


def test_export_of_a_2d_sharded_tp_save_is_bitwise(pg_pool, tmp_path):
    ours = tmp_path / "tp"
    pg_pool(4).run(tools_cases.save_tp, str(ours))
    # The reference for what export must write is the checkpoint as load_full reads it. (A
    # full_tensor() reference from rank 0 can differ from it for parameters replicated over
    # tp: dist_cases.train feeds every rank different tokens, so tp replicas drift apart,
    # and the save keeps one replica's copy.)
    ref = shardsafe.load_full(ours)
    boxes = layout_boxes(ours, "model.blocks.0.down.weight")  # RowwiseParallel: columns split over tp
    assert len({(b.col0, b.cols) for b in boxes}) == 2 and len(boxes) == 4
    export_checkpoint(ours, tmp_path / "tp.pt", "torch")
    assert_bitwise(ref, torch.load(tmp_path / "tp.pt", weights_only=True))
    report = export_checkpoint(ours, tmp_path / "hf", "hf", max_shard_size="4KB")
    assert len(report.files) > 2
    got = {}
    for shard in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            got.update({k: f.get_tensor(k) for k in f.keys()})
    expected = tensors_of(ref)
    assert set(got) == set(expected)
    for k, t in expected.items():
        assert tensors_equal(got[k], t), k


# ------------------------------------------------------------------------------------------------ import


def test_import_dcp_fsdp2_bitwise(fsdp, tmp_path, capsys):
    out = tmp_path / "imported"
    code, text, err = run_cli("import", fsdp["dcp"], out, "--trust-pickle", "--json", capsys=capsys)
    assert code == 0, err
    assert json.loads(text)["source"] == "dcp"
    ref = torch.load(fsdp["ref"], weights_only=True)
    assert_bitwise(ref, shardsafe.load_full(out))
    # and it equals what shardsafe itself saved from the same ranks
    assert diff_checkpoints(out, fsdp["ours"]).same


def test_import_dcp_needs_trust_pickle(fsdp, tmp_path):
    out = tmp_path / "refused"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.run([sys.executable, "-m", "shardsafe.tools.cli", "import", str(fsdp["dcp"]), str(out)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardsafe: error:"), proc.stderr
    assert "pickle" in lines[0] and "runs code" in lines[0] and "--trust-pickle" in lines[0]
    assert not out.exists()
    with pytest.raises(shardsafe.CheckpointError, match="--trust-pickle"):
        import_checkpoint(fsdp["dcp"], out)


def test_import_help_explains_trust_pickle(capsys):
    assert main(["import", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--trust-pickle" in text and "runs code" in text and "you trust" in text


def test_import_torch_save_roundtrip(small, tmp_path):
    _, state = small
    src = tmp_path / "plain.pt"
    torch.save(plain(state), src)
    report = import_checkpoint(src, tmp_path / "from_torch")
    assert report.source == "torch" and report.tensors == len(tensors_of(plain(state)))
    assert_bitwise(plain(state), shardsafe.load_full(tmp_path / "from_torch"))


def test_import_safetensors_and_hf_roundtrip(small, tmp_path, capsys):
    _, state = small
    flat = {k: v.contiguous() for k, v in tensors_of(plain(state)).items()}
    save_file(flat, tmp_path / "one.safetensors")
    code, _, err = run_cli("import", tmp_path / "one.safetensors", tmp_path / "from_st", "--prefix", "model",
                           capsys=capsys)
    assert code == 0, err
    assert_bitwise({"model": flat}, shardsafe.load_full(tmp_path / "from_st"))
    # a Hugging Face folder written by the safetensors library: two shards and an index
    hf = tmp_path / "hf"
    hf.mkdir()
    names = sorted(flat)
    half = {n: flat[n] for n in names[: len(names) // 2]}, {n: flat[n] for n in names[len(names) // 2:]}
    weight_map = {}
    for i, part in enumerate(half):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file(part, hf / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 0},
                                                                 "weight_map": weight_map}))
    report = import_checkpoint(hf, tmp_path / "from_hf")
    assert report.source == "hf"
    assert_bitwise(flat, shardsafe.load_full(tmp_path / "from_hf"))
    # export -> import round trip through our own hf writer
    export_checkpoint(tmp_path / "from_hf", tmp_path / "hf2", "hf", max_shard_size="10KB")
    import_checkpoint(tmp_path / "hf2", tmp_path / "from_hf2")
    assert diff_checkpoints(tmp_path / "from_hf", tmp_path / "from_hf2").same


# ------------------------------------------------------------------------------------------------ verify


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


def test_verify_names_a_flipped_byte(small, tmp_path, capsys):
    path, _ = small
    code, text, _ = run_cli("verify", path, capsys=capsys)
    assert code == 0 and text.strip().endswith("OK")
    bad = _copy(path, tmp_path / "bad")
    manifest = shardsafe.read_manifest(bad)
    key = "model.layers.0.w"
    chunk = manifest.tensors[key].chunks[0]
    fname = manifest.files[chunk.file].name
    offset = chunk.start + 1000
    _flip(bad / fname, offset)
    report = verify_checkpoint(bad)
    assert not report.ok and len(report.problems) == 1
    p = report.problems[0]
    assert (p.file, p.key) == (fname, key) and p.start <= offset < p.end
    assert (p.start, p.end) == (chunk.start, chunk.end)  # one block: the whole chunk
    code, text, _ = run_cli("verify", bad, capsys=capsys)
    assert code == 1
    assert fname in text and key in text and f"bytes {p.start}-{p.end}" in text
    code, text, _ = run_cli("verify", bad, "--json", capsys=capsys)
    data = json.loads(text)
    assert code == 1 and data["ok"] is False and data["problems"][0]["key"] == key


def test_verify_header_truncation_and_missing_file(small, tmp_path):
    path, _ = small
    manifest = shardsafe.read_manifest(path)
    fname = manifest.files[0].name
    bad = _copy(path, tmp_path / "header")
    _flip(bad / fname, 20)
    problems = verify_checkpoint(bad).problems
    assert [(p.file, p.key) for p in problems] == [(fname, None)] and "header" in problems[0].what
    bad = _copy(path, tmp_path / "short")
    size = (bad / fname).stat().st_size
    os.truncate(bad / fname, size - 100)
    problems = verify_checkpoint(bad).problems
    assert any("truncated" in p.what and p.key is None for p in problems)
    assert any("past the end" in p.what and p.key is not None for p in problems)
    (bad / fname).unlink()
    problems = verify_checkpoint(bad).problems
    assert len(problems) == 1 and "missing" in problems[0].what
    with open(bad / "manifest.json", "r+b") as f:
        f.truncate(200)
    report = verify_checkpoint(bad)
    assert not report.ok and "manifest" in str(report.problems[0])


# ------------------------------------------------------------------------------------------------ diff


def test_diff_finds_changes_and_respects_atol(small, tmp_path, capsys):
    path, state = small
    changed = make_state()
    changed["model"]["layers"][0]["w"][3, 4] += 0.5
    changed["optim"]["step"] = 8
    changed["extra"] = torch.zeros(2)
    del changed["buffers"]["scale"]
    changed["model"]["head.weight"] = changed["model"]["head.weight"].double()
    shardsafe.save(changed, tmp_path / "b")
    code, text, _ = run_cli("diff", path, tmp_path / "b", capsys=capsys)
    assert code == 1
    report = diff_checkpoints(path, tmp_path / "b")
    by_key = {c.key: c for c in report.changes}
    assert by_key["model.layers.0.w"].what == "values"
    assert by_key["model.layers.0.w"].max_abs_diff == pytest.approx(0.5, abs=1e-6)
    assert by_key["model.layers.0.w"].differing == 1
    assert by_key["optim.step"].what == "value"
    assert by_key["extra"].what == "added" and by_key["buffers.scale"].what == "removed"
    assert by_key["model.head.weight"].what == "dtype"
    assert "max abs diff 0.5" in text and "+ added" in text and "- removed" in text
    # within atol: only the structural changes remain
    report = diff_checkpoints(path, tmp_path / "b", atol=0.6, keys=["model.layers"])
    assert report.same and report.max_abs_diff["model.layers.0.w"] == pytest.approx(0.5, abs=1e-6)
    code, _, _ = run_cli("diff", path, tmp_path / "b", "--atol", "0.4", "--keys", "model.layers", capsys=capsys)
    assert code == 1
    code, text, _ = run_cli("diff", path, path, "--json", capsys=capsys)
    assert code == 0 and json.loads(text)["same"] is True


def test_compare_tensors_edge_cases():
    nan, inf = float("nan"), float("inf")
    a = torch.tensor([1.0, nan, inf, -0.0])
    assert compare_tensors(a, torch.tensor([1.0, nan, inf, 0.0])) == (0.0, 0)
    assert compare_tensors(a, torch.tensor([1.0, 2.0, inf, 0.0]))[1] == 1
    worst, bad = compare_tensors(torch.tensor([1.0, 2.0]), torch.tensor([1.1, 2.0]), rtol=0.1)
    assert bad == 0 and worst == pytest.approx(0.1, abs=1e-6)
    big = torch.tensor([2**62], dtype=torch.int64)
    assert compare_tensors(big, big + 1) == (1.0, 1)
    assert compare_tensors(torch.tensor([True]), torch.tensor([False])) == (1.0, 1)


# ------------------------------------------------------------------------------------------------ ls


def test_ls_marks_torn_and_incomplete_checkpoints(tmp_path, capsys):
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    folder = tmp_path / "run"
    for step in (100, 200, 300, 400):
        shardsafe.save(state, folder / f"step-{step:08d}")
    (folder / "step-00000200" / "manifest.json").unlink()
    m3 = folder / "step-00000300" / "manifest.json"
    m3.write_bytes(m3.read_bytes()[:-40])
    data4 = next((folder / "step-00000400").glob("data-*.safetensors"))
    os.truncate(data4, 100)
    tmp = folder / ".step-00000500.shardsafe-tmp-0123456789ab"
    tmp.mkdir()
    (tmp / "data-r00000-00.safetensors").write_bytes(b"x" * 10)
    (folder / "notes").mkdir()
    entries = list_checkpoints(folder)
    status = {e.step: e.status for e in entries}
    assert status == {100: "valid", 200: "invalid", 300: "invalid", 400: "invalid", 500: "incomplete"}
    by_step = {e.step: e for e in entries}
    assert "no manifest" in by_step[200].problem and "manifest" in by_step[300].problem
    assert "data file" in by_step[400].problem
    assert by_step[100].world_size == 1 and by_step[100].created and by_step[100].size > 4000
    code, text, _ = run_cli("ls", folder, capsys=capsys)
    assert code == 0
    lines = text.splitlines()
    assert len(lines) == 6 and "incomplete" in lines[-1] and ".step-00000500" in lines[-1]
    code, text, _ = run_cli("ls", folder, "--json", capsys=capsys)
    assert [e["status"] for e in json.loads(text)["checkpoints"]] == ["valid", "invalid", "invalid", "invalid",
                                                                     "incomplete"]


# ------------------------------------------------------------------------------------------------ inspect


def test_layout_of_a_4_rank_fsdp2_save(fsdp, tmp_path, capsys):
    ours = fsdp["ours"]
    boxes = layout_boxes(ours, "model.embed.weight")
    assert len(boxes) == 4 and {b.rank for b in boxes} == {0, 1, 2, 3}
    assert sorted((b.row0, b.rows, b.col0, b.cols) for b in boxes) == [
        (0, 8, 0, 12), (8, 8, 0, 12), (16, 8, 0, 12), (24, 7, 0, 12)]
    text = layout_text(ours, "model.embed.weight")
    grid = [line.strip() for line in text.splitlines() if re.fullmatch(r"\s+[0-9a-zA-Z*.#]+", line)]
    assert set("".join(grid)) == {"0", "1", "2", "3"}
    png = layout_png(ours, "model.embed.weight", tmp_path / "embed.png")
    assert png.read_bytes()[:8] == PNG_MAGIC and png.stat().st_size > 1000
    code, out, _ = run_cli("inspect", ours, "--layout", "model.embed.weight", "--png", tmp_path / "cli.png",
                           capsys=capsys)
    assert code == 0 and "legend" in out and (tmp_path / "cli.png").read_bytes()[:8] == PNG_MAGIC
    code, _, err = run_cli("inspect", ours, "--layout", "model.embed.weigth", capsys=capsys)
    assert code == 2 and "did you mean 'model.embed.weight'" in err


def test_inspect_tree(small, fsdp, capsys):
    path, _ = small
    report = inspect_checkpoint(path)
    rows = {r.key: r for r in report.rows}
    assert rows["model.embed.weight"].kind == "replicated" and rows["model.embed.weight"].shape == [64, 48]
    assert rows["model.embed.weight"].nbytes == 64 * 48 * 4 and rows["model.embed.weight"].chunks == 1
    assert rows["rng"].kind == "rank-local value"
    assert rows["rng#rank0.state"].kind == "rank_local"
    assert rows["optim.lr"].kind == "value" and "0.001" in rows["optim.lr"].value
    code, text, _ = run_cli("inspect", fsdp["ours"], capsys=capsys)
    assert code == 0 and "sharded" in text and "4 chunks" in text and "world size 4" in text
    code, text, _ = run_cli("inspect", fsdp["ours"], "--json", capsys=capsys)
    data = json.loads(text)
    entry = next(e for e in data["entries"] if e["key"] == "model.embed.weight")
    assert entry["kind"] == "sharded" and entry["ranks"] == [0, 1, 2, 3] and data["world_size"] == 4


# ------------------------------------------------------------------------------------------------ errors, misc


def test_errors_are_one_line_with_exit_2(small, tmp_path, capsys):
    path, _ = small
    code, out, err = run_cli("verify", tmp_path / "nothing", "--json", capsys=capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("shardsafe: error: no checkpoint at")
    assert json.loads(out)["ok"] is False
    (tmp_path / "taken.pt").write_bytes(b"x")
    code, _, err = run_cli("export", path, tmp_path / "taken.pt", "--to", "torch", capsys=capsys)
    assert code == 2 and "--overwrite" in err
    code, _, err = run_cli("export", path, tmp_path / "hf", "--to", "hf", "--max-shard-size", "lots", capsys=capsys)
    assert code == 2 and "5GB" in err
    code, _, err = run_cli("export", path, tmp_path / "o", "--to", "zip", capsys=capsys)
    assert code == 2
    code, _, err = run_cli("import", path, tmp_path / "again", capsys=capsys)
    assert code == 2 and "already a shardsafe checkpoint" in err
    assert parse_size("5GB") == 5 * 10**9 and parse_size("200MiB") == 200 << 20 and parse_size("64") == 64


def test_progress_line_only_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    with Progress("verify", 1000, stream=tty) as bar:
        bar.advance(1000)
    assert "\rverify [" in tty.getvalue() and "100.0%" in tty.getvalue()
    pipe = io.StringIO()
    with Progress("verify", 1000, stream=pipe) as bar:
        bar.advance(1000)
    assert pipe.getvalue() == ""
