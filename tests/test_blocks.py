"""The Llama-family block options against their definitions, in one process: parameter counts, FLOPs, the grouped
kv heads' convention, RoPE against Hugging Face's, the KV cache against the full forward, the untied head."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trident.config import ModelConfig
from trident.models.gpt import GPT, count_params, flops_per_token, init_weights
from trident.models.kv_cache import KVCache
from trident.models.rope import apply_rope, rope_frequencies, rope_tables
from trident.parallel.tensor import ColumnParallelLinear, ReplicatedColumnLinear, RowParallelLinear

GPT2 = ModelConfig(name="g", n_layers=2, d_model=32, n_heads=4, seq_len=24, vocab_size=100)
LLAMA = dataclasses.replace(
    GPT2, norm="rmsnorm", mlp="swiglu", position="rope", n_kv_heads=2, d_ff=48, bias=False, tie_embeddings=False
)
VARIANTS = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "llama-mqa-bias": dataclasses.replace(LLAMA, n_kv_heads=1, bias=True),
    "llama-mha-tied": dataclasses.replace(LLAMA, n_kv_heads=None, tie_embeddings=True),
    "layernorm-swiglu-rope": dataclasses.replace(GPT2, mlp="swiglu", position="rope"),
    "rmsnorm-gelu-learned-gqa": dataclasses.replace(GPT2, norm="rmsnorm", n_kv_heads=2),
}


def build(cfg: ModelConfig, seed: int = 0) -> GPT:
    model = GPT(cfg)
    init_weights(model, cfg, seed)
    return model.eval()


def tokens(cfg: ModelConfig, b: int = 2, t: int | None = None, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (b, t or cfg.seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", VARIANTS)
def test_count_params_matches_the_module(name):
    cfg = VARIANTS[name]
    model = build(cfg)
    heads = 1 if cfg.tie_embeddings else 2  # wte, and lm_head when untied, each padded
    pad = (model.padded_vocab - cfg.vocab_size) * cfg.d_model * heads
    assert count_params(cfg) == sum(p.numel() for p in model.parameters()) - pad


@pytest.mark.parametrize("name", VARIANTS)
def test_flops_per_token_is_6n_of_the_matmuls_plus_attention(name):
    cfg = VARIANTS[name]
    model = build(cfg)
    linears = (ColumnParallelLinear, RowParallelLinear, ReplicatedColumnLinear)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, linears))
    matmul += cfg.vocab_size * cfg.d_model  # the LM head, tied or not
    assert flops_per_token(cfg) == 6 * matmul + 12 * cfg.n_layers * cfg.d_model * cfg.seq_len


def test_no_position_table_with_rope_and_an_own_head_when_untied():
    names = dict(build(LLAMA).named_parameters())
    assert "wpe.weight" not in names and names["lm_head.weight"].shape == names["wte.weight"].shape
    assert not torch.equal(names["lm_head.weight"], names["wte.weight"])
    tied = dict(build(VARIANTS["llama-mha-tied"]).named_parameters())
    assert "lm_head.weight" not in tied and "layers.0.attn.qkv.weight" in tied


@torch.no_grad()
def test_grouped_kv_heads_are_multi_head_attention_with_each_kv_head_repeated_for_its_query_group():
    """Query head i reads kv head i // (n_heads / n_kv_heads): the same model written as multi-head attention, its
    k and v rows repeated per query head, gives the same logits (Hugging Face's repeat_kv convention)."""
    gqa, mha_cfg = build(LLAMA), dataclasses.replace(LLAMA, n_kv_heads=None)
    mha = build(mha_cfg)
    heads, kv_heads, dh = LLAMA.n_heads, LLAMA.kv_heads, LLAMA.head_size
    for name, p in mha.named_parameters():
        if name.endswith("attn.qkv.weight"):
            layer = name[: -len("qkv.weight")]
            q = gqa.get_parameter(layer + "q.weight").view(heads, dh, -1)
            kv = gqa.get_parameter(layer + "kv.weight").view(kv_heads, 2, dh, -1)
            kv = kv.repeat_interleave(heads // kv_heads, dim=0)  # [heads, 2, dh, d]
            p.copy_(torch.cat([q.unsqueeze(1), kv], dim=1).reshape_as(p))  # rows (h three dh)
        else:
            p.copy_(gqa.get_parameter(name))
    x = tokens(LLAMA)
    assert torch.allclose(gqa(x), mha(x), atol=1e-5)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("scaling", [None, LLAMA3_SCALING], ids=["plain", "llama3-scaled"])
def test_rope_is_hugging_faces(scaling):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    dh, theta, t = 64, 500000.0, 40
    hf_scaling = None if scaling is None else {**scaling, "original_max_position_embeddings": 8192}
    hf_cfg = LlamaConfig(
        hidden_size=256, num_attention_heads=4, rope_theta=theta, max_position_embeddings=16384, rope_scaling=hf_scaling
    )
    hf = LlamaRotaryEmbedding(hf_cfg)
    ours = ModelConfig(d_model=256, n_heads=4, position="rope", rope_theta=theta, seq_len=16384)
    if scaling is not None:
        ours = dataclasses.replace(ours, rope_scaling="llama3", rope_factor=32.0, rope_original_seq_len=8192)
    q, k = torch.randn(2, 2, 4, t, dh).unbind(0)
    positions = torch.arange(9000, 9000 + t)  # past the original context: the scaled frequencies matter
    cos, sin = hf(q, positions[None])
    hf_q, hf_k = apply_rotary_pos_emb(q, k, cos, sin)
    ours_cos, ours_sin = rope_tables(positions, rope_frequencies(ours))
    assert torch.allclose(apply_rope(q, ours_cos, ours_sin), hf_q, atol=1e-4)
    assert torch.allclose(apply_rope(k, ours_cos, ours_sin), hf_k, atol=1e-4)
    scaled = dataclasses.replace(ours, rope_scaling="llama3", rope_factor=32.0, rope_original_seq_len=8192)
    assert (scaling is None) == (not torch.equal(rope_frequencies(ours), rope_frequencies(scaled)))


def test_rope_scores_depend_only_on_the_distance():
    cfg = ModelConfig(d_model=32, n_heads=4, position="rope")
    q, k = torch.randn(2, cfg.head_size).unbind(0)

    def score(m: int, n: int) -> torch.Tensor:
        cos, sin = rope_tables(torch.tensor([m, n]), rope_frequencies(cfg))
        rotated = apply_rope(torch.stack([q, k]), cos, sin)
        return rotated[0] @ rotated[1]

    assert torch.allclose(score(5, 2), score(13, 10), atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 4), atol=1e-3)


@pytest.mark.parametrize("name", ["gpt2", "llama", "llama-mqa-bias", "llama-mha-tied"])
@torch.no_grad()
def test_the_kv_cache_gives_the_full_forwards_logits(name):
    """A prompt, then one token at a time, then a chunk of three: every position's logits are the full forward's."""
    cfg = VARIANTS[name]
    model, x = build(cfg), tokens(cfg, t=20)
    cache = KVCache(cfg.seq_len)
    pieces = [model(x[:, :10], cache)] + [model(x[:, i : i + 1], cache) for i in range(10, 17)]
    pieces.append(model(x[:, 17:20], cache))
    assert cache.length == 20
    assert torch.allclose(torch.cat(pieces, dim=1), model(x), atol=1e-5)
    with pytest.raises(ValueError, match="seq_len"):
        model(tokens(cfg, t=5), cache)  # 25 positions > seq_len 24


def test_an_untied_head_over_pipeline_stages_asks_for_no_embedding_sum():
    """Untied, the last stage's lm_head is a parameter of its own: no copy of wte, no sum over the embedding group.
    Tied, the two copies on the first and last stage each take that sum."""
    from trident.parallel.placement import placement_of

    for cfg, marked in ((LLAMA, set()), (VARIANTS["llama-mha-tied"], {"wte.weight", "lm_head.weight"})):
        first, last = GPT(cfg, layers=[0], first=True, last=False), GPT(cfg, layers=[1], first=False, last=True)
        summed = {n for m in (first, last) for n, p in m.named_parameters() if placement_of(p).grad_sums}
        assert summed == marked
        assert placement_of(last.lm_head.weight).tied_to == ("wte.weight" if cfg.tie_embeddings else None)


def test_a_16_bit_model_keeps_ropes_frequencies_in_fp32():
    model = build(LLAMA).to(torch.bfloat16)
    attn = model.layers["0"].attn
    assert attn.inv_freq.dtype == torch.float32 and torch.equal(attn.inv_freq, rope_frequencies(LLAMA))
