"""The layout planner: every layout the validator accepts for a model, world and batch, its memory from the
estimator (trident/memory/estimate.py), its step time from the step-time model (trident/plan/cost.py), ranked.

Memory is predicted first, and a layout that does not fit the device is not timed: ``Plan.unfit`` lists it with
its peak. The rest are ranked by predicted tokens per second (ties: less memory first, then the space's order:
shape by shape, each with every variant).

A plan of the ``top`` best (``plan(..., top=k)``: the tool's table, ``parallel.auto``) finds exactly the ranking's
first k without estimating and timing every layout (a large model on many ranks has hundreds of thousands): on a
GPU a layout whose model states alone exceed the device cannot fit (``states_floor``, before any estimate); every
other one gets a lower bound of its step (``cost.step_floor``, one per schedule and recomputation, whatever the
ZeRO stage and offload), and they are timed best bound first until the k-th best step timed is below every bound
left. A layout is estimated only if its step could be among the best: first the mean stage's model states (a
bound) and batch, then the estimator itself. tests/test_plan_search.py checks that this ranks the same first
layouts as estimating and timing every one.

The search is one procedure read top to bottom (space, bounds, estimates, timing, ranking), so it stays whole
past ~400 lines.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from trident.config import Config, ModelConfig, validate
from trident.layout import PLANNED_KEYS, Layout, override_value
from trident.memory.activations import POLICIES
from trident.memory.estimate import Estimate, estimate
from trident.models.gpt import count_params, flops_per_token
from trident.parallel.pipeline.schedules import resolve_schedule
from trident.parallel.precision import precision_policy
from trident.plan.cost import RankPlacement, StepTime, pipeline_floor, step_floor, step_time
from trident.plan.profile import Needs, Profile, cpu_threads_per_rank
from trident.plan.space import Keys, Space


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
    ranked: list[Prediction] = field(default_factory=list)  # fits, best first (with ``top``: the top best)
    unfit: list[Prediction] = field(default_factory=list)  # estimated, and they do not fit
    refused: list[tuple[Keys, str]] = field(default_factory=list)
    needs: Needs = field(default_factory=Needs)
    seconds: float = 0.0
    top: int | None = None  # the plan's ``top``: None when every accepted layout was estimated and timed
    accepted: int | None = None  # layouts the validator accepts (None: those ranked and unfit)
    # Of them, not estimated: a lower bound of their memory exceeds the device (``states_floor``, with the batch's
    # activations for those whose step could reach the top).
    floored: int = 0
    untimed: int = 0  # of them, not estimated: their step's lower bound cannot reach the top (``cost.step_floor``)

    @property
    def examined(self) -> int:
        """The accepted layouts."""
        return self.accepted if self.accepted is not None else len(self.ranked) + len(self.unfit)

    @property
    def do_not_fit(self) -> int:
        """The accepted layouts known not to fit: estimated, or by a lower bound of their memory."""
        return len(self.unfit) + self.floored

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None


class MemoryModel:
    """The estimator's per-rank peak of a layout, from two cached halves: model states and transient buffers depend
    on the sharding keys only (dp, tp, pp, vpp, ZeRO, offload, precision, buckets), activations on the batch keys
    only (tp, pp, vpp, schedule, micro-batch and their count, recomputation, sequence parallelism). The sum is
    ``estimate(...).worst.peak(policy)`` exactly (tests/test_plan.py), at a fraction of the cost over a whole space.
    The estimator reports every recomputation policy's activations (trident/memory/activations.py ``POLICIES``), so
    the layouts differing in those alone share one estimate too."""

    def __init__(self, m: ModelConfig) -> None:
        self.m = m
        self._states: dict[Layout, Estimate] = {}
        self._acts: dict[Layout, Estimate] = {}

    def _get(self, cache: dict[Layout, Estimate], layout: Layout) -> Estimate:
        if layout not in cache:
            cache[layout] = estimate(self.m, layout)
        return cache[layout]

    def _batch(self, layout: Layout) -> Estimate:
        """The activations half of ``layout``'s estimate."""
        batch = dataclasses.replace(layout, dp=1, zero=0, offload="none", offload_ratio=1.0, bucket_mb=25.0)
        if layout.recompute in POLICIES:  # every such policy's activations come out of one estimate
            batch = dataclasses.replace(batch, activation_checkpointing="none", recompute_every=1)
        return self._get(self._acts, batch)

    def activations_mean(self, layout: Layout) -> float:
        """The mean over the pipeline stages of what a GPU layout's batch adds to a rank's device memory at its peak
        (activations and backward's transients): with a lower bound of the model states' mean, one of the peak."""
        acts, policy = self._batch(layout), layout.recompute
        return sum(a.activations[policy] + a.backward_transient(policy) for a in acts.stages) / len(acts.stages)

    def peak(self, layout: Layout) -> tuple[dict[str, int], dict[str, int]]:
        """(peak bytes by place, model-state bytes by place) of the most loaded pipeline stage."""
        # zb-v places its chunks in a V (the ranks hold other parameters) and walks its actions for ZeRO-3's blocks.
        # How cp exchanges keys and values is no part of what a rank keeps.
        v = layout.schedule == "zb-v"
        states = self._get(
            self._states,
            dataclasses.replace(
                layout,
                cp_comm=Layout.cp_comm,
                micro_batch_size=1,
                micro_batches=layout.micro_batches if v and layout.zero == 3 else 1,
                activation_checkpointing="none",
                recompute_every=1,
                schedule="zb-v" if v else None,
                sequence_parallel=False,
                document_mask=False,
            ),
        )
        acts = self._batch(layout)
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


