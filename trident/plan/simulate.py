"""A pipeline step with real per-action costs: the schedule's own action lists (parallel/pipeline/schedules.py) run
as a discrete-event simulation.

Each action of rank r has a compute part and a communication part (tensor parallelism's collectives inside it),
in seconds as if its rank had its compute to itself; a message to the next (or previous) stage arrives
``transfer`` seconds after the action that sends it ends. An action starts when its rank is free and what it
needs has arrived, runs its compute, then its communication.

Ranks that share compute share it: ``speed(k)`` is the rate each of ``k`` pipeline ranks computing at once gets (a
CPU whose cores every rank of the node shares: more ranks busy, each slower; while a rank waits in the bubble the
others run faster). On GPUs each rank has its own device and the speed is always 1, and the simulation is the list
scheduling of ``schedules.simulate`` with these costs; under unit costs it gives the schedules' bubble formulas.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from trident.parallel.pipeline.schedules import (
    LOOP,
    Action,
    DeadlockError,
    Schedule,
    build_schedule,
    format_action,
    list_schedule,
    stage_placement,
    waits_for,
)

Cost = Callable[[int, Action], tuple[float, float]]  # (rank, action) -> (compute seconds, communication seconds)


@dataclass(frozen=True)
class TimedSpan:
    rank: int
    action: Action
    start: float
    compute_end: float  # compute done, its collectives start
    end: float


def full_speed(active: int) -> float:
    return 1.0


@lru_cache(maxsize=256)
def structure(name: str, pp: int, vpp: int, micro: int) -> tuple[Schedule, list]:
    """Schedule ``name``'s action lists and, per action, what it waits for (dependencies that exist)."""
    schedule = build_schedule(name, pp, vpp, micro)
    return schedule, waits_for(schedule, vpp, stage_placement(name))


@lru_cache(maxsize=256)
def messages(name: str, pp: int, vpp: int, micro: int) -> dict[tuple[int, Action], int]:
    """Per (rank, action) of schedule ``name``: the point-to-point messages it sends or receives (what it waits for
    from another rank, and what another rank waits for from it)."""
    schedule, deps = structure(name, pp, vpp, micro)
    out: dict[tuple[int, Action], int] = {}
    for r, actions in enumerate(schedule):
        for a, needs in zip(actions, deps[r], strict=True):
            for d in needs:
                if d[0] != r:
                    out[(r, a)] = out.get((r, a), 0) + 1
                    out[d] = out.get(d, 0) + 1
    return out


def run_schedule(
    name: str,
    pp: int,
    vpp: int,
    micro: int,
    cost: Cost,
    transfer: Callable[[int, Action], float] = lambda r, a: 0.0,
    speed: Callable[[int], float] | None = None,
) -> list[TimedSpan]:
    """``run`` of schedule ``name`` for P ranks, V chunks and M micro-batches (its structure built once)."""
    schedule, deps = structure(name, pp, vpp, micro)
    return run_actions(schedule, vpp, cost, transfer, speed or full_speed, deps, stage_placement(name))


def run_actions(
    schedule: Schedule,
    vpp: int,
    cost: Cost,
    transfer: Callable[[int, Action], float] = lambda r, a: 0.0,
    speed: Callable[[int], float] = full_speed,
    deps: Sequence[Sequence[Sequence[tuple[int, Action]]]] | None = None,
    placement: str = LOOP,
) -> list[TimedSpan]:
    """Every action's span. ``deps``: ``schedules.waits_for(schedule, vpp, placement)``, if already built
    (``placement``: how the schedule places its chunks, ``schedules.stage_placement``). Raises ``DeadlockError`` if
    the lists cannot all finish."""
    pp = len(schedule)
    deps = deps if deps is not None else waits_for(schedule, vpp, placement)
    if speed is full_speed:  # every rank computes alone: the schedules' list scheduling, compute then communication
        spans = list_schedule(schedule, deps, lambda r, a: sum(cost(r, a)), transfer, placement)
        return [TimedSpan(s.rank, s.action, s.start, s.start + cost(s.rank, s.action)[0], s.end) for s in spans]
    done: dict[tuple[int, Action], float] = {}
    pos = [0] * pp
    now = 0.0
    # Rank state: None (idle), ("compute", remaining work, start, action), ("comm", end, start, compute_end, action)
    state: list[tuple | None] = [None] * pp
    spans: list[TimedSpan] = []

    def ready_at(r: int) -> float | None:
        """When rank r's next action may start (None: something it needs is not done yet)."""
        t = now
        for d in deps[r][pos[r]]:
            if d not in done:
                return None
            t = max(t, done[d] + (transfer(d[0], d[1]) if d[0] != r else 0.0))
        return t

    wake: list[float] = []
    while True:
        # Start what can start now.
        for r in range(pp):
            if state[r] is None and pos[r] < len(schedule[r]):
                t = ready_at(r)
                if t is None:
                    continue
                if t > now + 1e-15:
                    heapq.heappush(wake, t)
                    continue
                a = schedule[r][pos[r]]
                work, comm = cost(r, a)
                state[r] = ("compute", work, now, a, comm)
        computing = [r for r in range(pp) if state[r] is not None and state[r][0] == "compute"]
        rate = speed(len(computing)) if computing else 1.0
        # The next event: a compute or a communication ending, or a message arriving.
        events = [now + state[r][1] / rate for r in computing]
        events += [state[r][1] for r in range(pp) if state[r] is not None and state[r][0] == "comm"]
        while wake and wake[0] <= now + 1e-15:
            heapq.heappop(wake)
        if wake:
            events.append(wake[0])
        if not events:
            break
        nxt = min(events)
        for r in computing:
            _, work, start, a, comm = state[r]
            left = work - (nxt - now) * rate
            if left <= 1e-12 * max(1.0, work):
                state[r] = ("comm", nxt + comm, start, nxt, a)
            else:
                state[r] = ("compute", left, start, a, comm)
        now = nxt
        for r in range(pp):
            s = state[r]
            if s is not None and s[0] == "comm" and s[1] <= now + 1e-15:
                _, end, start, compute_end, a = s
                spans.append(TimedSpan(r, a, start, compute_end, end))
                done[(r, a)] = end
                state[r] = None
                pos[r] += 1
    stuck = [r for r in range(pp) if pos[r] < len(schedule[r])]
    if stuck:
        waits = "; ".join(f"rank {r} at {format_action(schedule[r][pos[r]], r, pp, placement)}" for r in stuck)
        raise DeadlockError(f"the schedule deadlocks: {waits}")
    return spans


def rank_ends(spans: Sequence[TimedSpan], pp: int) -> list[float]:
    """When each rank's last action ends."""
    ends = [0.0] * pp
    for s in spans:
        ends[s.rank] = max(ends[s.rank], s.end)
    return ends


def bubble(spans: Sequence[TimedSpan], pp: int) -> float:
    """The fraction of the pipeline's rank-time spent idle between the step's start and its last action's end."""
    end = max(s.end for s in spans)
    busy = sum(s.end - s.start for s in spans)
    return (pp * end - busy) / (pp * end)
