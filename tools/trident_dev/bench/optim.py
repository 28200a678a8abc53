"""``tools/bench.py optim``: Muon (``optim.name=muon``) against AdamW at equal tokens, each at its best learning rate
of a small sweep, as real ``train.py`` runs on the embedded corpus: the loss reached, the validation loss and the
step time of every run, Muon's step-time overhead, and the loss curves drawn (docs/benchmarks.md#optim).

    python tools/bench.py optim                                  # gpt-mini, one process and dp=4 ZeRO-1
    python tools/bench.py optim --dp 1 --steps 40 --adamw-lr 3e-3 --muon-lr 0.02 0.04 --plot optim.png

AdamW's sweep runs first; Muon's runs with AdamW's best ``optim.lr`` for what it does not step itself (embeddings,
head, norms, biases). Every run of a world sees the same batches (same seed, steps and global batch), so the losses
are at equal tokens; the best of each optimizer is the lowest validation loss after the last step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from trident_dev.bench.harness import Table, ratio
from trident_dev.bench.runs import Trial, checked_trial, run_trial

HEADER = ["ranks", "optimizer", "lr", "AdamW lr (rest)", "train loss (last 4)", "val loss", "step time (s)"]
HEADER += ["vs AdamW", "best"]
BASE = ["wandb.mode=disabled", "logging.interval=1000"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--dp", type=int, nargs="+", default=[1, 4], help="worlds (data-parallel ranks), a table each")
    p.add_argument("--zero", type=int, default=1, help="parallel.zero where dp > 1")
    p.add_argument("--steps", type=int, default=16, help="optimizer steps of every run (equal tokens)")
    p.add_argument("--warmup-steps", type=int, default=2, help="optim.warmup_steps (then cosine to optim.min_lr)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (model.seq_len)")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--micro-batch", type=int, default=None, help="default: global batch / dp")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches after the last step")
    p.add_argument("--adamw-lr", type=float, nargs="+", default=[1e-3, 3e-3, 6e-3], help="AdamW's sweep (optim.lr)")
    p.add_argument("--muon-lr", type=float, nargs="+", default=[0.01, 0.02, 0.04], help="Muon's (optim.muon_lr)")
    p.add_argument(
        "--ns-dtype",
        choices=["auto", "bf16", "fp32"],
        default="auto",
        help="optim.muon_ns_dtype; auto: bf16 on a GPU, fp32 on a CPU (where bf16 matmuls are emulated, slow)",
    )
    p.add_argument("--base", nargs="*", default=[], help="train.py overrides every run shares")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--plot", type=Path, help="draw the loss curves (loss against tokens) to this PNG")
    p.add_argument("--keep", type=Path, help="keep the runs' directories (metrics.jsonl, ...) under this one")


@dataclass
class Result:
    """One run of the sweep."""

    dp: int
    zero: int
    optimizer: str
    lr: float
    rest_lr: float
    trial: Trial

    @property
    def rows(self) -> list[dict]:
        return self.trial.rows

    @property
    def val_loss(self) -> float:
        vals = [r["val_loss"] for r in self.rows if r.get("val_loss") is not None]
        return vals[-1] if vals else float("inf")

    @property
    def train_loss(self) -> float:
        tail = [r["loss"] for r in self.rows[-4:]]
        return sum(tail) / len(tail) if tail else float("inf")

    @property
    def step_times(self) -> list[float]:
        """Seconds per step after the first two (start-up, allocator growth)."""
        rows = self.rows[2:] or self.rows
        return [r["step_time_s"] for r in rows]

    @property
    def step_time(self) -> float | None:
        return statistics.median(self.step_times) if self.step_times else None


def run(args: argparse.Namespace) -> list[Table]:
    ns_dtype = args.ns_dtype if args.ns_dtype != "auto" else ("bf16" if torch.cuda.is_available() else "fp32")
    tables, results = [], []
    with tempfile.TemporaryDirectory(prefix="bench-optim-") as tmp:
        for dp in args.dp:
            table, world = sweep(args, dp, ns_dtype, (args.keep or Path(tmp)) / f"dp{dp}")
            tables.append(table)
            results += world
            print(table.markdown(), file=sys.stderr, flush=True)
    if args.plot:
        plot(results, tables[0].title.split(";")[0].rsplit(", ", 1)[0], args.plot)  # each panel names its world
    return tables


def run_overrides(args: argparse.Namespace, dp: int) -> list[str]:
    micro = args.micro_batch or max(1, args.global_batch // dp)
    out = [f"model={args.model}", *BASE, f"model.seq_len={args.seq}", f"train.steps={args.steps}"]
    out += [f"train.global_batch_size={args.global_batch}", f"train.micro_batch_size={micro}"]
    out += [f"train.eval_every={args.steps}", f"train.eval_batches={args.eval_batches}"]
    out += [f"optim.warmup_steps={args.warmup_steps}", f"parallel.dp={dp}"]
    if dp > 1:
        out.append(f"parallel.zero={args.zero}")
    return [*out, *args.base]


def sweep(args: argparse.Namespace, dp: int, ns_dtype: str, tmp: Path) -> tuple[Table, list[Result]]:
    """AdamW's sweep, then Muon's at AdamW's best lr for the rest: the world's table and its runs."""
    base = run_overrides(args, dp)
    results: list[Result] = []

    def launch(optimizer: str, lr: float, rest_lr: float, extra: list[str]) -> Result:
        label = f"{optimizer} lr={lr:g}"
        trial = checked_trial(args.repo, "1", [*base, *extra])
        if trial.refused is None:
            run_trial(args.repo, trial, tmp / f"{optimizer}-{lr:g}", args.timeout)
        result = Result(dp, args.zero if dp > 1 else 0, optimizer, lr, rest_lr, trial)
        results.append(result)
        status = trial.refused or trial.error or f"val loss {result.val_loss:.4f}, train loss {result.train_loss:.4f}"
        print(f"[dp {dp}] {label}: {status} ({trial.wall_s:.0f} s)", file=sys.stderr, flush=True)
        return result

    adamw = [launch("AdamW", lr, lr, ["optim.name=adamw", f"optim.lr={lr}"]) for lr in args.adamw_lr]
    best_adamw = min(adamw, key=lambda r: r.val_loss)
    rest = best_adamw.lr
    muon_keys = ["optim.name=muon", f"optim.lr={rest}", f"optim.muon_ns_dtype={ns_dtype}"]
    muon = [launch("Muon", lr, rest, [*muon_keys, f"optim.muon_lr={lr}"]) for lr in args.muon_lr]
    best_muon = min(muon, key=lambda r: r.val_loss)

    cfg = next((r.trial.config for r in results if r.trial.config is not None), None)
    tokens = args.steps * args.global_batch * args.seq
    where = "one process" if dp == 1 else f"dp={dp} ZeRO-{args.zero}"
    shape = (
        f"{args.model}, seq {args.seq}, global batch {args.global_batch}"
        if cfg is None
        else (f"{cfg.model.name}, seq {cfg.model.seq_len}, global batch {cfg.train.global_batch_size}")
    )
    title = f"{shape}, {args.steps} steps = {tokens:,} tokens, {where}; Muon's Newton-Schulz in {ns_dtype}"
    table = Table(title, HEADER)
    adamw_time = statistics.median(t for r in adamw for t in r.step_times) if any(r.rows for r in adamw) else None
    for r in results:
        best = "best" if r is best_adamw or r is best_muon else ""
        if not r.trial.ok or len(r.rows) != args.steps:
            why = r.trial.refused or r.trial.error or "missing steps"
            table.add(dp, r.optimizer, f"{r.lr:g}", f"{r.rest_lr:g}", f"failed: {why}")
            table.ok = False
            continue
        table.add(
            dp,
            r.optimizer,
            f"{r.lr:g}",
            f"{r.rest_lr:g}",
            f"{r.train_loss:.4f}",
            f"{r.val_loss:.4f}",
            f"{r.step_time:.3f}",
            ratio(r.step_time, adamw_time),
            best,
        )
    if table.ok:
        below = best_muon.val_loss < best_adamw.val_loss
        table.notes.append(
            f"At {tokens:,} tokens Muon's best validation loss {best_muon.val_loss:.4f} (muon_lr {best_muon.lr:g}) is "
            f"{'below' if below else 'not below'} AdamW's best {best_adamw.val_loss:.4f} (lr {best_adamw.lr:g}); "
            f"Muon's median step time over AdamW's: {ratio(median_time(muon), median_time(adamw))}."
        )
    table.notes.append(
        f"best: the lowest validation loss ({args.eval_batches} batches after the last step) of each optimizer's "
        "sweep; train loss: the mean of the last 4 steps' losses; step time: the median of each run's metrics.jsonl "
        "step_time_s after its first two steps, vs AdamW: over the median of every AdamW step of the sweep. "
        "The runs are sequential, so load that drifts between them moves the step times."
    )
    return table, results


def median_time(results: list[Result]) -> float | None:
    times = [t for r in results for t in r.step_times]
    return statistics.median(times) if times else None


def plot(results: list[Result], title: str, path: Path) -> None:
    """Training loss against tokens: a panel per world, the best run of each optimizer bold, the rest faint; each
    run's validation loss a marker at its last step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("error: --plot needs matplotlib (pip install matplotlib)") from None
    worlds = sorted({r.dp for r in results})
    fig, axes = plt.subplots(1, len(worlds), figsize=(6 * len(worlds), 4.2), squeeze=False, sharey=True)
    colors = {"AdamW": "#4c72b0", "Muon": "#dd8452"}
    for ax, dp in zip(axes[0], worlds, strict=True):
        mine = [r for r in results if r.dp == dp and r.rows]
        best = {
            name: min((r for r in mine if r.optimizer == name), key=lambda r: r.val_loss, default=None)
            for name in colors
        }
        for r in mine:
            top = r is best[r.optimizer]
            tokens = [row["tokens"] for row in r.rows]
            ax.plot(
                tokens,
                [row["loss"] for row in r.rows],
                color=colors[r.optimizer],
                alpha=1.0 if top else 0.3,
                linewidth=2.0 if top else 1.0,
                label=f"{r.optimizer} lr {r.lr:g}" + (f" (val {r.val_loss:.3f})" if top else ""),
            )
            if r.val_loss != float("inf"):
                ax.scatter([tokens[-1]], [r.val_loss], color=colors[r.optimizer], marker="*", s=80 if top else 25)
        ax.set_title("one process" if dp == 1 else f"dp={dp} ZeRO-{mine[0].zero if mine else '?'}", fontsize=10)
        ax.set_xlabel("tokens")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("training loss (stars: validation loss at the end)")
    fig.suptitle(textwrap.fill(f"Muon vs AdamW: {title}", 75 * len(worlds)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
