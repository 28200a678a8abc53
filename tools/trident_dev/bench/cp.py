"""``tools/bench.py cp``: context parallelism at one sequence length: tokens/s and activation bytes per rank for
cp 1, 2, 4 with each ``parallel.cp_comm``, against dp on the same ranks.

    python tools/bench.py cp                                   # gpt-mini, 2048 tokens, global batch 4, fp32
    python tools/bench.py cp --seq-len 4096 --global-batch 2 --layouts cp=1 cp=2 cp=4 dp=2 --comms ring ulysses

Each layout runs on its own pool of gloo ranks (trident_dev.ranks), built as train.py builds it (trident/build.py:
model, reducer, ZeRO optimizer, runner, trainer), on random tokens with the same global batch and sequence
length for every layout. Per layout:

  activations  the storages one micro-batch's forward and loss leave alive on a rank (trident/memory/measure.py
               ``held_by_forward``, parameters and batch left out), the largest rank's; and its ratio to cp=1's
  s/step       the median over --rounds of a training step (forward, backward, gradient reduction, optimizer),
               after --warmup steps; tokens/s the global batch's tokens over it, and its ratio to dp=2's; CPU-s/step
               the CPU time a step costs all ranks together (compute and gloo threads), which other load on the
               machine hardly changes, and dp=2's over it
  cp_balance   the most attended (query, key) pairs a cp rank computes over their mean (1.0 for causal windows
               under the head-tail split; packed documents are not drawn here)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from trident.build import build_parts
from trident.config import Config, compose_config, validate
from trident.loop import Trainer, cp_balance
from trident.memory.measure import held_by_forward
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.harness import Table, format_bytes, number, random_windows, spread
from trident_dev.ranks import run_distributed

HEADER = ["layout", "ranks", "activations/rank", "vs cp=1", "s/step", "spread", "tokens/s", "vs dp=2", "CPU-s/step"]
HEADER += ["CPU vs dp=2", "cp_balance"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, default=4, help="sequences per step (micro-batches of 1 per rank)")
    p.add_argument("--layouts", nargs="+", default=["cp=1", "dp=2", "cp=2", "cp=4"], help="cp=N or dp=N")
    p.add_argument("--comms", nargs="+", default=["ring", "allgather", "ulysses"], help="parallel.cp_comm values")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3, help="timed steps")


def _config(args: argparse.Namespace, kind: str, n: int, comm: str) -> Config:
    overrides = [
        f"model={args.model}",
        f"model.seq_len={args.seq_len}",
        f"train.global_batch_size={args.global_batch}",
        "train.micro_batch_size=1",
        f"train.precision={args.precision}",
        "train.device=cpu",
        "wandb.mode=disabled",
        f"parallel.{kind}={n}",
        *([f"parallel.cp_comm={comm}"] if kind == "cp" else []),
    ]
    return compose_config(args.conf, overrides)


def _rank(rank: int, world: int, cfg: Config, warmup: int, rounds: int) -> dict:
    torch.manual_seed(0)
    layout = validate(cfg, world)
    groups = build_process_groups(Topology(dp=layout.dp, pp=1, tp=1, cp=layout.cp))
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 8 * cfg.train.global_batch_size)
    parts = build_parts(cfg, layout, groups, torch.device("cpu"))
    trainer = Trainer(cfg, groups, parts, (data, data), prefetch=False)
    model, batch = parts.chunks[0], trainer.micro_batches(0)[0]

    def forward() -> torch.Tensor:
        logits = model(
            batch.tokens, documents=batch.documents, positions=batch.positions, index=batch.index, keys=batch.keys
        )
        return model.loss_sum(logits, batch.targets)

    inputs = [t for t in (batch.tokens, batch.targets, batch.documents, batch.positions, batch.index) if t is not None]
    loss, held = held_by_forward(forward, [*model.parameters(), *inputs])
    loss.backward()  # frees the graph; the step below starts from zeroed gradients
    model.zero_grad(set_to_none=False)
    times, cpu = [], []
    for step in range(warmup + rounds):
        batches = trainer.micro_batches(step)
        start, start_cpu = time.perf_counter(), time.process_time()
        trainer.train_step(step, batches)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    parts.optimizer.remove_hooks()
    balance = cp_balance(trainer.micro_batches(0)) if layout.cp > 1 else None
    return {"held": held, "times": times[warmup:], "cpu": cpu[warmup:], "balance": balance}


def run(args: argparse.Namespace) -> list[Table]:
    torch.set_num_threads(1)
    runs: dict[str, tuple[int, dict]] = {}
    for spec in args.layouts:
        kind, _, value = spec.partition("=")
        n = int(value)
        comms = args.comms if kind == "cp" and n > 1 else [args.comms[0]]
        for comm in comms:
            name = f"{kind}={n} {comm}" if kind == "cp" and n > 1 else f"{kind}={n}"
            cfg = _config(args, kind, n, comm)
            per_rank = run_distributed(_rank, n, cfg, args.warmup, args.rounds, timeout_s=24 * 3600)
            runs[name] = (n, {"per_rank": per_rank})
    tokens = args.global_batch * args.seq_len
    base = runs.get("cp=1")
    dp2 = runs.get("dp=2")

    def step_time(run: dict) -> list[float]:  # the slowest rank's time of each step
        return [max(ts) for ts in zip(*(r["times"] for r in run["per_rank"]), strict=True)]

    def step_cpu(run: dict) -> float:  # the median step's CPU time, all ranks together
        return statistics.median(sum(cs) for cs in zip(*(r["cpu"] for r in run["per_rank"]), strict=True))

    t = Table(
        f"{args.model} at {args.seq_len} tokens, global batch {args.global_batch} sequences, {args.precision} on "
        f"CPU (gloo, one thread a rank); {args.rounds} timed steps after {args.warmup}",
        HEADER,
    )
    for name, (ranks, run) in runs.items():
        held = max(r["held"] for r in run["per_rank"])
        s = statistics.median(step_time(run))
        t.add(
            name,
            ranks,
            format_bytes(held),
            f"{held / max(r['held'] for r in base[1]['per_rank']):.2f}" if base else None,
            number(s, ".3f"),
            spread(step_time(run)),
            number(tokens / s),
            f"{statistics.median(step_time(dp2[1])) / s:.2f}x" if dp2 and ranks == dp2[0] else None,
            number(step_cpu(run), ".3f"),
            f"{step_cpu(dp2[1]) / step_cpu(run):.2f}x" if dp2 and ranks == dp2[0] else None,
            number(run["per_rank"][0]["balance"], ".3f"),
        )
    t.notes.append(
        "activations/rank: one micro-batch's forward and loss, the largest rank's; vs dp=2: dp=2's step time over "
        "this layout's, on as many ranks with the same global batch and sequence length."
    )
    return [t]
