"""tools/generate.py's sampling with a KV cache gives the tokens the model gives without one."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from tests.helpers import REPO
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


def test_a_hugging_face_llama_directory_generates_transformers_greedy_text(tmp_path, monkeypatch, capsys):
    """``tools/generate.py DIR`` on a transformers Llama saved locally, with its tokenizer.json: the greedy text is
    what transformers' own generate gives."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    from tests.helpers.tools import run_tool

    words = ["<|endoftext|>", *[f"w{i}" for i in range(47)]]
    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = Whitespace()
    hf_cfg = transformers.LlamaConfig(
        vocab_size=len(words), hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None,  # our tool does not stop at an end token: neither may transformers
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "llama")
    tokenizer.save(str(tmp_path / "llama" / "tokenizer.json"))
    prompt = "w3 w17 w5 w40"
    code, text, err = run_tool(
        "generate", str(tmp_path / "llama"), "--prompt", prompt, "--tokens", "30", "--temperature", "0",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    with torch.no_grad():
        expected = hf.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=0)[0].tolist()
    assert text.strip() == tokenizer.decode(expected)
    assert len(set(expected[4:])) > 3
