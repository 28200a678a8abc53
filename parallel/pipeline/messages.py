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
``check_rendezvous`` runs those batches the way NCCL does (each rank's batches in order on one stream; a batch
completes once the batch holding the other end of each of its messages has started; an action waits for the
batch that received its input) and reports a deadlock, so the ordering that cannot be run here without GPUs is
at least checked. (Posting each receive lazily, just before the action that needs it, does deadlock there:
the interleaved schedule's sends then wait on receives queued behind them.)

On gloo a receive is posted a tick earlier instead (``receive_lead``), in the batch before its send's tick, so it
is usually waiting when the message arrives. Gloo's receives block nothing else, so any lead is safe there as long
as each pair's receives keep the order of its sends (``check_order``); under NCCL's rules a lead deadlocks. Posted
in its send's own tick, a receive goes out after the receiver's action of that tick, often after the neighbour has
sent; posting a receive for a message already sent took 0.14 ms against 0.02 ms on the idle 2-core VM,
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
    DeadlockError,
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


def sender_of(message: Message, pp: int, placement: str = LOOP) -> int:
    """The pipeline rank that sends ``message``: the holder of the stage before (activations) or after (gradients)."""
    kind, _, stage = message
    return holder_of(stage - 1 if kind == "act" else stage + 1, pp, placement)[0]


def received_need(action: Action, rank: int, pp: int, stages: int, placement: str = LOOP) -> Message | None:
    """``needs_of`` if another rank sends it (a batch must receive it), else None."""
    need = needs_of(action, rank, pp, stages, placement)
    return None if need is None or sender_of(need, pp, placement) == rank else need


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


def check_order(
    plans: list[list[Step]], stages: int, placement: str = LOOP
) -> dict[tuple[str, Message], tuple[int, int]]:
    """Raise ``ValueError`` if a pair's receives are not posted in the order of its sends or not before they are
    needed; return where each end of each message is posted: {(send|recv, message): (rank, tick)}."""
    pp = len(plans)
    batch_of: dict[tuple[str, Message], tuple[int, int]] = {}  # (send|recv, message) -> (rank, tick)
    for r, plan in enumerate(plans):
        for t, step in enumerate(plan):
            batch_of.update({("send", m): (r, t) for m, _ in step.sends})
            batch_of.update({("recv", m): (r, t) for m, _ in step.recvs})
            need = None if step.action is None else received_need(step.action, r, pp, stages, placement)
            if need is not None and batch_of.get(("recv", need), (r, t))[1] >= t:
                raise ValueError(f"rank {r} needs {need} at tick {t} before its receive is posted")
    for src in range(pp):
        for dst in range(pp):
            sent = [m for step in plans[src] for m, to in step.sends if to == dst]
            received = [m for step in plans[dst] for m, frm in step.recvs if frm == src]
            if sent != received:
                raise ValueError(f"rank {dst} posts its receives from rank {src} out of the order they are sent")
    return batch_of


def check_rendezvous(plans: list[list[Step]], stages: int, placement: str = LOOP) -> None:
    """Run every rank's ticks (``p2p_plan`` of each rank) under NCCL's rules (module docstring); raise
    ``DeadlockError`` if they stall, ``ValueError`` as ``check_order`` does."""
    pp = len(plans)
    batch_of = check_order(plans, stages, placement)
    started, completed, acted = [0] * pp, [0] * pp, [0] * pp  # per rank: batches started, completed; actions run
    progress = True
    while progress:
        progress = False
        for r, plan in enumerate(plans):
            t = acted[r]
            # The action of tick t runs once the batch that received its input has completed (and tick t-1's).
            if t < len(plan) and completed[r] >= t:
                step = plan[t]
                need = None if step.action is None else received_need(step.action, r, pp, stages, placement)
                if need is None or completed[r] > batch_of[("recv", need)][1]:
                    acted[r] += 1
                    progress = True
            # Batch t starts after action t and after batch t-1 is done (one stream), completes once every
            # message's other end is in a started batch.
            if started[r] == completed[r] < len(plan) and acted[r] > started[r]:
                started[r] += 1
                progress = True
            if completed[r] < started[r]:
                step = plan[completed[r]]
                ends = [batch_of[("recv", m)] for m, _ in step.sends] + [batch_of[("send", m)] for m, _ in step.recvs]
                if all(started[peer] > tick for peer, tick in ends):
                    completed[r] += 1
                    progress = True
    stuck = [r for r in range(pp) if completed[r] < len(plans[r])]
    if stuck:
        where = ", ".join(f"rank {r} at tick {completed[r]}" for r in stuck)
        raise DeadlockError(f"p2p batches stall under rendezvous: {where}")
