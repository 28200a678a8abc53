"""Queries and keys normalised (``model.qk_norm``) and heads wider than d_model / n_heads (``model.head_dim``) under
tensor parallelism give the one-process curve of the same seed.

Per-head norms (Qwen3) hold one gain every tp rank keeps whole, applied to that rank's heads only: without a sum
over tp each rank steps with its own partial gradient and the copies drift apart. The learning rate is high (1e-2)
so that a drift shows in six steps; it also makes the gradient norm chaotic (0.2% apart by step 6 between two CPUs'
rounding with the fix in), so the first three steps are compared whole at the curve's tolerance and every step's
loss at 1e-5, where the rounding stays below 2e-7 and the missing sum shows from step 3 (3.7e-5, and 4e-3 in the
grad norm). The projection-wide norm (OLMoE) splits its gain with the heads and sums its squares over tp.
"""

from __future__ import annotations

import pytest

from tests.helpers.layouts import assert_same_curve, four_layers, train_in_process

pytestmark = pytest.mark.multiprocess

STEPS = 6
LOSS_REL = 1e-5


def _base(dataset, *extra: str) -> list[str]:
    return four_layers(dataset, STEPS, "model=llama-tiny", "optim.lr=1e-2", "model.qk_norm=true", *extra)


LAYOUTS = {
    "head-tp2": ([], ["parallel.tp=2"]),
    "head-tp2-sp": ([], ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "head-tp2-pp2": ([], ["parallel.tp=2", "parallel.pp=2"]),
    # Qwen3's shape: heads of 32 on d_model 64 (4 x 32 = 128 wide), multi-head (the fused qkv) over tp.
    "head-dim32-mha-tp2": (["model.head_dim=32", "model.n_kv_heads=4"], ["parallel.tp=2"]),
    "projection-tp2": (["model.qk_norm_scope=projection"], ["parallel.tp=2"]),
    "projection-dim32-tp2-sp-pp2": (
        ["model.qk_norm_scope=projection", "model.head_dim=32"],
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.pp=2"],
    ),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_normalised_queries_and_keys_give_the_one_process_curve_under_tp(tiny_dataset, tmp_path, references, name):
    model, layout = LAYOUTS[name]
    reference = references.history(_base(tiny_dataset, *model))
    world = 4 if "parallel.pp=2" in layout else 2
    for history in train_in_process(tmp_path, _base(tiny_dataset, *model, *layout), world=world):
        assert_same_curve(reference[:3], history[:3])
        assert [r["step"] for r in history] == [r["step"] for r in reference]
        for want, have in zip(reference, history, strict=True):
            assert have["loss"] == pytest.approx(want["loss"], rel=LOSS_REL), (want["step"], have["loss"], want["loss"])
