"""trident_dev/plan/breakdown.py and the model's side of it: a profiled step split into what the step-time model
separates (from hand-built profiler events), the prediction's own split of the same step (it sums to the step,
its parts where the layout puts them), and the table ``--measure`` prints beside them. All pure: the profiled
run itself is tests/test_plan_measure.py's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.plan_profiles import hand_built_cpu
from trident.config import compose_config
from trident.plan import planner
from trident_dev.bench.runs import Trial
from trident_dev.plan import measure
from trident_dev.plan.breakdown import (
    CATEGORIES,
    CP_MARK,
    PASSES_MARK,
    STEP_MARK,
    Event,
    run_queue_s,
    split_step,
    with_core_wait,
)
from trident_dev.plan.splits import mean_split, read_splits

MAIN, GLOO = 1, 7


def ev(name: str, start: float, end: float, thread: int = MAIN) -> Event:
    return Event(name, thread, start, end)


def test_a_profiled_step_splits_into_op_classes_waits_framework_and_data() -> None:
    events = [
        ev(STEP_MARK, 0.0, 10.0),
        ev(PASSES_MARK, 0.0, 8.0),
        # A linear's forward: the wrapper's own 0.5 s is the framework's, the matmul's 2 s its own.
        ev("aten::linear", 0.0, 2.5),
        ev("aten::addmm", 0.5, 2.5),
        ev("aten::_scaled_dot_product_flash_attention_for_cpu", 2.5, 3.5),
        ev("autograd::engine::evaluate_function: MmBackward0", 3.5, 5.0),
        ev("aten::mm", 3.6, 4.6),  # 1 s matmul, 0.5 s of autograd around it, 0.3 s of which a tp collective's wait
        ev("gloo:all_reduce", 4.55, 4.9, GLOO),
        ev("aten::gelu", 5.0, 5.5),
        # 5.5 - 6.0: the main thread waits on a message from the previous stage (gloo records the recv).
        ev("gloo:recv", 5.4, 6.0, GLOO),
        # 6.0 - 6.5: a tp all-reduce's wait, ended 0.5 ms after the gap (the thread's wake-up).
        ev("c10d::allreduce_", 6.0, 6.1),
        ev("gloo:all_reduce", 6.05, 6.5005, GLOO),
        # 6.6 - 7.0: Python between ops; a dp bucket in flight that ends long after is not what it waited on.
        ev("c10d::allreduce_", 6.5, 6.6),
        ev("gloo:all_reduce", 6.55, 8.6, GLOO),
        ev("aten::add", 7.0, 8.0),
        # After the passes: the dp bucket's wait (8.0 - 8.6), the optimizer, then 1 s of gap with nothing.
        ev("aten::_fused_adamw_", 8.6, 9.0),
    ]
    split = split_step(events, data_s=0.25)
    assert set(split) == set(CATEGORIES)
    assert split["matmul"] == pytest.approx(3.0)
    assert split["attention"] == pytest.approx(1.0)
    assert split["elementwise"] == pytest.approx(0.5 + 1.0)  # gelu, add
    assert split["pipeline wait"] == pytest.approx(0.5)
    assert split["comm in passes"] == pytest.approx(0.3 + 0.1 + 0.1 + 0.4)  # in autograd, two c10d calls, a wait
    assert split["dp + sync"] == pytest.approx(0.6)
    assert split["optimizer"] == pytest.approx(0.4)
    assert split["data"] == pytest.approx(0.25)
    # The linear's 0.5 s and autograd's 0.2 s, the 0.4 s of Python with the bucket in flight, the last 1 s gap, less
    # the loader's wait.
    assert split["framework"] == pytest.approx(0.5 + 0.2 + 0.4 + 1.0 - 0.25)
    assert sum(split.values()) == pytest.approx(10.0)


def test_context_parallel_ring_messages_are_communication_in_the_passes_not_the_pipelines() -> None:
    events = [
        ev(STEP_MARK, 0.0, 4.0),
        ev(PASSES_MARK, 0.0, 4.0),
        # The cp ring's exchange (parallel/context/ring.py marks where it posts it), then a wait for it.
        ev(CP_MARK, 0.0, 0.2),
        ev("c10d::send", 0.0, 0.1),
        ev("c10d::recv_", 0.1, 0.2),
        ev("gloo:recv", 0.1, 1.0),
        # A pipeline stage's receive, waited on the same way.
        ev("c10d::recv_", 2.0, 2.1),
        ev("gloo:recv", 2.0, 3.0),
    ]
    split = split_step(events)
    assert split["comm in passes"] == pytest.approx(0.2 + 0.8)
    assert split["pipeline wait"] == pytest.approx(0.1 + 0.9)


def test_without_passes_everything_is_after_them_and_data_is_at_most_the_framework() -> None:
    events = [ev(STEP_MARK, 0.0, 1.0), ev("aten::mul", 0.0, 0.6), ev("gloo:all_reduce", 0.5, 0.8, GLOO)]
    split = split_step(events, data_s=5.0)
    assert split["optimizer"] == pytest.approx(0.6)
    assert split["dp + sync"] == pytest.approx(0.2)
    assert split["data"] == pytest.approx(0.2) and split["framework"] == 0.0


def test_waiting_for_a_core_comes_out_of_the_parts_the_thread_was_runnable_in() -> None:
    split = dict.fromkeys(CATEGORIES, 0.0) | {"matmul": 3.0, "framework": 1.0, "pipeline wait": 2.0}
    moved = with_core_wait(split, 2.0)
    assert moved["matmul"] == pytest.approx(1.5) and moved["framework"] == pytest.approx(0.5)
    assert moved["core wait"] == 2.0 and moved["pipeline wait"] == 2.0  # a blocked thread waits for no core
    assert with_core_wait(split, 9.0)["core wait"] == 4.0  # at most the runnable time
    assert sum(moved.values()) == pytest.approx(sum(split.values()))
    queued = run_queue_s()
    assert queued is None or queued >= 0


def test_the_ranks_profiled_steps_are_split_averaged_and_scaled_to_the_median_step(tmp_path: Path) -> None:
    """A run writes each rank's events (trident/step_profile.py); read_splits splits them, with the thread's wait
    for a core taken out of what it was runnable in."""
    for r, matmul in enumerate((1.0, 3.0)):
        step = [ev(STEP_MARK, 0.0, matmul + 2.0), ev(PASSES_MARK, 0.0, matmul + 2.0), ev("aten::mm", 0.0, matmul)]
        profiled = {"step_s": matmul + 2.0, "data_s": 0.0, "waited_s": 1.0 * r, "cuda": False}
        profiled["events"] = [dataclasses.astuple(e) for e in step]
        (tmp_path / f"rank{r}.json").write_text(json.dumps(profiled))
    splits = read_splits(tmp_path)
    assert [s["step_s"] for s in splits] == [3.0, 5.0]
    assert splits[0]["split"]["matmul"] == 1.0 and splits[0]["split"]["framework"] == pytest.approx(2.0)
    assert splits[1]["split"]["core wait"] == 1.0 and splits[1]["split"]["matmul"] == pytest.approx(3.0 * 4 / 5)
    mean = mean_split(splits)
    assert mean["matmul"] == pytest.approx((1.0 + 2.4) / 2)
    assert sum(mean_split(splits, step_s=2.0).values()) == pytest.approx(2.0)
    assert mean_split([]) is None


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.pp=2", "parallel.schedule=gpipe", "train.micro_batch_size=1"],
        ["parallel.tp=2", "parallel.zero=1"],
    ],
)
def test_the_predicted_split_sums_to_the_step_and_puts_each_part_where_the_layout_has_it(layout: list[str]) -> None:
    cfg = compose_config(REPO / "conf", ["model=gpt-tiny", "train.global_batch_size=4", *layout])
    t = planner.predict(cfg, 2, hand_built_cpu()).time
    assert t is not None and set(t.split) == set(CATEGORIES)
    assert sum(t.split.values()) == pytest.approx(t.step)
    assert all(v >= -1e-12 for v in t.split.values())
    assert t.split["matmul"] > 0 and t.split["attention"] > 0 and t.split["elementwise"] > 0
    assert t.split["data"] == 0.0
    if "parallel.pp=2" in layout:  # gpipe's bubble, no tp collectives
        assert t.split["pipeline wait"] > 0 and t.split["comm in passes"] == 0.0
    else:  # tp's collectives inside the passes, no pipeline
        assert t.split["comm in passes"] > 0 and t.split["pipeline wait"] == pytest.approx(0.0, abs=1e-12)
        assert t.split["dp + sync"] > 0  # ZeRO 1's all-gather and the step's all-reduces


def test_the_framework_share_is_the_busy_time_beyond_the_kernels() -> None:
    cfg = compose_config(REPO / "conf", ["model=gpt-tiny", "train.global_batch_size=4"])
    plain = planner.predict(cfg, 1, hand_built_cpu()).time
    heavy_profile = hand_built_cpu()
    heavy_profile.framework = 1.5
    heavy = planner.predict(cfg, 1, heavy_profile).time
    assert plain.split["framework"] == pytest.approx(0.0, abs=1e-12)
    kernels = sum(plain.split[c] for c in ("matmul", "attention", "elementwise"))
    assert heavy.split["framework"] == pytest.approx(0.5 * kernels)
    assert heavy.split["matmul"] == pytest.approx(plain.split["matmul"])


def test_ranks_sharing_cores_wait_for_them_as_the_sharing_curve_says() -> None:
    cfg = compose_config(REPO / "conf", ["model=gpt-tiny", "train.global_batch_size=8", "train.micro_batch_size=1"])
    profile = hand_built_cpu()  # two cores
    alone = planner.predict(cfg, 1, profile).time
    assert alone.split["core wait"] == pytest.approx(0.0, abs=1e-12)
    profile = dataclasses.replace(profile, ranks_per_node=8, sharing=[1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0])
    eight = planner.predict(cfg, 8, profile).time  # dp 8: every rank computes at once, each at 2 / 8 speed
    kernels = sum(eight.split[c] for c in ("matmul", "attention", "elementwise", "framework"))
    assert eight.split["core wait"] == pytest.approx(3 * kernels, rel=1e-6)


def test_the_breakdown_names_the_largest_miss() -> None:
    cfg = compose_config(REPO / "conf", ["model=gpt-tiny", "train.global_batch_size=4"])
    p = planner.predict(cfg, 1, hand_built_cpu())
    step = p.time.step
    split = dict(p.time.split)
    split["framework"] += 0.3 * step
    m = measure.Measured(p, Trial("x", []), 1.3 * step, split=split)
    text = measure.breakdown(m)
    lines = text.splitlines()
    assert lines[0].startswith(p.label) and "+30.0%" in lines[0]
    assert [line.split()[0] for line in lines[2:5]] == ["predicted", "measured", "miss"]
    assert lines[-1].startswith("  largest miss: framework +")
    assert "(no profiled step" in measure.breakdown(measure.Measured(p, Trial("x", []), step))
    assert measure.breakdown(measure.Measured(p, Trial("x", []), None)) == ""
