"""The planner against every GPU figure recorded: docs/benchmarks.md's one-GPU rows (`tools/bench.py gpu`, bf16,
H100 2026-11-26 and H200 2026-11-27), predicted from the datasheet profiles at world 1 with the run's micro-batch
and four micro-batches a step, as the bench ran them: with the loss of then, the whole logits in fp32
(``model.loss_chunk_tokens=0``; the chunked loss since holds about 1.5 GiB less for gpt-small at micro-batch 8, a
figure no GPU has measured yet).

Issue 49 asks for 15% in time and 2% in peak memory. The rows the planner misses are marked ``xfail(strict=True)``
with the measured miss in the reason, so a change that brings one within the bound fails here until its mark goes:
the GPT blocks run 1.3-2.2x slower on a GPU than the datasheet prices them (about 1.8 ms a layer per 8192-token
micro-batch at either width, a term not found without a GPU), and llama-1b's peak is 2.2% above the one measured.
"""

from __future__ import annotations

import pytest

from trident.config.compose import compose_config
from trident.plan.planner import predict
from trident.plan.profile import DATASHEETS

CONF = "conf"
TIME_BOUND, PEAK_BOUND = 0.15, 0.02

# (device, model, micro-batch, measured tokens/s, measured peak GiB), from docs/benchmarks.md's tables.
ROWS = [
    ("h100", "gpt-small", 8, 187_934, 9.33),
    ("h100", "llama-1b", 4, 53_485, 44.0),
    ("h100", "gpt-1.3b", 4, 42_048, 40.3),
    ("h200", "gpt-small", 8, 195_751, 9.33),
    ("h200", "llama-1b", 4, 57_383, 44.0),
    ("h200", "gpt-1.3b", 4, 44_924, 40.3),
]
# Predicted over measured when this was written: what a mark's reason says.
TIME_MISSES = {("h100", "gpt-small"): 1.91, ("h200", "gpt-small"): 2.16, ("h100", "gpt-1.3b"): 1.31,
               ("h200", "gpt-1.3b"): 1.34}  # fmt: skip
PEAK_MISSES = {("h100", "llama-1b"): 1.022, ("h200", "llama-1b"): 1.022}


def _predicted(device: str, model: str, micro: int):
    overrides = [f"model={model}", "train.precision=bf16", f"train.micro_batch_size={micro}",
                 f"train.global_batch_size={4 * micro}", "model.loss_chunk_tokens=0"]  # fmt: skip
    return predict(compose_config(CONF, overrides), 1, DATASHEETS[device])


def _marked(misses: dict, what: str) -> list:
    out = []
    for device, model, micro, tokens, peak in ROWS:
        miss = misses.get((device, model))
        marks = [pytest.mark.xfail(strict=True, reason=f"{what} predicted {miss}x the measured")] if miss else []
        out.append(pytest.param(device, model, micro, tokens, peak, marks=marks, id=f"{device}-{model}"))
    return out


@pytest.mark.parametrize(("device", "model", "micro", "tokens", "peak"), _marked(TIME_MISSES, "time"))
def test_step_time_within_15_percent_of_the_gpu_rows(device, model, micro, tokens, peak):
    p = _predicted(device, model, micro)
    assert abs(p.tokens_per_s / tokens - 1) <= TIME_BOUND, (p.tokens_per_s, tokens)


@pytest.mark.parametrize(("device", "model", "micro", "tokens", "peak"), _marked(PEAK_MISSES, "peak"))
def test_peak_within_2_percent_of_the_gpu_rows(device, model, micro, tokens, peak):
    p = _predicted(device, model, micro)
    assert abs(p.peak["device"] / 2**30 / peak - 1) <= PEAK_BOUND, (p.peak["device"] / 2**30, peak)
