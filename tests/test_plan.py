"""The layout planner (trident/plan/): its space is exactly what the validator accepts, its memory is the
estimator's, its simulated schedules give the bubble formulas, and its step-time model composes its rates as it
says (a hand-built profile, so every expected figure is worked out here, not read back from the model)."""

from __future__ import annotations

import dataclasses
import itertools
import runpy
from collections.abc import Callable, Sequence

import pytest

from tests.helpers import REPO
from tests.helpers.plan_space import Enumeration, enumerate_layouts, grid
from trident.config import Config, compose_config, validate
from trident.errors import ConfigError
from trident.layout import PLANNED_KEYS, Layout, with_keys
from trident.memory.estimate import estimate
from trident.parallel.pipeline.schedules import UNIT_COSTS
from trident.plan import simulate
from trident.plan.cost import (
    Pricer,
    RankPlacement,
    StepTime,
    _chunk_reduce_end,
    amid_time,
    collective_time,
    flops_attention,
    step_time,
)
from trident.plan.ops import Shape, layer_ops, layer_parts
from trident.plan.planner import MemoryModel, fits, placement_for, plan, predict
from trident.plan.profile import DATASHEETS, Profile, Rate, collective_key, matmul_key
from trident.plan.report import launch_overrides
from trident_dev.schedule_theory import bubble_formula

TINY = ["model=gpt-tiny", "train.global_batch_size=8"]


def cpu_profile(memory: float = 24e9, cores: int = 2) -> Profile:
    """Round figures: 1 GFLOP/s matmuls, 1 GB/s element-wise with no latency, collectives 1 ms + 1 GB/s."""
    rate = Rate(1e-3, 1e9)
    return Profile(
        name="test",
        device="cpu",
        source="test",
        memory_bytes=memory,
        units_per_node=cores,
        peak_tflops={"fp32": 1e-3, "bf16": 1e-3},
        matmul_efficiency=1.0,
        attention_efficiency=1.0,
        elementwise=Rate(0.0, 1e9),
        collectives={
            collective_key(op, g): rate for op in ("all_reduce", "all_gather", "reduce_scatter") for g in (2, 4)
        }
        | {collective_key("p2p", 2): rate},
        adam=1e8,
        host_adam=1e8,
    )


def _validators_verdict(cfg: Config, world: int, part: Callable[[dict], bool]) -> tuple[set[Layout], Enumeration]:
    """What the validator accepts of the grid's ``part``, and the planner's enumeration."""
    accepted = set()
    for keys in grid(cfg, world):
        if not part(keys):
            continue
        try:
            accepted.add(validate(with_keys(cfg, keys), world))
        except ConfigError:
            continue
    return accepted, enumerate_layouts(cfg, world)


def _assert_enumeration_is(
    accepted: set[Layout], found: Enumeration, part: Callable[[dict], bool], world: int = 4
) -> None:
    listed = [layout for layout, _ in found.accepted if part(layout.keys())]
    assert len(listed) == len(set(listed)) and set(listed) == accepted
    assert all(validate(variant, world) == layout for layout, variant in found.accepted if part(layout.keys()))


@pytest.mark.parametrize(
    "overrides",
    [["model=gpt-tiny", "train.global_batch_size=2"], ["model=moe-tiny", "train.global_batch_size=1"]],
    ids=["dense", "moe"],
)
def test_enumeration_is_the_validators_verdict_on_the_whole_grid(overrides: list[str]) -> None:
    """Every combination of every planned key's domain (the schedule named or not, offload ratios without offload,
    vpp and pp that do not divide, each cp_comm, every ep of the world's divisors, ...) on two ranks goes to
    ``validate``; the launches it accepts, written one way, are exactly the planner's accepted candidates, and the
    planner lists nothing twice. For the model with experts that includes ep drawn from dp x cp (cp 2, ep 2 on
    two ranks: dp is 1), which the validator accepts."""
    cfg = compose_config(REPO / "conf", overrides)
    world = 2

    def part(keys: dict) -> bool:
        return True

    accepted, found = _validators_verdict(cfg, world, part)
    _assert_enumeration_is(accepted, found, part, world)
    assert len(accepted) > 500  # the space is not trivially small: every key varies
    if cfg.model.moe.enabled:
        assert (1, 2, 2) in {(layout.dp, layout.cp, layout.ep) for layout in accepted}
    # What the planner refuses, the validator refuses, with its own line.
    for keys, line in found.refused[:50]:
        with pytest.raises(ConfigError, match=line[:30].replace("(", r"\(").replace(")", r"\)")):
            validate(with_keys(cfg, keys), world)


