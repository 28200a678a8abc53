"""Pipeline schedules as data (no process group): invariants over many layouts, deadlock-free simulation, the
bubble against its formula, the grid's print/parse round trip, one schedule written out by hand, and the
executor's message plan: sends match receives, in order, and never stall under NCCL's rendezvous rules; on gloo
each receive is posted a tick ahead of its send, in the same order."""

from __future__ import annotations

import pytest

from trident.parallel.pipeline.messages import Message, Step, needs_of, p2p_plan, receive_lead
from trident.parallel.pipeline.schedules import (
    LOOP,
    UNIT_COSTS,
    Action,
    B,
    DeadlockError,
    F,
    I,
    V,
    W,
    activation_peak,
    build_schedule,
    format_action,
    forward_only,
    holder_of,
    schedule_error,
    simulate,
    stage_of,
    stage_placement,
)
from trident_dev.schedule_theory import (
    bubble_formula,
    check_schedule,
    format_grid,
    idle_fractions,
    parse_action,
    parse_grid,
)

LAYOUTS = [
    (name, pp, vpp, micro)
    for pp in (2, 3, 4, 5)
    for micro in range(1, 3 * pp + 2)
    for name, vpps in (("gpipe", (1,)), ("1f1b", (1,)), ("zb-h1", (1,)), ("interleaved", (2, 3, 4)))
    for vpp in vpps
]
EQUAL = {F: 1.0, B: 2.0, I: 1.0, W: 1.0}


# The executor's message plans run as NCCL runs them (parallel/pipeline/messages.py's docstring): what the tests
# check every schedule's plans against.


def sender_of(message: Message, pp: int, placement: str = LOOP) -> int:
    """The pipeline rank that sends ``message``: the holder of the stage before (activations) or after (gradients)."""
    kind, _, stage = message
    return holder_of(stage - 1 if kind == "act" else stage + 1, pp, placement)[0]


def received_need(action: Action, rank: int, pp: int, stages: int, placement: str = LOOP) -> Message | None:
    """``needs_of`` if another rank sends it (a batch must receive it), else None."""
    need = needs_of(action, rank, pp, stages, placement)
    return None if need is None or sender_of(need, pp, placement) == rank else need


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


def _position(schedule, pp):
    """(stage, kind, micro) -> (rank, index in the rank's list)."""
    return {
        (stage_of(a.chunk, r, pp), a.kind, a.micro): (r, i) for r, ops in enumerate(schedule) for i, a in enumerate(ops)
    }


