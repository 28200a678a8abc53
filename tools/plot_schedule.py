"""Draw a pipeline schedule as a timeline: one row per pipeline rank, a box per action (F, B, I, W) labelled
micro-batch and chunk, the gaps between boxes the bubble.

    python tools/plot_schedule.py --schedule 1f1b --pp 4 --micro 8 --out docs/schedule.svg        # as planned
    python tools/plot_schedule.py --pp 4 --vpp 2 --out interleaved.png   # the schedule train.py picks: interleaved
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
calibration (trident_dev/plan/calibrate.py, cached; only what the layout needs is measured). A box's solid part is
compute, its hatched end the tensor-parallel collectives inside the action; the timeline is the planner's
simulation of the schedule (trident/plan/simulate.py), in seconds. With ``--measured`` too, the planned lanes are
drawn above the measured ones of the same layout on one time scale, and the title gives both pipeline times
(first action's start to the last one's end).

``--out`` ending in ``.svg`` is drawn without any library, one ending in ``.png`` with matplotlib (the install
brings it). Every box carries its label where the label fits, upright in a narrow box. The timelines and their
drawing are trident_dev/schedule_plot.py's; this is its command line.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trident.config import Config, ModelConfig, ParallelConfig, TrainConfig, validate
from trident.errors import ConfigError
from trident.layout import chunks_per_rank
from trident.parallel.pipeline.schedules import SCHEDULES, UNIT_COSTS
from trident_dev.plan.machine import DEVICES, profile_for
from trident_dev.schedule_plot import (
    Panel,
    boxes_of,
    draw,
    measured,
    plan_and_measured,
    plan_panel,
    planned,
    read_timings,
    to_png,
)
from trident_dev.tool_config import default_world, load_config

CONF = Path(__file__).resolve().parent.parent / "conf"


# train.py's keys for this tool's flags, so the validator's line names what to change here.
FLAGS = {
    "parallel.schedule": "--schedule",
    "parallel.vpp": "--vpp",
    "parallel.pp": "--pp",
    "train.global_batch_size or train.micro_batch_size": "--micro",
    "train.global_batch_size": "--micro",
}


def decide(schedule: str | None, pp: int, vpp: int, micro: int) -> tuple[str, int]:
    """The schedule train.py runs for this pipeline (``schedule`` None: its default for ``vpp``) and its chunks per
    rank (zb-v's two when ``vpp`` is left at 1), checked by train.py's own validator on a config of that layout: one
    rank per stage, one sequence per micro-batch."""
    par = ParallelConfig(pp=pp, vpp=vpp, schedule=schedule)
    model = ModelConfig(n_layers=max(1, pp * chunks_per_rank(schedule, pp, vpp)))
    cfg = Config(model=model, parallel=par, train=TrainConfig(micro_batch_size=1, global_batch_size=micro))
    try:
        layout = validate(cfg, world_size=pp)
    except ConfigError as e:
        message = str(e)
        for key, flag in FLAGS.items():
            message = message.replace(key, flag)
        raise SystemExit(f"error: {message}") from None
    return layout.schedule or "1f1b", layout.vpp  # one rank: gradient accumulation, 1F1B's order


# --- the layout planner's costs (--plan) ------------------------------------------------------------------------


def timelines(args: argparse.Namespace) -> tuple[list[Panel], str, str | None]:
    """The panels the flags ask for, their title, and their time unit (None: the unit-cost simulation's)."""
    unit_flags = [f"--{k}" for k in ("schedule", "pp", "vpp", "micro", "costs") if getattr(args, k) is not None]
    if args.plan:
        if unit_flags:
            raise SystemExit(
                f"error: --plan takes the layout as train.py overrides (parallel.pp=4 ...), not {unit_flags[0]}"
            )
        cfg = load_config(CONF, args.overrides)
        world = args.world or default_world(cfg)
        profile = profile_for(cfg, world, args.device, one_layout=True)
        prediction, panel, title = plan_panel(cfg, world, profile)
        panels = [panel]
        if args.measured is not None:
            panels, title = plan_and_measured(prediction, panel, read_timings(args.measured, args.call), args.measured)
        return panels, title, "s"
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
        schedule, vpp = decide(args.schedule, pp, vpp, micro)
        spans, title = planned(schedule, pp, vpp, micro, costs)
    return [Panel("", boxes_of(spans))], title, "ms" if args.measured is not None else None


def main(argv: list[str] | None = None) -> None:
    summary, _, details = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        description=summary, epilog=details, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    try:
        panels, title, unit = timelines(args)
        if args.out.suffix == ".png":
            to_png(panels, title, args.out)
        else:
            args.out.write_text(draw(panels, title, unit))
    except (ConfigError, ValueError, ImportError) as e:  # the drawing's refusals, as one line
        raise SystemExit(f"error: {e}") from None
    print(f"{title}\nwrote {args.out}")


if __name__ == "__main__":
    main()