def test_enumeration_of_context_parallelism_is_the_validators_verdict() -> None:
    """cp and each cp_comm against every key the validator's cp rules read (tp, pp, vpp, schedule, sequence
    parallelism; the sequence's split, ulysses' heads), the rest at one value each (the whole grid of them is the
    test above, at cp = 1): exactly what the validator accepts, ulysses where the heads spread, and cp x tp x pp
    at most the world."""
    cfg = compose_config(REPO / "conf", [*TINY, "model.n_kv_heads=2"])
    world = 4
    rest = {
        "parallel.zero": 0,
        "parallel.offload.optimizer": "none",
        "train.micro_batch_size": 1,
        "train.activation_checkpointing": "none",
        "parallel.zero3_gather": "micro_batch",
    }

    def part(keys: dict) -> bool:
        return all(keys[k] == v for k, v in rest.items())

    accepted, found = _validators_verdict(cfg, world, part)
    _assert_enumeration_is(accepted, found, part)
    cps = {(layout.cp, layout.cp_comm) for layout in accepted}
    assert cps == {(1, "ring"), *((cp, comm) for cp in (2, 4) for comm in ("ring", "allgather", "ulysses"))}
    assert any(layout.cp == 2 and layout.tp == 2 and layout.sequence_parallel for layout in accepted)
    assert all(layout.world == world for layout in accepted)


