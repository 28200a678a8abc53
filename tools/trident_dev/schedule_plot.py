"""A pipeline schedule drawn as a timeline (tools/plot_schedule.py is its command line): one lane per pipeline rank,
a box per action (F, B, I, W) labelled micro-batch and chunk, the gaps between boxes the bubble.

The boxes come from one of three places: the unit-cost simulation of parallel/pipeline/schedules.py (``planned``),
the action timings a run records with ``logging.pipeline_timings=true`` (``read_timings``, ``measured``), or the
layout planner's prediction (``plan_panel``), whose boxes also know where an action's compute ends and its
tensor-parallel collectives start. ``draw`` writes panels of lanes one above the other on one time scale as SVG,
with no dependency; ``to_png`` draws them with matplotlib.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from trident.config import Config
from trident.parallel.pipeline.schedules import (
    UNIT_COSTS,
    Action,
    Span,
    build_schedule,
    simulate,
    stage_placement,
)
from trident.plan import planner
from trident.plan.planner import Prediction
from trident.plan.profile import Profile
from trident_dev.schedule_theory import bubble_formula, idle_fractions

COLORS = {"F": "#4c78a8", "B": "#54a24b", "I": "#88d27a", "W": "#f58518"}
LANE, PAD, LEFT, TOP = 34, 6, 70, 40
HEADING = 22  # a panel's heading line, above its lanes
AXIS = 24  # the time axis under the lanes


@dataclass(frozen=True)
class Box:
    """An action drawn: its rank's lane, start and end; ``compute_end`` where its compute ends and its
    communication starts (None: not split, as measured)."""

    rank: int
    action: Action
    start: float
    end: float
    compute_end: float | None = None


@dataclass
class Panel:
    """A group of lanes, one per pipeline rank: the planned timeline, or the measured one."""

    heading: str
    boxes: list[Box]

    @property
    def ranks(self) -> int:
        return 1 + max(b.rank for b in self.boxes)


def boxes_of(spans: list[Span]) -> list[Box]:
    return [Box(s.rank, s.action, s.start, s.end) for s in spans]


def _formula(name: str, pp: int, vpp: int, micro: int, costs: Mapping[str, float] = UNIT_COSTS) -> str:
    """ ", formula x" for a title, or nothing where the schedule has no formula (zb-v for M < 2P - 1 or f, i, w
    unequal)."""
    try:
        return f", formula {bubble_formula(name, pp, vpp, micro, costs):.3f}"
    except ValueError:
        return ""


def planned(name: str, pp: int, vpp: int, micro: int, costs: dict[str, float]) -> tuple[list[Span], str]:
    spans = simulate(build_schedule(name, pp, vpp, micro), vpp, costs, stage_placement(name))
    idle = max(idle_fractions(spans, pp))
    title = f"{name}, pp={pp}, vpp={vpp}, {micro} micro-batches (planned): bubble {idle:.3f} of busy time"
    return spans, title + _formula(name, pp, vpp, micro, costs)


@dataclass
class Recorded:
    """One recorded step of a run's pipeline: spans in seconds from its first action, and its layout."""

    spans: list[Span]
    schedule: str
    pp: int
    vpp: int
    micro_batches: int
    # The data-parallel reduction left after the schedule (the reducer's finish), worst rank; None if not recorded.
    exposed_reduce_s: float | None = None

    @property
    def pipeline_s(self) -> float:
        return max(s.end for s in self.spans) - min(s.start for s in self.spans)


