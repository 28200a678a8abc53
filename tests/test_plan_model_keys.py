"""The planner prices the work each model key adds (trident/plan/ops.py): a key the model computes with is never free
in the step-time model. Pure: the op lists of one layer."""

from __future__ import annotations

import dataclasses

from trident.config import ModelConfig
from trident.plan.ops import Shape, layer_ops, recompute_ops

LLAMA = ModelConfig(
    n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, seq_len=64, vocab_size=512, d_ff=176, bias=False,
    norm="rmsnorm", mlp="swiglu", position="rope", tie_embeddings=False,
)  # fmt: skip
SHAPE = Shape(batch=2, seq=64, tp=2, sequence_parallel=False, precision="fp32")


def _work(cfg: ModelConfig, kind: str, phases: str = "FIW") -> float:
    """The layer's bytes of element-wise work, or its matmul FLOPs (m x n x k summed), in ``phases``."""
    ops = [o for o in layer_ops(cfg, SHAPE) if o.kind == kind and o.phase in phases]
    if kind == "matmul":
        return sum(o.shape[0] * o.shape[1] * o.shape[2] for o in ops)
    return sum(o.nbytes for o in ops)


def test_qk_norm_is_priced_and_recomputed_with_the_layer() -> None:
    normed = dataclasses.replace(LLAMA, qk_norm=True)
    # q: 2 local heads x 16, k: 1 local kv head x 16, over 128 tokens in fp32; read twice and written once.
    assert _work(normed, "elementwise", "F") - _work(LLAMA, "elementwise", "F") == 3 * 128 * (2 + 1) * 16 * 4
    assert _work(normed, "elementwise") > _work(normed, "elementwise", "F")  # and its backward
    for policy in ("full", "selective"):
        again = recompute_ops(normed, SHAPE, policy)
        assert sum(o.nbytes for o in again if o.kind == "elementwise") > sum(
            o.nbytes for o in recompute_ops(LLAMA, SHAPE, policy) if o.kind == "elementwise"
        )


def test_a_wider_head_widens_the_attention_projections() -> None:
    wide = dataclasses.replace(LLAMA, head_dim=32)  # heads of 32 on d_model 64: q is 128 wide, k and v 64 each
    per_token = 64 * (4 * 16 + 2 * 2 * 16 + 4 * 16)  # q, k, v and the output projection at heads of 16
    # Each projection's width doubles (local halves at tp 2), forward, input gradient and weight gradient: 3 matmuls.
    assert _work(wide, "matmul") - _work(LLAMA, "matmul") == 3 * 128 * per_token // 2