def test_plan_keeps_what_fits_and_lists_what_does_not() -> None:
    """With a memory budget between the smallest and the largest peak, the ranked layouts are exactly the
    accepted ones whose estimator peak fits, the unfit ones the rest."""
    cfg = compose_config(REPO / "conf", TINY)
    roomy = plan(cfg, 4, cpu_profile())
    peaks = sorted(sum(p.peak.values()) for p in roomy.ranked)
    assert not roomy.unfit and len(roomy.ranked) == len(enumerate_layouts(cfg, 4).accepted)
    budget = peaks[len(peaks) // 2] * 4 / 0.9  # four ranks on the node share its memory
    tight = plan(cfg, 4, cpu_profile(memory=budget))
    assert tight.ranked and tight.unfit
    assert {p.layout for p in tight.ranked} | {p.layout for p in tight.unfit} == {p.layout for p in roomy.ranked}
    ranked = {id(p) for p in tight.ranked}  # by identity: a list's ``in`` compares whole predictions, n^2 of them
    for p in tight.ranked + tight.unfit:
        assert fits(p.peak, tight.profile, tight.placement) == (id(p) in ranked)
        assert (sum(p.peak.values()) * 4 <= 0.9 * budget) == (id(p) in ranked)
    assert [p.tokens_per_s for p in tight.ranked] == sorted((p.tokens_per_s for p in tight.ranked), reverse=True)


@pytest.mark.parametrize(
    "overrides",
    [
        ["model=gpt-mini", "train.global_batch_size=32"],
        ["model=llama-tiny", "train.global_batch_size=16", "train.precision=bf16"],
        ["model=llama-tiny", "train.global_batch_size=8", "train.precision=bf16", "parallel.cp=2"],
        ["model=moe-tiny", "train.global_batch_size=16", "parallel.ep=2"],
    ],
)
def test_memory_predictions_are_the_estimators(overrides: list[str]) -> None:
    cfg = compose_config(REPO / "conf", overrides)
    world = 4 if "parallel.ep=2" in overrides else 8  # moe-tiny's 4 experts: ep 2 and 4 on dp 4
    found = enumerate_layouts(cfg, world)
    memory = MemoryModel(cfg.model)
    accepted_layouts = found.accepted
    if "parallel.cp=2" in overrides:  # every context-parallel layout (the others are the cases above)
        accepted_layouts = [(layout, variant) for layout, variant in accepted_layouts if layout.cp > 1]
        assert {layout.cp_comm for layout, _ in accepted_layouts} == {"ring", "allgather", "ulysses"}
    if "parallel.ep=2" in overrides:  # every expert-parallel layout: the experts' states and the routing's bound
        accepted_layouts = [(layout, variant) for layout, variant in accepted_layouts if layout.ep > 1]
        assert {layout.ep for layout, _ in accepted_layouts} == {2, 4}  # of 4 experts
    # A spread of about 12 (each model-state walk once per device, every layout's activations traced under its own
    # recomputation: a cp or sparse layout's traces cost about a second here): the two paths share their code, and
    # this checks the planner's own bookkeeping of it.
    for accepted, variant in accepted_layouts[:: max(1, len(accepted_layouts) // 12)]:
        for device in ("cpu", "cuda"):
            layout = dataclasses.replace(accepted, device=device)
            worst = estimate(variant.model, layout, policies=(), balanced=False).worst  # the layout's own policy
            peak, states = memory.peak(layout)
            assert peak == worst.peak(layout.recompute)
            assert states == worst.model_states["total"]


CASES = [
    ("gpipe", 4, 1, 8),
    ("1f1b", 4, 1, 8),
    ("1f1b", 4, 1, 3),
    ("1f1b", 2, 1, 1),
    ("interleaved", 4, 2, 8),
    ("interleaved", 4, 2, 12),
    ("interleaved", 4, 2, 3),
    ("interleaved", 2, 4, 5),
    ("interleaved", 8, 2, 16),
    ("zb-h1", 4, 1, 8),
    ("zb-h1", 4, 1, 2),
    ("zb-v", 4, 2, 8),
    ("zb-v", 2, 2, 3),
]


@pytest.mark.parametrize("name,pp,vpp,micro", CASES)
def test_simulated_bubble_is_the_formula(name: str, pp: int, vpp: int, micro: int) -> None:
    """Unit costs (F 1, B 2; I 1, W 1): the planner's simulation leaves each rank idle over busy exactly as the
    schedule's theory says, both by list scheduling and by the shared-compute event simulation at full speed."""
    unit = lambda r, a: (UNIT_COSTS[a.kind], 0.0)  # noqa: E731
    listed = simulate.run_schedule(name, pp, vpp, micro, unit)
    events = simulate.run_schedule(name, pp, vpp, micro, unit, speed=lambda k: 1.0)
    expected = bubble_formula(name, pp, vpp, micro)
    for spans in (listed, events):
        assert idle_over_busy(spans, pp) == pytest.approx([expected] * pp, abs=1e-9)


def test_shared_cores_stretch_compute_but_not_communication() -> None:
    """Two pipeline ranks on one core: while both compute each runs at half speed, so a 1f1b step of M
    micro-batches takes all the compute, serialised; an action's communication part takes its own time."""
    unit = lambda r, a: (UNIT_COSTS[a.kind], 0.0)  # noqa: E731
    spans = simulate.run_schedule("1f1b", 2, 1, 4, unit, speed=lambda k: 1.0 / k)
    assert max(s.end for s in spans) == pytest.approx(2 * 4 * 3)  # 2 ranks x 4 micro-batches x (1 + 2)
    with_comm = simulate.run_schedule("1f1b", 2, 1, 1, lambda r, a: (1.0, 0.5), speed=lambda k: 1.0 / k)
    # F on rank 0, F on rank 1, B on rank 1, B on rank 0: nothing overlaps, each 1 + 0.5.
    assert max(s.end for s in with_comm) == pytest.approx(4 * 1.5)


def test_step_time_composes_measured_rates() -> None:
    """One rank, no parallelism: the step is the priced ops and the optimizer. Halving every matmul's measured time
    halves exactly the matmul share; a measured matmul replaces its FLOPs rule."""
    cfg = compose_config(REPO / "conf", TINY + ["train.micro_batch_size=8"])
    profile = cpu_profile()
    base = predict(cfg, 1, profile)
    assert base.time is not None and base.time.bubble == 0 and base.time.tp_comm == 0 and base.time.dp_comm == 0
    # Measure every matmul shape at exactly half its FLOPs-rule time.
    collected = plan(cfg, 1, profile).needs
    rule = {matmul_key(*k): 2 * k[1] * k[2] * k[3] / 1e9 for k in collected.matmuls}
    assert {k[4] for k in collected.matmuls} == {"nt", "nn", "tn"}  # forward, input and weight gradients
    halved = dataclasses.replace(profile, matmuls={key: t / 2 for key, t in rule.items()})
    fast = predict(cfg, 1, halved)
    assert fast.time is not None
    matmul_share = base.time.compute - fast.time.compute
    assert matmul_share > 0
    measured = dataclasses.replace(profile, matmuls=rule)
    same = predict(cfg, 1, measured)
    assert same.time is not None and same.time.step == pytest.approx(base.time.step, rel=1e-12)
    assert fast.time.step == pytest.approx(base.time.step - matmul_share, rel=1e-9)


def test_data_parallel_reduction_hides_behind_backward() -> None:
    """dp=2 with buckets small enough to spread: with collectives far faster than the backward only the last bucket
    is left exposed; made slower than the backward, nearly all of it is."""
    cfg = compose_config(REPO / "conf", TINY + ["parallel.bucket_mb=0.01"])
    fast = cpu_profile()
    slow = dataclasses.replace(
        fast, collectives={k: Rate(v.latency, v.bandwidth / 1e4) for k, v in fast.collectives.items()}
    )
    one, two = predict(cfg, 2, fast).time, predict(cfg, 2, slow).time
    assert one is not None and two is not None
    assert 0 < one.dp_comm < 0.05 * one.step
    assert two.dp_comm > 0.5 * two.step


def test_layouts_on_datasheet_gpus_do_not_share_compute() -> None:
    profile = DATASHEETS["h100"]
    placement = placement_for(profile, 64)
    assert (placement.nodes, placement.ranks_per_node, placement.threads) == (8, 8, 1)
    assert all(placement.share(k) == 1.0 for k in range(1, 9))
    cpu = placement_for(cpu_profile(cores=2), 8)
    assert (cpu.nodes, cpu.threads) == (1, 1) and cpu.share(2) == 1.0 and cpu.share(8) == pytest.approx(0.25)
    measured = RankPlacement(8, 8, 1, 2, capacity=1.6)  # all eight together get 1.6 lone ranks' worth
    assert measured.share(2) == 1.0 and measured.share(8) == pytest.approx(0.2)
    # A calibration's sharing curve, k = 1 .. 8 ranks computing at once, is what the ranks get, not the cores' count.
    curve = (1.0, 1.7, 1.8, 1.6, 1.6, 1.5, 1.5, 1.4)
    swept = RankPlacement(8, 8, 1, 2, capacity=1.4, sharing=curve)
    assert [swept.share(k) for k in (1, 2, 3, 8)] == pytest.approx([1.0, 0.85, 0.6, 1.4 / 8])
    profile = dataclasses.replace(cpu_profile(cores=2), ranks_per_node=8, sharing=list(curve))
    assert placement_for(profile, 8).sharing == curve and placement_for(profile, 4).sharing == ()


def test_table_launch_overrides_reproduce_each_layout() -> None:
    """The table's overrides, on top of the user's, are the layout the row names: train.py's validator accepts
    them for the world, and they give the same prediction."""
    base = TINY + ["parallel.zero=1"]
    cfg = compose_config(REPO / "conf", base)
    result = plan(cfg, 4, DATASHEETS["a100"])
    text = runpy.run_path(str(REPO / "tools" / "plan.py"))["plan_table"](result, cfg, 5)  # the tool's table
    assert text.count("\n") >= 2 + 2 * 5 and "tokens/s" in text
    for p in result.ranked[:5]:
        launched = compose_config(REPO / "conf", base + launch_overrides(p, cfg))
        assert validate(launched, 4) == dataclasses.replace(p.layout, device="cpu")
        again = predict(launched, 4, DATASHEETS["a100"])
        assert again.layout == p.layout and again.time.step == pytest.approx(p.time.step)


def test_candidates_name_every_layout_key() -> None:
    """A candidate's overrides are exactly the layout keys parallel.auto chooses (and keeps when given)."""
    assert [o.split("=")[0] for o in Layout().overrides()] == list(PLANNED_KEYS)
    assert list(itertools.islice(grid(compose_config(REPO / "conf", TINY), 1), 1))


def test_pipeline_chunks_reduce_behind_their_own_last_backward() -> None:
    """Under pipelines each chunk's buckets fill during its last weight-gradient action and queue on the dp group:
    a chunk done early is reduced while the schedule runs on; only what the last chunk fills is left to the end."""
    profile = cpu_profile()
    layout = Layout(dp=2, pp=2, vpp=2, bucket_mb=1.0)
    per_bucket = 2**20 // 4
    s = collective_time(profile, "all_reduce", 2, 4 * per_bucket, False)
    # Chunk 1: two buckets filled over [0, 1]; chunk 0: one bucket over [10, 11] (given first: ordered by its end).
    end = _chunk_reduce_end(profile, layout, [(per_bucket, 10.0, 11.0), (2 * per_bucket, 0.0, 1.0)], False)
    assert s < 4  # the first chunk's two reductions are over long before the second chunk's action ends
    assert end == pytest.approx(11.0 + s)
    # Both ending at 1.0, in the order given (as the executor launches): the three queue from 1.0, one after another.
    end = _chunk_reduce_end(profile, layout, [(per_bucket, 1.0, 1.0), (2 * per_bucket, 0.0, 1.0)], False)
    assert end == pytest.approx(1.0 + 3 * s)


def test_recomputation_is_priced_and_the_plan_picks_the_least_that_fits() -> None:
    """Each recomputation is priced by what it recomputes and kept by what it keeps: at one layout none is the
    fastest and keeps the most, full the slowest and keeps the least, op-level selective and full recomputation of
    every second block between them. With memory for no more than selective (then for no more than full/2), the
    plan's best recomputes selectively (then every second block), not every block in full."""
    # One micro-batch size; the unchunked loss, whose logits make gpt-tiny's peaks fall in this order (with the chunked
    # one, the default, a layer recomputed whole lifts full/2's transient above selective's peak at this size).
    base = ["model=gpt-tiny", "train.global_batch_size=1", "train.micro_batch_size=1", "model.loss_chunk_tokens=0"]
    recomputations = {
        "none": [],
        "selective": ["train.activation_checkpointing=selective"],
        "full/2": ["train.activation_checkpointing=full", "train.recompute_every=2"],
        "full": ["train.activation_checkpointing=full"],
    }
    predicted = {
        name: predict(compose_config(REPO / "conf", [*base, *extra]), 1, cpu_profile())
        for name, extra in recomputations.items()
    }
    peak = {name: p.peak["host"] for name, p in predicted.items()}
    step = {name: p.time.step for name, p in predicted.items()}
    assert step["none"] < step["selective"] < step["full/2"] < step["full"]
    assert peak["none"] > peak["selective"] > peak["full/2"] > peak["full"]
    cfg = compose_config(REPO / "conf", base)
    for budget in ("selective", "full/2"):
        best = plan(cfg, 1, cpu_profile(memory=peak[budget] / 0.9 + 1)).best
        assert best is not None and best.layout.recompute == budget


def _tiny_step(layout: Layout, profile: Profile) -> StepTime:
    cfg = compose_config(REPO / "conf", TINY)
    return step_time(cfg.model, layout, profile, placement_for(profile, layout.world))


def test_context_parallel_attention_is_a_rank_share_of_the_pairs() -> None:
    """Under the head-tail split every cp rank attends 1 / cp of the causal pairs: its attention (ring and allgather:
    cp causal blocks of seq / cp; ulysses: the whole sequence on heads / cp) is priced at 1 / cp of one rank's, and
    the rest of the layer on its seq / cp tokens."""
    m = compose_config(REPO / "conf", TINY).model
    pricer = Pricer(cpu_profile(), "fp32", RankPlacement(4, 4))

    def priced(cp: int, comm: str, kind: str) -> float:
        shape = Shape(1, m.seq_len // cp, 1, False, "fp32", cp, comm)
        return sum(pricer.kernels(o) for o in layer_ops(m, shape) if o.kind == kind)

    whole = priced(1, "ring", "attention")
    assert whole == pytest.approx(3.5 * flops_attention(1, m.n_heads, m.seq_len, m.head_size, "fwd") / 1e9)
    for cp in (2, 4):
        for comm in ("ring", "allgather", "ulysses"):
            assert priced(cp, comm, "attention") == pytest.approx(whole / cp)
        assert priced(cp, "ring", "matmul") == pytest.approx(priced(1, "ring", "matmul") / cp)


def test_context_parallel_cost_grows_with_exposed_communication() -> None:
    """gpt-tiny at cp 2 on two ranks, one micro-batch per step and rank of 8 sequences: the exchange of every layer
    forward and backward is the step's only cp-group communication (``tp_comm``, tp being 1). allgather: every
    rank's token positions (int64) and the whole sequence's K/V gathered, their gradients reduce-scattered, at the
    profile's rate; a slower rate adds exactly its extra time to the step. ring: a step's message hides behind the
    attention of its block; only the excess is exposed, none with a link fast enough; the gradients' trip home
    hides behind nothing."""
    m = compose_config(REPO / "conf", TINY).model
    layers, kv = m.n_layers, 2 * m.seq_len * m.n_heads * m.head_size * 4 * 8  # K and V of 8 sequences, fp32
    positions = 8 * 8 * m.seq_len  # every token's position in the sequence, int64
    profile = cpu_profile()
    gathered = Layout(dp=1, cp=2, cp_comm="allgather", micro_batch_size=8, micro_batches=1, device="cpu")
    base = _tiny_step(gathered, profile)
    rate = Rate(1e-3, 1e9)  # cpu_profile's all-gather and reduce-scatter over 2
    assert base.tp_comm == pytest.approx(layers * (2 * rate.time(kv) + rate.time(positions)))
    slow = Rate(2e-3, 0.5e9)
    slower = dataclasses.replace(
        profile,
        collectives=profile.collectives | {collective_key(op, 2): slow for op in ("all_gather", "reduce_scatter")},
    )
    worse = _tiny_step(gathered, slower)
    extra = layers * (2 * (slow.time(kv) - rate.time(kv)) + slow.time(positions) - rate.time(positions))
    assert worse.tp_comm == pytest.approx(base.tp_comm + extra)
    # The gradient all-reduce over dp x cp runs on the slower rates too: only the exchange is compared on the step.
    assert worse.step - worse.dp_comm - worse.optimizer == pytest.approx(
        base.step - base.dp_comm - base.optimizer + extra
    )

    ring = dataclasses.replace(gathered, cp_comm="ring")
    block = flops_attention(8, m.n_heads, m.seq_len // 2, m.head_size, "fwd") / 1e9  # one step's block, forward
    p2p = Rate(1e-3, 1e9)
    # Forward and backward a K/V block behind the block's attention; backward their fp32 gradients home, exposed.
    exposed = layers * (max(0.0, p2p.time(kv / 2) - block) + max(0.0, p2p.time(kv / 2) - 2.5 * block))
    exposed += layers * p2p.time(kv / 2)
    assert exposed > 0
    assert _tiny_step(ring, profile).tp_comm == pytest.approx(exposed)
    # ulysses: four all-to-alls of a rank's [T, heads, dh] (q, k, v, the output) each way, at the measured rate.
    spread = dataclasses.replace(gathered, cp_comm="ulysses")
    measured = dataclasses.replace(profile, collectives=profile.collectives | {collective_key("all_to_all", 2): slow})
    assert _tiny_step(spread, measured).tp_comm == pytest.approx(layers * 2 * 4 * slow.time(kv / 4))
    fast = dataclasses.replace(profile, collectives=profile.collectives | {collective_key("p2p", 2): Rate(0.0, 1e15)})
    assert _tiny_step(ring, fast).tp_comm == pytest.approx(0.0, abs=1e-9)
    assert _tiny_step(ring, fast).step < _tiny_step(ring, profile).step


def test_collectives_the_passes_meet_are_priced_at_their_rate_amid_compute() -> None:
    """A calibration's rate for a collective amid compute (``Profile.amid``) prices the collectives inside the
    passes (here cp's all-gathers and reduce-scatters, and a pipeline's messages), and only those: the gradient
    all-reduce after the passes, and a layout that meets no collective in its passes, keep the back-to-back rate."""
    m = compose_config(REPO / "conf", TINY).model
    kv = 2 * m.seq_len * m.n_heads * m.head_size * 4 * 8  # K and V of 8 sequences, fp32
    profile = cpu_profile()
    slow = Rate(5e-3, 0.2e9)
    amid = {collective_key(op, 2): slow for op in ("all_gather", "reduce_scatter", "all_reduce", "p2p")}
    loaded = dataclasses.replace(profile, amid=amid)
    gathered = Layout(dp=1, cp=2, cp_comm="allgather", micro_batch_size=8, micro_batches=1, device="cpu")
    base, worse = _tiny_step(gathered, profile), _tiny_step(gathered, loaded)
    positions = 8 * 8 * m.seq_len  # every token's position in the sequence, int64, gathered before the K/V
    assert worse.tp_comm == pytest.approx(m.n_layers * (2 * slow.time(kv) + slow.time(positions)))
    assert worse.step - base.step == pytest.approx(worse.tp_comm - base.tp_comm)  # the gradient all-reduce: unchanged
    plain = Layout(dp=2, micro_batch_size=4, micro_batches=1, device="cpu")
    assert _tiny_step(plain, loaded).step == _tiny_step(plain, profile).step
    piped = Layout(dp=1, pp=2, micro_batch_size=2, micro_batches=4, schedule="1f1b", device="cpu")
    message = 2 * m.seq_len * m.d_model * 4
    assert _tiny_step(piped, loaded).p2p == pytest.approx(2 * 4 * slow.time(message))
    assert _tiny_step(piped, profile).p2p == pytest.approx(2 * 4 * Rate(1e-3, 1e9).time(message))


def test_a_collective_after_a_longer_stretch_of_compute_costs_what_the_longer_probe_measured() -> None:
    """Amid compute, the longer a rank computes before a collective, the likelier its peer was stopped in
    mid-stretch: the rate measured after 1 ms of compute and the one after 4 ms, read straight in between by the
    compute a pass has between its collectives, the nearer one's outside, never below the shorter one's."""
    key = collective_key("p2p", 2)
    short, longer = Rate(2e-3, 1e9), Rate(5e-3, 1e9)
    profile = dataclasses.replace(cpu_profile(), amid={key: short}, amid_long={key: longer})
    nbytes = 1e6
    at = {s: amid_time(profile, "p2p", 2, nbytes, False, s) for s in (None, 1e-4, 1e-3, 2.5e-3, 4e-3, 0.1)}
    assert at[None] == at[1e-4] == at[1e-3] == pytest.approx(short.time(nbytes))
    assert at[2.5e-3] == pytest.approx((short.time(nbytes) + longer.time(nbytes)) / 2)
    assert at[4e-3] == at[0.1] == pytest.approx(longer.time(nbytes))
    cheaper = dataclasses.replace(profile, amid_long={key: Rate(1e-3, 1e9)})
    assert amid_time(cheaper, "p2p", 2, nbytes, False, 0.1) == pytest.approx(short.time(nbytes))
    # A cp ring at one sequence a micro-batch: its passes' compute between two messages is priced long here.
    ring = Layout(dp=1, cp=2, cp_comm="ring", micro_batch_size=8, micro_batches=1, device="cpu")
    base = dataclasses.replace(cpu_profile(), amid={key: short})
    assert _tiny_step(ring, profile).tp_comm > _tiny_step(ring, base).tp_comm


def test_a_sequence_only_context_parallelism_fits_is_planned_with_it() -> None:
    """A long sequence on two ranks with room for only a context-parallel layout's activations: the plan ranks
    only cp layouts, and its best is one."""
    # The unchunked loss: its [tokens, vocab] logits are what a long sequence's activations are made of at gpt-tiny's
    # width (with the chunked loss, cp's exchange buffers outweigh what cp=2 saves at this length).
    overrides = ["model=gpt-tiny", "model.seq_len=1024", "train.global_batch_size=2", "model.loss_chunk_tokens=0"]
    cfg = compose_config(REPO / "conf", overrides)
    roomy = plan(cfg, 2, cpu_profile())
    least = {cp: min(sum(p.peak.values()) for p in roomy.ranked if p.layout.cp == cp) for cp in (1, 2)}
    assert least[2] < least[1]
    budget = (least[1] + least[2]) / 2 * 2 / 0.9  # two ranks share the node's memory
    tight = plan(cfg, 2, cpu_profile(memory=budget))
    assert tight.ranked and all(p.layout.cp == 2 for p in tight.ranked)
    assert any(p.layout.cp == 1 for p in tight.unfit)
    assert tight.best is not None and "cp2" in tight.best.label


def test_expert_parallel_layouts_are_planned_and_priced() -> None:
    """moe-tiny on 4 ranks: ep 1, 2 and 4 (dividing dp 4 and the 4 experts) are candidates, each timed; the experts
    are priced on the rows of their top-k pairs (the active parameters: 2 of 4 experts a token), and under ep each
    sparse layer's dispatch and combine, forward and backward, at the measured all-to-all rate of the ep group."""
    cfg = compose_config(REPO / "conf", ["model=moe-tiny", "train.global_batch_size=8"])
    m = cfg.model
    rate = Rate(1e-3, 1e9)
    profile = cpu_profile(cores=8)
    profile = dataclasses.replace(
        profile, collectives=profile.collectives | {collective_key("all_to_all", g): rate for g in (2, 4)}
    )
    keep = {"parallel.cp": "1", "parallel.tp": "1", "parallel.pp": "1", "parallel.zero": "0"}
    keep |= {"train.micro_batch_size": "2", "train.activation_checkpointing": "none"}  # cp 1: no ulysses exchange
    found = plan(cfg, 4, profile, keep=keep)
    by_ep = {p.layout.ep: p for p in found.ranked}
    assert sorted(by_ep) == [1, 2, 4] and all(p.time is not None and p.tokens_per_s > 0 for p in by_ep.values())
    # One micro-batch of 2 x 64 tokens a rank, 2 sparse layers, 4 messages each of 2 x 64 x 2 rows of 64 fp32.
    message = 2 * 64 * 2 * 64 * 4
    assert by_ep[1].time.tp_comm == 0
    for ep in (2, 4):
        assert by_ep[ep].time.tp_comm == pytest.approx(2 * 4 * rate.time(message))
        assert ep in found.needs.groups
    parts = layer_parts(m, Shape(2, 64, 1, False, "fp32", ep=2), sparse=True)
    forward = {o.shape for o in parts["mlp"] if o.phase == "F"}
    # the router; gate, up and down on 2 x 128 rows
    assert forward == {(128, 4, 64, "nt", None), (256, 64, 64, "nt", None)}
    assert [o.shape for o in parts["dispatch"] if o.kind == "collective"] == [("all_to_all", "ep")] * 2
    # The expert weights' gradients reduce over dp / ep ranks, after the dense ones over dp: with an all-reduce over
    # 2 ranks made 10^4 times slower, ep 2 (experts over 2 ranks) leaves far more exposed than ep 1 (all over 4)
    # and ep 4 (the experts' group is one rank: nothing to reduce).
    slow_pairs = collective_key("all_reduce", 2)
    slow = dataclasses.replace(
        profile, collectives=profile.collectives | {slow_pairs: Rate(rate.latency, rate.bandwidth / 1e4)}
    )
    exposed = []
    for ep in (1, 2, 4):
        variant = compose_config(REPO / "conf", ["model=moe-tiny", "train.global_batch_size=8", f"parallel.ep={ep}"])
        timed = predict(with_keys(variant, {"train.micro_batch_size": 2}), 4, slow).time
        assert timed is not None
        exposed.append(timed.dp_comm)
    assert exposed[1] > 10 * max(exposed[0], exposed[2])


def idle_over_busy(spans: Sequence[simulate.TimedSpan], pp: int) -> list[float]:
    """Per rank, idle time over busy time between the step's start and its last action's end (the quantity of
    the schedules' bubble formulas)."""
    end = max(s.end for s in spans)
    busy = [0.0] * pp
    for s in spans:
        busy[s.rank] += s.end - s.start
    return [(end - b) / b for b in busy]
