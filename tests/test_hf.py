"""Hugging Face folders with the real ``transformers`` (offline, tiny models), and DCP export.

FSDP2 training on 4 gloo ranks -> manager save (TrainState + the config) -> ``shardsafe
export --to hf`` and ``save_final`` -> ``from_pretrained``: logits bitwise equal to the
trained model's. ``save_pretrained`` folder -> ``shardsafe import`` -> FSDP2 load on 2
ranks: parameters bitwise equal. Renaming rules, tied weights, configs, DCP export.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
transformers = pytest.importorskip("transformers")

import hf_cases  # noqa: E402
import shardsafe  # noqa: E402
from bitwise import assert_bitwise  # noqa: E402
from shardsafe.hf_folder import HFFolderError, config_state, rename_names  # noqa: E402
from shardsafe.tools import export_checkpoint, import_checkpoint  # noqa: E402
from shardsafe.tools.cli import main  # noqa: E402


def from_pretrained(folder: Path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(folder)


def logits(model: torch.nn.Module) -> torch.Tensor:
    """As the workers compute them: one thread, eval mode, fixed tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return hf_cases.logits_of(model)
    finally:
        torch.set_num_threads(threads)


def cli(*args: object, capsys: pytest.CaptureFixture) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def trained(pg_pool, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """Both tiny models trained and saved under FSDP2 on 4 ranks (see hf_cases.train_and_save)."""
    folder = tmp_path_factory.mktemp("hf-trained")
    out = pg_pool(4).run(hf_cases.train_and_save, str(folder))
    return folder, out[0]


# ------------------------------------------------------------------------------------------------ export


@pytest.mark.parametrize("kind", hf_cases.KINDS)
def test_fsdp2_trainstate_export_to_hf_loads_with_from_pretrained_bitwise(trained, kind, tmp_path, capsys):
    folder, out = trained
    ckpt, hf = folder / kind / "step-00000002", tmp_path / "hf"
    code, text, err = cli("export", ckpt, hf, "--to", "hf", "--strip", "train.model", "--max-shard-size", "20KB",
                          capsys=capsys)
    assert code == 0, err
    assert "config.json from the checkpoint's 'hf_config'" in text
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] > 0 and len(set(index["weight_map"].values())) > 1
    config = json.loads((hf / "config.json").read_text())
    assert config["dtype"] == "float32" and config["architectures"] == [
        {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}[kind]]
    if kind == "gpt2":  # tied: written once, as save_pretrained does
        assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]
        assert "lm_head.weight left out: tied to transformer.wte.weight" in text
        assert (hf / "generation_config.json").exists()
    else:
        assert "lm_head.weight" in index["weight_map"]
    model = from_pretrained(hf)
    assert_bitwise(out[kind]["logits"], logits(model))


def test_save_final_loads_with_from_pretrained_bitwise(trained):
    folder, out = trained
    for kind in hf_cases.KINDS:
        final = Path(out[kind]["final"])
        assert final == folder / kind / "final" / "model.safetensors"
        assert (final.parent / "config.json").exists()
        assert_bitwise(out[kind]["logits"], logits(from_pretrained(final.parent)), kind)
    from safetensors import safe_open

    with safe_open(folder / "gpt2" / "final" / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and f.metadata() == {"format": "pt"}


def test_export_hf_with_config_path_and_shard_layout(trained, tmp_path, capsys):
    folder, out = trained
    ckpt = folder / "llama" / "step-00000002"
    final = folder / "llama" / "final"
    code, text, err = cli("export", ckpt, tmp_path / "hf", "--to", "hf", "--keys", "train.model", "--strip",
                          "train.model", "--config", final / "config.json", "--dtype", "bfloat16", capsys=capsys)
    assert code == 0, err
    assert f"config.json from {final / 'config.json'}" in text
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    model = from_pretrained(tmp_path / "hf")
    assert model.dtype == torch.bfloat16
    want = from_pretrained(final).state_dict()
    assert_bitwise({k: v.to(torch.bfloat16) for k, v in want.items()}, dict(model.state_dict()))


# ------------------------------------------------------------------------------------------------ import


def test_hf_folder_import_then_fsdp2_load_on_2_ranks_bitwise(pg_pool, tmp_path, capsys):
    hf_dirs, imported = {}, {}
    for kind in hf_cases.KINDS:
        model = hf_cases.tiny(kind, seed=7)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.01)  # not the initialization
        hf_dirs[kind] = tmp_path / f"{kind}-hf"
        model.save_pretrained(hf_dirs[kind], max_shard_size="40KB")
        imported[kind] = tmp_path / f"{kind}-ours"
        code, text, err = cli("import", hf_dirs[kind], imported[kind], "--prefix", "model", capsys=capsys)
        assert code == 0, err
        assert "config stored under hf_config, hf_generation_config" in text
        if kind == "gpt2":
            assert "lm_head.weight restored as a copy of transformer.wte.weight" in text
    pg_pool(2).run(hf_cases.load_imported, {k: str(v) for k, v in imported.items()},
                   {k: str(v) for k, v in hf_dirs.items()})
    # and back: the stored config makes the round trip need no --config
    report = export_checkpoint(imported["gpt2"], tmp_path / "back", "hf", strip="model")
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"}
    assert_bitwise(dict(from_pretrained(hf_dirs["gpt2"]).state_dict()),
                   dict(from_pretrained(tmp_path / "back").state_dict()))


