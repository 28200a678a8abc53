"""``tools/bench.py recompute``: what each recomputation policy keeps and what it costs: one micro-batch's
activations measured beside the estimator's prediction, and the step time against no recomputation
(docs/benchmarks.md#recompute).

    python tools/bench.py recompute                                  # gpt-mini, micro-batch 4 x 256 tokens, fp32
    python tools/bench.py recompute --model llama-150m --micro-batch 1 --seq-len 256 --rounds 3 --steps 1 --threads 1
    python tools/bench.py recompute --policies none selective "selective[norm,mlp_act,attn_core]" full/2 full
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import torch

from trident.config import Config, compose_config
from trident.layout import Layout
from trident.memory.activations import activation_bytes, recompute_flops
from trident.memory.measure import held_by_forward
from trident.models.checkpointing import apply_activation_checkpointing, parse_label
from trident.models.gpt import GPT, count_params, init_weights
from trident.parallel.precision import autocast
from trident.parallel.random import model_parallel_rng
from trident.peak import PRECISION_DTYPES
from trident_dev.bench.compare import Column, Comparison, Rank, Row, Setting, Steps, compare, per_round
from trident_dev.bench.harness import Table, format_bytes, number, spread


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--policies", nargs="+", default=["none", "selective", "attention", "full/2", "full"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=2, help="forward + backward steps per timed block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch's intra-op threads (1 steadies timings on a shared CPU)")


@dataclasses.dataclass
class Job:
    cfg: Config
    policies: list[str]
    precision: str
    micro_batch: int


def run(args: argparse.Namespace) -> list[Table]:
    cfg = compose_config(args.conf, [f"model={args.model}", f"model.seq_len={args.seq_len}", "wandb.mode=disabled"])
    m = cfg.model
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    job = Job(cfg, args.policies, args.precision, args.micro_batch)
    setting = Setting(_policies, job, world=None, device="cpu" if device.type == "cpu" else "pool")
    layout = Layout(micro_batch_size=args.micro_batch, precision=args.precision, device=device.type)
    first = "none" if "none" in args.policies else args.policies[0]

    def predicted(row: Row) -> int:
        return activation_bytes(m, layout, 0, row.name)

    def held(row: Row) -> int:
        return row.out.figures["held"]

    columns = [
        Column("policy"),
        Column("activations", lambda r: format_bytes(held(r))),
        Column("estimate", lambda r: format_bytes(predicted(r))),
        Column("vs measured", lambda r: f"{predicted(r) / held(r):.3f}" if held(r) else "-"),
        Column("s/step", lambda r: number(r.out.time.median, ".3f")),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("vs none", lambda r: f"{per_round(r.out.wall, r.of(first).wall):.2f}x"),
        Column("CPU-s/step", lambda r: number(r.out.cpu_s, ".3f")),
        Column("CPU vs none", lambda r: f"{per_round(r.out.ranks[0].cpu, r.of(first).ranks[0].cpu):.2f}x"),
        Column(
            "recompute TFLOP",
            lambda r: number(recompute_flops(m, dataclasses.replace(layout, micro_batches=1), 0, r.name) / 1e12, ".4f"),
        ),
    ]
    title = (
        f"{args.model} ({count_params(m) / 1e6:.1f}M params), micro-batch {args.micro_batch} x {m.seq_len} tokens, "
        f"{args.precision} on {device.type}; forward + backward, {args.steps} steps a block, {args.rounds} rounds"
    )
    notes = [
        "activations: storages one micro-batch's forward leaves alive; estimate: trident/memory/activations.py "
        "(to the byte on a CPU; on CUDA from the kernels' signatures); vs none: each round's block over none's."
    ]
    return [compare(Comparison(title, columns, [setting], warmup=1, steps=args.steps, rounds=args.rounds, notes=notes))]


def _policies(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    """A model per policy, from the same weights, on one micro-batch: its forward's activations measured when it is
    built, then its steps (forward and backward)."""
    m, device, precision = job.cfg.model, rank.device, job.precision
    seed = job.cfg.train.seed
    rng = model_parallel_rng(seed)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, m.vocab_size, (job.micro_batch, m.seq_len), generator=g).to(device)
    y = torch.randint(0, m.vocab_size, (job.micro_batch, m.seq_len), generator=g).to(device)

    def policy(label: str) -> Steps:
        model = GPT(m, rng=rng)
        init_weights(model, m, seed)
        model.to(device=device, dtype=PRECISION_DTYPES[precision])
        name, modules, every = parse_label(label)
        apply_activation_checkpointing(model, name, modules=modules, every=every)

        def loss(step: int) -> torch.Tensor:
            with autocast(precision, device), rng.context(step, range(len(x))):
                return model.loss_sum(model(x), y)

        def step(i: int) -> None:
            loss(i).backward()
            model.zero_grad(set_to_none=True)

        rope = [mod.inv_freq for mod in model.modules() if getattr(mod, "inv_freq", None) is not None]
        out, held = held_by_forward(lambda: loss(0), [*model.parameters(), *rope, x, y])
        del out
        return Steps(step, figures=lambda: {"held": held})

    return {label: (lambda label=label: policy(label)) for label in job.policies}
