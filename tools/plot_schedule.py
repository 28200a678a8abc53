"""Draw a pipeline schedule as a timeline: one row per pipeline rank, a box per action (F, B, I, W) labelled
micro-batch and chunk, the gaps between boxes the bubble.

    python tools/plot_schedule.py --schedule 1f1b --pp 4 --micro 8 --out docs/schedule.svg        # as planned
    python tools/plot_schedule.py --pp 4 --vpp 2 --out interleaved.svg   # the schedule train.py picks: interleaved
    python tools/plot_schedule.py --measured outputs/<run>/pipeline_timings --out measured.svg      # as measured
    python tools/plot_schedule.py --plan model=gpt-small parallel.pp=4 parallel.tp=2 --world 16 --device h100 \\
        --out plan.svg                                                     # the layout planner's costs, in seconds
    python tools/plot_schedule.py --plan model=gpt-tiny parallel.pp=2 --device cpu \\
        --measured outputs/<run>/pipeline_timings --out both.svg           # the planner's beside a run's

Planned: the unit-cost simulation of parallel/pipeline/schedules.py (``--costs F=1,B=2,I=1,W=1``) of the schedule
train.py would run: ``--schedule`` left out is 1f1b, or interleaved when ``--vpp`` > 1 (``parallel.schedule``'s
default), and a layout train.py refuses is refused here with the same line. Measured: the
action timings a run records with ``logging.pipeline_timings=true`` (one file per pipeline rank; ``--call`` picks
the step, default the last training step).

``--plan``: the layout is train.py's own overrides (as tools/estimate_memory.py takes them, validated the same way,
on ``--world`` ranks, default dp x tp x pp), and each action costs what the layout planner's step-time model
(trident/plan/cost.py) prices it at on ``--device``: a datasheet (h100, h200, a100) or ``cpu``, this machine's
calibration (trident/plan/calibrate.py, cached; only what the layout needs is measured). A box's solid part is
compute, its hatched end the tensor-parallel collectives inside the action; the timeline is the planner's
simulation of the schedule (trident/plan/simulate.py), in seconds. With ``--measured`` too, the planned lanes are
drawn above the measured ones of the same layout on one time scale, and the title gives both pipeline times
(first action's start to the last one's end).

SVG is written here without any dependency; a ``.png`` output needs matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from trident.config import Config, ModelConfig, ParallelConfig, TrainConfig, resolve_schedule, validate
from trident.errors import ConfigError
from trident.parallel.pipeline.schedules import (
    SCHEDULES,
    UNIT_COSTS,
    Action,
    Span,
    bubble_formula,
    build_schedule,
    idle_fractions,
    simulate,
)
from trident.plan import planner
from trident.plan.machine import profile_for
from trident.plan.planner import Prediction
from trident.plan.profile import Profile
from trident.tool_config import default_world, load_config

COLORS = {"F": "#4c78a8", "B": "#54a24b", "I": "#88d27a", "W": "#f58518"}
LANE, PAD, LEFT, TOP = 34, 6, 70, 40
HEADING = 22  # a panel's heading line, above its lanes
AXIS = 24  # the time axis under the lanes
CONF = Path(__file__).resolve().parent.parent / "conf"
DEVICES = ("h100", "h200", "a100", "cpu")


# train.py's keys for this tool's flags, so the validator's line names what to change here.
FLAGS = {
    "parallel.schedule": "--schedule",
    "parallel.vpp": "--vpp",
    "parallel.pp": "--pp",
    "train.global_batch_size or train.micro_batch_size": "--micro",
    "train.global_batch_size": "--micro",
}


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


def decide(schedule: str | None, pp: int, vpp: int, micro: int) -> str:
    """The schedule train.py runs for this pipeline (``schedule`` None: its default for ``vpp``), checked by
    train.py's own validator on a config of that layout: one rank per stage, one sequence per micro-batch."""
    par = ParallelConfig(pp=pp, vpp=vpp, schedule=schedule)
    model = ModelConfig(n_layers=max(1, pp * vpp))
    cfg = Config(model=model, parallel=par, train=TrainConfig(micro_batch_size=1, global_batch_size=micro))
    try:
        validate(cfg, world_size=pp)
    except ConfigError as e:
        message = str(e)
        for key, flag in FLAGS.items():
            message = message.replace(key, flag)
        raise SystemExit(f"error: {message}") from None
    return resolve_schedule(par)