# ------------------------------------------------------------------------------------------------ renaming

TITAN_TO_HF = [  # torchtitan's Llama 3 names (Llama3StateDictAdapter.from_hf_map) -> Hugging Face's
    r"^tok_embeddings\.=model.embed_tokens.",
    r"^norm\.=model.norm.",
    r"^layers\.=model.layers.",
    r"\.attention\.qkv_linear\.w([qkv])\.=.self_attn.\1_proj.",
    r"\.attention\.wo\.=.self_attn.o_proj.",
    r"\.feed_forward\.w1\.=.mlp.gate_proj.",
    r"\.feed_forward\.w2\.=.mlp.down_proj.",
    r"\.feed_forward\.w3\.=.mlp.up_proj.",
    r"\.attention_norm\.=.input_layernorm.",
    r"\.ffn_norm\.=.post_attention_layernorm.",
]


def to_titan(name: str) -> str:
    """HF Llama names -> torchtitan's (the inverse of TITAN_TO_HF)."""
    pairs = [("model.embed_tokens.", "tok_embeddings."), ("model.norm.", "norm."),
             ("model.layers.", "layers."), (".self_attn.q_proj.", ".attention.qkv_linear.wq."),
             (".self_attn.k_proj.", ".attention.qkv_linear.wk."), (".self_attn.v_proj.", ".attention.qkv_linear.wv."),
             (".self_attn.o_proj.", ".attention.wo."), (".mlp.gate_proj.", ".feed_forward.w1."),
             (".mlp.down_proj.", ".feed_forward.w2."), (".mlp.up_proj.", ".feed_forward.w3."),
             (".input_layernorm.", ".attention_norm."), (".post_attention_layernorm.", ".ffn_norm.")]
    for a, b in pairs:
        name = name.replace(a, b)
    return name


def test_rename_rules_torchtitan_names_to_hf(tmp_path, capsys):
    model = hf_cases.tiny("llama", seed=3)
    sd = model.state_dict()
    titan = {to_titan(k): v for k, v in sd.items()}
    assert "layers.0.attention.qkv_linear.wq.weight" in titan and "tok_embeddings.weight" in titan
    shardsafe.save({"train": {"model": titan}, **config_state(model)}, tmp_path / "ckpt")
    args = ["export", tmp_path / "ckpt", tmp_path / "hf", "--to", "hf", "--strip", "train.model"]
    for rule in TITAN_TO_HF:
        args += ["--rename", rule]
    code, _, err = cli(*args, capsys=capsys)
    assert code == 0, err
    assert_bitwise(logits(model), logits(from_pretrained(tmp_path / "hf")))
    # a mapping and a callable do the same in Python
    mapping = {to_titan(k): k for k in sd}
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf2", "hf", strip="train.model", rename=mapping)
    export_checkpoint(tmp_path / "ckpt", tmp_path / "hf3", "safetensors", strip="train.model",
                      rename=lambda n: mapping[n])
    from safetensors.torch import load_file

    assert_bitwise(dict(sd), load_file(tmp_path / "hf3"))
    assert (tmp_path / "hf2" / "config.json").exists()


def test_rename_errors():
    with pytest.raises(HFFolderError, match="matches no name"):
        rename_names(["a.w", "b.w"], [r"^c\.=d."])
    with pytest.raises(HFFolderError, match="would both be named 'x'"):
        rename_names(["a", "b"], [r"^.*$=x"])
    with pytest.raises(HFFolderError, match="REGEX=REPLACEMENT"):
        rename_names(["a"], ["no-equals-sign"])
    assert rename_names(["layers.3.w"], [r"^layers\.(\d+)\.=h.\1.", r"\.w$=.weight"]) == ["h.3.weight"]