def states_floor(m: ModelConfig, layout: Layout) -> float:
    """A lower bound of the device bytes the estimator gives the model states of the most loaded stage of a GPU
    layout (trident/memory/states.py): the parameters (every one's elements split over tp at most, experts over
    ep x tp, the stages at least their mean) in the parameters' dtype, their fp32 gradients, and the fp32 master
    copy (16-bit parameters) and Adam's two moments of the part of the rank's shard kept on the device, each
    sharded over dp x cp where the ZeRO stage shards it. A thousandth and a MiB below that figure (the shards'
    rounding, padding left out)."""
    return _states_floor(
        count_params(m), layout.precision, layout.tp * layout.pp * layout.ep, layout.grad_ranks, layout.zero,
        layout.offloaded_fraction,
    )  # fmt: skip


def _states_floor(params: int, precision: str, split: int, grad_ranks: int, zero: int, offloaded: float) -> float:
    pb = precision_policy(precision).param_dtype.itemsize
    per_stage = params / split
    shard = per_stage / (grad_ranks if zero >= 1 else 1)
    weights = pb * (shard if zero == 3 else per_stage)
    grads = 4 * (shard if zero >= 2 else per_stage)
    optimizer = (1 - offloaded) * shard * (8 + (4 if pb != 4 else 0))
    return max(0.0, 0.999 * (weights + grads + optimizer) - 2**20)


def _predict(
    layout: Layout,
    variant: Config,
    profile: Profile,
    placement: RankPlacement,
    memory: MemoryModel,
    needs: Needs,
    cache: dict,
    force: bool = False,
    timed: StepTime | None = None,
) -> Prediction:
    """A layout's memory on the profile's device and, if it fits (or ``force``), its step time (``timed``, if
    already known)."""
    layout = dataclasses.replace(layout, device=profile.device)
    peak, states = memory.peak(layout)
    p = Prediction(layout, variant, peak, states)
    p.fits = fits(peak, profile, placement)
    if not p.fits and not force:
        return p
    p.time = timed if timed is not None else step_time(variant.model, layout, profile, placement, needs, cache)
    if variant.train.replay_every:  # every N-th step's passes run twice (trident/replay.py)
        again = (p.time.step - p.time.optimizer) / variant.train.replay_every
        p.time = dataclasses.replace(p.time, step=p.time.step + again)
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
    """Whether a candidate's keys (or a part of them: a shape's, a variant's) can name a layout with the given values
    (dp and a null schedule are resolved by the validator: left to ``matches``)."""
    return all(
        key == "parallel.dp"
        or key not in keys
        or (_null(want) and key == "parallel.schedule")
        or _same(keys[key], want)
        for key, want in given.items()
    )


