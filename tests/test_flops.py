"""``flops_per_token`` (models/gpt.py), what MFU divides by, against the matmul FLOPs torch counts for a real forward
and backward.

The convention, PaLM's (Chowdhery et al., 2022, appendix B): a training token costs 6N for the N weights of the
matmuls (the LM head included, the embedding lookups excluded) plus 12 L d T for attention, the scores q k^T and
their product with v for every query head over the full T x T square (not halved for causality), forward and
backward (3x the forward), with nothing for recomputation. Elementwise work (norms, activations, RoPE, softmax) is
not counted, and FlopCounterMode counts matmuls only, so the two must agree exactly.

Attention runs through SDPA's math backend here: its q k^T and probabilities @ v are plain batched matmuls over the
full square (the causal mask is applied to the scores, not skipped), with grouped-query k and v repeated to every
query head, so FlopCounterMode sees exactly PaLM's attention term. (The CPU's fused kernel is not in its registry,
so it would count nothing for attention; on CUDA its formula for the fused kernels also counts the full square,
but adds the backward's recomputation of the scores, 5 matmuls where PaLM counts 4.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from tests.helpers.layouts import make_config
from trident.config import ModelConfig
from trident.models.gpt import GPT, flops_per_token, init_weights

GPT_TINY = make_config("model=gpt-tiny").model
LLAMA_TINY = make_config("model=llama-tiny").model  # grouped-query (2 kv heads for 4), SwiGLU, RoPE, untied
SHAPES = {
    "gpt-tiny": GPT_TINY,
    "llama-tiny": LLAMA_TINY,
    "llama-tiny-tied": dataclasses.replace(LLAMA_TINY, tie_embeddings=True),
    "llama-tiny-mha": dataclasses.replace(LLAMA_TINY, n_kv_heads=None),
    "llama-tiny-mqa": dataclasses.replace(LLAMA_TINY, n_kv_heads=1),
    "llama-tiny-gelu-bias": dataclasses.replace(LLAMA_TINY, mlp="gelu", bias=True),
    # d_ff not a multiple of d, a vocab the embedding pads (the head multiplies only the real rows)
    "llama-odd": dataclasses.replace(LLAMA_TINY, d_ff=100, vocab_size=515, n_layers=3),
}


def counted_flops(cfg: ModelConfig, batch: int, seq: int) -> int:
    """FLOPs FlopCounterMode counts for one forward and backward of the one-process model on a [batch, seq] batch."""
    model = GPT(cfg)
    init_weights(model, cfg, 0)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, seq), generator=g)
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model.loss_sum(model(x), y).backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("name", list(SHAPES))
def test_flops_per_token_is_what_torch_counts(name: str) -> None:
    cfg = SHAPES[name]
    batch, seq = 2, cfg.seq_len // 2  # a run shorter than the model's context: T is the run's
    assert counted_flops(cfg, batch, seq) == flops_per_token(cfg, seq) * batch * seq


def test_the_count_sees_each_block_option() -> None:
    """The counter is not blind to what the formula must count: grouped-query attention does less work than
    multi-head, SwiGLU's third matrix more than GELU's two, and an untied head no more than a tied one (both multiply
    once by the vocabulary)."""
    flops = {name: counted_flops(SHAPES[name], 1, 32) for name in ("llama-tiny", "llama-tiny-mha", "llama-tiny-tied")}
    d, dh = LLAMA_TINY.d_model, LLAMA_TINY.head_size
    kv_saved = 2 * d * (LLAMA_TINY.n_heads - LLAMA_TINY.kv_heads) * dh  # the k and v weights grouping removes
    assert flops["llama-tiny-mha"] - flops["llama-tiny"] == 6 * LLAMA_TINY.n_layers * kv_saved * 32
    assert flops["llama-tiny-tied"] == flops["llama-tiny"]
    swiglu, gelu = LLAMA_TINY, dataclasses.replace(LLAMA_TINY, mlp="gelu")
    assert counted_flops(swiglu, 1, 32) - counted_flops(gelu, 1, 32) == 6 * swiglu.n_layers * d * swiglu.ffn_dim * 32
