"""The layout planner: every layout the validator accepts for a model, world and batch, its memory from the
estimator (trident/memory/estimate.py), its step time from the step-time model (trident/plan/cost.py), ranked.

Memory is predicted first, and a layout that does not fit the device is not timed: ``Plan.unfit`` lists it with
its peak. The rest are ranked by predicted tokens per second (ties: less memory first).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from trident.config import Config, ModelConfig, validate
from trident.layout import PLANNED_KEYS, Layout, override_value
from trident.memory.estimate import Estimate, estimate
from trident.models.gpt import flops_per_token
from trident.parallel.pipeline.schedules import resolve_schedule
from trident.plan.cost import RankPlacement, StepTime, step_time
from trident.plan.profile import Needs, Profile, cpu_threads_per_rank
from trident.plan.space import Keys, judge, key_sets


@dataclass
class Prediction:
    layout: Layout  # the validator's, on the profile's device
    config: Config  # the config that launches it
    peak: dict[str, int]  # the most loaded stage's peak per rank, by place (device, host)
    states: dict[str, int]  # its model states (parameters, gradients, optimizer), by place
    fits: bool = True
    time: StepTime | None = None  # None: not timed (it does not fit)
    tokens_per_s: float = 0.0
    mfu: float | None = None

    @property
    def label(self) -> str:
        return self.layout.short()

    @property
    def dp(self) -> int:
        return self.layout.dp


@dataclass
class Plan:
    world: int
    profile: Profile
    placement: RankPlacement
    ranked: list[Prediction] = field(default_factory=list)  # fits, best first
    unfit: list[Prediction] = field(default_factory=list)
    refused: list[tuple[Keys, str]] = field(default_factory=list)
    needs: Needs = field(default_factory=Needs)
    seconds: float = 0.0

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None


class MemoryModel:
    """The estimator's per-rank peak of a layout, from two cached halves: model states and transient buffers depend
    on the sharding keys only (dp, tp, pp, vpp, ZeRO, offload, precision, buckets), activations on the batch keys
    only (tp, pp, vpp, schedule, micro-batch and their count, recomputation, sequence parallelism). The sum is
    ``estimate(...).worst.peak(policy)`` exactly (tests/test_plan.py), at a fraction of the cost over a whole space."""

    def __init__(self, m: ModelConfig) -> None:
        self.m = m
        self._states: dict[Layout, Estimate] = {}
        self._acts: dict[Layout, Estimate] = {}

    def _get(self, cache: dict[Layout, Estimate], layout: Layout) -> Estimate:
        if layout not in cache:
            cache[layout] = estimate(self.m, layout)
        return cache[layout]

    def peak(self, layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
        """(peak bytes by place, model-state bytes by place) of the most loaded pipeline stage."""
        # zb-v places its chunks in a V (the ranks hold other parameters) and walks its actions for ZeRO-3's blocks.
        v = layout.schedule == "zb-v"
        states = self._get(
            self._states,
            dataclasses.replace(
                layout,
                micro_batch_size=1,
                micro_batches=layout.micro_batches if v else 1,
                activation_checkpointing="none",
                recompute_every=1,
                schedule="zb-v" if v else None,
                sequence_parallel=False,
                document_mask=False,
            ),
        )
        acts = self._get(
            self._acts, dataclasses.replace(layout, dp=1, zero=0, offload="none", offload_ratio=1.0, bucket_mb=25.0)
        )
        policy = layout.recompute
        best: tuple[tuple[int, int], dict[str, int], dict[str, int]] | None = None
        for s, a in zip(states.stages, acts.stages, strict=True):
            # This layout's model states with the activations and backward transients of its batch and schedule.
            peak = dataclasses.replace(
                s, activations=a.activations, recompute=a.recompute, loss_backward=a.loss_backward
            ).peak(policy)
            rank = (peak["device"], peak["host"])
            if best is None or rank > best[0]:
                best = (rank, peak, dict(s.model_states["total"]))
        assert best is not None
        return best[1], best[2]


def placement_for(profile: Profile, world: int, nodes: int | None = None) -> RankPlacement:
    """Where ``world`` ranks go: ``nodes`` nodes (default: as many as the world needs at the profile's devices per
    node; one for a CPU), the same count on each."""
    if nodes is None:
        nodes = 1 if profile.device == "cpu" else max(1, -(-world // profile.units_per_node))
    per_node = -(-world // nodes)
    threads = cpu_threads_per_rank(per_node, profile.units_per_node) if profile.device == "cpu" else 1
    # A calibration's measured sharing holds for the ranks per node it was measured with.
    same = profile.ranks_per_node == per_node
    capacity = profile.shared_capacity if same else 0.0
    sharing = tuple(profile.sharing) if same and profile.device == "cpu" else ()
    return RankPlacement(world, per_node, threads, profile.units_per_node, capacity, sharing)


def fits(peak: dict[str, int], profile: Profile, placement: RankPlacement) -> bool:
    """A GPU's peak within its usable memory; on a CPU every rank of the node within the node's memory."""
    budget = profile.usable_fraction * profile.memory_bytes
    if profile.device == "cpu":
        return (peak["device"] + peak["host"]) * placement.ranks_per_node <= budget
    return peak["device"] <= budget


def _predict(
    layout: Layout,
    variant: Config,
    profile: Profile,
    placement: RankPlacement,
    memory: MemoryModel,
    needs: Needs,
    cache: dict,
    force: bool = False,
) -> Prediction:
    """A layout's memory on the profile's device and, if it fits (or ``force``), its step time."""
    layout = dataclasses.replace(layout, device=profile.device)
    peak, states = memory.peak(layout)
    p = Prediction(layout, variant, peak, states)
    p.fits = fits(peak, profile, placement)
    if not p.fits and not force:
        return p
    p.time = step_time(variant.model, layout, profile, placement, needs, cache)
    tokens = layout.global_batch_size * variant.model.seq_len
    p.tokens_per_s = tokens / p.time.step
    if profile.peak_tflops.get(layout.precision):
        p.mfu = p.tokens_per_s * flops_per_token(variant.model) / (profile.peak(layout.precision) * placement.world)
    return p


def predict(
    cfg: Config, world: int, profile: Profile, nodes: int | None = None, needs: Needs | None = None
) -> Prediction:
    """The prediction of the one layout ``cfg`` asks for (timed even if it does not fit); raises ConfigError if
    the validator refuses it."""
    layout = validate(cfg, world)
    placement = placement_for(profile, world, nodes)
    needs = needs if needs is not None else Needs(precisions={cfg.train.precision})
    return _predict(layout, cfg, profile, placement, MemoryModel(cfg.model), needs, {}, force=True)


def given_keys(overrides: Iterable[str]) -> dict[str, str]:
    """The planned layout keys set by ``overrides``, and their values as written."""
    out = {}
    for o in overrides:
        key, _, value = o.lstrip("+").partition("=")
        if key in PLANNED_KEYS:
            out[key] = value
    return out


def _same(have: object, want: str) -> bool:
    have = override_value(have)
    try:
        return float(have) == float(want)
    except ValueError:
        return have.lower() == want.lower()


def _null(value: str) -> bool:
    return value in ("null", "None", "")


def matches(layout: Layout, given: dict[str, str]) -> bool:
    """Whether the layout has the given keys' values; a null dp or schedule is whatever the launch resolves."""
    mine = layout.keys()
    for key, want in given.items():
        if _null(want) and key == "parallel.dp":
            continue
        if _null(want) and key == "parallel.schedule":
            if layout.schedule in (None, resolve_schedule(None, layout.vpp)):
                continue
            return False
        if not _same(mine[key], "null" if _null(want) else want):
            return False
    return True