def planned(name: str, pp: int, vpp: int, micro: int, costs: dict[str, float]) -> tuple[list[Span], str]:
    spans = simulate(build_schedule(name, pp, vpp, micro), vpp, costs)
    idle = max(idle_fractions(spans, pp))
    formula = bubble_formula(name, pp, vpp, micro, costs)
    title = f"{name}, pp={pp}, vpp={vpp}, {micro} micro-batches (planned): bubble {idle:.3f} of busy time"
    title += f", formula {formula:.3f}"
    return spans, title


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
    first action."""
    rows = []
    for path in sorted(directory.glob("rank*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        train = [row for row in lines if row["train"]]
        if not train:
            raise SystemExit(f"{path} holds no training step")
        rows.append(next((r for r in train if r["call"] == call), None) if call is not None else train[-1])
    if not rows or None in rows:
        raise SystemExit(f"no timings for call {call} in {directory}")
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
    formula = bubble_formula(rec.schedule, rec.pp, rec.vpp, rec.micro_batches)
    title = (
        f"{rec.schedule}, pp={rec.pp}, vpp={rec.vpp}, {rec.micro_batches} micro-batches (measured, ms): "
        f"bubble {idle:.3f} of busy time, formula {formula:.3f}"
    )
    if rec.exposed_reduce_s is not None:
        title += f"; dp reduction exposed after it {rec.exposed_reduce_s * 1e3:.1f} ms"
    return spans, title


# --- the layout planner's costs (--plan) ------------------------------------------------------------------------


def plan_panel(cfg: Config, world: int, profile: Profile) -> tuple[Prediction, Panel, str]:
    """The planner's prediction of ``cfg``'s layout on ``world`` ranks of ``profile``, its timeline as a panel
    (seconds) and a title line. A layout train.py refuses is refused here with the validator's line."""
    try:
        p = planner.predict(cfg, world, profile)
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    t = p.time
    boxes = [Box(s.rank, s.action, s.start, s.end, s.compute_end) for s in t.spans]
    lay = p.layout
    shape = f"{lay.resolved_schedule}, pp={lay.pp}, vpp={lay.vpp}, {lay.micro_batches} micro-batches"
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
    be of the same pipeline (ranks, chunks, schedule, micro-batches)."""
    lay = prediction.layout
    want = (lay.pp, lay.vpp, lay.resolved_schedule, lay.micro_batches)
    got = (rec.pp, rec.vpp, rec.schedule, rec.micro_batches)
    if want != got:
        names = ("pp", "vpp", "schedule", "micro-batches")
        diff = ", ".join(f"{n} {g} (planned {w})" for n, w, g in zip(names, want, got, strict=True) if w != g)
        raise SystemExit(f"error: the timings in {directory} are of another pipeline: {diff}")
    planned_s = prediction.time.pipeline
    error = rec.pipeline_s / planned_s - 1 if planned_s else math.nan
    title = (
        f"{prediction.config.model.name} {prediction.label}, {lay.resolved_schedule}, pp={lay.pp}, vpp={lay.vpp}, "
        f"{lay.micro_batches} micro-batches: pipeline {planned_s:.4g} s planned, {rec.pipeline_s:.4g} s measured "
        f"({100 * error:+.1f}%)"
    )
    measured_panel = Panel(f"measured: {directory}", boxes_of(rec.spans))
    return [planned_panel, measured_panel], title


# --- drawing --------------------------------------------------------------------------------------------------


def label(action: Action, vpp: int) -> str:
    return f"{action.kind}{action.micro}" + (f".{action.chunk}" if vpp > 1 else "")


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
            if w > 7 * len(text):
                out.append(
                    f'<text x="{x + w / 2:.1f}" y="{y + LANE / 2 + 2}" font-size="11" fill="white" '
                    f'text-anchor="middle">{text}</text>'
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


def to_svg(spans: list[Span], title: str, width: int = 1100) -> str:
    """One timeline of schedule spans (any unit), as the unit-cost and measured modes draw it."""
    return draw([Panel("", boxes_of(spans))], title, width=width)


def to_png(panels: list[Panel], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("a .png needs matplotlib (pip install matplotlib); or write a .svg") from None
    lanes = [(p, r) for p in panels for r in range(p.ranks)]
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(lanes) + 1))
    for i, (panel, r) in enumerate(lanes):
        for b in panel.boxes:
            if b.rank == r:
                ax.barh(i, b.end - b.start, left=b.start, color=COLORS[b.action.kind], edgecolor="white")
                if b.compute_end is not None and b.end > b.compute_end:
                    ax.barh(i, b.end - b.compute_end, left=b.compute_end, color="none", hatch="//", edgecolor="white")
    names = [f"{p.heading.split(':')[0]} rank {r}" if len(panels) > 1 else f"rank {r}" for p, r in lanes]
    ax.set_yticks(range(len(lanes)), names)
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, help="default: 1f1b, or interleaved when --vpp > 1")
    parser.add_argument("--pp", type=int, help="default 4")
    parser.add_argument("--vpp", type=int, help="default 1")
    parser.add_argument("--micro", type=int, help="micro-batches per step (default 8)")
    parser.add_argument("--costs", help="planned cost of each kind of action (default F=1,B=2,I=1,W=1)")
    parser.add_argument("--measured", type=Path, help="a run's pipeline_timings directory")
    parser.add_argument("--call", type=int, help="which recorded call (default: the last training step)")
    parser.add_argument("--plan", action="store_true", help="the layout planner's costs of the layout OVERRIDES give")
    parser.add_argument("overrides", nargs="*", help="--plan: train.py overrides, e.g. model=gpt-small parallel.pp=4")
    parser.add_argument("--world", type=int, help="--plan: ranks of the launch (default: dp x tp x pp)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="--plan: a datasheet, or cpu: this machine")
    parser.add_argument("--out", type=Path, required=True, help=".svg or .png")
    args = parser.parse_intermixed_args(argv)
    unit_flags = [f"--{k}" for k in ("schedule", "pp", "vpp", "micro", "costs") if getattr(args, k) is not None]
    if args.plan:
        if unit_flags:
            raise SystemExit(
                f"error: --plan takes the layout as train.py overrides (parallel.pp=4 ...), not {unit_flags[0]}"
            )
        try:
            cfg = load_config(CONF, args.overrides)
            world = args.world or default_world(cfg)
            profile = profile_for(cfg, world, args.device, one_layout=True)
        except ConfigError as e:
            raise SystemExit(f"error: {e}") from None
        prediction, panel, title = plan_panel(cfg, world, profile)
        panels = [panel]
        if args.measured is not None:
            panels, title = plan_and_measured(prediction, panel, read_timings(args.measured, args.call), args.measured)
        unit = "s"
    else:
        if args.overrides or args.world is not None:
            raise SystemExit("error: train.py overrides and --world go with --plan")
        if args.measured is not None:
            spans, title = measured(args.measured, args.call)
        else:
            costs = {
                **UNIT_COSTS,
                **{k: float(v) for k, v in (kv.split("=") for kv in (args.costs or "").split(",") if kv)},
            }
            pp, vpp, micro = (d if v is None else v for v, d in ((args.pp, 4), (args.vpp, 1), (args.micro, 8)))
            schedule = decide(args.schedule, pp, vpp, micro)
            spans, title = planned(schedule, pp, vpp, micro, costs)
        panels, unit = [Panel("", boxes_of(spans))], "ms" if args.measured is not None else None
    if args.out.suffix == ".png":
        to_png(panels, title, args.out)
    else:
        args.out.write_text(draw(panels, title, unit))
    print(f"{title}\nwrote {args.out}")


if __name__ == "__main__":
    main()
