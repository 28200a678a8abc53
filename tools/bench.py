"""Tokens/s, MFU, peak memory and model-state bytes of several layouts of one preset, as one table.

    python tools/bench.py --model gpt-mini --layouts 1 dp=2 tp=2 --compile both --baseline
    python tools/bench.py --model gpt-small --layouts "dp=8" "tp=2 pp=4" "dp=2 tp=2 pp=2 zero=1" --steps 30 \\
        --base train.precision=bf16 --out bench.md --plot bench.png

Each layout (short forms in trident/trials.py; ``1`` is one process) is a real run: ``torchrun --standalone
train.py`` for ``--steps`` steps, the same config and data for all. Its figures come from what the run leaves:
metrics.jsonl (the first ``--warmup`` steps are skipped: start-up, compilation, allocator growth), and the
per-rank model-state bytes of ``<run dir>/memory.json`` where the run writes one ("-" otherwise).

- tokens/s: tokens over time of the measured steps. "x first" divides by the first row's.
- MFU: the run's own figure (metrics.jsonl), the mean over the measured steps.
- peak mem: the logging rank's peak (on a CPU its peak resident set, which includes the framework, on a GPU the
  allocator's peak), the largest over the measured steps.
- model states: parameters, gradients and optimizer states of the most loaded rank.
- ``--compile both`` adds each layout again with ``train.compile=true``; "compile x" is its tokens/s over the
  eager row's (compilation itself happens in the warm-up steps and is not counted).
- ``--baseline`` adds a plain PyTorch training loop of the same preset and batch in one process, measured by
  tools/bench_throughput.py (which times it against trident's own step in alternating rounds).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from trident.trials import Trial, markdown_table, plan, run

REPO = Path(__file__).resolve().parent.parent
BASE = ["train.eval_every=0", "wandb.mode=disabled", "logging.interval=1000"]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def tokens_per_s(rows: list[dict]) -> float:
    time = sum(r["step_time_s"] for r in rows)
    return sum(r["tokens_per_s"] * r["step_time_s"] for r in rows) / time


def model_state_bytes(memory: dict | None) -> str:
    """The most loaded rank's model states in memory.json (every place they live), or "-"."""
    try:
        return format_bytes(sum(memory["max"]["total"].values()))
    except (TypeError, KeyError, AttributeError):
        return "-"


def baseline(model: str, mbs: int, gbs: int, precision: str, steps: int, timeout: float) -> float | None:
    """tools/bench_throughput.py's plain-torch-loop tokens/s for one process."""
    cmd = [sys.executable, str(REPO / "tools" / "bench_throughput.py"), "--model", model, "--micro-batch", str(mbs)]
    cmd += ["--global-batch", str(gbs), "--precision", precision, "--steps", str(steps), "--rounds", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    found = re.search(r"^plain torch loop\s+([\d,]+) tokens/s", proc.stdout, re.MULTILINE)
    if proc.returncode != 0 or not found:
        print(f"baseline failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return None
    return float(found.group(1).replace(",", ""))


def plot(labels: list[str], rates: list[float], title: str, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("error: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        sys.exit(2)
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    ax.barh(labels[::-1], rates[::-1], color="#4c72b0")
    ax.set_xlabel("tokens/s")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--layouts", nargs="+", default=["1", "dp=2", "tp=2"])
    p.add_argument("--base", nargs="*", default=[], help="train.py overrides every run shares")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps not measured")
    p.add_argument("--compile", choices=["off", "on", "both"], default="off", help="train.compile for each layout")
    p.add_argument("--baseline", action="store_true", help="add a plain PyTorch loop (tools/bench_throughput.py)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--out", type=Path, help="also write the table (markdown) here")
    p.add_argument("--plot", type=Path, help="also draw tokens/s as a bar chart (needs matplotlib)")
    args = p.parse_args()
    if args.warmup >= args.steps:
        print("error: --warmup must be below --steps", file=sys.stderr)
        sys.exit(2)

    base = [f"model={args.model}", *BASE, *args.base, f"train.steps={args.steps}"]
    variants = {"off": [""], "on": [" compile"], "both": ["", " compile"]}[args.compile]
    try:
        trials = [plan(REPO, (layout + v).strip(), base) for layout in args.layouts for v in variants]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)

    header = ["layout", "ranks", "tokens/s", "x first", "compile x", "MFU", "peak mem (MB)", "model states / rank"]
    rows: list[list[str]] = []
    rates: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="bench-") as tmp:
        for i, trial in enumerate(trials):
            if trial.refused is None:
                run(REPO, trial, Path(tmp) / f"run-{i}", args.timeout)
            rows.append(table_row(trial, args.warmup, args.steps, rates))
            print(f"[{i + 1}/{len(trials)}] {' | '.join(rows[-1])}", file=sys.stderr, flush=True)
    if args.baseline and trials[0].config is not None:
        tr = trials[0].config.train
        rate = baseline(args.model, tr.micro_batch_size, tr.global_batch_size, tr.precision, 3, args.timeout)
        first = next(iter(rates.values()), None)
        ratio = f"{rate / first:.2f}" if rate and first else "-"
        rows.append(["plain torch loop (bench_throughput.py)", "1", f"{rate:,.0f}" if rate else "failed", ratio])
        rows[-1] += ["-"] * (len(header) - len(rows[-1]))
        if rate:
            rates["plain torch loop"] = rate
    cfg = trials[0].config
    shape = f"{args.model}, global batch {cfg.train.global_batch_size} x {cfg.model.seq_len}, " if cfg else ""
    title = f"{shape}{' '.join(args.base) or 'fp32'}, steps {args.warmup + 1}-{args.steps} of {args.steps} measured"
    table = markdown_table(header, rows)
    print(f"{title}\n\n{table}")
    if args.out:
        args.out.write_text(f"{title}\n\n{table}\n")
    if args.plot:
        plot(list(rates), list(rates.values()), title, args.plot)


def table_row(trial: Trial, warmup: int, steps: int, rates: dict[str, float]) -> list[str]:
    """One layout's cells; its tokens/s goes into ``rates`` (by layout) when it ran."""
    if trial.refused is not None:
        return [trial.layout, str(trial.world), f"refused: {trial.refused}", *["-"] * 5]
    if trial.error is not None or len(trial.rows) != steps:
        return [trial.layout, str(trial.world), f"failed: {trial.error or 'missing steps'}", *["-"] * 5]
    measured = trial.rows[warmup:]
    rate = tokens_per_s(measured)
    first = next(iter(rates.values()), rate)
    twin = trial.layout.removesuffix("compile").strip()  # the eager run of a compiled layout
    eager = rates.get(twin) if twin != trial.layout else None
    rates[trial.layout] = rate
    mfus = [r["mfu"] for r in measured if r.get("mfu") is not None]
    return [
        trial.layout,
        str(trial.world),
        f"{rate:,.0f}",
        f"{rate / first:.2f}",
        f"{rate / eager:.2f}" if eager else "-",
        f"{100 * sum(mfus) / len(mfus):.2f}%" if mfus else "-",
        f"{max(r['peak_mem_mb'] for r in measured):,.0f}",
        model_state_bytes(trial.memory),
    ]


if __name__ == "__main__":
    main()
