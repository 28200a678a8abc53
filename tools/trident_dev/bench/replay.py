"""``tools/bench.py replay``: what ``train.replay_every=N`` costs (docs/nodes.md, trident/replay.py): trident's
training step with replays every N steps against the same step without them, on one layout, in alternating rounds
(docs/benchmarks.md#replay).

    python tools/bench.py replay                              # gpt-mini, one rank, replay every 4 and every 1
    python tools/bench.py replay --tp 2 --pp 2 --every 4 1    # the layout tests/test_replay.py checks
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

import torch

from trident.build import build_parts, layout_of
from trident.config import compose_config
from trident.loop import Trainer
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench import harness
from trident_dev.bench.compare import Column, Comparison, Rank, Setting, Steps, batch_title, compare, per_round
from trident_dev.bench.harness import Table, number, spread

OFF = "replay off"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--every", type=int, nargs="+", default=[4, 1], help="train.replay_every values, a row each")
    p.add_argument("--dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (model.seq_len)")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=4, help="steps per timed block (a multiple of every --every)")
    p.add_argument("--rounds", type=int, default=5, help="alternating timed blocks per variant; medians reported")
    p.add_argument("--warmup", type=int, default=1)


def run(args: argparse.Namespace) -> list[Table]:
    bad = [n for n in args.every if n < 1 or args.steps % n]
    if bad:
        raise SystemExit(f"--every {bad}: each must be >= 1 and divide --steps {args.steps}")
    cfg = compose_config(
        args.conf,
        [
            f"model={args.model}",
            f"model.seq_len={args.seq}",
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}",
            f"train.precision={args.precision}",
            f"parallel.tp={args.tp}",
            f"parallel.pp={args.pp}",
            "train.steps=1000000",
            "optim.warmup_steps=0",
            "wandb.mode=disabled",
        ],
    )
    world = args.dp * args.tp * args.pp
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    names = [OFF, *(f"every {n}" for n in args.every)]
    columns = [
        Column("variant"),
        Column("tokens/s", lambda r: number(r.out.rate(tokens).median)),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("step time vs replay off", lambda r: f"{per_round(r.out.wall, r.of(OFF).wall):.2f}x"),
        Column("replayed steps", lambda r: r.out.figures.get("replayed", "")),
    ]
    where = lambda info: f"dp {args.dp} x tp {args.tp} x pp {args.pp}, {info['device']}"
    setting = Setting(_variants, (cfg, args.dp, args.tp, args.pp, args.every), world=world, rows=names)
    notes = [
        "A replayed step runs its forward and backward twice and compares the loss and every gradient buffer's digest "
        "bitwise; the optimizer step runs once. Expected cost: 1 + (forward + backward share of the step) / N. "
        "The variants train the same parts in turn."
    ]
    title = batch_title(cfg, where, args.rounds, args.steps, args.warmup)
    return [compare(Comparison(title, columns, [setting], args.warmup, args.steps, args.rounds, notes))]


def _variants(rank: Rank, job: tuple) -> dict[str, Callable[[], Steps]]:
    cfg, dp, tp, pp, everies = job
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // rank.world))
    groups = build_process_groups(Topology(dp=dp, tp=tp, pp=pp))
    rank.info.update(device=rank.device.type)
    data = harness.random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)
    parts = build_parts(cfg, layout_of(cfg, groups), groups, rank.device)

    def trident(every: int) -> Steps:
        c = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, replay_every=every))
        trainer = Trainer(c, groups, parts, (data, data), prefetch=False)
        replayed = [0]

        def step(i: int) -> float:
            replayed[0] += trainer.replay.due(i)
            return trainer.train_step(i, trainer.micro_batches(i)).loss

        return Steps(step, figures=lambda: {"replayed": replayed[0]})

    variants: dict[str, Callable[[], Steps]] = {OFF: lambda: trident(0)}
    for n in everies:
        variants[f"every {n}"] = lambda n=n: trident(n)
    return variants
