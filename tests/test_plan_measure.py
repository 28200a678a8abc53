"""trident_dev/plan/measure.py: which layouts of a plan are measured (the best, and a spread of the rest), the summary
line from hand-built measurements, and one real measurement: two layouts of gpt-tiny on two ranks through train.py,
whose model-state memory the estimator predicts to the byte."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.plan_profiles import hand_built_cpu
from trident.config import Config, compose_config
from trident.layout import Layout
from trident.memory.estimate import estimate
from trident.plan import planner
from trident.plan.cost import StepTime
from trident.plan.planner import Plan, Prediction
from trident_dev.bench.runs import Trial
from trident_dev.plan import measure
from trident_dev.plan.breakdown import RUNNABLE

BASE = ["model=gpt-tiny", "train.global_batch_size=4", "logging.peak_tflops=1"]
PROFILE = hand_built_cpu()
LINE = re.compile(
    r"plan: (\d+) layouts measured; step time error median (\d+\.\d)%, max (\d+\.\d)%; "
    r"memory error max (\d+\.\d)%; predicted best is measured rank (\d+) of (\d+), "
    r"its step (\d+\.\d)% above the measured best's"
)


@pytest.fixture(scope="module")
def plan() -> Plan:
    """Every layout of gpt-tiny on 2 ranks, batch 4, ranked on a hand-built CPU profile (no calibration)."""
    return planner.plan(compose_config(REPO / "conf", BASE), 2, PROFILE)


# --- pick (pure) ---------------------------------------------------------------------------------------------


def test_pick_takes_the_k_best_then_k_spread_over_the_rest_down_to_the_worst(plan: Plan) -> None:
    ranked = plan.ranked
    assert len(ranked) > 20
    picked = measure.pick(plan, 3)
    assert picked[:3] == ranked[:3]
    rest = [ranked.index(p) for p in picked[3:]]
    n = len(ranked) - 3
    assert len(rest) == 3 and rest == sorted(set(rest)) and rest[-1] == len(ranked) - 1
    # The last of each third of the rest: evenly spread, not bunched after the best.
    assert all(3 + t * n // 3 <= i < 3 + (t + 1) * n // 3 for t, i in enumerate(rest))
    assert measure.pick(plan, 1) == [ranked[0], ranked[-1]]
    assert measure.pick(plan, 0) == []


def test_pick_takes_everything_when_the_ranking_is_short(plan: Plan) -> None:
    short = Plan(plan.world, plan.profile, plan.placement, ranked=plan.ranked[:5])
    assert measure.pick(short, 3) == plan.ranked[:5]
    assert measure.pick(short, 2) == [*plan.ranked[:2], plan.ranked[2], plan.ranked[4]]
    assert measure.pick(Plan(plan.world, plan.profile, plan.placement), 2) == []


# --- summary, from hand-built measurements (pure) --------------------------------------------------------------


def prediction(step: float, states: int = 1000, device: str = "cpu", peak: int = 0) -> Prediction:
    time = StepTime(step, step, step, 0.0, 0.0, 0.0, 0.0, 0.0)
    place = "host" if device == "cpu" else "device"
    return Prediction(
        Layout(device=device),
        Config(),
        peak={"device": peak, "host": 0},
        states={"device": 0, "host": 0} | {place: states},
        time=time,
        tokens_per_s=1 / step,
    )


def measured(p: Prediction, step_s: float | None, states: int | None, error: str | None = None) -> measure.Measured:
    trial = Trial("x", [], error=error)
    place = "host" if p.layout.device == "cpu" else "device"
    figures = None if states is None else {"device": 0, "host": 0} | {place: states}
    return measure.Measured(p, trial, step_s, figures)


def test_summary_gives_the_median_and_largest_errors_and_the_predicted_bests_measured_rank() -> None:
    runs = [
        measured(prediction(1.0), 1.8, 1000),  # +80%; predicted best, measured second
        measured(prediction(2.0), 1.5, 1010),  # -25%, memory +1%
        measured(prediction(3.0), 2.7, 1000),  # -10%
        measured(prediction(4.0), None, 500, error="error: out of memory"),  # failed: not counted
    ]
    assert [m.step_error for m in runs[:3]] == pytest.approx([0.8, -0.25, -0.1])
    assert runs[1].memory_error == pytest.approx(0.01)
    assert measure.summary(runs) == (
        "plan: 3 layouts measured; step time error median 25.0%, max 80.0%; memory error max 1.0%; "
        "predicted best is measured rank 2 of 3, its step 20.0% above the measured best's"
    )
    # The plan's order breaks a tie in predicted speed; the fastest measured is rank 1.
    tied = [measured(prediction(1.0), 0.9, 1000), measured(prediction(1.0), 1.2, 1000)]
    assert measure.summary(tied).endswith("median 15.0%, max 20.0%; memory error max 0.0%; predicted best is "
                                          "measured rank 1 of 2, its step 0.0% above the measured best's")  # fmt: skip
    assert measure.summary(tied[::-1]).endswith("predicted best is measured rank 2 of 2, its step 33.3% above the "
                                                "measured best's")  # fmt: skip
    assert measure.summary([runs[3]]) == (
        "plan: 0 layouts measured; step time error median n/a, max n/a; memory error max n/a; "
        "predicted best is measured rank n/a of 0"
    )
    table = measure.measured_table(runs).splitlines()
    assert table[0].split("  ")[0] == "layout" and len(table) == 5
    assert "+80.0%" in table[1] and "parallel.tp=1" in table[1]
    assert table[4].endswith("failed: error: out of memory")


def test_on_cuda_the_memory_error_is_the_larger_of_model_states_and_the_peak() -> None:
    p = prediction(1.0, states=100 * 2**20, device="cuda", peak=400 * 2**20)
    m = measured(p, 1.0, 101 * 2**20)
    m.peak_mb = 300.0  # 25% under the predicted peak
    assert m.states_error == pytest.approx(0.01) and m.peak_error == pytest.approx(-0.25)
    assert m.memory_error == pytest.approx(-0.25)
    assert "memory error max 25.0%" in measure.summary([m])
    assert "peak pred (MiB)" in measure.measured_table([m])


# --- a real measurement (multi-process) --------------------------------------------------------------------------


@pytest.mark.lab
@pytest.mark.multiprocess
def test_measure_runs_train_py_and_compares_with_the_plan(plan: Plan, tiny_dataset: Path, tmp_path: Path) -> None:
    picked = measure.pick(plan, 1)  # the best and the worst ranked layout
    logged: list[str] = []
    base = [*BASE, f"data.dataset_dir={tiny_dataset}"]
    runs = measure.measure(picked, base, 2, REPO, tmp_path / "runs", steps=4, warmup=1, log=logged.append)
    assert [m.prediction for m in runs] == picked
    for m in runs:
        assert m.trial.ok, m.trial.error
        assert len(m.trial.rows) == 5 and m.step_s is not None and m.step_s > 0  # and one step profiled
        # The profiled step's split, scaled to the median of the 3 timed after the warm-up (not the profiled one).
        assert m.step_s == pytest.approx(sorted(r["step_time_s"] for r in m.trial.rows[1:4])[1])
        assert m.split is not None and sum(m.split.values()) == pytest.approx(m.step_s)
        # Each op class was timed, unless the rank waited for a core longer than it ran: then the core wait takes
        # all of those parts (trident_dev/plan/breakdown.py ``with_core_wait``; seen in a loaded fresh-clone CI run).
        timed = all(m.split[k] > 0 for k in ("matmul", "attention", "framework"))
        assert timed or (sum(m.split[k] for k in RUNNABLE) == 0 and m.split["core wait"] > 0), m.split
        assert "largest miss:" in measure.breakdown(m)
        assert m.states is not None and abs(m.memory_error) < 0.01  # model states: predicted to the byte
        assert m.peak_mb is None  # a CPU run measures no activations
        assert (
            m.trial.overrides[len(base) : len(base) + len(m.prediction.layout.overrides())]
            == m.prediction.layout.overrides()
        )
        checkpoints = Path(m.trial.overrides[-1].removeprefix("checkpoint.dir="))
        assert checkpoints.parent.parent == tmp_path / "runs" and checkpoints.is_dir()  # a run directory each
    assert sum(line.startswith("measure [") for line in logged) == 4  # a start and a result per layout
    found = LINE.fullmatch(measure.summary(runs))
    assert found, measure.summary(runs)
    assert found[1] == found[6] == "2" and found[4] == "0.0" and found[5] in ("1", "2")
    assert (found[7] == "0.0") == (found[5] == "1")


def test_model_states_are_compared_as_memory_json_counts_them_the_max_over_stages() -> None:
    """Under a pipeline the stage with the largest peak (whose states ``prediction.states`` holds) need not hold the
    most model states: here stage 1 peaks (activations), stage 0 holds more states, and memory.json's max is
    stage 0's."""
    layout = ["parallel.pp=2", "parallel.schedule=gpipe", "parallel.zero=1", "parallel.offload.optimizer=cpu"]
    layout += ["train.activation_checkpointing=full", "train.global_batch_size=8", "train.micro_batch_size=8"]
    p = planner.predict(compose_config(REPO / "conf", ["model=gpt-tiny", *layout]), 2, PROFILE)
    stages = estimate(p.config.model, p.layout).stages
    per_stage = [s.model_states["total"]["host"] for s in stages]
    assert per_stage[0] > per_stage[1] == p.states["host"]
    assert measure.expected_states(p) == {"device": 0, "host": per_stage[0]}
    m = measure.read(p, Trial("x", [], memory={"max": {"total": {"device": 0, "host": per_stage[0]}}}), 1)
    assert m.states_error == 0.0 and m.step_s is None


def test_a_run_that_ends_in_its_profiled_step_is_timed_by_the_steps_before() -> None:
    p = prediction(1.0)
    rows = [{"step_time_s": t} for t in (9.0, 1.0, 2.0, 3.0)]
    m = measure.read(p, Trial("x", [], rows=list(rows), error="did not finish within 600 s"), 1, steps=4)
    assert m.error is None and m.step_s == 2.0 and m.split is None
    short = measure.read(p, Trial("x", [], rows=rows[:3], error="did not finish within 600 s"), 1, steps=4)
    assert short.step_s is None and short.error == "did not finish within 600 s"