def _may_match(keys: Keys, given: dict[str, str]) -> bool:
    """Whether a candidate's keys can name a layout with the given values (dp and a null schedule are resolved by
    the validator: left to ``matches``)."""
    return all(
        key == "parallel.dp" or (_null(want) and key == "parallel.schedule") or _same(keys[key], want)
        for key, want in given.items()
    )


Progress = Callable[[int, int, float], None]  # (candidates examined, of how many, seconds so far)


def plan(
    cfg: Config,
    world: int,
    profile: Profile,
    nodes: int | None = None,
    needs: Needs | None = None,
    progress: Progress | None = None,
    keep: dict[str, str] | None = None,
) -> Plan:
    """Enumerate, estimate, time and rank every layout of ``cfg`` on ``world`` ranks of ``profile``; ``progress``
    is told after each candidate (validated, then estimated and timed if accepted). ``keep`` (planned key -> value
    as written, ``given_keys``) limits the plan to the layouts with those values, as ``parallel.auto`` keeps the
    keys it is given: the others are neither validated nor estimated."""
    start = time.perf_counter()
    placement = placement_for(profile, world, nodes)
    out = Plan(world=world, profile=profile, placement=placement, needs=needs or Needs())
    out.needs.precisions.add(cfg.train.precision)
    # The block a calibration runs whole: a micro-batch of one sequence, as every plan has (tp 1, micro-batch 1).
    out.needs.block = {"model": dataclasses.asdict(cfg.model), "batch": 1, "precision": cfg.train.precision}
    keep = keep or {}
    candidates = [keys for keys in key_sets(cfg, world) if _may_match(keys, keep)]
    cache: dict = {}
    memory = MemoryModel(cfg.model)
    for i, keys in enumerate(candidates, 1):
        verdict = judge(cfg, world, keys)
        if isinstance(verdict, str):
            out.refused.append((keys, verdict))
        elif matches(verdict[0], keep):
            p = _predict(*verdict, profile, placement, memory, out.needs, cache)
            (out.ranked if p.fits else out.unfit).append(p)
        if progress is not None:
            progress(i, len(candidates), time.perf_counter() - start)
    out.ranked.sort(key=lambda p: (-p.tokens_per_s, p.peak["device"] + p.peak["host"]))
    out.seconds = time.perf_counter() - start
    return out
