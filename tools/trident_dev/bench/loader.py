"""``tools/bench.py loader``: what reading the batches costs a real training step, from the training loop's own
timings.

    python tools/bench.py loader                                   # gpt-mini and llama-tiny, one process
    python tools/bench.py loader --models llama-tiny --set data.dataset_dir=DIR   # a prepared dataset of yours
    python tools/bench.py loader --set "data.mix=[A:0.7,B:0.3]"    # a mixture's reads

For each preset, on one local rank (trident_dev.ranks' pool), train.py's data (``open_training_data``: the embedded
corpus at the preset's vocabulary unless ``--set data.*`` says otherwise, memory-mapped) and train.py's parts
(trident/build.py) run ``Trainer.fit``, the loop itself, in alternating rounds (trident_dev/bench/harness.py's order)
with two loaders:

- ``read ahead`` (what train.py runs): the loop's ``BatchLoader`` reads the next step's micro-batches in a
  background thread while the step computes (on a GPU: into pinned memory, copied on a stream of its own), so the
  step waits only for what is not ready yet;
- ``read in the step``: the same reads made on the critical path, at the start of each step (the cost without the
  read-ahead, and what reading a batch costs at all).

Each row: the step's time, how long reading its batches took (``data_read_ms`` in metrics.jsonl), how long the step
waited for them (``data_ms``), and that wait as a share of the step (``data_share``): medians over rounds of each
round's totals. The issue's target: under 1% of a step read ahead.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import io
import os
import statistics

import torch

from trident.build import build_parts, layout_of
from trident.config import Config, compose_config
from trident.data.mixture import open_training_data
from trident.loop import Trainer
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.harness import Table, barrier, number, rank_device
from trident_dev.ranks import run_distributed

HEADER = ["model", "loader", "step ms", "read ms", "wait ms", "loader share of step", "spread of share"]
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


def run(args: argparse.Namespace) -> list[Table]:
    if args.global_batch % args.micro_batch:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by --micro-batch {args.micro_batch}")
    t = Table(
        f"the loader's share of a training step: one process, global batch {args.global_batch}, micro-batch "
        f"{args.micro_batch}; {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, medians",
        HEADER,
    )
    for model in args.models:
        cfg = build_config(args, model)
        job = Job(cfg, args.warmup, args.steps, args.rounds)
        result = run_distributed(_rank, 1, job, timeout_s=24 * 3600)[0]
        for name, r in result["variants"].items():
            shares = [w / s for w, s in zip(r["wait"], r["step"], strict=True)]
            t.add(
                f"{model} ({result['device']}, {result['tokens_per_step']:,} tokens/step)",
                name,
                number(1e3 * statistics.median(r["step"]), ",.1f"),
                number(1e3 * statistics.median(r["read"]), ",.3f"),
                number(1e3 * statistics.median(r["wait"]), ",.3f"),
                f"{100 * statistics.median(shares):.2f}%",
                f"{100 * min(shares):.2f}-{100 * max(shares):.2f}%",
            )
    t.notes.append(
        "step ms: a training step as the loop times it (the wait for its batches included); read ms: reading its "
        "micro-batches (sampler, memmap windows, to the device); wait ms: the part of that read the step waited for. "
        "Per step, medians over rounds of each round's totals; spread: lowest and highest round. Each round is a "
        "fit() of its own whose first step (read in the step whatever the loader, as a run's first) is not counted."
    )
    return [t]


@dataclasses.dataclass
class Job:
    cfg: Config
    warmup: int
    steps: int
    rounds: int


def _rank(rank: int, world: int, job: Job) -> dict:
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = rank_device(rank, world)
    groups = build_process_groups(Topology(dp=1, pp=1, tp=1))
    cfg = job.cfg
    tr = cfg.train
    data = open_training_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len, tr.global_batch_size, None)
    trainers, parts = {}, []
    for name, prefetch in VARIANTS.items():
        own = copy.deepcopy(cfg)  # its own train.steps, raised round by round
        p = build_parts(own, layout_of(own, groups), groups, device)
        parts.append(p)
        trainers[name] = Trainer(own, groups, p, data.pair, eos_id=data.eos_id, prefetch=prefetch)

    def advance(trainer: Trainer, steps: int) -> list[dict]:
        trainer.cfg.steps = trainer.step + steps
        with contextlib.redirect_stdout(io.StringIO()):  # fit's summary line
            return trainer.fit()

    for trainer in trainers.values():
        advance(trainer, job.warmup)
    figures = {name: {"step": [], "read": [], "wait": []} for name in trainers}
    names = list(trainers)
    for r in range(job.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            barrier(device)
            # A round's first step is its fit's first: nothing was read ahead for it (as a run's first step).
            rows = advance(trainers[name], job.steps + 1)[1:]
            f = figures[name]
            f["step"].append(sum(row["step_time_s"] for row in rows) / len(rows))
            f["read"].append(sum(row["data_read_ms"] for row in rows) / 1e3 / len(rows))
            f["wait"].append(sum(row["data_ms"] for row in rows) / 1e3 / len(rows))
    for p in parts:
        p.optimizer.remove_hooks()
    return {
        "device": device.type,
        "tokens_per_step": tr.global_batch_size * cfg.model.seq_len,
        "variants": figures,
    }
