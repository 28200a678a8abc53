"""The point-to-point messages of a schedule, and the batches in which the executor posts them.

A message is named by what it carries: ``("act", micro, stage)`` is the input activation of ``stage`` (sent by
stage - 1 after its F), ``("grad", micro, stage)`` the gradient of ``stage``'s output (sent by stage + 1 after its
B or I). Each has one sender and one receiver, and every rank can work out every rank's messages, since
schedules are data. Where the two stages are on one rank (the V placement's turn: stages P - 1 and P on rank
P - 1) the message is local: the executor hands the tensor over, and no batch carries it.

The executor walks a common clock (torch.distributed.pipelining does the same): the schedule simulated with
every action costing one step gives each action a time step at which its inputs were sent at earlier steps.
After step t every rank posts one batch: the sends of its own action at t and the receives of what its
neighbours send at t. Both ends of every message are so in the batch of the same step, and each pair's
receives are posted in the order of its sends (NCCL matches same-shaped messages by order alone).
tests/test_pipeline_schedules.py runs those batches the way NCCL does (``check_rendezvous``: each rank's batches in
order on one stream; a batch completes once the batch holding the other end of each of its messages has started; an
action waits for the batch that received its input) and reports a deadlock, so the ordering that cannot be run here
without GPUs is at least checked. (Posting each receive lazily, just before the action that needs it, does deadlock
there: the interleaved schedule's sends then wait on receives queued behind them.)

On gloo a receive is posted a tick earlier instead (``receive_lead``), in the batch before its send's tick, so it
is usually waiting when the message arrives. Gloo's receives block nothing else, so any lead is safe there as long
as each pair's receives keep the order of its sends (the tests' ``check_order``); under NCCL's rules a lead
deadlocks. Posted in its send's own tick, a receive goes out after the receiver's action of that tick, often after
the neighbour has sent; posting a receive for a message already sent took 0.14 ms against 0.02 ms on the idle 2-core VM,
and on rank 0 of interleaved pp=2 (tools/bench.py pp) posting took 20-24 ms a step against
10 ms a tick ahead: trident's interleaved schedule went from 0.93-0.97x of torch.distributed.pipelining (which
posts its receives an action ahead) to 1.01-1.07x over six runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trident.parallel.pipeline.schedules import (
    KINDS,
    LOOP,
    Action,
    B,
    F,
    I,
    Schedule,
    holder_of,
    simulate,
    stage_of,
)

Message = tuple[str, int, int]


def sends_of(action: Action, rank: int, pp: int, stages: int, placement: str = LOOP) -> list[tuple[Message, int]]:
    """What ``action`` on ``rank`` sends, to which pipeline rank (``rank`` itself for a local message)."""
    s = stage_of(action.chunk, rank, pp, placement)
    if action.kind == F and s < stages - 1:
        return [(("act", action.micro, s + 1), holder_of(s + 1, pp, placement)[0])]
    if action.kind in (B, I) and s > 0:
        return [(("grad", action.micro, s - 1), holder_of(s - 1, pp, placement)[0])]
    return []


def needs_of(action: Action, rank: int, pp: int, stages: int, placement: str = LOOP) -> Message | None:
    """The message ``action`` on ``rank`` must have received (or, if local, been handed) before it runs."""
    s = stage_of(action.chunk, rank, pp, placement)
    if action.kind == F and s > 0:
        return ("act", action.micro, s)
    if action.kind in (B, I) and s < stages - 1:
        return ("grad", action.micro, s)
    return None


@dataclass
class Step:
    """One tick of the common clock on one rank: its action (None: idle), then one batch of messages."""

    action: Action | None
    sends: list[tuple[Message, int]] = field(default_factory=list)  # (message, to rank), the action's
    recvs: list[tuple[Message, int]] = field(default_factory=list)  # (message, from rank), sent at this tick


def p2p_plan(schedule: Schedule, rank: int, stages: int, lead: int = 0, placement: str = LOOP) -> list[Step]:
    """``rank``'s ticks: what it runs and which batch it posts after each one. ``lead``: post each receive that
    many ticks before the tick of its send (0: in the same tick's batch, as NCCL needs). Local messages are in no
    batch."""
    pp = len(schedule)
    spans = simulate(schedule, stages // pp, dict.fromkeys(KINDS, 1.0), placement)
    ticks = int(max(s.end for s in spans))
    plan = [Step(None) for _ in range(ticks)]
    for s in spans:  # each rank's in its order, so a pair's receives keep the order of its sends
        t = int(s.start)
        for message, dst in sends_of(s.action, s.rank, pp, stages, placement):
            if dst == s.rank:
                continue
            if s.rank == rank:
                plan[t].sends.append((message, dst))
            if dst == rank:
                plan[max(0, t - lead)].recvs.append((message, s.rank))
        if s.rank == rank:
            plan[t].action = s.action
    return plan


def receive_lead(backend: str) -> int:
    """How many ticks before its send's tick ``p2p_plan`` posts a receive: 1 on gloo, 0 under NCCL's rules."""
    return 1 if backend == "gloo" else 0
