"""tools/generate.py's sampling with a KV cache gives the tokens the model gives without one."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from tests.conftest import REPO
from trident.config import ModelConfig
from trident.models.gpt import GPT, init_weights

_spec = importlib.util.spec_from_file_location("generate_tool", REPO / "tools" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

LLAMA = ModelConfig(
    name="l", n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, d_ff=48, seq_len=48, vocab_size=97,
    norm="rmsnorm", mlp="swiglu", position="rope", bias=False, tie_embeddings=False,
)  # fmt: skip
GPT2 = ModelConfig(name="g", n_layers=2, d_model=32, n_heads=4, seq_len=48, vocab_size=97)


@torch.no_grad()
def greedy_without_cache(model: GPT, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_greedy_tokens_with_the_cache_are_the_full_forwards(cfg):
    model = GPT(cfg)
    init_weights(model, dataclasses.replace(cfg, init_std=0.2), seed=3)  # large weights: no ties among logits
    model.eval()
    prompt = [5, 17, 2, 60, 33]
    out = generate.sample(model, prompt, 40, 0.0, 0, torch.Generator())
    assert out == greedy_without_cache(model, prompt, 40)
    assert len(set(out)) > 3  # not one token repeated: the comparison means something


def test_generation_goes_on_past_the_window():
    """Past seq_len the cache restarts from the last half window; sampling continues with the tokens it gives."""
    model = GPT(LLAMA).eval()
    init_weights(model, LLAMA, seed=0)
    out = generate.sample(model, [1, 2, 3], 120, 1.0, 10, torch.Generator().manual_seed(0))
    assert len(out) == 120 and all(0 <= t < LLAMA.vocab_size for t in out)