Progress = Callable[[int, int, float], None]  # (candidates settled, of how many, seconds so far)


def plan(
    cfg: Config,
    world: int,
    profile: Profile,
    nodes: int | None = None,
    needs: Needs | None = None,
    progress: Progress | None = None,
    keep: dict[str, str] | None = None,
    top: int | None = None,
) -> Plan:
    """Enumerate, estimate, time and rank every layout of ``cfg`` on ``world`` ranks of ``profile``; ``progress``
    is told as candidates are settled (refused, estimated and timed if they fit, or left by a bound). ``keep``
    (planned key -> value as written, ``given_keys``) limits the plan to the layouts with those values, as
    ``parallel.auto`` keeps the keys it is given: the others are neither validated nor estimated. ``top``: rank
    only the ``top`` best, exactly those the whole ranking starts with, estimating and timing no more layouts than
    that needs (module docstring); None: every accepted layout."""
    start = time.perf_counter()
    placement = placement_for(profile, world, nodes)
    out = Plan(world=world, profile=profile, placement=placement, needs=needs or Needs(), top=top)
    out.needs.precisions.add(cfg.train.precision)
    # The block a calibration runs whole: a micro-batch of one sequence, as every plan has (tp 1, micro-batch 1).
    out.needs.block = {"model": dataclasses.asdict(cfg.model), "batch": 1, "precision": cfg.train.precision}
    keep = keep or {}
    space = Space(cfg, world, lambda keys: _may_match(keys, keep))
    shape_keys = {k: v for k, v in keep.items() if k not in space.variant_keys}
    variant_keys = {k: v for k, v in keep.items() if k in space.variant_keys}
    # A candidate has the kept values when its shape's layout has the shape's and its variant's layout the variant's.
    variant_ok = [
        space.reference is not None and space.readable(j) and matches(space.verdict(space.reference, j), variant_keys)
        for j in range(len(space.variants))
    ]
    total = len(space.shapes) * len(space.variants)
    done = 0
    candidates: list[tuple[int, int]] = []  # (shape, variant): accepted with the kept values
    for i, base in enumerate(space.bases):
        shape_ok = isinstance(base, Layout) and matches(base, shape_keys)
        for j in range(len(space.variants)):
            if isinstance(base, str) and space.readable(j):
                out.refused.append((space.keys(i, j), base))
                continue
            if isinstance(base, Layout) and space.readable(j):
                if variant_ok[j] and shape_ok:
                    candidates.append((i, j))
                continue
            verdict = space.verdict(i, j)  # read off neither part: the validator's own verdict
            if isinstance(verdict, str):
                out.refused.append((space.keys(i, j), verdict))
            elif matches(verdict, keep):
                candidates.append((i, j))
    done = total - len(candidates)
    out.accepted = len(candidates)
    if progress is not None and candidates:
        progress(done, total, time.perf_counter() - start)

    cache: dict = {}
    memory = MemoryModel(cfg.model)

    def predicted(i: int, j: int, timed: StepTime | None = None) -> Prediction:
        layout = space.verdict(i, j)
        assert isinstance(layout, Layout)
        return _predict(layout, layout.apply(cfg), profile, placement, memory, out.needs, cache, timed=timed)

    ranked: list[tuple[float, int, tuple[int, int], Prediction]] = []
    if top is None:  # every candidate, in the enumeration's order
        for n, (i, j) in enumerate(candidates, 1):
            p = predicted(i, j)
            (ranked.append((-p.tokens_per_s, sum(p.peak.values()), (i, j), p)) if p.fits else out.unfit.append(p))
            if progress is not None:
                progress(done + n, total, time.perf_counter() - start)
    else:
        found = (space, candidates, profile, placement, top, predicted, memory, out, cache, progress, start)
        ranked = _search(cfg, *found)
        done = total
    ranked.sort(key=lambda r: r[:3])  # tokens/s (every layout's step has the same tokens), memory, enumeration
    out.ranked = [r[3] for r in ranked[:top]]
    if progress is not None and top is not None:
        progress(total, total, time.perf_counter() - start)
    out.seconds = time.perf_counter() - start
    return out


