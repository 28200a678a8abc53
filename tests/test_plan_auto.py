"""``parallel.auto=true``: train.py launches the planner's best layout, keeps the layout keys given with it, says
which in one line, refuses a world no layout can use, and trains the one-process curve."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests.helpers.layouts import assert_same_curve, make_config, tiny, train_in_process
from tests.helpers.processes import start_ranks
from trident.config import validate
from trident.errors import ConfigError
from trident.plan import auto
from trident.plan.planner import plan
from trident.plan.profile import Profile, Rate


def fixed_profile() -> Profile:
    return Profile(
        name="fixed",
        device="cpu",
        source="test",
        memory_bytes=24e9,
        units_per_node=8,
        peak_tflops={"fp32": 0.01, "bf16": 0.01},
        elementwise=Rate(1e-6, 5e9),
        intra=Rate(1e-4, 1e9),
        inter=Rate(1e-4, 1e9),
    )


@pytest.fixture
def profile(monkeypatch: pytest.MonkeyPatch) -> Profile:
    fixed = fixed_profile()
    monkeypatch.setattr(auto, "auto_profile", lambda cfg, world: fixed)
    return fixed


def test_auto_launches_the_plans_best_and_keeps_given_keys(profile: Profile) -> None:
    cfg = make_config("model=gpt-tiny", "train.global_batch_size=16", "parallel.auto=true")
    whole = plan(cfg, 4, profile)
    ranked, accepted = whole.ranked, whole.ranked + whole.unfit
    chosen, line = auto.choose(cfg, 4)
    best = ranked[0]
    assert validate(chosen, 4) == dataclasses.replace(best.layout, device="cpu")
    assert line.startswith(f"parallel.auto: {best.label}, the best of {len(accepted)} layouts for 4 ranks")
    assert "\n" not in line and chosen.parallel.auto

    given = ["parallel.pp=2", "train.activation_checkpointing=full"]
    kept, line = auto.choose(cfg, 4, given)
    assert kept.parallel.pp == 2 and kept.train.activation_checkpointing == "full"
    with_given = [p for p in ranked if p.layout.pp == 2 and p.layout.activation_checkpointing == "full"]
    assert validate(kept, 4) == dataclasses.replace(with_given[0].layout, device="cpu")
    given_accepted = [p for p in accepted if p.layout.pp == 2 and p.layout.activation_checkpointing == "full"]
    assert f"the best of {len(given_accepted)} layouts with parallel.pp=2 train.activation_checkpointing=full" in line


def test_auto_refuses_in_one_line(profile: Profile) -> None:
    cfg = make_config("model=gpt-tiny", "train.global_batch_size=8", "parallel.auto=true")
    with pytest.raises(ConfigError, match=r"^parallel.auto=true: no layout of 7 ranks is accepted for gpt-tiny"):
        auto.choose(cfg, 7)
    with pytest.raises(ConfigError, match=r"^parallel.auto=true: no layout of 4 ranks has parallel.tp=3"):
        auto.choose(cfg, 4, ["parallel.tp=3"])
    wrong = make_config("model=gpt-tiny", "model.n_kv_heads=3", "parallel.auto=true")
    with pytest.raises(ConfigError, match=r"^model.n_kv_heads=3 must divide model.n_heads=4"):
        auto.choose(wrong, 2)


@pytest.mark.multiprocess
def test_auto_trains_the_one_process_curve(tiny_dataset: Path, tmp_path: Path, references) -> None:
    base = tiny(tiny_dataset, "train.steps=4", "model.n_layers=4")
    reference = references.history([*base, "train.micro_batch_size=16"])
    histories = train_in_process(tmp_path / "auto", [*base, "parallel.auto=true"], world=4)
    for history in histories:
        assert_same_curve(reference, history)


@pytest.mark.multiprocess
def test_a_launch_of_two_ranks_says_which_layout_once(tiny_dataset: Path, tmp_path: Path) -> None:
    """Two ranks of ``python train.py`` with torchrun's environment: one line between them says the layout."""
    overrides = [*tiny(tiny_dataset, "train.steps=2"), "parallel.auto=true", "parallel.tp=2"]
    env = dict(os.environ, HOME=str(tmp_path))  # no calibration cached: the nominal CPU profile
    ranks = start_ranks(tmp_path, overrides, 2, env=env)
    try:
        outputs = [rank.communicate(timeout=300) for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert [rank.returncode for rank in ranks] == [0, 0], outputs[0][1][-2000:] + outputs[1][1][-2000:]
    stdout = "".join(out for out, _ in outputs)
    lines = [line for line in stdout.splitlines() if line.startswith("parallel.auto:")]
    assert len(lines) == 1 and "dp1 tp2 pp1" in lines[0] and "with parallel.tp=2" in lines[0]
    assert "cpu (nominal)" in lines[0]
    assert "world 2 (dp 1 x tp 2 x pp 1)" in stdout


def test_auto_keeps_a_given_context_parallelism_or_chooses_it(profile: Profile) -> None:
    """parallel.cp given with parallel.auto=true stays as given (with its exchange, if given too); without it, the
    plan's best is launched whatever its cp, and cp layouts are among those ranked."""
    cfg = make_config("model=gpt-tiny", "train.global_batch_size=16", "parallel.auto=true")
    ranked = plan(cfg, 4, profile).ranked
    assert any(p.layout.cp > 1 for p in ranked)
    kept, line = auto.choose(cfg, 4, ["parallel.cp=2", "parallel.cp_comm=ulysses"])
    assert kept.parallel.cp == 2 and kept.parallel.cp_comm == "ulysses"
    with_given = [p for p in ranked if p.layout.cp == 2 and p.layout.cp_comm == "ulysses"]
    assert validate(kept, 4) == dataclasses.replace(with_given[0].layout, device="cpu")
    assert "with parallel.cp=2 parallel.cp_comm=ulysses" in line
    chosen, _ = auto.choose(cfg, 4)
    assert validate(chosen, 4) == dataclasses.replace(ranked[0].layout, device="cpu")
