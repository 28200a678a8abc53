"""``tools/bench.py loader``: what reading the batches costs a real training step, from the training loop's own
timings: the loop's background loader against reading in the step (docs/benchmarks.md#loader).

    python tools/bench.py loader                                   # gpt-mini and llama-tiny, one process
    python tools/bench.py loader --models llama-tiny --set data.dataset_dir=DIR   # a prepared dataset of yours
    python tools/bench.py loader --set "data.mix=[A:0.7,B:0.3]"    # a mixture's reads
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import os
import statistics
from collections.abc import Callable

import torch

from trident.build import RunParts, build_parts, layout_of
from trident.config import Config, compose_config
from trident.data.mixture import open_training_data
from trident.loop import Trainer
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.compare import Column, Comparison, Rank, Row, Setting, Steps, compare
from trident_dev.bench.harness import Table, number

VARIANTS = {"read ahead": True, "read in the step": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["gpt-mini", "llama-tiny"], help="presets under conf/model")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=5, help="steps per timed round (after its untimed first)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds per loader; the median is reported")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each loader first")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more train.py overrides (data.*)")


def build_config(args: argparse.Namespace, model: str) -> Config:
    overrides = [
        f"model={model}",
        f"train.micro_batch_size={args.micro_batch}",
        f"train.global_batch_size={args.global_batch}",
        "train.eval_every=0",  # the loop's steps alone
        "wandb.mode=disabled",
        *args.set,
    ]
    return compose_config(args.conf, overrides)


@dataclasses.dataclass
class Job:
    cfg: Config
    warmup: int
    steps: int


def run(args: argparse.Namespace) -> list[Table]:
    if args.global_batch % args.micro_batch:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by --micro-batch {args.micro_batch}")
    settings = []
    for model in args.models:
        cfg = build_config(args, model)
        tokens = cfg.train.global_batch_size * cfg.model.seq_len
        cells = {"model": model, "tokens": tokens}
        settings.append(Setting(_loaders, Job(cfg, args.warmup, args.steps), cells, backend="gloo"))  # its GPU, if any

    def ms(row: Row, figure: str, spec: str) -> str:
        return number(1e3 * statistics.median(row.out.figures[figure]), spec)

    def shares(row: Row) -> list[float]:
        f = row.out.figures
        return [w / s for w, s in zip(f["wait"], f["step"], strict=True)]

    columns = [
        Column("model", lambda r: f"{r.cells['model']} ({r.info['device']}, {r.cells['tokens']:,} tokens/step)"),
        Column("loader"),
        Column("step ms", lambda r: ms(r, "step", ",.1f")),
        Column("read ms", lambda r: ms(r, "read", ",.3f")),
        Column("wait ms", lambda r: ms(r, "wait", ",.3f")),
        Column("loader share of step", lambda r: f"{100 * statistics.median(shares(r)):.2f}%"),
        Column("spread of share", lambda r: f"{100 * min(shares(r)):.2f}-{100 * max(shares(r)):.2f}%"),
    ]
    title = (
        f"the loader's share of a training step: one process, global batch {args.global_batch}, micro-batch "
        f"{args.micro_batch}; {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, medians"
    )
    notes = [
        "step ms: a training step as the loop times it (the wait for its batches included); read ms: reading its "
        "micro-batches (sampler, memmap windows, to the device); wait ms: the part of that read the step waited for. "
        "Per step, medians over rounds of each round's totals; spread: lowest and highest round. Each round is a "
        "fit() of its own whose first step (read in the step whatever the loader, as a run's first) is not counted."
    ]
    return [compare(Comparison(title, columns, settings, warmup=1, steps=1, rounds=args.rounds, notes=notes))]


class _Fits(Steps):
    """A loader's trainer; its step ``i`` is one ``fit()``: the warm-up's (step 0) of ``job.warmup`` steps, then
    each of ``job.steps`` steps and one more first, whose rows give the round's figures."""

    def __init__(self, trainer: Trainer, parts: RunParts, job: Job) -> None:
        super().__init__()
        self.trainer, self.parts, self.job = trainer, parts, job
        self.rounds: dict[str, list[float]] = {"step": [], "read": [], "wait": []}

    def step(self, i: int) -> None:
        if i == 0:
            self.fit(self.job.warmup)
            return
        # A round's first step is its fit's first: nothing was read ahead for it (as a run's first step).
        rows = self.fit(self.job.steps + 1)[1:]
        for figure, key, per_s in (("step", "step_time_s", 1), ("read", "data_read_ms", 1e3), ("wait", "data_ms", 1e3)):
            self.rounds[figure].append(sum(row[key] for row in rows) / per_s / len(rows))  # seconds a step

    def fit(self, steps: int) -> list[dict]:
        self.trainer.cfg.steps = self.trainer.step + steps
        with contextlib.redirect_stdout(io.StringIO()):  # fit's summary line
            return self.trainer.fit()

    def close(self) -> None:
        self.parts.optimizer.remove_hooks()

    def figures(self) -> dict:
        return self.rounds


def _loaders(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    """Both loaders over the same data, each its own parts and trainer."""
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    rank.info["device"] = rank.device.type
    groups = build_process_groups(Topology(dp=1, pp=1, tp=1))
    cfg = job.cfg
    data = open_training_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len, cfg.train.global_batch_size, None)

    def loader(prefetch: bool) -> Steps:
        own = copy.deepcopy(cfg)  # its own train.steps, raised round by round
        parts = build_parts(own, layout_of(own, groups), groups, rank.device)
        return _Fits(Trainer(own, groups, parts, data.pair, eos_id=data.eos_id, prefetch=prefetch), parts, job)

    return {name: (lambda p=prefetch: loader(p)) for name, prefetch in VARIANTS.items()}