def _search(
    cfg: Config,
    space: Space,
    candidates: list[tuple[int, int]],
    profile: Profile,
    placement: RankPlacement,
    top: int,
    predicted: Callable[..., Prediction],
    memory: MemoryModel,
    out: Plan,
    cache: dict,
    progress: Progress | None,
    start: float,
) -> list[tuple[float, int, tuple[int, int], Prediction]]:
    """The ``top`` best of ``candidates`` and every one that ties with them, by bounds (module docstring)."""
    m = cfg.model
    floors: dict = {}  # step_floor's priced chunks
    budget = profile.usable_fraction * profile.memory_bytes
    params = count_params(m)
    # What a variant sets of the model states (the same on every shape: ``Space``).
    states = {}
    for j in {j for _, j in candidates}:
        v = space.verdict(space.reference, j) if space.reference is not None else None
        states[j] = (v.zero, v.offloaded_fraction) if isinstance(v, Layout) else None

    def floors_of(i: int, j: int) -> float | None:
        """``states_floor`` of candidate (i, j) on a GPU (None on a CPU, where the bound is not used)."""
        base = space.bases[i]
        if profile.device == "cpu" or not isinstance(base, Layout) or states[j] is None:
            return None
        return _states_floor(params, base.precision, base.tp * base.pp * base.ep, base.grad_ranks, *states[j])

    # Candidates sharing a shape and a recomputation share a schedule walk and its bound.
    groups: dict[tuple[int, object], list[int]] = {}
    for i, j in candidates:
        floor = floors_of(i, j)
        if floor is not None and floor > budget:
            out.floored += 1
            continue
        groups.setdefault((i, space.recompute_of(j)), []).append(j)
    bounds = []
    for (i, _), js in groups.items():
        layout = space.verdict(i, js[0])
        assert isinstance(layout, Layout)
        layout = dataclasses.replace(layout, device=profile.device)
        bounds.append((step_floor(m, layout, profile, placement, floors), i, js))
    bounds.sort(key=lambda b: (b[0], b[1]))
    settled = len(space.shapes) * len(space.variants) - len(candidates) + out.floored
    best: list[float] = []  # the ``top`` smallest steps timed, negated (a max-heap)
    ranked: list[tuple[float, int, tuple[int, int], Prediction]] = []

    def behind(step: float) -> bool:
        """Whether a step (or a lower bound of it) is behind the ``top`` best timed: it cannot be among them."""
        return len(best) >= top and step > -best[0] * (1 + 1e-9)

    for n, (bound, i, js) in enumerate(bounds):
        # Every step left is at least its bound: once the top-th best is below them all, the ranking's top is known.
        if behind(bound):
            out.untimed += sum(len(b[2]) for b in bounds[n:])
            break
        # The group's simulated schedule, a bound of each of its steps: a walk behind the best needs no variant timed.
        first = dataclasses.replace(space.verdict(i, js[0]), device=profile.device)  # type: ignore[arg-type]
        if behind(pipeline_floor(m, first, profile, placement, out.needs, cache)):
            out.untimed += len(js)
            settled += len(js)
            continue
        for j in js:
            settled += 1
            # Timed first (its schedule walk is its group's): a step behind the best needs no estimate.
            layout = space.verdict(i, j)
            assert isinstance(layout, Layout)
            layout = dataclasses.replace(layout, device=profile.device)
            timed = step_time(m, layout, profile, placement, out.needs, cache)
            if behind(timed.step):
                out.untimed += 1
                continue
            if floors_of(i, j) is not None and floors_of(i, j) + memory.activations_mean(layout) > budget:
                out.floored += 1  # the mean stage's model states (a bound) and batch exceed the device already
                continue
            p = predicted(i, j, timed)
            if not p.fits:
                out.unfit.append(p)
                continue
            ranked.append((-p.tokens_per_s, sum(p.peak.values()), (i, j), p))
            heapq.heappush(best, -timed.step)
            if len(best) > top:
                heapq.heappop(best)
        if progress is not None:
            progress(settled, len(space.shapes) * len(space.variants), time.perf_counter() - start)
    return ranked
