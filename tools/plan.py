"""Plan a launch: every layout train.py accepts for a model, world size and global batch, its peak memory per rank
(the estimator's) and its step time (the planner's model), the best first.

    python tools/plan.py model=gpt-mini --world 8                       # this machine (measured once, then cached)
    python tools/plan.py model=gpt-mini --world 8 --measure 6           # and check 12 of them by running them
    python tools/plan.py model=llama-8b train.global_batch_size=512 train.precision=bf16 --world 64 --device h100
    python tools/plan.py model=llama-8b model.seq_len=131072 parallel.zero=1 train.micro_batch_size=1 \\
        parallel.offload.optimizer=none parallel.sequence_parallel=true --world 64 --device h100 --keep

Takes train.py's own overrides (the model, batch, precision, and any layout key, which the planner then varies).
The first lines say what it plans for: the global batch (train.global_batch_size sequences of model.seq_len
tokens) and the precision, which on a GPU (a datasheet --device, or this machine's GPU) is bf16 unless
train.precision is given, and on a CPU train.py's default, fp32. While it works, stderr shows the layouts examined,
the time spent and the time left; the table ends with the whole torchrun command that launches the best layout.
It estimates and times only as many layouts as it takes to know the --top best (bounds on memory and step time
rule out the rest, trident/plan/planner.py); --measure, which samples the whole ranking, times every one.
The layouts are every combination of tp, pp, vpp, schedule, ZeRO stage (and ZeRO-3's gather mode), optimizer
offload (and ratio), recomputation, micro-batch size and sequence parallelism that train.py's validator accepts,
with dp the rest of the world; those whose predicted peak does not fit the device are dropped. The layouts include
context parallelism (parallel.cp, with each parallel.cp_comm). ``--keep`` plans only the layouts that have the layout
keys given among the overrides, as parallel.auto=true keeps them (a large model on many ranks has hundreds of
thousands of layouts; keeping a few keys makes its plan take minutes). ``--device`` picks
a datasheet profile (h100, h200, a100: nodes of 8 GPUs, NVLink inside, InfiniBand between) or ``cpu``, this machine
measured; by default the machine this runs on. ``--calibrate`` measures this machine again (for a GPU: instead of
its datasheet). A CPU calibration ends with one held-out run of train.py (dp = the world at the plan's micro-batch,
at a global batch none of the plan's layouts has) whose measured over modelled step scales every prediction
(trident_dev/plan/residual.py). ``--measure K`` runs the K best layouts and K from the rest of the ranking through
train.py here and prints predicted against measured step time and memory, and a last line with the errors.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from trident.config import Config
from trident.errors import ConfigError
from trident.memory.measure import format_bytes
from trident.plan.machine import local_device
from trident.plan.planner import Plan, Prediction, given_keys, plan
from trident.plan.report import launch_overrides
from trident_dev.plan import measure
from trident_dev.plan.contention import describe_profile
from trident_dev.plan.machine import DEVICES, profile_for
from trident_dev.tool_config import load_config

REPO = Path(__file__).resolve().parent.parent


def launch_command(p: Prediction, plan: Plan, base: Config, given: list[str]) -> str:
    """The whole command that launches ``p``: torchrun on the plan's nodes and ranks per node, train.py with the
    overrides the plan was made for (``given``, but those of the keys the layout sets) and the layout's own."""
    mine = launch_overrides(p, base)
    keys = {o.split("=", 1)[0].lstrip("+") for o in mine}
    kept = [o for o in given if o.split("=", 1)[0].lstrip("+") not in keys]
    nodes, per_node = plan.placement.nodes, plan.placement.ranks_per_node
    rendezvous = " --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id JOB" if nodes > 1 else ""
    return f"torchrun --nnodes {nodes} --nproc-per-node {per_node}{rendezvous} train.py {' '.join([*kept, *mine])}"


