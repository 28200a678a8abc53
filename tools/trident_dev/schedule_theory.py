"""The schedules' theory, for the tests and the tools: a schedule's well-formedness (``check_schedule``), a schedule
as a step x rank grid of torch.distributed.pipelining's ``"<stage><kind><micro>"`` strings (``format_grid``) and
read back (``parse_action``, ``parse_grid``), and the bubble: measured from spans (``idle_fractions``) and by each
schedule's formula (``bubble_formula``: parallel/pipeline/schedules.py's docstring derives them)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from trident.parallel.pipeline.schedules import (
    KINDS,
    LOOP,
    UNIT_COSTS,
    Action,
    F,
    I,
    Schedule,
    Span,
    W,
    format_action,
    holder_of,
)


def parse_action(text: str, rank: int, pp: int, placement: str = LOOP) -> Action:
    """``"3B1"`` on rank 1 of P=2 -> Action("B", micro=1, chunk=1) (stage 3 = chunk 1 * 2 + rank 1; under the V
    placement stage 3 is chunk 1 of rank 0)."""
    text = text.strip()
    at = next((i for i, ch in enumerate(text) if ch in KINDS), None)
    if at is None or not text[:at].isdigit() or not text[at + 1 :].isdigit():
        raise ValueError(f"cannot read action {text!r}; write <stage><F|B|I|W><micro-batch>, e.g. 1F0")
    stage, micro = int(text[:at]), int(text[at + 1 :])
    holder, chunk = holder_of(stage, pp, placement)
    if holder != rank:
        raise ValueError(f"action {text!r}: stage {stage} is not on rank {rank} of {pp}")
    return Action(text[at], micro, chunk)


def format_grid(schedule: Schedule, pp: int, spans: Sequence[Span] | None = None, placement: str = LOOP) -> str:
    """A step x rank grid. Without ``spans`` row i is each rank's i-th action; with a unit-cost simulation's
    spans row t is what each rank does at time t, ``.`` where it idles (the bubble)."""
    if spans is None:
        rows = [
            [format_action(ops[i], r, pp, placement) if i < len(ops) else "" for r, ops in enumerate(schedule)]
            for i in range(max(map(len, schedule)))
        ]
    else:
        end = int(max(s.end for s in spans))
        rows = [["."] * len(schedule) for _ in range(end)]
        for s in spans:
            for t in range(int(s.start), int(s.end)):
                rows[t][s.rank] = format_action(s.action, s.rank, pp, placement)
    width = max(6, *(len(c) for row in rows for c in row))
    head = "step  " + " ".join(f"rank{r}".ljust(width) for r in range(len(schedule)))
    lines = [head] + [f"{t:<5} " + " ".join(c.ljust(width) for c in row) for t, row in enumerate(rows)]
    return "\n".join(line.rstrip() for line in lines)


def check_schedule(schedule: Schedule, vpp: int, micro: int) -> None:
    """Each rank runs, for every (micro-batch, chunk), one F and then either one B or one I followed by one W."""
    for r, ops in enumerate(schedule):
        seen = {}
        for i, a in enumerate(ops):
            if a.kind not in KINDS or not (0 <= a.micro < micro and 0 <= a.chunk < vpp):
                raise ValueError(f"rank {r}: action {a} is outside {micro} micro-batches x {vpp} chunks")
            if (a.kind, a.micro, a.chunk) in seen:
                raise ValueError(f"rank {r}: {a} appears twice")
            seen[a] = i
        for m in range(micro):
            for c in range(vpp):
                f, b, i, w = (seen.get(Action(k, m, c)) for k in KINDS)
                split = (i, w) != (None, None)
                ok = f is not None and (
                    (b is not None and not split and f < b) or (b is None and None not in (i, w) and f < i < w)  # type: ignore[operator]
                )
                if not ok:
                    raise ValueError(f"rank {r}: micro-batch {m}, chunk {c} needs one F, then B (or I, then W)")


def parse_grid(text: str, pp: int, placement: str = LOOP) -> Schedule:
    """The schedule a ``format_grid`` printed (either form: ``.`` and repeated cells of one action are skipped)."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    ranks = len(lines[0].split()) - 1
    if ranks != pp:
        raise ValueError(f"the grid has {ranks} rank columns, expected {pp}")
    out: Schedule = [[] for _ in range(pp)]
    cols = [lines[0].index(f"rank{r}") for r in range(pp)]
    for line in lines[1:]:
        for r, start in enumerate(cols):
            cell = line[start : cols[r + 1] if r + 1 < pp else None].strip()
            if cell and cell != ".":
                action = parse_action(cell, r, pp, placement)
                if not out[r] or out[r][-1] != action:
                    out[r].append(action)
    return out


def idle_fractions(spans: Sequence[Span], pp: int) -> list[float]:
    """Per rank, idle time over busy time between the first start and the last end of the step."""
    start, end = min(s.start for s in spans), max(s.end for s in spans)
    busy = [sum(s.end - s.start for s in spans if s.rank == r) for r in range(pp)]
    return [(end - start - b) / b for b in busy]


def bubble_formula(name: str, pp: int, vpp: int, micro: int, costs: Mapping[str, float] = UNIT_COSTS) -> float:
    """Idle over busy time per rank that the schedule's theory gives (schedules.py's docstring; zb-v's only for
    M >= 2P - 1 and f = i = w)."""
    f, i, w = costs[F], costs[I], costs[W]
    if name == "zb-v":
        if micro < 2 * pp - 1 or not f == i == w:
            raise ValueError("zb-v's bubble formula is for M >= 2P - 1 and f = i = w: simulate the schedule")
        return (pp - 1) / (6 * micro)
    if name in ("gpipe", "1f1b"):
        return (pp - 1) / micro
    if name == "interleaved":
        return (pp - 1 + (vpp - 1) * max(0, pp - micro)) / (vpp * micro)
    # W passes fill the cool-down, as many as there are micro-batches after the first (at most P - 1).
    return ((pp - 1) * (f + i) - min(micro - 1, pp - 1) * w) / (micro * (f + i + w))
