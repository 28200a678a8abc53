"""The estimator on pipeline chunks: what a runner keeps of one micro-batch's forward through a later stage's model
chunk, measured on a real chunk (built as trident/build.py builds a stage, run from a residual-stream input that
requires grad, as parallel/pipeline/executor.py runs it), against the trace and the formula, to the byte (CPU, one
process)."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from tests.test_memory import DROPOUT, LLAMA, SHAPES
from trident.build import chunk_model
from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.activations import POLICIES, activation_bytes
from trident.memory.measure import held_by_forward
from trident.models.checkpointing import apply_activation_checkpointing, parse_label
from trident.models.gpt import init_weights
from trident.parallel.precision import autocast
from trident.parallel.random import RNGTracker
from trident.peak import PRECISION_DTYPES

# Three layers over pp = 3: a first chunk (the embedding), a middle one and a last (the head and loss), one layer
# each; under full/2 the middle chunk's layer 1 runs plain and the last's layer 2 recomputed. GPT-2's LayerNorm keeps
# a received stream itself in either precision, Llama's RMSNorm its fp32 copy in bf16 (with dropout's explicit core).
GPT, ODD, LLAMA3 = (dataclasses.replace(c, n_layers=3) for c in (SHAPES[0], DROPOUT, LLAMA))
LLAMA_DROPOUT = dataclasses.replace(LLAMA3, name="llama-dropout", dropout=0.1)
CASES = [(GPT, "fp32"), (ODD, "bf16"), (LLAMA3, "fp32"), (LLAMA3, "bf16"), (LLAMA_DROPOUT, "bf16")]


def _held(cfg: ModelConfig, layout: Layout, stage: int, policy: str) -> int:
    """What the executor keeps of virtual stage ``stage``'s forward of one micro-batch (its ``saved``): the
    received input buffer and the output, with the graph behind them."""
    rng, dtype, b = RNGTracker(0), PRECISION_DTYPES[layout.precision], layout.micro_batch_size
    torch.manual_seed(0)
    chunk = chunk_model(cfg, layout, stage, None, rng)
    init_weights(chunk, cfg, 0)
    chunk.to(dtype)
    name, modules, every = parse_label(policy)
    apply_activation_checkpointing(chunk, name, modules=modules, every=every)
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, b, cfg.seq_len), generator=g)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = tokens
        if not chunk.is_first:  # the message from the stage before, received into a buffer of the step
            x = torch.randn(b, cfg.seq_len, cfg.d_model, generator=g).to(dtype).requires_grad_()
        with autocast(layout.precision, x.device), rng.context(0, range(b)):
            out = chunk(x, targets=targets)  # the last chunk's loss, as the runners have it
        return x, out

    rope = [m.inv_freq for m in chunk.modules() if getattr(m, "inv_freq", None) is not None]
    gc.freeze()  # held_by_forward's collection then skips the objects older than the forward, none of it (fast)
    try:
        return held_by_forward(forward, [*chunk.parameters(), *chunk.buffers(), *rope, tokens, targets])[1]
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("cfg,precision", CASES, ids=[f"{c.name}-{p}" for c, p in CASES])
def test_a_pipeline_chunk_keeps_what_is_predicted(cfg: ModelConfig, precision: str) -> None:
    """Each stage of pp = 3 with one micro-batch in flight keeps, beside its layers' activations, the output it
    runs backward from (but the last) and the residual stream it received (but the first) where its first layer
    keeps a copy rather than the tensor itself (RMSNorm's fp32 input in 16 bits): the trace and the formula both
    predict it to the byte, under every recomputation."""
    layout = Layout(pp=3, micro_batches=1, micro_batch_size=2, precision=precision, device="cpu")
    for stage in range(3):
        held = {p: _held(cfg, layout, stage, p) for p in POLICIES}
        assert {p: activation_bytes(cfg, layout, stage, p) for p in POLICIES} == held, stage
        assert {p: activation_bytes(cfg, layout, stage, p, traced=False) for p in POLICIES} == held, stage