def header(plan: Plan, cfg: Config) -> list[str]:
    m, tr, pl = cfg.model, cfg.train, plan.placement
    nodes = f"{pl.nodes} node{'s' if pl.nodes > 1 else ''} of {pl.ranks_per_node}"
    threads = (
        f", {pl.threads} thread{'s' if pl.threads > 1 else ''} per rank on {pl.cores} cores"
        if plan.profile.device == "cpu"
        else ""
    )
    floored = f" ({plan.floored:,} by a lower bound of their memory)" if plan.floored else ""
    untimed = (
        f"; {plan.untimed:,} not estimated, their step (or its lower bound) behind the best {plan.top}"
        if plan.untimed
        else ""
    )
    return [
        f"plan: {m.name} on {plan.world} ranks ({nodes}{threads}), {describe_profile(plan.profile)}",
        f"batch {tr.global_batch_size} x {m.seq_len} tokens, {tr.precision}; "
        f"{plan.examined:,} layouts accepted by the validator ({len(plan.refused):,} refused), "
        f"{plan.do_not_fit:,} do not fit in {format_bytes(plan.profile.usable_fraction * plan.profile.memory_bytes)}"
        f"{' per node' if plan.profile.device == 'cpu' else ' per device'}{floored}{untimed}; "
        f"planned in {plan.seconds:.1f} s",
    ]


