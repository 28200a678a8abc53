"""trident_dev/plan/residual.py: the held-out run that scales the step-time model is a layout no plan of the same
config scores (another global batch), it is run once through train.py by a calibration that is given the
repository and cached with the profile, and the model's step and split are scaled by exactly its ratio."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.plan_profiles import hand_built_cpu
from trident.config import compose_config, validate
from trident.layout import Layout
from trident.plan.cost import step_time
from trident.plan.planner import placement_for, plan
from trident.plan.profile import Needs, load_cached
from trident_dev.plan import calibrate as calibration
from trident_dev.plan import residual
from trident_dev.plan.calibrate import calibrate

TINY = ["model=gpt-tiny", "train.global_batch_size=8"]


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_held_out_layout_is_plain_data_parallelism_at_a_batch_no_plan_layout_has(world: int) -> None:
    cfg = compose_config(REPO / "conf", TINY)
    run = residual.held_out(cfg, world, TINY)
    assert run["world"] == world and run["overrides"][: len(TINY)] == TINY
    held = compose_config(REPO / "conf", run["overrides"])
    layout = validate(held, world)
    assert (layout.dp, layout.tp, layout.pp, layout.cp, layout.zero) == (world, 1, 1, 1, 0)
    assert layout.micro_batch_size == cfg.train.micro_batch_size
    assert held.train.global_batch_size != cfg.train.global_batch_size
    if world == 2:  # so none of the plan's layouts (every one at the plan's batch) is the held-out one
        ranked = plan(cfg, world, hand_built_cpu()).ranked
        assert ranked and all(p.layout.global_batch_size != layout.global_batch_size for p in ranked)


def test_the_step_and_its_split_are_scaled_by_the_residual_and_nothing_else_is() -> None:
    m = compose_config(REPO / "conf", TINY).model
    layout = Layout(dp=1, pp=2, micro_batch_size=2, micro_batches=4, schedule="1f1b", device="cpu")
    profile = hand_built_cpu()
    base = step_time(m, layout, profile, placement_for(profile, 2))
    scaled = step_time(m, layout, dataclasses.replace(profile, residual=1.25), placement_for(profile, 2))
    assert scaled.step == pytest.approx(1.25 * base.step)
    assert scaled.split == pytest.approx({kind: 1.25 * t for kind, t in base.split.items()})
    assert (scaled.pipeline, scaled.compute, scaled.bubble) == (base.pipeline, base.compute, base.bubble)


@pytest.mark.lab
@pytest.mark.multiprocess
def test_a_calibration_given_the_repository_runs_the_held_out_layout_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One rank of gpt-tiny through train.py: the ratio of its measured step to the model's is kept with the
    runs it came from; a second calibration with the same needs runs nothing, one without the repository none."""
    monkeypatch.setattr(calibration, "cpu_threads_per_rank", lambda ranks_per_node: 1)
    # Micro-batches of 8 sequences of 512 tokens: a step of about 0.12 s, which the other test worker's ranks taking
    # the cores for a scheduler's quantum or two cannot stretch twentyfold, as they did a 5 ms one (a residual of 25).
    longer = [*TINY, "model.seq_len=512", "train.micro_batch_size=8"]
    cfg = compose_config(REPO / "conf", longer)
    needs = Needs(precisions={"fp32"}, run=residual.held_out(cfg, 1, longer))
    cache = tmp_path / "profile.json"
    lines: list[str] = []
    profile = calibrate(needs, 1, cache=cache, log=lines.append, accept_busy=True, repo=REPO)
    assert profile.residual_run == needs.run and 0.05 < profile.residual < 20, lines
    assert any("held-out run" in line and "scaled by" in line for line in lines)
    # Before it, the tiny twin's runs with full and selective recomputation (one rank: no cp or pipeline pair)
    # priced their overheads.
    assert set(profile.overheads) == {"recompute", "selective"} and min(profile.overheads.values()) >= 0
    assert any("tiny twin's" in line and "per layer recomputed" in line for line in lines), lines
    assert any("tiny twin's" in line and "per op under selective checkpointing" in line for line in lines), lines
    assert load_cached("cpu", 1, profile.threads, cache) == profile

    def refuse(*args: object) -> float:
        raise AssertionError("ran the held-out layout again")

    monkeypatch.setattr(calibration, "measure_residual", refuse)
    assert calibrate(needs, 1, cache=cache, log=lambda _: None, accept_busy=True, repo=REPO) == profile
    unmeasured = calibrate(needs, 1, cache=None, log=lambda _: None, accept_busy=True)
    assert unmeasured.residual == 1.0 and unmeasured.residual_run is None
