"""The planner's search (trident/plan/planner.py ``plan(..., top=k)``): it ranks the same first layouts as estimating
and timing every accepted one, its bounds are below what they bound, a simulation shared by layouts that differ in
ZeRO and offload times each as it would alone, and an expert-parallel group drawn from dp x cp is priced on the
links its ranks sit on (parallel/topology.py's groups)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import REPO
from tests.helpers.plan_space import enumerate_layouts
from tests.test_plan import cpu_profile
from trident.config import compose_config
from trident.layout import Layout
from trident.memory.estimate import estimate
from trident.parallel.topology import Topology
from trident.plan.cost import _pricer, expert_dp_across, pipeline_floor, step_floor, step_time
from trident.plan.planner import MemoryModel, placement_for, plan, states_floor
from trident.plan.profile import DATASHEETS, Profile


def _tight(cfg_overrides: list[str], world: int) -> Profile:
    """An H100 with memory for about half of the layouts' peaks: some fit, some do not, some by their states alone."""
    cfg = compose_config(REPO / "conf", cfg_overrides)
    roomy = plan(cfg, world, DATASHEETS["h100"])
    peaks = sorted(p.peak["device"] for p in roomy.ranked)
    h100 = DATASHEETS["h100"]
    return dataclasses.replace(h100, memory_bytes=peaks[len(peaks) // 2] / h100.usable_fraction)


CASES = [
    (["model=gpt-tiny", "train.global_batch_size=8"], 4, "h100"),  # pipelines, cp, sequence parallelism
    (["model=gpt-tiny", "train.global_batch_size=8"], 4, "tight"),  # and the memory bounds
    (["model=moe-tiny", "train.global_batch_size=2"], 2, "cpu"),  # ep drawn from dp x cp, ranks sharing cores
]


@pytest.mark.parametrize("overrides,world,device", CASES, ids=["h100", "tight-h100", "moe-cpu"])
def test_the_pruned_plan_ranks_what_timing_every_layout_ranks_first(
    overrides: list[str], world: int, device: str
) -> None:
    """``top=5``: the same five layouts in the same order, with the same steps and peaks, as the whole ranking (every
    accepted layout estimated and, if it fits, timed), most layouts neither estimated nor timed."""
    cfg = compose_config(REPO / "conf", overrides)
    profile = {"h100": DATASHEETS["h100"], "cpu": cpu_profile()}.get(device) or _tight(overrides, world)
    whole = plan(cfg, world, profile)
    pruned = plan(cfg, world, profile, top=5)
    assert len(whole.ranked) >= 5 and pruned.examined == whole.examined and len(pruned.refused) == len(whole.refused)
    assert [p.layout for p in pruned.ranked] == [p.layout for p in whole.ranked[:5]]
    assert [p.time.step for p in pruned.ranked] == [p.time.step for p in whole.ranked[:5]]
    assert [p.peak for p in pruned.ranked] == [p.peak for p in whole.ranked[:5]]
    assert pruned.untimed > pruned.examined // 2
    if device == "tight":
        assert whole.unfit and pruned.floored > 0 and pruned.do_not_fit <= len(whole.unfit)
    if device == "cpu":
        assert any(p.layout.cp == 2 and p.layout.ep == 2 for p in whole.ranked)


@pytest.mark.parametrize(
    "overrides,world",
    [(["model=gpt-tiny", "train.global_batch_size=8"], 4), (["model=moe-tiny", "train.global_batch_size=4"], 4)],
)
def test_bounds_are_below_what_they_bound(overrides: list[str], world: int) -> None:
    """On layouts across the space (every schedule, cp, ep, recomputation, ZeRO and offload), on a GPU datasheet
    and on ranks sharing a CPU's cores: the step's lower bounds are at most its step, the model states' floor at
    most the estimator's device peak, and with the mean stage's batch still at most that peak."""
    cfg = compose_config(REPO / "conf", overrides)
    accepted = enumerate_layouts(cfg, world).accepted
    memory = MemoryModel(cfg.model)
    for profile in (DATASHEETS["h100"], cpu_profile()):
        placement = placement_for(profile, world)
        floors: dict = {}
        for layout, _ in accepted[:: max(1, len(accepted) // 120)]:
            layout = dataclasses.replace(layout, device=profile.device)
            step = step_time(cfg.model, layout, profile, placement).step
            assert step_floor(cfg.model, layout, profile, placement, floors) <= step * (1 + 1e-12)
            assert pipeline_floor(cfg.model, layout, profile, placement) <= step * (1 + 1e-12)
            if profile.device != "cpu":
                peak = estimate(cfg.model, layout).worst.peak(layout.recompute)["device"]
                assert states_floor(cfg.model, layout) <= peak
                assert states_floor(cfg.model, layout) + memory.activations_mean(layout) <= peak


def test_a_shared_simulation_times_each_layout_as_alone() -> None:
    """Layouts that differ in ZeRO and offload share one simulated schedule (and its reduction queues) in a plan's
    cache: each is timed, step and split, exactly as with no cache."""
    cfg = compose_config(REPO / "conf", ["model=gpt-tiny", "train.global_batch_size=8"])
    profile = DATASHEETS["h100"]
    placement = placement_for(profile, 4)
    cache: dict = {}
    for layout, _ in enumerate_layouts(cfg, 4).accepted[::7]:
        layout = dataclasses.replace(layout, device="cuda")
        shared, alone = (step_time(cfg.model, layout, profile, placement, cache=c) for c in (cache, None))
        assert shared.step == alone.step and shared.split == alone.split and shared.dp_comm == alone.dp_comm


def test_an_expert_group_drawn_from_dp_x_cp_is_priced_on_its_ranks_links() -> None:
    """Nodes of 8 GPUs, 16 ranks: an ep group is a run of ep members of a dp x cp group (tp apart), an expert-dp
    group every ep-th of them. Whether either crosses a node, as the step-time model prices the all-to-all and the
    experts' gradient reduction, is what the topology's own groups say (at cp > 1 the runs are a sequence's cp ranks
    first, not dp ranks tp x cp apart)."""
    placement = placement_for(DATASHEETS["h100"], 16)
    checked = 0
    for tp, cp, pp in ((1, 2, 1), (2, 2, 1), (4, 2, 1), (2, 4, 1), (1, 4, 2), (2, 2, 2), (4, 1, 1)):
        dp = 16 // (tp * cp * pp)
        for ep in (e for e in (2, 4, 8) if dp * cp % e == 0):
            topology = Topology(dp=dp, pp=pp, tp=tp, cp=cp, ep=ep)

            def crosses(groups: list[list[int]]) -> bool:
                return any(len({r // placement.ranks_per_node for r in g}) > 1 for g in groups)

            layout = Layout(dp=dp, tp=tp, cp=cp, pp=pp, ep=ep)
            assert _pricer(layout, DATASHEETS["h100"], placement).ep_across_nodes == crosses(topology.ep_groups())
            assert expert_dp_across(layout, placement) == crosses(topology.expert_dp_groups())
            checked += 1
    assert checked > 10


def test_a_precision_a_calibration_did_not_time_is_priced_at_its_fp32_peak() -> None:
    """A CPU calibrated for an fp32 plan, asked to plan an fp16 run (parallel.auto with train.precision=fp16): the
    matmuls it never timed are priced from the fp32 peak, not a KeyError out of the planner."""
    calibrated = dataclasses.replace(DATASHEETS["h100"], peak_tflops={"fp32": 2.0})
    assert calibrated.peak("fp16") == calibrated.peak("fp32") == 2e12