@pytest.mark.parametrize("name,pp,vpp,micro", LAYOUTS, ids=lambda v: str(v))
def test_invariants_simulation_and_bubble(name, pp, vpp, micro):
    schedule = build_schedule(name, pp, vpp, micro)
    assert len(schedule) == pp
    check_schedule(schedule, vpp, micro)  # one F, then one B (or I then W) per (micro-batch, chunk) on its rank
    split = name == "zb-h1"
    assert all((a.kind in (I, W)) == split for ops in schedule for a in ops if a.kind != F)
    spans = simulate(schedule, vpp, EQUAL)  # raises DeadlockError
    end = {(s.rank, s.action): s.end for s in spans}
    start = {(s.rank, s.action): s.start for s in spans}
    stages = pp * vpp
    where = _position(schedule, pp)
    for m in range(micro):
        for s in range(stages):
            r, c = s % pp, s // pp
            if s > 0:  # the F of chunk c starts after the F of the stage upstream has ended
                up = ((s - 1) % pp, Action(F, m, (s - 1) // pp))
                assert start[(r, Action(F, m, c))] >= end[up]
            back = I if split else B
            if s < stages - 1:
                down = ((s + 1) % pp, Action(back, m, (s + 1) // pp))
                assert start[(r, Action(back, m, c))] >= end[down]
            assert where[(s, F, m)][0] == r
    assert idle_fractions(spans, pp) == pytest.approx([bubble_formula(name, pp, vpp, micro, EQUAL)] * pp)


@pytest.mark.parametrize("name,pp,vpp,micro", LAYOUTS[::5], ids=lambda v: str(v))
def test_grid_round_trip_and_forward_only(name, pp, vpp, micro):
    schedule = build_schedule(name, pp, vpp, micro)
    assert parse_grid(format_grid(schedule, pp), pp) == schedule
    assert parse_grid(format_grid(schedule, pp, simulate(schedule, vpp)), pp) == schedule
    only = forward_only(schedule)
    assert all(a.kind == F for ops in only for a in ops)
    simulate(only, vpp)


def test_one_f_one_b_by_hand():
    # Unit costs, B twice F: rank 0 idles 3 of 9 units, (P - 1) / M = 1/2 of its busy time. "." is the bubble.
    grid = """
    step  rank0  rank1
    0     0F0    .
    1     0F1    1F0
    2     .      1B0
    3     .      1B0
    4     0B0    1F1
    5     0B0    1B1
    6     .      1B1
    7     0B1    .
    8     0B1    .
    """
    schedule = build_schedule("1f1b", 2, 1, 2)
    assert schedule == [
        [Action(F, 0), Action(F, 1), Action(B, 0), Action(B, 1)],
        [Action(F, 0), Action(B, 0), Action(F, 1), Action(B, 1)],
    ]
    assert parse_grid(grid, 2) == schedule
    assert format_grid(schedule, 2, simulate(schedule, 1, UNIT_COSTS)).split() == grid.split()


def test_interleaved_by_hand():
    """P=2, V=2, M=2: rank 0 holds stages 0 and 2, rank 1 stages 1 and 3."""
    got = build_schedule("interleaved", 2, 2, 2)
    assert [[f"{stage_of(a.chunk, r, 2)}{a.kind}{a.micro}" for a in ops] for r, ops in enumerate(got)] == [
        ["0F0", "0F1", "2F0", "2F1", "2B0", "2B1", "0B0", "0B1"],
        ["1F0", "1F1", "3F0", "3B0", "3F1", "3B1", "1B0", "1B1"],
    ]


def test_actions_read_as_torch_writes_them():
    assert parse_action("3B1", rank=1, pp=2) == Action(B, 1, 1)
    assert parse_action(" 0W12 ", rank=0, pp=4) == Action(W, 12, 0)
    for bad in ("F0", "1X0", "1F", "2F0"):  # 2F0 is stage 2: not on rank 1 of 2
        with pytest.raises(ValueError):
            parse_action(bad, rank=1, pp=2)


def test_a_schedule_that_deadlocks_is_named():
    # Rank 1 wants the backward before its forward's input ever arrives from rank 0, which waits on rank 1.
    schedule = [
        [Action(F, 0), Action(B, 1), Action(F, 1), Action(B, 0)],
        [Action(F, 1), Action(B, 1), Action(F, 0), Action(B, 0)],
    ]
    with pytest.raises(DeadlockError, match="rank 0 at 0B1"):
        simulate(schedule)


def test_bad_schedules_are_refused():
    assert schedule_error("interleaved", 2, 1, 4) is not None
    assert schedule_error("1f1b", 2, 2, 4) is not None
    assert schedule_error("pipedream", 2, 1, 4) is not None
    assert schedule_error("interleaved", 4, 2, 3) is None  # M < P and M % P != 0 both run
    with pytest.raises(ValueError, match="twice"):
        check_schedule([[Action(F, 0), Action(F, 0), Action(B, 0)]], 1, 1)
    with pytest.raises(ValueError, match="needs one F"):
        check_schedule([[Action(B, 0), Action(F, 0)]], 1, 1)


@pytest.mark.parametrize("name,pp,vpp,micro", LAYOUTS, ids=lambda v: str(v))
def test_message_plan_matches_every_send_and_never_stalls_under_rendezvous(name, pp, vpp, micro):
    schedule = build_schedule(name, pp, vpp, micro)
    for planned in (schedule, forward_only(schedule)):
        plans = [p2p_plan(planned, r, pp * vpp) for r in range(pp)]
        # Each rank runs its own actions, in its order.
        assert [[s.action for s in plan if s.action is not None] for plan in plans] == planned
        check_rendezvous(plans, pp * vpp)


def test_receives_posted_after_a_send_that_waits_for_them_stall():
    """Two ranks that each send at tick 0 but post the matching receive only at tick 1: under rendezvous each
    send waits for a receive queued behind the other's send (what posting receives lazily did to interleaved)."""
    a, b = ("act", 0, 1), ("grad", 0, 0)
    plans = [
        [Step(Action(F, 0), sends=[(a, 1)]), Step(None, recvs=[(b, 1)])],
        [Step(None, sends=[(b, 0)]), Step(None, recvs=[(a, 0)])],
    ]
    with pytest.raises(DeadlockError, match="rendezvous"):
        check_rendezvous(plans, 2)
    plans[0][1].recvs, plans[0][0].recvs = [], [(b, 1)]  # both ends in the batch of the same tick
    plans[1][1].recvs, plans[1][0].recvs = [], [(a, 0)]
    check_rendezvous(plans, 2)


def _receive_ticks(plans: list[list[Step]]) -> dict:
    return {(r, m): t for r, plan in enumerate(plans) for t, step in enumerate(plan) for m, _ in step.recvs}


@pytest.mark.parametrize("name,pp,vpp,micro", LAYOUTS, ids=lambda v: str(v))
def test_receives_posted_a_tick_ahead_keep_each_pairs_order(name, pp, vpp, micro):
    """gloo's plan (``receive_lead``): the same actions and sends at the same ticks, each receive posted one tick
    before its send's (the first tick's at tick 0), still in the order each pair sends and before it is needed."""
    schedule = build_schedule(name, pp, vpp, micro)
    for planned in (schedule, forward_only(schedule)):
        same = [p2p_plan(planned, r, pp * vpp) for r in range(pp)]
        ahead = [p2p_plan(planned, r, pp * vpp, lead=1) for r in range(pp)]
        check_order(ahead, pp * vpp)
        for a, b in zip(same, ahead, strict=True):
            assert [(s.action, s.sends) for s in a] == [(s.action, s.sends) for s in b]
        before, after = _receive_ticks(same), _receive_ticks(ahead)
        assert before.keys() == after.keys() and before
        assert all(after[k] == max(0, t - 1) for k, t in before.items())


def test_a_lead_is_for_gloo_only_under_nccl_rules_it_deadlocks():
    assert (receive_lead("gloo"), receive_lead("nccl")) == (1, 0)
    plans = [p2p_plan(build_schedule("interleaved", 2, 2, 8), r, 4, lead=1) for r in range(2)]
    with pytest.raises(DeadlockError, match="rendezvous"):
        check_rendezvous(plans, 4)


def test_receives_out_of_order_or_too_late_are_refused():
    a0, a1 = ("act", 0, 1), ("act", 1, 1)
    sender = [Step(Action(F, 0), sends=[(a0, 1)]), Step(Action(F, 1), sends=[(a1, 1)]), Step(None)]
    swapped = [Step(None, recvs=[(a1, 0)]), Step(None, recvs=[(a0, 0)]), Step(Action(F, 0)), Step(Action(F, 1))]
    with pytest.raises(ValueError, match="out of the order"):
        check_order([sender, swapped], 2)
    late = [Step(None), Step(Action(F, 0), recvs=[(a0, 0), (a1, 0)]), Step(Action(F, 1))]
    with pytest.raises(ValueError, match="before its receive is posted"):
        check_order([sender, late], 2)
    check_order([sender, [Step(None, recvs=[(a0, 0), (a1, 0)]), Step(Action(F, 0)), Step(Action(F, 1))]], 2)


# -- zb-v: two chunks per rank in a V (rank r holds stages r and 2P - 1 - r) ----------------------------------------

ZBV = [
    (pp, micro) for pp in range(2, 9) for micro in sorted({1, 2, pp - 1, pp, pp + 1, 2 * pp - 1, 2 * pp, 3 * pp + 1})
]


def test_v_placement_puts_the_first_and_last_stage_on_rank_0():
    assert [[stage_of(c, r, 4, V) for c in (0, 1)] for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [holder_of(s, 4, V) for s in range(8)] == [(0, 0), (1, 0), (2, 0), (3, 0), (3, 1), (2, 1), (1, 1), (0, 1)]
    assert [holder_of(s, 4) for s in range(8)] == [(s % 4, s // 4) for s in range(8)]  # the loop, as before
    assert stage_placement("zb-v") == V and stage_placement("interleaved") == stage_placement(None) == LOOP
    assert parse_action("7I2", rank=0, pp=4, placement=V) == Action(I, 2, 1)
    with pytest.raises(ValueError, match="not on rank"):
        parse_action("7I2", rank=3, pp=4, placement=V)  # the loop's rank of stage 7


@pytest.mark.parametrize("pp,micro", ZBV, ids=lambda v: str(v))
def test_zb_v_runs_without_deadlock_below_the_other_bubbles_in_1f1b_memory(pp, micro):
    schedule = build_schedule("zb-v", pp, 2, micro)
    check_schedule(schedule, 2, micro)
    assert all(a.kind in (F, I, W) for ops in schedule for a in ops)
    spans = simulate(schedule, 2, EQUAL, V)  # raises DeadlockError
    end = {(s.rank, s.action): s.end for s in spans}
    start = {(s.rank, s.action): s.start for s in spans}
    for m in range(micro):
        for s in range(2 * pp):
            r, c = holder_of(s, pp, V)
            if s > 0:
                down, chunk = holder_of(s - 1, pp, V)
                assert start[(r, Action(F, m, c))] >= end[(down, Action(F, m, chunk))]
            if s < 2 * pp - 1:
                up, chunk = holder_of(s + 1, pp, V)
                assert start[(r, Action(I, m, c))] >= end[(up, Action(I, m, chunk))]
    bubble = idle_fractions(spans, pp)
    # A chunk is half a 1F1B stage: idle over busy time does not depend on the unit, so the bubbles compare as is.
    h1 = max(idle_fractions(simulate(build_schedule("zb-h1", pp, 1, micro), 1, EQUAL), pp))
    assert max(bubble) <= h1 + 1e-9 and (micro <= pp or max(bubble) < h1)
    assert max(bubble) < bubble_formula("1f1b", pp, 1, micro)
    if micro >= 2 * pp - 1:
        assert bubble == pytest.approx([bubble_formula("zb-v", pp, 2, micro, EQUAL)] * pp)
    # Activation memory in half-stage sets: the most any rank holds is 1F1B's (its rank 0's), never more.
    peak = [activation_peak(ops, r, pp, placement=V) for r, ops in enumerate(schedule)]
    one_f_one_b = [
        activation_peak(ops, r, pp, lambda _: 2) for r, ops in enumerate(build_schedule("1f1b", pp, 1, micro))
    ]
    assert max(peak) <= max(one_f_one_b)
    assert parse_grid(format_grid(schedule, pp, placement=V), pp, V) == schedule
    assert parse_grid(format_grid(schedule, pp, spans, V), pp, V) == schedule


def test_zb_v_is_torchs_action_for_action():
    from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble

    kinds = {"FORWARD": F, "BACKWARD_INPUT": I, "BACKWARD_WEIGHT": W}
    for pp, micro in ZBV[::3]:
        theirs = object.__new__(ScheduleZBVZeroBubble)  # the action lists alone: no stages, no process group
        theirs.pp_group_size, theirs._n_microbatches, theirs.num_stages = pp, micro, 2 * pp
        for r, ops in enumerate(build_schedule("zb-v", pp, 2, micro)):
            want = [
                f"{a.stage_index}{kinds[a.computation_type.name]}{a.microbatch_index}"
                for a in theirs._calculate_single_rank_operations(r)
                if a is not None
            ]
            assert [format_action(a, r, pp, V) for a in ops] == want


def test_zb_v_by_hand():
    """P=2, M=2: rank 0 holds stages 0 and 3 (the loss), rank 1 stages 1 and 2; the turn 1 -> 2 stays on rank 1."""
    got = build_schedule("zb-v", 2, 2, 2)
    assert [[format_action(a, r, 2, V) for a in ops] for r, ops in enumerate(got)] == [
        ["0F0", "0F1", "3F0", "3I0", "3W0", "3F1", "3I1", "3W1", "0I0", "0W0", "0I1", "0W1"],
        ["1F0", "2F0", "1F1", "2F1", "2I0", "2W0", "1I0", "1W0", "2I1", "2W1", "1I1", "1W1"],
    ]
    assert schedule_error("zb-v", 2, 1, 4) is not None and schedule_error("zb-v", 2, 2, 1) is None


@pytest.mark.parametrize("pp,micro", ZBV[::2], ids=lambda v: str(v))
def test_zb_v_message_plan_keeps_the_turn_local_and_never_stalls(pp, micro):
    schedule = build_schedule("zb-v", pp, 2, micro)
    for planned in (schedule, forward_only(schedule)):
        plans = [p2p_plan(planned, r, 2 * pp, placement=V) for r in range(pp)]
        assert [[s.action for s in plan if s.action is not None] for plan in plans] == planned
        check_rendezvous(plans, 2 * pp, V)
        check_order([p2p_plan(planned, r, 2 * pp, lead=1, placement=V) for r in range(pp)], 2 * pp, V)
        # Every message between two ranks is in a batch; the turn (stage P - 1 to P, and back) in none.
        sent = {m for plan in plans for step in plan for m, _ in step.sends}
        assert sent and all(holder_of(m[2], pp, V)[0] != sender_of(m, pp, V) for m in sent)
        assert not {("act", m, pp) for m in range(micro)} & sent


def test_the_activation_walk_gives_each_set_back_once_and_holds_what_i_keeps_until_w():
    """Stage 0's I is its whole backward: its set goes back there and its W gives back nothing (given back twice, a
    later peak read low). Past stage 0 a set is held until W, or with ``kept`` (a deferred I's bytes,
    parallel/wgrad.py) swapped at I for what it keeps until W."""
    stage0 = [Action(F, 0), Action(I, 0), Action(W, 0), Action(F, 1), Action(F, 2), Action(I, 2), Action(I, 1)]
    assert activation_peak(stage0, 0, 2) == 2
    later = [Action(F, 0), Action(F, 1), Action(I, 0), Action(W, 0), Action(I, 1), Action(F, 2), Action(W, 1)]
    assert activation_peak(later, 1, 2) == 2  # F 0 and F 1 held together; each until its W
    assert activation_peak(later, 1, 2, lambda _: 10, kept=lambda _: 3) == 20  # both forwards
    assert activation_peak(later, 1, 2, lambda _: 1, kept=lambda _: 5) == 6  # after I 0 (1 + 5), after F 2 (5 + 1)
    # zb-h1's lists: every rank holds pp sets at once (its W waits), which the executor measures (memory.json).
    assert [activation_peak(ops, r, 4) for r, ops in enumerate(build_schedule("zb-h1", 4, 1, 8))] == [4, 4, 4, 4]
