"""``tools/bench.py layouts``: tokens/s, MFU, peak memory and model-state bytes of several layouts of one preset, as
one table, each a real ``torchrun train.py`` run (docs/benchmarks.md#layouts).

    python tools/bench.py layouts --model gpt-mini --layouts 1 dp=2 tp=2 --compile both --baseline
    python tools/bench.py layouts --model gpt-small --layouts "dp=8" "tp=2 pp=4" "dp=2 tp=2 pp=2 zero=1" \\
        --steps 30 --base train.precision=bf16 --out bench.md --plot bench.png
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

from trident_dev.bench import throughput
from trident_dev.bench.harness import Table, format_bytes, number, ratio, spread
from trident_dev.bench.runs import Trial, checked_trial, run_trial

BASE = ["train.eval_every=0", "wandb.mode=disabled", "logging.interval=1000"]
HEADER = ["layout", "ranks", "tokens/s", "spread", "x first", "compile x", "MFU", "peak mem (MB)"]
HEADER.append("model states / rank")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--layouts", nargs="+", default=["1", "dp=2", "tp=2"])
    p.add_argument("--base", nargs="*", default=[], help="train.py overrides every run shares")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps not measured")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off", help="train.compile for each layout")
    p.add_argument("--baseline", action="store_true", help="add a plain PyTorch loop (the throughput subcommand)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--plot", type=Path, help="also draw tokens/s as a bar chart (needs matplotlib)")


def mean_tokens_per_s(rows: list[dict]) -> float:
    time = sum(r["step_time_s"] for r in rows)
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in rows) / time


def model_state_bytes(memory: dict | None) -> str:
    """The most loaded rank's model states in memory.json (every place they live), or "-"."""
    try:
        return format_bytes(sum(memory["max"]["total"].values()))
    except (TypeError, KeyError, AttributeError):
        return "-"


def run(args: argparse.Namespace) -> list[Table]:
    if args.warmup >= args.steps:
        raise SystemExit("error: --warmup must be below --steps")
    base = [f"model={args.model}", *BASE, *args.base, f"train.steps={args.steps}"]
    variants = {"off": [""], "on": [" compile"], "both": ["", " compile"]}[args.compile]
    try:
        trials = [checked_trial(args.repo, (layout + v).strip(), base) for layout in args.layouts for v in variants]
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None

    cfg = trials[0].config
    shape = f"{args.model}, global batch {cfg.train.global_batch_size} x {cfg.model.seq_len}, " if cfg else ""
    title = f"{shape}{' '.join(args.base) or 'fp32'}, steps {args.warmup + 1}-{args.steps} of {args.steps} measured"
    table = Table(title, HEADER)
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i, trial in enumerate(trials):
            if trial.refused is None:
                run_trial(args.repo, trial, Path(tmp) / f"run-{i}", args.timeout)
            table.add(*row(trial, args.warmup, args.steps, rates))
            print(f"[{i + 1}/{len(trials)}] {' | '.join(table.rows[-1])}", file=sys.stderr, flush=True)
    if args.baseline and cfg is not None:
        # One process of the same model and batch, as the plain loop has no parallelism to compare.
        par = dataclasses.replace(cfg.parallel, dp=None, tp=1, pp=1, vpp=1, schedule=None, zero=0)
        par.sequence_parallel = False
        train = dataclasses.replace(
            cfg.train,
            compile=False,
            activation_checkpointing="none",
            recompute_every=1,
            recompute_modules=["norm", "mlp_act"],
        )
        one = dataclasses.replace(cfg, parallel=par, train=train)
        bench = throughput.table(one, 1, warmup=1, steps=3, rounds=2, peak_tflops=cfg.logging.peak_tflops)
        rate = float(bench.column("tokens/s")[1].replace(",", ""))
        first = next(iter(rates.values()), None)
        table.add("plain torch loop (throughput)", 1, number(rate), bench.column("spread")[1], ratio(rate, first))
        rates["plain torch loop"] = rate
    if args.plot:
        plot(list(rates), list(rates.values()), title, args.plot)
    return [table]


def row(trial: Trial, warmup: int, steps: int, rates: dict[str, float]) -> list[str]:
    """One layout's cells; its tokens/s goes into ``rates`` (by layout) when it ran."""
    if trial.refused is not None:
        return [trial.layout, str(trial.world), f"refused: {trial.refused}"]
    if trial.error is not None or len(trial.rows) != steps:
        return [trial.layout, str(trial.world), f"failed: {trial.error or 'missing steps'}"]
    measured = trial.rows[warmup:]
    rate = mean_tokens_per_s(measured)
    first = next(iter(rates.values()), rate)
    twin = trial.layout.removesuffix("compile").strip()  # the eager run of a compiled layout
    eager = rates.get(twin) if twin != trial.layout else None
    rates[trial.layout] = rate
    mfus = [r["mfu"] for r in measured if r.get("mfu") is not None]
    return [
        trial.layout,
        str(trial.world),
        number(rate),
        spread(r["step_time_s"] for r in measured),
        ratio(rate, first),
        ratio(rate, eager),
        f"{100 * sum(mfus) / len(mfus):.2f}%" if mfus else "-",
        f"{max(r['peak_mem_mb'] for r in measured):,.0f}",
        model_state_bytes(trial.memory),
    ]


def plot(labels: list[str], rates: list[float], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    ax.barh(labels[::-1], rates[::-1], color="#4c72b0")
    ax.set_xlabel("tokens/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
