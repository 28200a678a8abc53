"""tools/estimate_memory.py, and the prediction against the ZeRO paper's closed forms on a real preset."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.helpers.layouts import make_config
from tests.helpers.tools import run_tool
from trident.config import validate
from trident.layout import Layout
from trident.memory.estimate import estimate
from trident.memory.measure import format_bytes


@pytest.mark.parametrize("model", ["gpt-small", "llama-150m"])
@pytest.mark.parametrize("precision,param_bytes", [("bf16", 2), ("fp32", 4)])
def test_model_states_reduce_to_the_zero_papers_formulas(model: str, precision: str, param_bytes: int) -> None:
    """gpt-small and llama-150m at dp=4: per-rank model states are the ZeRO paper's (Psi parameters, N ranks, K =
    12 bytes of fp32 master, momentum and variance) with trident's fp32 gradients, within 1% (bucket padding, step
    counters): stage 0 (p + 4 + K) Psi, 1 (p + 4) Psi + K Psi / N, 2 p Psi + (4 + K) Psi / N, 3 (p + 4 + K) Psi / N,
    where fp32 parameters are their own masters (K = 8)."""
    cfg = make_config(f"model={model}")
    psi, n, p = estimate(cfg.model, Layout(device="cpu")).stages[0].params, 4, param_bytes
    k = 12 if p == 2 else 8
    closed = {0: (p + 4 + k) * psi, 1: (p + 4) * psi + k * psi / n, 2: p * psi + (4 + k) * psi / n}
    closed[3] = (p + 4 + k) * psi / n
    for zero, expected in closed.items():
        got = estimate(cfg.model, Layout(dp=n, zero=zero, precision=precision)).worst.model_states["total"]
        assert got["host"] == 0
        assert got["device"] == pytest.approx(expected, rel=0.01), zero


def test_table_lists_every_option_and_marks_the_asked_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    overrides = ["model=gpt-small", "parallel.dp=4", "parallel.zero=2", "train.precision=bf16"]
    code, out, err = run_tool("estimate_memory", *overrides, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    rows = [line for line in out.splitlines() if "| zero=" in line]
    assert len(rows) == 8
    assert [r for r in rows if "(asked)" in r] == [r for r in rows if r.rstrip().endswith("| zero=2 (asked)")]
    assert "refused: parallel.offload.optimizer=cpu needs a ZeRO stage" in rows[1]
    # The asked row shows the library's prediction for the same config.
    cfg = make_config(*overrides)
    states = estimate(cfg.model, dataclasses.replace(validate(cfg, 4), device="cuda")).worst.model_states["total"]
    asked = next(r for r in rows if "(asked)" in r)
    assert asked.split("|")[0].strip() == format_bytes(states["device"])


def test_pipeline_layout_json_and_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A pp layout is predicted per stage (the first stage holds the most with 1F1B); a bad config is one line
    and exit code 2."""
    args = ["model=gpt-tiny", "parallel.pp=2", "parallel.tp=2", "--world", "8", "--json", "train.micro_batch_size=2"]
    code, out, err = run_tool("estimate_memory", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    stages = json.loads(out)["stages"]
    assert [s["stage"] for s in stages] == [0, 1]
    assert stages[0]["activations"]["none"] > stages[1]["activations"]["none"] > stages[1]["activations"]["full"]
    code, out, err = run_tool(
        "estimate_memory", "model=gpt-tiny", "parallel.zero=5", monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 2
    assert err.strip() == "error: parallel.zero=5 is not valid; use one of 0, 1, 2, 3"


@pytest.mark.parametrize("tp", [8, 16])
def test_llama_8b_per_rank_parameters(
    tp: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """model=llama-8b: the Llama 3 8B count (8,030,261,248 with its untied 128256-piece head), and each tp rank's
    parameters by hand: q, o, gate/up and down split over tp, the 8 kv heads split at tp=8 and held whole by every
    rank at tp=16 (fewer kv heads than ranks), the norms whole, both vocabulary tables padded to 64 tp rows."""
    code, out, err = run_tool(
        "estimate_memory", "model=llama-8b", f"parallel.tp={tp}", "--json", monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["total_params"] == 8_030_261_248
    d, f, layers, kv = 4096, 14336, 32, 2 * 8 * 128 * 4096
    block = 2 * d * d // tp + (kv // tp if tp <= 8 else kv) + 3 * d * f // tp + 2 * d
    vocab = -(-128256 // (64 * tp)) * 64 * tp // tp * d
    (stage,) = report["stages"]
    assert stage["params"] == layers * block + 2 * vocab + d
