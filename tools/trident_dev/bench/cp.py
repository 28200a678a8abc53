"""``tools/bench.py cp``: context parallelism at one sequence length: tokens/s and activation bytes per rank for
cp 1, 2, 4 with each ``parallel.cp_comm``, against dp on the same ranks (docs/benchmarks.md#cp).

    python tools/bench.py cp                                   # gpt-mini, 2048 tokens, global batch 4, fp32
    python tools/bench.py cp --seq-len 4096 --global-batch 2 --layouts cp=1 cp=2 cp=4 dp=2 --comms ring ulysses
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from trident.build import build_parts
from trident.config import Config, compose_config, validate
from trident.loop import Trainer, cp_balance
from trident.memory.measure import held_by_forward
from trident.parallel.batch import Batch
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.compare import Column, Comparison, Outcome, Rank, Row, Setting, Steps, compare
from trident_dev.bench.harness import Table, format_bytes, number, random_windows, ratio, spread


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


def run(args: argparse.Namespace) -> list[Table]:
    torch.set_num_threads(1)
    settings = []
    for spec in args.layouts:
        kind, _, value = spec.partition("=")
        n = int(value)
        comms = args.comms if kind == "cp" and n > 1 else [args.comms[0]]
        for comm in comms:
            name = f"{kind}={n} {comm}" if kind == "cp" and n > 1 else f"{kind}={n}"
            job = (name, _config(args, kind, n, comm))
            settings.append(Setting(_layout, job, {"ranks": n}, world=n, device="cpu"))
    tokens = args.global_batch * args.seq_len

    def held(out: Outcome | None) -> int | None:  # the largest rank's
        return max(r.figures["held"] for r in out.ranks) if out is not None else None

    def dp2(row: Row) -> Outcome | None:  # dp=2 on as many ranks as this row's layout
        out = row.of("dp=2")
        return out if out is not None and len(out.ranks) == row.cells["ranks"] else None

    def vs_dp2(row: Row, figure: Callable[[Outcome], float]) -> str | None:
        base = dp2(row)
        return ratio(figure(base), figure(row.out)) if base is not None else None

    columns = [
        Column("layout"),
        Column("ranks"),
        Column("activations/rank", lambda r: format_bytes(held(r.out))),
        Column("vs cp=1", lambda r: f"{held(r.out) / held(r.of('cp=1')):.2f}" if r.of("cp=1") else None),
        Column("s/step", lambda r: number(r.out.time.median, ".3f")),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("tokens/s", lambda r: number(r.out.rate(tokens).median)),
        Column("vs dp=2", lambda r: vs_dp2(r, lambda o: o.time.median)),
        Column("CPU-s/step", lambda r: number(r.out.cpu_s, ".3f")),
        Column("CPU vs dp=2", lambda r: vs_dp2(r, lambda o: o.cpu_s)),
        Column("cp_balance", lambda r: number(r.out.figures["balance"], ".3f")),
    ]
    title = (
        f"{args.model} at {args.seq_len} tokens, global batch {args.global_batch} sequences, {args.precision} on "
        f"CPU (gloo, one thread a rank); {args.rounds} timed steps after {args.warmup}"
    )
    notes = [
        "activations/rank: one micro-batch's forward and loss, the largest rank's; vs dp=2: dp=2's step time over "
        "this layout's, on as many ranks with the same global batch and sequence length."
    ]
    return [compare(Comparison(title, columns, settings, args.warmup, 1, args.rounds, notes))]


def _layout(rank: Rank, job: tuple[str, Config]) -> dict[str, Callable[[], Steps]]:
    """One variant: the layout's training steps, after one micro-batch's forward measured (its activations)."""
    name, cfg = job

    def build() -> Steps:
        torch.manual_seed(0)
        layout = validate(cfg, rank.world)
        groups = build_process_groups(Topology(dp=layout.dp, pp=1, tp=1, cp=layout.cp))
        data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 8 * cfg.train.global_batch_size)
        parts = build_parts(cfg, layout, groups, rank.device)
        trainer = Trainer(cfg, groups, parts, (data, data), prefetch=False)
        model = parts.chunks[0]

        held = forward_held(model, trainer.micro_batches(0)[0])
        balance = cp_balance(trainer.micro_batches(0)) if layout.cp > 1 else None
        return Steps(
            lambda i: trainer.train_step(i, trainer.micro_batches(i)).loss,
            close=parts.optimizer.remove_hooks,
            figures=lambda: {"held": held, "balance": balance},
        )

    return {name: build}


def forward_held(model: torch.nn.Module, batch: Batch) -> int:
    """The bytes one micro-batch's forward and loss leave alive (parameters and batch left out); the gradients
    its backward leaves are zeroed, so the steps start from zeroed gradients."""

    def forward() -> torch.Tensor:
        b = batch
        logits = model(b.tokens, documents=b.documents, positions=b.positions, index=b.index, keys=b.keys)
        return model.loss_sum(logits, b.targets)

    inputs = [t for t in (batch.tokens, batch.targets, batch.documents, batch.positions, batch.index) if t is not None]
    loss, held = held_by_forward(forward, [*model.parameters(), *inputs])
    loss.backward()  # frees the graph
    model.zero_grad(set_to_none=False)
    return held
