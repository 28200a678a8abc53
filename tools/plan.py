"""Plan a launch: every layout train.py accepts for a model, world size and global batch, its peak memory per rank
(the estimator's) and its step time (the planner's model), the best first.

    python tools/plan.py model=gpt-mini --world 8                       # this machine (measured once, then cached)
    python tools/plan.py model=gpt-mini --world 8 --measure 6           # and check 12 of them by running them
    python tools/plan.py model=llama-8b train.global_batch_size=512 train.precision=bf16 --world 64 --device h100

Takes train.py's own overrides (the model, batch, precision, and any layout key, which the planner then varies).
The layouts are every combination of tp, pp, vpp, schedule, ZeRO stage (and ZeRO-3's gather mode), optimizer
offload (and ratio), recomputation, micro-batch size and sequence parallelism that train.py's validator accepts,
with dp the rest of the world; those whose predicted peak does not fit the device are dropped. ``--device`` picks
a datasheet profile (h100, h200, a100: nodes of 8 GPUs, NVLink inside, InfiniBand between) or ``cpu``, this machine
measured; by default the machine this runs on. ``--calibrate`` measures this machine again (for a GPU: instead of
its datasheet). ``--measure K`` runs the K best layouts and K from the rest of the ranking through train.py here and
prints predicted against measured step time and memory, and a last line with the errors.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from trident.errors import ConfigError
from trident.plan.machine import DEVICES, profile_for
from trident.plan.planner import plan
from trident.plan.report import plan_table
from trident.tool_config import load_config

REPO = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="train.py's overrides, e.g. model=gpt-small train.precision=bf16")
    p.add_argument("--world", type=int, required=True, help="processes to launch")
    p.add_argument("--nodes", type=int, help="nodes they run on (default: as many as the device's nodes need)")
    p.add_argument("--device", choices=DEVICES, help="datasheet profile, or cpu (default: this machine's)")
    p.add_argument("--top", type=int, default=10, help="layouts to print")
    p.add_argument("--measure", type=int, default=0, metavar="K", help="run the K best and K others here")
    p.add_argument("--calibrate", action="store_true", help="measure this machine now, replacing the cached figures")
    p.add_argument("--steps", type=int, default=8, help="steps of each measured run")
    args = p.parse_intermixed_args(argv)
    try:
        if args.world < 1 or (args.nodes is not None and not 1 <= args.nodes <= args.world):
            raise ConfigError("--world must be >= 1 and --nodes between 1 and --world")
        cfg = load_config(REPO / "conf", args.overrides)
        profile = profile_for(cfg, args.world, args.device, args.nodes, args.calibrate, log=print)
        result = plan(cfg, args.world, profile, args.nodes)
    except ConfigError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(plan_table(result, cfg, args.top))
    if args.measure:
        from trident.plan import measure  # noqa: PLC0415

        if result.profile.device != "cpu" and result.profile.source.startswith("datasheet"):
            print("note: measuring here checks a datasheet's predictions against this machine", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="trident-plan-") as runs:
            picked = measure.pick(result, args.measure)
            measured = measure.measure(picked, args.overrides, args.world, REPO, Path(runs), steps=args.steps)
        print()
        print(measure.measured_table(measured))
        print(measure.summary(measured))
    return 0


if __name__ == "__main__":
    sys.exit(main())
