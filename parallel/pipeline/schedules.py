"""Pipeline schedules as data: for each pipeline rank, the ordered list of actions it runs in one step.

An ``Action`` is a kind, a micro-batch and a model chunk. Kinds: ``F`` forward, ``B`` full backward, and for the
zero-bubble schedules ``I`` (backward for the chunk's input only) and ``W`` (backward for its weights). With P
pipeline ranks and V chunks per rank there are S = P * V virtual stages, placed by the schedule (``stage_placement``):

    loop   chunk c of rank r is stage c * P + r: a micro-batch goes rank 0, 1, ..., P-1, then back to rank 0 for
           chunk 1, and so on (every schedule but zb-v)
    v      V = 2, chunk 0 of rank r is stage r and chunk 1 stage 2P - 1 - r: down the ranks and back up, so rank 0
           holds the first and the last stage (zb-v; torch.distributed.pipelining's "v" style)

Every function that turns a chunk into a stage takes the placement (``stage_of``, ``holder_of``).

Nothing here touches a process group: every rank can compute every rank's list (the executor uses that to
post its receives in the order its peers send), an action is written like ``"1F0"`` (torch.distributed.pipelining's
form: virtual stage 1, forward, micro-batch 0; trident_dev/schedule_theory.py prints a schedule as a step x rank grid
of them and parses it back), and a schedule is simulated with unit costs to find deadlocks and measure the bubble.

Bubble (idle time over busy time on each rank, F and B of a chunk costing f and b, b = i + w):

    gpipe, 1f1b     (P - 1) / M
    interleaved     (P - 1) / (V * M)                     for M >= P (any M, not only multiples of P);
                    (P - 1 + (V - 1) * (P - M)) / (V * M)   for M < P (chunk 1 waits for the lap to come round)
    zb-h1           (P - 1) * (f + i - w) / (M * (f + i + w))   for M >= P: a third of 1f1b's when f = i = w;
                    ((P - 1) * (f + i) - (M - 1) * w) / (M * (f + i + w))   for M < P
    zb-v            (P - 1) / (6 M)   for M >= 2P - 1 and f = i = w (half of zb-h1's; f, i, w a half-stage chunk's);
                    for M <= P zb-h1's, in between below it (the simulator's, tests/test_pipeline_schedules.py)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

F, B, I, W = "F", "B", "I", "W"  # noqa: E741 (I is the zero-bubble paper's name for the input backward)
KINDS = (F, B, I, W)
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
# The schedules whose backward is two passes, input gradients (I) then weights (W), the graph retained between them.
SPLIT_BACKWARD = ("zb-h1", "zb-v")
LOOP, V = "loop", "v"
PLACEMENTS = (LOOP, V)


class Action(NamedTuple):
    kind: str
    micro: int
    chunk: int = 0


Schedule = list[list[Action]]  # rank -> its actions in order


def stage_placement(schedule: str | None) -> str:
    """How ``schedule`` places its virtual stages on the ranks (module docstring): zb-v in a V, the others in loops."""
    return V if schedule == "zb-v" else LOOP


def stage_of(chunk: int, rank: int, pp: int, placement: str = LOOP) -> int:
    """The virtual stage of ``chunk`` on pipeline rank ``rank`` under ``placement``."""
    if placement == V:
        if chunk not in (0, 1):
            raise ValueError(f"the V placement has two chunks per rank, not chunk {chunk}")
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def holder_of(stage: int, pp: int, placement: str = LOOP) -> tuple[int, int]:
    """The (pipeline rank, chunk) that holds virtual stage ``stage`` under ``placement`` (``stage_of`` inverted)."""
    if placement == V:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def makes_weight_grads(action: Action, rank: int, pp: int, placement: str = LOOP) -> bool:
    """Whether ``action`` on pipeline rank ``rank`` produces weight gradients of its chunk: B, W, or I on stage 0,
    where I is the whole backward (token ids in, no input gradient) and W has nothing left. A chunk's last such
    action is where its gradients are complete (the executor starts their dp reduction there)."""
    return action.kind in (B, W) or (action.kind == I and stage_of(action.chunk, rank, pp, placement) == 0)


def activation_peak(
    actions: Sequence[Action],
    rank: int,
    pp: int,
    size: Callable[[int], int] = lambda _: 1,
    placement: str = LOOP,
    kept: Callable[[int], int] | None = None,
) -> int:
    """The most a pipeline rank holds for backward at once, walking its ``actions``: each forward takes
    ``size(chunk)`` (default: one activation set, a micro-batch x model chunk) until its B, its I on stage 0 (the
    whole backward there), else its W; with ``kept``, what a deferred I keeps for W (parallel/wgrad.py) from I to W
    instead. The executor keeps its tensors that long (parallel/pipeline/executor.py); the estimator walks the same."""
    held = peak = 0
    for a in actions:
        first = stage_of(a.chunk, rank, pp, placement) == 0
        if a.kind == F:
            held += size(a.chunk)
        elif a.kind == B or (a.kind == I and first):
            held -= size(a.chunk)
        elif a.kind == I and kept is not None:
            held += kept(a.chunk) - size(a.chunk)
        elif a.kind == W and not first:
            held -= size(a.chunk) if kept is None else kept(a.chunk)
        peak = max(peak, held)
    return peak


def gpipe(pp: int, micro: int) -> Schedule:
    """Every forward, then every backward: M micro-batches of activations in flight on every rank."""
    return [[Action(F, m) for m in range(micro)] + [Action(B, m) for m in range(micro)] for _ in range(pp)]


def one_f_one_b(pp: int, micro: int) -> Schedule:
    """PipeDream-flush: rank r runs P - 1 - r forwards, then alternates one forward and one backward, then
    drains the backwards. At most P - r micro-batches are in flight on rank r."""
    out = []
    for r in range(pp):
        warmup = min(pp - 1 - r, micro)
        ops = [Action(F, m) for m in range(warmup)]
        for k in range(micro - warmup):
            ops += [Action(F, warmup + k), Action(B, k)]
        ops += [Action(B, m) for m in range(micro - warmup, micro)]
        out.append(ops)
    return out


def interleaved_rounds(pp: int, micro: int) -> list[int]:
    """Micro-batches per round of the interleaved schedule: ``max(1, M // P)`` rounds as even as can be
    (torch's flexible interleaved 1F1B asks for equal rounds; uneven ones simulate deadlock-free too)."""
    rounds = max(1, micro // pp)
    return [micro // rounds + (1 if i < micro % rounds else 0) for i in range(rounds)]


def interleaved(pp: int, vpp: int, micro: int) -> Schedule:
    """Megatron's interleaved 1F1B over V chunks per rank.

    Micro-batches go in rounds (``interleaved_rounds``): a rank runs the forwards of a round's micro-batches
    through chunk 0, then chunk 1, ..., and the backwards likewise with the chunks reversed. Rank r warms up with
    (V - 1) * (first round) + 2 * (P - 1 - r) forwards, then alternates one forward and one backward.
    Megatron needs M % P == 0; rounds of at least P micro-batches take any M >= P, and M < P is one round.
    """
    rounds = interleaved_rounds(pp, micro)
    spans = [range(sum(rounds[:i]), sum(rounds[: i + 1])) for i in range(len(rounds))]
    fwd = [Action(F, m, c) for micros in spans for c in range(vpp) for m in micros]
    bwd = [Action(B, m, c) for micros in spans for c in reversed(range(vpp)) for m in micros]
    total = len(fwd)
    out = []
    for r in range(pp):
        warmup = min((vpp - 1) * rounds[0] + 2 * (pp - 1 - r), total)
        ops = fwd[:warmup]
        for k in range(total - warmup):
            ops += [fwd[warmup + k], bwd[k]]
        ops += bwd[total - warmup :]
        out.append(ops)
    return out


def zb_h1(pp: int, micro: int) -> Schedule:
    """Zero-bubble H1 (Qi et al. 2023): 1F1B with each backward split into I (input gradient, on the critical
    path to the rank upstream) and W (weight gradient, which nothing waits for). Rank r delays its W by r
    steps, so the W passes fill what would have been the cool-down bubble; in-flight activations as 1F1B."""
    out = []
    for r in range(pp):
        warmup = min(pp - 1 - r, micro)
        ops = [Action(F, m) for m in range(warmup)]
        done_w = 0
        for k in range(micro):
            if warmup + k < micro:
                ops.append(Action(F, warmup + k))
            ops.append(Action(I, k))
            if k >= r:
                ops.append(Action(W, done_w))
                done_w += 1
        ops += [Action(W, m) for m in range(done_w, micro)]
        out.append(ops)
    return out


def zb_v(pp: int, micro: int) -> Schedule:
    """Zero-bubble V (Qi et al. 2023, section 6; torch.distributed.pipelining's ``ScheduleZBVZeroBubble``, action for
    action): two chunks per rank in the V placement, each backward split into I and W. Rank r warms up with
    2(P - r) - 1 forwards of chunk 0, then r pairs of chunk-1 and chunk-0 forwards, then P - r rounds of a chunk-1
    F, I, W; the steady state alternates F, I, W of chunk 0 and of chunk 1; the cool-down runs the remaining I
    passes first and the W passes after them, filling the bubble. Built for max(M, 2P - 1) micro-batches and the
    extra ones dropped (as torch does), so any M runs. A chunk holds half a 1F1B stage's layers, and a rank's peak
    is about 2P such half sets, P whole ones: 1F1B's peak (its rank 0's), on every rank."""
    n = max(2 * pp - 1, micro)
    return [[a for a in _zb_v_rank(pp, n, r) if a.micro < micro] for r in range(pp)]


def _zb_v_rank(pp: int, n: int, r: int) -> list[Action]:
    """Rank r's zb-v actions over ``n`` >= 2P - 1 micro-batches (``zb_v``)."""
    ops: list[Action] = []
    f, i = [0, 0], [0, 0]  # forwards and input backwards run, per chunk

    def run(kind: str, chunk: int, count: list[int]) -> None:
        ops.append(Action(kind, count[chunk], chunk))
        count[chunk] += 1

    for _ in range(2 * (pp - r) - 1):
        run(F, 0, f)
    for _ in range(r):
        run(F, 1, f)
        run(F, 0, f)
    for _ in range(pp - r):
        run(F, 1, f)
        ops.append(Action(I, i[1], 1))
        run(W, 1, i)
    while f[1] < f[0] or f[0] < n:
        if f[0] < n:
            run(F, 0, f)
        ops.append(Action(I, i[0], 0))
        run(W, 0, i)
        run(F, 1, f)
        ops.append(Action(I, i[1], 1))
        run(W, 1, i)
    w = list(i)  # the weight backwards run, per chunk
    for _ in range(r):
        run(I, 0, i)
        run(I, 1, i)
    for _ in range(pp - r):
        run(I, 0, i)
        run(W, 0, w)
    ops += [Action(W, m, 1) for m in range(w[1], i[1])]
    ops += [Action(W, m, 0) for m in range(w[0], i[0])]
    return ops


def resolve_schedule(name: str | None, vpp: int) -> str:
    """The schedule a pipeline runs: the one named, else interleaved over several chunks per rank, else 1F1B."""
    return name or ("interleaved" if vpp > 1 else "1f1b")


def schedule_error(name: str, pp: int, vpp: int, micro: int) -> str | None:
    """Why schedule ``name`` cannot run P ranks x V chunks over M micro-batches, or None if it can."""
    if name not in SCHEDULES:
        return f"unknown pipeline schedule {name!r}; use one of {', '.join(SCHEDULES)}"
    if pp < 1 or vpp < 1 or micro < 1:
        return f"pp={pp}, vpp={vpp} and the micro-batch count {micro} must be >= 1"
    if name == "interleaved" and vpp < 2:
        return "the interleaved schedule needs vpp > 1 model chunks per pipeline rank"
    if name == "zb-v" and vpp != 2:
        return f"the zb-v schedule runs two model chunks per rank in a V (vpp=2), got vpp={vpp}"
    if name not in ("interleaved", "zb-v") and vpp != 1:
        return f"the {name} schedule runs one model chunk per rank (vpp=1), got vpp={vpp}"
    return None


def build_schedule(name: str, pp: int, vpp: int, micro: int) -> Schedule:
    """Every rank's action list of schedule ``name``."""
    if error := schedule_error(name, pp, vpp, micro):
        raise ValueError(error)
    if name == "gpipe":
        return gpipe(pp, micro)
    if name == "1f1b":
        return one_f_one_b(pp, micro)
    if name == "interleaved":
        return interleaved(pp, vpp, micro)
    if name == "zb-v":
        return zb_v(pp, micro)
    return zb_h1(pp, micro)


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of a schedule, in its order (evaluation): dropping actions never adds a dependency."""
    return [[a for a in ops if a.kind == F] for ops in schedule]


# -- strings: torch.distributed.pipelining's "<stage><kind><micro>" ----------------------------------------------


def format_action(action: Action, rank: int, pp: int, placement: str = LOOP) -> str:
    return f"{stage_of(action.chunk, rank, pp, placement)}{action.kind}{action.micro}"


# -- simulation ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    rank: int
    action: Action
    start: float
    end: float


class DeadlockError(RuntimeError):
    pass


UNIT_COSTS: Mapping[str, float] = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


def dependencies(action: Action, rank: int, pp: int, vpp: int, placement: str = LOOP) -> list[tuple[int, Action]]:
    """The (rank, action) pairs ``action`` waits for on other ranks or earlier on its own.

    F of stage s needs F of stage s-1; B or I of stage s needs the input-gradient pass (B or I) of stage s+1
    (both kinds are looked for: a schedule uses one of them) and its own F; W needs its own I."""
    s, last = stage_of(action.chunk, rank, pp, placement), pp * vpp - 1
    m = action.micro
    if action.kind == F:
        if s == 0:
            return []
        down, chunk = holder_of(s - 1, pp, placement)
        return [(down, Action(F, m, chunk))]
    if action.kind == W:
        return [(rank, Action(I, m, action.chunk))]
    deps = [(rank, Action(F, m, action.chunk))]
    if s < last:
        up, chunk = holder_of(s + 1, pp, placement)
        deps += [(up, Action(B, m, chunk)), (up, Action(I, m, chunk))]
    return deps


def waits_for(schedule: Schedule, vpp: int = 1, placement: str = LOOP) -> list[list[list[tuple[int, Action]]]]:
    """Per rank and action, the (rank, action) pairs of ``dependencies`` that the schedule has."""
    pp = len(schedule)
    exists = {(r, a) for r, ops in enumerate(schedule) for a in ops}
    return [
        [[d for d in dependencies(a, r, pp, vpp, placement) if d in exists] for a in ops]
        for r, ops in enumerate(schedule)
    ]


def list_schedule(
    schedule: Schedule,
    deps: Sequence[Sequence[Sequence[tuple[int, Action]]]],
    cost: Callable[[int, Action], float],
    transfer: Callable[[int, Action], float] = lambda rank, action: 0.0,
    placement: str = LOOP,
) -> list[Span]:
    """Run every rank's list in order, each action as soon as its rank is free and what it needs (``deps``, from
    ``waits_for``) is done, a result of another rank arriving ``transfer(rank, action)`` after it ends (sends are
    buffered: a sender never waits for its receiver); ``cost(rank, action)`` is its duration. Raises
    ``DeadlockError`` naming what each stuck rank waits for."""
    pp = len(schedule)
    done: dict[tuple[int, Action], float] = {}
    pos, clock = [0] * pp, [0.0] * pp
    spans: list[Span] = []
    progress = True
    while progress:
        progress = False
        for r, ops in enumerate(schedule):
            while pos[r] < len(ops):
                a, needs = ops[pos[r]], deps[r][pos[r]]
                if any(d not in done for d in needs):
                    break
                start = clock[r]
                for d in needs:
                    start = max(start, done[d] + (transfer(*d) if d[0] != r else 0.0))
                clock[r] = start + cost(r, a)
                done[(r, a)] = clock[r]
                spans.append(Span(r, a, start, clock[r]))
                pos[r] += 1
                progress = True
    stuck = [r for r in range(pp) if pos[r] < len(schedule[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at {format_action(schedule[r][pos[r]], r, pp, placement)}" for r in stuck)
        raise DeadlockError(f"the schedule deadlocks: {waits}")
    return spans


def simulate(
    schedule: Schedule, vpp: int = 1, costs: Mapping[str, float] = UNIT_COSTS, placement: str = LOOP
) -> list[Span]:
    """``list_schedule`` with a cost per action kind and no transfer time."""
    deps = waits_for(schedule, vpp, placement)
    return list_schedule(schedule, deps, lambda rank, action: costs[action.kind], placement=placement)