def read_timings(directory: Path, call: int | None) -> Recorded:
    """The spans of one recorded step (``call``; None: the last training step), times in seconds from the step's
    first action. A ValueError says which rank's file lacks the step."""
    rows = []
    for path in sorted(directory.glob("rank*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        train = [row for row in lines if row["train"]]
        if not train:
            raise ValueError(f"{path} holds no training step")
        rows.append(next((r for r in train if r["call"] == call), None) if call is not None else train[-1])
    if not rows or None in rows:
        raise ValueError(f"no timings for call {call} in {directory}")
    t0 = min(s[3] for row in rows for s in row["spans"])
    spans = [
        Span(row["rank"], Action(k, m, c), start - t0, end - t0) for row in rows for k, m, c, start, end in row["spans"]
    ]
    first = rows[0]
    reduces = [row["reduce"][1] - row["reduce"][0] for row in rows if "reduce" in row]
    exposed = max(reduces) if reduces else None
    return Recorded(spans, first["schedule"], len(rows), first["vpp"], first["micro_batches"], exposed)


def measured(directory: Path, call: int | None) -> tuple[list[Span], str]:
    """Spans of one recorded step, times in ms from the step's first action."""
    rec = read_timings(directory, call)
    spans = [Span(s.rank, s.action, s.start * 1e3, s.end * 1e3) for s in rec.spans]
    idle = max(idle_fractions(spans, rec.pp))
    title = (
        f"{rec.schedule}, pp={rec.pp}, vpp={rec.vpp}, {rec.micro_batches} micro-batches (measured, ms): "
        f"bubble {idle:.3f} of busy time{_formula(rec.schedule, rec.pp, rec.vpp, rec.micro_batches)}"
    )
    if rec.exposed_reduce_s is not None:
        title += f"; dp reduction exposed after it {rec.exposed_reduce_s * 1e3:.1f} ms"
    return spans, title


# --- the layout planner's costs -------------------------------------------------------------------------------


def plan_panel(cfg: Config, world: int, profile: Profile) -> tuple[Prediction, Panel, str]:
    """The planner's prediction of ``cfg``'s layout on ``world`` ranks of ``profile``, its timeline as a panel
    (seconds) and a title line. A layout train.py refuses raises the validator's ConfigError."""
    p = planner.predict(cfg, world, profile)
    t = p.time
    boxes = [Box(s.rank, s.action, s.start, s.end, s.compute_end) for s in t.spans]
    lay = p.layout
    shape = f"{lay.schedule}, pp={lay.pp}, vpp={lay.vpp}, {lay.micro_batches} micro-batches"
    if lay.pp == 1:
        shape = f"no pipeline, {lay.micro_batches} micro-batches"
    title = (
        f"{cfg.model.name} {p.label} on {world} ranks of {profile.name}: {shape}; planned pipeline "
        f"{t.pipeline:.4g} s (step {t.step:.4g} s), bubble {t.bubble:.3f}"
    )
    heading = f"planned: {profile.name}, {profile.source}"
    return p, Panel(heading, boxes), title


def plan_and_measured(
    prediction: Prediction, planned_panel: Panel, rec: Recorded, directory: Path
) -> tuple[list[Panel], str]:
    """The planned panel above the measured one, and a title line with both pipeline times. The recorded run must
    be of the same pipeline (ranks, chunks, schedule, micro-batches): a ValueError says what differs."""
    lay = prediction.layout
    want = (lay.pp, lay.vpp, lay.schedule, lay.micro_batches)
    got = (rec.pp, rec.vpp, rec.schedule, rec.micro_batches)
    if want != got:
        names = ("pp", "vpp", "schedule", "micro-batches")
        diff = ", ".join(f"{n} {g} (planned {w})" for n, w, g in zip(names, want, got, strict=True) if w != g)
        raise ValueError(f"the timings in {directory} are of another pipeline: {diff}")
    planned_s = prediction.time.pipeline
    error = rec.pipeline_s / planned_s - 1 if planned_s else math.nan
    title = (
        f"{prediction.config.model.name} {prediction.label}, {lay.schedule}, pp={lay.pp}, vpp={lay.vpp}, "
        f"{lay.micro_batches} micro-batches: pipeline {planned_s:.4g} s planned, {rec.pipeline_s:.4g} s measured "
        f"({100 * error:+.1f}%)"
    )
    measured_panel = Panel(f"measured: {directory}", boxes_of(rec.spans))
    return [planned_panel, measured_panel], title


# --- drawing --------------------------------------------------------------------------------------------------


def label(action: Action, vpp: int) -> str:
    return f"{action.kind}{action.micro}" + (f".{action.chunk}" if vpp > 1 else "")


CHAR_EM = 0.62  # a sans-serif digit's or capital's width, in font sizes (a conservative one: labels must fit)
MIN_FONT = 7.0


def fit(text: str, width: float, height: float, largest: float = 11.0) -> tuple[float, bool] | None:
    """The font size a box's label is drawn at and whether it runs upright (rotated), or None where it does not
    fit even at MIN_FONT: across the box where it fits at 8 or more, else up the box (a narrow box of an
    interleaved schedule is taller than wide), else across at the larger of the two smaller sizes."""
    across = min(largest, (width - 2) / (CHAR_EM * len(text)), height - 4)
    up = min(largest, (height - 4) / (CHAR_EM * len(text)), width - 2)
    if across >= 8 or across >= up:
        return (across, False) if across >= MIN_FONT else None
    return (up, True) if up >= MIN_FONT else None


def ticks(end: float) -> list[float]:
    """Round times from 0 to ``end``, 4 to 10 of them."""
    if end <= 0:
        return [0.0]
    raw = end / 5
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    return [i * step for i in range(int(end / step + 1e-9) + 1)]


def draw(panels: list[Panel], title: str, unit: str | None = None, width: int = 1100) -> str:
    """Panels of lanes one above the other on one time scale: a box per action, its communication (where the
    box knows it) hatched, and, with ``unit``, a time axis."""
    vpp = 1 + max(b.action.chunk for p in panels for b in p.boxes)
    end = max(b.end for p in panels for b in p.boxes) or 1.0
    scale = (width - LEFT - PAD) / end
    headed = len(panels) > 1 or any(p.heading for p in panels)
    lanes_height = sum(p.ranks * LANE + (HEADING if headed else 0) for p in panels)
    axis = AXIS if unit else 0
    height = TOP + lanes_height + axis + 30
    comm = any(b.compute_end is not None and b.end > b.compute_end for p in panels for b in p.boxes)
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
        '<defs><pattern id="comm" width="6" height="6" patternUnits="userSpaceOnUse" patternTransform="rotate(45)">'
        '<rect width="3" height="6" fill="white" fill-opacity="0.6"/></pattern></defs>',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{PAD}" y="20" font-size="13">{escape(title)}</text>',
    ]
    y0 = TOP
    for n, panel in enumerate(panels):
        if headed:
            out.append(
                f'<text x="{PAD}" y="{y0 + 14}" font-size="12" font-weight="bold">{escape(panel.heading)}</text>'
            )
            y0 += HEADING
        for r in range(panel.ranks):
            y = y0 + r * LANE
            out.append(f'<rect x="{LEFT}" y="{y}" width="{end * scale:.1f}" height="{LANE - 4}" fill="#eeeeee"/>')
            out.append(f'<text x="{PAD}" y="{y + LANE / 2 + 2}" font-size="12">rank {r}</text>')
        for b in panel.boxes:
            x, w = LEFT + b.start * scale, max((b.end - b.start) * scale, 0.5)
            y = y0 + b.rank * LANE
            # Later chunks are drawn lighter, so the interleaved schedule's laps can be told apart.
            opacity = 1.0 - 0.45 * b.action.chunk / max(1, vpp - 1)
            out.append(
                f'<rect class="action" data-panel="{n}" data-rank="{b.rank}" x="{x:.1f}" y="{y}" width="{w:.1f}" '
                f'height="{LANE - 4}" fill="{COLORS[b.action.kind]}" fill-opacity="{opacity:.2f}" stroke="white" '
                f'stroke-width="0.5"/>'
            )
            if b.compute_end is not None and b.end > b.compute_end:
                cx = LEFT + b.compute_end * scale
                out.append(
                    f'<rect class="comm" x="{cx:.1f}" y="{y}" width="{max((b.end - b.compute_end) * scale, 0.5):.1f}" '
                    f'height="{LANE - 4}" fill="url(#comm)"/>'
                )
            text = label(b.action, vpp)
            fitted = fit(text, w, LANE - 4)
            if fitted is not None:
                size, upright = fitted
                cx, cy = x + w / 2, y + (LANE - 4) / 2
                turn = f' transform="rotate(-90 {cx:.1f} {cy:.1f})"' if upright else ""
                out.append(
                    f'<text class="label" x="{cx:.1f}" y="{cy:.1f}" font-size="{size:.1f}" fill="white" '
                    f'text-anchor="middle" dominant-baseline="central"{turn}>{text}</text>'
                )
        y0 += panel.ranks * LANE
    if unit:
        out.append(f'<line x1="{LEFT}" y1="{y0 + 2}" x2="{LEFT + end * scale:.1f}" y2="{y0 + 2}" stroke="#666"/>')
        for t in ticks(end):
            x = LEFT + t * scale
            out.append(f'<line x1="{x:.1f}" y1="{y0 + 2}" x2="{x:.1f}" y2="{y0 + 6}" stroke="#666"/>')
            out.append(f'<text x="{x:.1f}" y="{y0 + 17}" font-size="10" text-anchor="middle">{t:.4g}</text>')
        out.append(f'<text x="{PAD}" y="{y0 + 17}" font-size="10">time ({unit})</text>')
        y0 += axis
    legend_y = y0 + 18
    kinds = sorted({b.action.kind for p in panels for b in p.boxes}, key="FBIW".index)
    for i, kind in enumerate(kinds):
        x = LEFT + i * 120
        name = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}[kind]
        out.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{COLORS[kind]}"/>')
        out.append(f'<text x="{x + 16}" y="{legend_y}" font-size="11">{kind}: {name}</text>')
    x = LEFT + len(kinds) * 120
    out.append(f'<text x="{x}" y="{legend_y}" font-size="11">grey: idle (bubble)</text>')
    if comm:
        out.append(f'<rect x="{x + 120}" y="{legend_y - 10}" width="12" height="12" fill="#555555"/>')
        out.append(f'<rect x="{x + 120}" y="{legend_y - 10}" width="12" height="12" fill="url(#comm)"/>')
        out.append(f'<text x="{x + 136}" y="{legend_y}" font-size="11">hatched: tp communication</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_png(panels: list[Panel], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("a .png needs matplotlib, a dependency of trident: pip install -e . (or write a .svg)") from e
    lanes = [(p, r) for p in panels for r in range(p.ranks)]
    vpp = 1 + max(b.action.chunk for p in panels for b in p.boxes)
    end = max(b.end for p in panels for b in p.boxes) or 1.0
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1))
    points = 12 * 72 * 0.8 / end  # points per time unit: the axes take about 80% of the figure's 12 inches
    for i, (panel, r) in enumerate(lanes):
        for b in panel.boxes:
            if b.rank == r:
                ax.barh(i, b.end - b.start, left=b.start, color=COLORS[b.action.kind], edgecolor="white")
                if b.compute_end is not None and b.end > b.compute_end:
                    ax.barh(i, b.end - b.compute_end, left=b.compute_end, color="none", hatch="//", edgecolor="white")
                text = label(b.action, vpp)
                fitted = fit(text, (b.end - b.start) * points, 0.8 * 0.6 * 72 * 0.8, largest=8.0)
                if fitted is not None:
                    size, upright = fitted
                    ax.text(
                        (b.start + b.end) / 2, i, text, ha="center", va="center", color="white",
                        fontsize=size, rotation=90 if upright else 0,
                    )  # fmt: skip
    names = [f"{p.heading.split(':')[0]} rank {r}" if len(panels) > 1 else f"rank {r}" for p, r in lanes]
    ax.set_yticks(range(len(lanes)), names)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