def plan_table(planned: Plan, cfg: Config, top: int, given: list[str] | None = None) -> str:
    """The ``top`` best layouts, one row each: predicted tokens/s, MFU, step time, peak memory per rank, pipeline
    bubble, exposed communication (tensor-parallel collectives, pipeline messages, dp/ZeRO not hidden), overrides;
    with ``given`` (the overrides the plan was made for), a last line: the whole command that launches the best."""
    lines = header(planned, cfg)
    if not planned.ranked:
        lines.append("no layout fits: try more ranks, train.activation_checkpointing, parallel.zero or offload")
        return "\n".join(lines)
    cols = (
        f"{'#':>3} {'tokens/s':>10} {'MFU':>6} {'step':>8} {'peak/rank':>10} {'bubble':>6} {'exposed comm':>13}  layout"
    )
    lines += ["", cols]
    for i, p in enumerate(planned.ranked[:top], 1):
        t = p.time
        assert t is not None
        mfu = f"{100 * p.mfu:5.1f}%" if p.mfu is not None else "   n/a"
        exposed_comm = t.tp_comm + t.p2p + t.dp_comm  # what nothing overlaps: tp collectives, p2p, exposed dp/ZeRO
        exposed = f"{exposed_comm:6.3f}s {100 * exposed_comm / t.step:4.1f}%"
        peak = (
            format_bytes(p.peak["device"] + p.peak["host"])
            if planned.profile.device == "cpu"
            else format_bytes(p.peak["device"])
        )
        bubble = f"{100 * t.bubble:5.1f}%"
        lines.append(
            f"{i:>3} {p.tokens_per_s:>10,.0f} {mfu:>6} {t.step:>7.3f}s {peak:>10} {bubble} {exposed:>13}  {p.label}"
        )
        lines.append(f"{'':>3} {' '.join(launch_overrides(p, cfg)) or '(the config as given)'}")
    if given is not None:
        lines += ["", "launch the best (#1):", f"  {launch_command(planned.ranked[0], planned, cfg, given)}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="train.py's overrides, e.g. model=gpt-small train.precision=bf16")
    p.add_argument("--world", type=int, required=True, help="processes to launch")
    p.add_argument("--nodes", type=int, help="nodes they run on (default: as many as the device's nodes need)")
    p.add_argument("--device", choices=DEVICES, help="datasheet profile, or cpu (default: this machine's)")
    p.add_argument("--keep", action="store_true", help="plan only layouts with the layout keys given (not vary them)")
    p.add_argument("--top", type=int, default=10, help="layouts to print")
    p.add_argument("--measure", type=int, default=0, metavar="K", help="run the K best and K others here")
    p.add_argument("--calibrate", action="store_true", help="measure this machine now, replacing the cached figures")
    p.add_argument("--steps", type=int, default=8, help="steps of each measured run (and one more, profiled)")
    p.add_argument("--runs", type=Path, help="keep the measured runs' directories here (default: a temporary one)")
    p.add_argument(
        "--accept-busy",
        action="store_true",
        help="cache a calibration taken while other processes kept the cores busy (default: say so, do not cache)",
    )
    args = p.parse_intermixed_args(argv)
    try:
        if args.world < 1 or (args.nodes is not None and not 1 <= args.nodes <= args.world):
            raise ConfigError("--world must be >= 1 and --nodes between 1 and --world")
        if args.measure and args.steps <= measure.WARMUP:
            raise ConfigError(
                f"--steps must be above the {measure.WARMUP} warm-up steps --measure leaves out; try --steps 8"
            )
        device = args.device or local_device()
        given = any(o.lstrip("+").split("=", 1)[0] == "train.precision" for o in args.overrides)
        bf16 = device != "cpu" and not given  # a GPU trains in bf16; fp32 is train.py's default for a CPU
        overrides = [*args.overrides, *(["train.precision=bf16"] if bf16 else [])]
        cfg = load_config(REPO / "conf", overrides)
        m, tr = cfg.model, cfg.train
        print(
            f"planning {m.name} on {args.world} ranks of {device}: a global batch of {tr.global_batch_size} "
            f"sequences x {m.seq_len} tokens (train.global_batch_size, model.seq_len), {tr.precision}"
            + (" (a GPU's default; set train.precision to change it)" if bf16 else ""),
            flush=True,
        )
        listing = Progress(sys.stderr, "listing what to measure")  # a calibration's needs: every layout, priced
        profile = profile_for(
            cfg,
            args.world,
            device,
            args.nodes,
            args.calibrate,
            log=print,
            progress=listing,
            accept_busy=args.accept_busy,
            held_out=(overrides, REPO),
        )
        keep = given_keys(args.overrides) if args.keep else None
        # The table's rows are all a plan needs to find (--measure picks from the whole ranking).
        top = None if args.measure else max(1, args.top)
        result = plan(cfg, args.world, profile, args.nodes, progress=Progress(sys.stderr), keep=keep, top=top)
    except ConfigError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    print(plan_table(result, cfg, args.top, given=overrides))
    if args.measure:
        if result.profile.device != "cpu" and result.profile.source.startswith("datasheet"):
            print("note: measuring here checks a datasheet's predictions against this machine", file=sys.stderr)
        with tempfile.TemporaryDirectory(prefix="trident-plan-") as runs:
            picked = measure.pick(result, args.measure)
            root = args.runs if args.runs is not None else Path(runs)
            measured = measure.measure(picked, overrides, args.world, REPO, root, steps=args.steps)
        print()
        print(measure.measured_table(measured))
        print("\nstep time split (seconds; the mean rank; measured: a profiled step scaled to the median step):")
        for m in measured:
            if text := measure.breakdown(m):
                print(text)
        print(measure.summary(measured))
    return 0


class Progress:
    """The planner's progress on ``out``: candidates examined, time spent and left, rewritten in place on a
    terminal (at most 10 times a second), a line every ``every`` seconds elsewhere, and a last line when done."""

    def __init__(self, out, what: str = "planning", every: float = 10.0) -> None:
        self.out, self.what, self.tty = out, what, out.isatty()
        self.every = 0.1 if self.tty else every
        self.shown = time.perf_counter()

    def __call__(self, done: int, total: int, elapsed: float) -> None:
        now = time.perf_counter()
        if done < total and now - self.shown < self.every:
            return
        self.shown = now
        if done < total:
            left = elapsed / done * (total - done)
            line = f"{self.what}: {done:,} of {total:,} layouts examined, {elapsed:.0f} s, about {left:.0f} s left"
        else:
            line = f"{self.what}: {total:,} layouts examined in {elapsed:.1f} s"
        end = "\n" if done == total or not self.tty else ""
        print(f"\r{line:<80}" if self.tty else line, end=end, file=self.out, flush=True)


if __name__ == "__main__":
    sys.exit(main())