def test_rename_needs_flat_names_for_nested_outputs(tmp_path):
    shardsafe.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    with pytest.raises(shardsafe.CheckpointError, match="--flat"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "x.pt", "torch", rename=["w=v"])
    export_checkpoint(tmp_path / "ckpt", tmp_path / "x.pt", "torch", rename=[r"^model\.w$=v"], flat=True)
    assert list(torch.load(tmp_path / "x.pt", weights_only=True)) == ["v"]


# ------------------------------------------------------------------------------------------------ DCP


def test_export_to_dcp_loads_back_bitwise_with_dcp(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)
    state = {"model": {"embed.weight": torch.randn(16, 8, generator=g), "layers": [
                 {"w": torch.randn(8, 8, generator=g).bfloat16(), "b": torch.randn(8, generator=g)}]},
             "optim": {"state": {"embed.weight": {"step": torch.tensor(3.0), "exp_avg": torch.randn(16, 8)}},
                       "param_groups": [{"lr": 0.01, "betas": (0.9, 0.99), "params": ["embed.weight"]}]},
             "step": 42}
    shardsafe.save(state, tmp_path / "ckpt")
    code, text, err = cli("export", tmp_path / "ckpt", tmp_path / "dcp", "--to", "dcp", capsys=capsys)
    assert code == 0, err
    files = sorted(p.name for p in (tmp_path / "dcp").iterdir())
    assert ".metadata" in files and sum(f.endswith(".distcp") for f in files) == 1  # small tensors: one file
    dest = {"model": {"embed.weight": torch.zeros(16, 8), "layers": [
                {"w": torch.zeros(8, 8, dtype=torch.bfloat16), "b": torch.zeros(8)}]},
            "optim": {"state": {"embed.weight": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(16, 8)}},
                      "param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": []}]},
            "step": 0}
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(dest, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert_bitwise(state, dest)
    # a part, converted, under the subtree's own names
    export_checkpoint(tmp_path / "ckpt", tmp_path / "dcp2", "dcp", strip="model", dtype="float64")
    part = {"embed.weight": torch.zeros(16, 8, dtype=torch.float64),
            "layers": [{"w": torch.zeros(8, 8, dtype=torch.float64), "b": torch.zeros(8, dtype=torch.float64)}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(part, checkpoint_id=str(tmp_path / "dcp2"), no_dist=True)
    assert torch.equal(part["layers"][0]["w"], state["model"]["layers"][0]["w"].double())


# ------------------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("to", ["torch", "safetensors", "hf", "dcp"])
@pytest.mark.parametrize("flat", [False, True])
def test_strip_that_matches_nothing_is_an_error_for_every_format(tmp_path, capsys, to, flat):
    shardsafe.save({"train": {"model": {"w": torch.ones(2)}, "step": 1}}, tmp_path / "ckpt")
    args = ["export", tmp_path / "ckpt", tmp_path / "out", "--to", to, "--strip", "model"] + (["--flat"] if flat
                                                                                           else [])
    code, _, err = cli(*args, capsys=capsys)
    assert code == 2
    assert "--strip 'model' selects nothing" in err and "'train.model'" in err and "top-level keys: train" in err
    assert not (tmp_path / "out").exists()


def test_keys_that_select_nothing_say_so_and_suggest(tmp_path, capsys):
    shardsafe.save({"train": {"model": {"layers.0.w": torch.ones(2)}}}, tmp_path / "ckpt")
    code, _, err = cli("export", tmp_path / "ckpt", tmp_path / "o", "--to", "safetensors", "--keys", "train.modle",
                       capsys=capsys)
    assert code == 2 and "--keys 'train.modle' selects nothing" in err and "did you mean 'train.model'" in err
    code, _, err = cli("diff", tmp_path / "ckpt", tmp_path / "ckpt", "--keys", "trian", capsys=capsys)
    assert code == 2 and "--keys 'trian' selects nothing" in err and "did you mean 'train'" in err


def test_config_options_are_for_hf_only(tmp_path):
    shardsafe.save({"model": {"w": torch.ones(2)}}, tmp_path / "ckpt")
    with pytest.raises(shardsafe.CheckpointError, match="for --to hf"):
        export_checkpoint(tmp_path / "ckpt", tmp_path / "o", "safetensors", config={"model_type": "gpt2"})


def test_import_restores_tied_weights_without_prefix(tmp_path):
    model = hf_cases.tiny("gpt2")
    model.save_pretrained(tmp_path / "hf")
    report = import_checkpoint(tmp_path / "hf", tmp_path / "ours")
    assert report.tied == {"lm_head.weight": "transformer.wte.weight"} and report.config_keys == []
    got = shardsafe.load_full(tmp_path / "ours")
    assert_bitwise({k: v.detach() for k, v in model.state_dict().items()}, got)
