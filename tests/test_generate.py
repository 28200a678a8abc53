"""tools/generate.py's sampling with a KV cache gives the tokens the model gives without one."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO
from trident.config import ModelConfig
from trident.models.gpt import GPT, init_weights
from trident.models.kv_cache import KVCache
from trident.parallel.placement import placement_of
from trident_dev.consolidated import ModelWeights

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


@torch.no_grad()
def greedy_windows_without_cache(model: GPT, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full forwards over the tokens of the current window: when the context would pass the
    model's window, the window starts again at the last half window of tokens (what sample's cache does)."""
    window, ids = model.cfg.seq_len, list(prompt)
    start = max(0, len(ids) - window)
    for _ in range(n):
        if len(ids) - start > window:
            start = len(ids) - window // 2
        ids.append(int(model(torch.tensor([ids[start:]]))[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("cfg", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_generation_goes_on_past_the_window(cfg):
    """Past seq_len the cache restarts from the last half window; sampling continues with the tokens it gives,
    the tokens full forwards over the same windows give (120 new tokens: the 48-token window restarts 4 times)."""
    model = GPT(cfg).eval()
    init_weights(model, dataclasses.replace(cfg, init_std=0.5), seed=3)  # large weights: no ties among logits
    prompt = [1, 2, 3]
    out = generate.sample(model, prompt, 120, 0.0, 0, torch.Generator())
    assert out == greedy_windows_without_cache(model, prompt, 120)
    assert len(out) == 120 and len(set(out[60:])) > 10  # past the window, not a loop of a few tokens


def test_the_cache_holds_the_prompt_and_the_new_tokens_in_the_weights_dtype(monkeypatch):
    """A bf16 model of a long context (a Llama 3.2 has 131072 positions) trained on short windows: the model runs in
    bf16 over its whole context, and the cache holds what one generation needs (prompt + new tokens) in bf16, not
    the context in fp32 (8 GiB for a Llama 3.2 1B); past the context, it holds the context."""
    made: list[KVCache] = []

    class Recorded(KVCache):
        def __init__(self, max_len: int) -> None:
            super().__init__(max_len)
            made.append(self)

    monkeypatch.setattr(generate, "KVCache", Recorded)
    cfg = dataclasses.replace(LLAMA, seq_len=32, max_seq_len=4096)
    model = GPT(cfg)
    init_weights(model, cfg, seed=0)
    tensors = {name: placement_of(p).real_part(p.detach()).bfloat16() for name, p in model.named_parameters()}
    weights = ModelWeights(tensors, {"model": dataclasses.asdict(cfg)}, 0, None, Path("bf16"))
    model = generate.build_model(weights, torch.device("cpu"))
    assert model.wte.weight.dtype == torch.bfloat16 and model.cfg.seq_len == 4096
    generate.sample(model, [5, 17, 2, 60, 33], 40, 0.0, 0, torch.Generator())
    (cache,) = made  # 45 tokens > the 32-token training window: no restart, the model's context is 4096
    size = 2 * cfg.n_layers * (1 * cfg.kv_heads * 45 * cfg.head_size)  # k and v per layer, [b, g, 45, dh]
    assert (cache.max_len, cache.dtype, cache.nbytes) == (45, torch.bfloat16, size * 2)

    made.clear()
    small = GPT(LLAMA).eval()  # a 48-token context: 5 + 60 tokens fill it, then the cache restarts
    generate.sample(small, [5, 17, 2, 60, 33], 60, 0.0, 0, torch.Generator())
    assert [c.max_len for c in made] == [48] * len(made) and len(made) > 1 and made[0].dtype == torch.float32


def test_a_hugging_face_llama_directory_generates_transformers_greedy_text(tmp_path, monkeypatch, capsys):
    """``tools/generate.py DIR`` on a transformers Llama saved locally, with a tokenizer.json whose post-processor
    puts BOS first (as Llama 2 / 3's do): the prompt is encoded as ``tokenizer(prompt)`` encodes it, BOS included,
    and the greedy tokens are transformers' own ``generate``'s."""
    import transformers

    from tests.helpers.hf import BOS, save_bos_tokenizer
    from tests.helpers.tools import run_tool

    n_words = 45
    hf_cfg = transformers.LlamaConfig(
        vocab_size=n_words + 3, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_theta=500.0, tie_word_embeddings=False,
        bos_token_id=BOS, eos_token_id=None,  # our tool does not stop at an end token: neither may transformers
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    hf.save_pretrained(tmp_path / "llama")
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(save_bos_tokenizer(tmp_path / "llama", n_words))
    )
    prompt = "w3 w17 w5 w40"
    code, text, err = run_tool(
        "generate", str(tmp_path / "llama"), "--prompt", prompt, "--tokens", "30", "--temperature", "0",
        monkeypatch=monkeypatch, capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    inputs = tokenizer(prompt, return_tensors="pt")
    assert inputs["input_ids"][0, 0] == BOS
    with torch.no_grad():
        expected = hf.generate(**inputs, max_new_tokens=30, do_sample=False, pad_token_id=0)[0].tolist()
    # The tool prints the prompt as typed (its BOS, which the tokenizer added, left out) and the continuation.
    assert text.strip() == tokenizer.decode(expected[1:])
    assert len(set(expected[5:])) > 3
