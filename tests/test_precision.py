"""Real mixed precision: 16-bit parameters with fp32 masters train like fp32; fp16's loss scaler skips overflowing
steps and stops the run at its floor."""

from __future__ import annotations

import pytest
import torch

import trident.build
from tests.helpers.layouts import make_config, tiny, train_in_process
from train import run
from trident.build import build_optimizer, layout_of, model_chunks
from trident.errors import DivergenceError
from trident.parallel.groups import build_process_groups
from trident.parallel.precision import LossScaler
from trident.parallel.topology import Topology
from trident_dev.ranks import run_distributed

pytestmark = pytest.mark.multiprocess

# 200 steps of 4 sequences: a few seconds each on one core.
LONG = ("train.steps=200", "train.global_batch_size=4", "train.micro_batch_size=4", "train.eval_every=0")


def test_bf16_and_fp16_runs_end_within_2_percent_of_the_fp32_loss(tiny_dataset, tmp_path):
    final = {}
    for precision in ("fp32", "bf16", "fp16"):
        overrides = [*tiny(tiny_dataset, *LONG), f"train.precision={precision}"]
        (history,) = train_in_process(tmp_path / precision, overrides)
        assert len(history) == 200
        final[precision] = sum(r["loss"] for r in history[-10:]) / 10
    assert final["fp32"] < 5.0  # it learned something: gpt-tiny starts at ln(512) = 6.2
    for precision in ("bf16", "fp16"):
        assert abs(final[precision] - final["fp32"]) <= 0.02 * final["fp32"], final


def _parameter_bytes(rank: int, world: int, precision: str) -> dict:
    cfg = make_config("model=gpt-tiny", f"train.precision={precision}")
    groups = build_process_groups(Topology(dp=1, pp=1, tp=1))
    (model,) = model_chunks(cfg.model, layout_of(cfg, groups), cfg.train, groups, torch.device("cpu"))
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    setup = build_optimizer([model], layout_of(cfg, groups), cfg.optim, groups)
    optimizer = setup.zero
    masters = {p: optimizer.master(pc) for _, pc in optimizer.pieces() for p in [pc.param]}
    return {
        "param_bytes": {p.element_size() for p in model.parameters()},
        "masters_fp32_exact": all(
            masters[p].dtype == torch.float32 and torch.equal(masters[p], reference[name].view(-1))
            for name, p in model.named_parameters()
        ),
        "params_are_cast_masters": all(
            torch.equal(p.detach(), reference[name].to(p.dtype)) for name, p in model.named_parameters()
        ),
    }


def test_a_bf16_model_holds_2_byte_parameters_and_exact_fp32_masters():
    (got,) = run_distributed(_parameter_bytes, 1, "bf16")
    assert got == {"param_bytes": {2}, "masters_fp32_exact": True, "params_are_cast_masters": True}


def _hits_the_floor(rank: int, world: int, cfg, run_dir) -> str:
    # Scales so large that every fp16 backward overflows: the step is skipped and the scale halved, down to the floor.
    original = trident.build.LossScaler
    trident.build.LossScaler = lambda: LossScaler(init_scale=2.0**40, min_scale=2.0**30)
    try:
        run(cfg, run_dir)
    except DivergenceError as e:
        return str(e)
    finally:
        trident.build.LossScaler = original
    return "did not stop"


def test_fp16_loss_scale_floor_stops_the_run_with_a_clear_message(tiny_dataset, tmp_path):
    cfg = make_config(*tiny(tiny_dataset, "train.steps=30", "train.precision=fp16", "train.max_skipped_steps=20"))
    (message,) = run_distributed(_hits_the_floor, 1, cfg, tmp_path)
    # Skipped at 2^40, 2^39, ..., 2^30: the eleventh skip is at the floor.
    assert message.startswith("training diverged at step 11, loss scale 1.07374e+09: "), message
    assert "the gradients overflowed with the fp16 loss scale already at its floor 1.07374e+09" in message
    assert "no checkpoint was saved yet" in message
