"""Draw a pipeline schedule as a timeline: one row per pipeline rank, a box per action (F, B, I, W) labelled
micro-batch and chunk, the gaps between boxes the bubble.

    python tools/plot_schedule.py --schedule 1f1b --pp 4 --micro 8 --out docs/schedule.svg        # as planned
    python tools/plot_schedule.py --pp 4 --vpp 2 --out interleaved.svg   # the schedule train.py picks: interleaved
    python tools/plot_schedule.py --measured outputs/<run>/pipeline_timings --out measured.svg      # as measured

Planned: the unit-cost simulation of parallel/pipeline/schedules.py (``--costs F=1,B=2,I=1,W=1``) of the schedule
train.py would run: ``--schedule`` left out is 1f1b, or interleaved when ``--vpp`` > 1 (``parallel.schedule``'s
default), and a layout train.py refuses is refused here with the same line. Measured: the
action timings a run records with ``logging.pipeline_timings=true`` (one file per pipeline rank; ``--call`` picks
the step, default the last training step). SVG is written here without any dependency; a ``.png`` output needs
matplotlib (``pip install matplotlib``).
"""

from __future__ import annotations

import argparse
import json
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

COLORS = {"F": "#4c78a8", "B": "#54a24b", "I": "#88d27a", "W": "#f58518"}
LANE, PAD, LEFT, TOP = 34, 6, 70, 40


# train.py's keys for this tool's flags, so the validator's line names what to change here.
FLAGS = {
    "parallel.schedule": "--schedule",
    "parallel.vpp": "--vpp",
    "parallel.pp": "--pp",
    "train.global_batch_size or train.micro_batch_size": "--micro",
    "train.global_batch_size": "--micro",
}


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


def measured(directory: Path, call: int | None) -> tuple[list[Span], str]:
    """Spans of one recorded step, times in ms from the step's first action."""
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
        Span(row["rank"], Action(k, m, c), (start - t0) * 1e3, (end - t0) * 1e3)
        for row in rows
        for k, m, c, start, end in row["spans"]
    ]
    pp = len(rows)
    idle = max(idle_fractions(spans, pp))
    first = rows[0]
    formula = bubble_formula(first["schedule"], pp, first["vpp"], first["micro_batches"])
    title = (
        f"{first['schedule']}, pp={pp}, vpp={first['vpp']}, {first['micro_batches']} micro-batches (measured, ms): "
        f"bubble {idle:.3f} of busy time, formula {formula:.3f}"
    )
    return spans, title


def label(action: Action, vpp: int) -> str:
    return f"{action.kind}{action.micro}" + (f".{action.chunk}" if vpp > 1 else "")


def to_svg(spans: list[Span], title: str, width: int = 1100) -> str:
    pp = 1 + max(s.rank for s in spans)
    vpp = 1 + max(s.action.chunk for s in spans)
    end = max(s.end for s in spans)
    scale = (width - LEFT - PAD) / end
    height = TOP + pp * LANE + 30
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{PAD}" y="20" font-size="13">{escape(title)}</text>',
    ]
    for r in range(pp):
        y = TOP + r * LANE
        out.append(f'<rect x="{LEFT}" y="{y}" width="{end * scale:.1f}" height="{LANE - 4}" fill="#eeeeee"/>')
        out.append(f'<text x="{PAD}" y="{y + LANE / 2 + 2}" font-size="12">rank {r}</text>')
    for s in spans:
        x, w = LEFT + s.start * scale, max((s.end - s.start) * scale, 0.5)
        y = TOP + s.rank * LANE
        # Later chunks are drawn lighter, so the interleaved schedule's laps can be told apart.
        opacity = 1.0 - 0.45 * s.action.chunk / max(1, vpp - 1)
        out.append(
            f'<rect x="{x:.1f}" y="{y}" width="{w:.1f}" height="{LANE - 4}" fill="{COLORS[s.action.kind]}" '
            f'fill-opacity="{opacity:.2f}" stroke="white" stroke-width="0.5"/>'
        )
        text = label(s.action, vpp)
        if w > 7 * len(text):
            out.append(
                f'<text x="{x + w / 2:.1f}" y="{y + LANE / 2 + 2}" font-size="11" fill="white" '
                f'text-anchor="middle">{text}</text>'
            )
    legend_y = TOP + pp * LANE + 18
    kinds = sorted({s.action.kind for s in spans}, key="FBIW".index)
    for i, kind in enumerate(kinds):
        x = LEFT + i * 120
        name = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weights)"}[kind]
        out.append(f'<rect x="{x}" y="{legend_y - 10}" width="12" height="12" fill="{COLORS[kind]}"/>')
        out.append(f'<text x="{x + 16}" y="{legend_y}" font-size="11">{kind}: {name}</text>')
    out.append(f'<text x="{LEFT + len(kinds) * 120}" y="{legend_y}" font-size="11">grey: idle (bubble)</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_png(spans: list[Span], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("a .png needs matplotlib (pip install matplotlib); or write a .svg") from None
    pp = 1 + max(s.rank for s in spans)
    fig, ax = plt.subplots(figsize=(12, 0.6 * pp + 1))
    for s in spans:
        ax.barh(s.rank, s.end - s.start, left=s.start, color=COLORS[s.action.kind], edgecolor="white")
    ax.set_yticks(range(pp), [f"rank {r}" for r in range(pp)])
    ax.invert_yaxis()
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=150)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", choices=SCHEDULES, help="default: 1f1b, or interleaved when --vpp > 1")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--vpp", type=int, default=1)
    parser.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    parser.add_argument("--costs", default="F=1,B=2,I=1,W=1", help="planned cost of each kind of action")
    parser.add_argument("--measured", type=Path, help="a run's pipeline_timings directory")
    parser.add_argument("--call", type=int, help="which recorded call (default: the last training step)")
    parser.add_argument("--out", type=Path, required=True, help=".svg or .png")
    args = parser.parse_args(argv)
    if args.measured is not None:
        spans, title = measured(args.measured, args.call)
    else:
        costs = {**UNIT_COSTS, **{k: float(v) for k, v in (kv.split("=") for kv in args.costs.split(","))}}
        schedule = decide(args.schedule, args.pp, args.vpp, args.micro)
        spans, title = planned(schedule, args.pp, args.vpp, args.micro, costs)
    if args.out.suffix == ".png":
        to_png(spans, title, args.out)
    else:
        args.out.write_text(to_svg(spans, title))
    print(f"{title}\nwrote {args.out}")


if __name__ == "__main__":
    main()
