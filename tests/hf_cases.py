"""Case functions for tests/test_hf.py, run on every rank of a WorkerPool (tests/distributed.py).

Tiny Hugging Face models (GPT-2 with tied embeddings, Llama without) built from their
configs offline, sharded with FSDP2 over every block and the root. Each case takes
(rank, world, *args)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

import shardsafe  # noqa: E402
from bitwise import assert_bitwise  # noqa: E402

VOCAB = 96
KINDS = ("gpt2", "llama")


def tiny(kind: str, seed: int = 0) -> torch.nn.Module:
    """A tiny GPT-2 (tied word embeddings, no dropout) or Llama (untied), seeded."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if kind == "gpt2":
        return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                          bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0))
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                        max_position_embeddings=32, tie_word_embeddings=False, bos_token_id=0,
                                        eos_token_id=0))


def blocks(model: torch.nn.Module) -> torch.nn.ModuleList:
    return model.transformer.h if hasattr(model, "transformer") else model.model.layers


def shard(model: torch.nn.Module, world: int) -> torch.nn.Module:
    """FSDP2 over every block and the root, on a CPU mesh of ``world`` ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for block in blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(seed))


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    """The model's logits on fixed tokens, in eval mode, on one thread (bitwise reproducible)."""
    model.eval()
    with torch.no_grad():
        return model(tokens(7)).logits.detach().clone()


def train_and_save(rank: int, world: int, folder: str) -> dict:
    """For each kind: FSDP2 on ``world`` ranks, 2 AdamW steps on per-rank data, then a
    manager save of ``{"train": TrainState, **config_state(model)}`` at step 2 and
    ``save_final`` (default folder ``<kind>/final``). Rank 0 returns the trained logits."""
    from shardsafe.hf_folder import config_state

    out = {}
    for kind in KINDS:
        model = shard(tiny(kind), world)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(2):
            batch = tokens(100 * step + rank)
            model(batch, labels=batch).loss.backward()
            opt.step()
            opt.zero_grad()
        train = shardsafe.TrainState(model, opt)
        train.step = 2
        with shardsafe.CheckpointManager(os.path.join(folder, kind)) as mgr:
            mgr.save(2, {"train": train, **config_state(model)})
            final = mgr.save_final(model)
        logits = logits_of(model)
        out[kind] = {"logits": logits if rank == 0 else None, "final": str(final)}
    return out


def load_imported(rank: int, world: int, imported: dict, hf_dirs: dict) -> dict:
    """For each kind: a fresh, differently seeded FSDP2 model on ``world`` ranks loads the
    checkpoint ``imported[kind]`` (made by ``shardsafe import --prefix model``); its full
    parameters must equal, bitwise, those ``from_pretrained(hf_dirs[kind])`` gives."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from transformers import AutoModelForCausalLM

    for kind in KINDS:
        model = shard(tiny(kind, seed=1234), world)
        state = {"model": get_model_state_dict(model)}
        shardsafe.load(state, imported[kind])
        set_model_state_dict(model, state["model"])
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            want = AutoModelForCausalLM.from_pretrained(hf_dirs[kind]).state_dict()
            assert_bitwise({k: v.detach() for k, v in want.items()}, {k: v.detach() for k, v in full.items()}, kind)
    return {"rank": rank}
