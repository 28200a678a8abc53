"""``tools/bench.py matrix``: many layouts of one small model for a few steps, each one's losses against one
process; exit 1 if an fp32 one is off (docs/benchmarks.md#matrix).

    python tools/bench.py matrix                                   # the default matrix on gpt-tiny (8 layers)
    python tools/bench.py matrix --layouts "dp=2 tp=2 sp" "tp=2 pp=4" --steps 8
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from trident_dev.bench.harness import Table
from trident_dev.bench.runs import Trial, checked_trial, run_trial
from trident_dev.curves import REL, curve_mismatches

LAYOUTS = [
    "dp=2",
    "dp=4 mbs=1",
    "tp=2",
    "tp=2 sp",
    "tp=4",
    "dp=2 tp=2 sp",
    "tp=2 ac=full",
    "dp=2 ac=selective",
    "tp=2 sp ac=selective",
    "precision=bf16",
    "dp=2 precision=fp16",
    "tp=2 sp compile",
    "pp=2",
    "pp=4",
    "pp=2 vpp=2",
    "pp=2 schedule=gpipe",
    "dp=2 zero=1",
    "dp=2 zero=2",
    "dp=2 zero=3",
    "tp=2 pp=4",
    "dp=2 tp=2 pp=2 vpp=2 zero=1 sp ac=selective",
]
BASE = [
    "model=gpt-tiny",
    "model.n_layers=8",  # splits over pp x vpp up to 8
    "train.global_batch_size=16",
    "train.micro_batch_size=2",
    "train.eval_every=0",
    "wandb.mode=disabled",
    "logging.interval=1000",
]
HEADER = ["layout", "ranks", "max rel. loss diff", "max rel. grad-norm diff", "status"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layouts", nargs="+", default=LAYOUTS, help="layouts to run (default: the matrix)")
    p.add_argument("--base", nargs="*", default=BASE, help="train.py overrides every run shares")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rel", type=float, default=REL, help="the largest relative difference an fp32 layout may show")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take")


def rel_diff(rows: list[dict], reference: list[dict], key: str) -> float:
    pairs = [(r[key], ref[key]) for r, ref in zip(rows, reference, strict=False)]
    return max((abs(a - b) / abs(b) for a, b in pairs if a is not None and b), default=float("nan"))


def row(trial: Trial, reference: list[dict], steps: int, rel: float) -> tuple[list[str], bool]:
    """The table row of one trial, and whether it is a failure."""
    if trial.refused is not None:
        return [trial.layout, str(trial.world), "-", "-", f"refused: {trial.refused}"], False
    if trial.error is not None or len(trial.rows) != steps:
        return [trial.layout, str(trial.world), "-", "-", f"failed: {trial.error or 'missing steps'}"], True
    loss, norm = rel_diff(trial.rows, reference, "loss"), rel_diff(trial.rows, reference, "grad_norm")
    fp32 = trial.config is not None and trial.config.train.precision == "fp32"
    if not fp32:
        status = "lower precision: for information"
    else:
        status = "ok" if not curve_mismatches(reference, trial.rows, rel) else f"OFF: beyond {rel:g}"
    return [trial.layout, str(trial.world), f"{loss:.1e}", f"{norm:.1e}", status], fp32 and status != "ok"


def run(args: argparse.Namespace) -> list[Table]:
    base = [*args.base, f"train.steps={args.steps}"]
    try:
        trials = [checked_trial(args.repo, layout, base) for layout in args.layouts]
        reference = checked_trial(args.repo, "1", base)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    title = f"{' '.join(args.base)}, {args.steps} steps, against one process (fp32 tolerance {args.rel:g})"
    table = Table(title, HEADER)
    with tempfile.TemporaryDirectory(prefix="layout-matrix-") as tmp:
        run_trial(args.repo, reference, Path(tmp) / "reference", args.timeout)
        if not reference.ok or len(reference.rows) != args.steps:
            raise SystemExit(f"error: the one-process reference run failed: {reference.error or reference.refused}")
        for i, trial in enumerate(trials):
            if trial.refused is None:
                run_trial(args.repo, trial, Path(tmp) / f"layout-{i}", args.timeout)
            cells, bad = row(trial, reference.rows, args.steps, args.rel)
            table.add(*cells)
            table.ok &= not bad
            print(f"[{i + 1}/{len(trials)}] {' | '.join(cells)}", file=sys.stderr, flush=True)
    return [table]
