"""``tools/bench.py moe``: the mixture-of-experts block's experts as one grouped matrix product against a matmul per
expert, forward and backward.

    python tools/bench.py moe                                   # two shapes, fp32 and bf16, on this machine's device
    python tools/bench.py moe --shapes 1024x2816x8x2 --tokens 8192 --precision bf16

For each shape (``d_model x d_expert x experts x top_k``) one sparse MLP (models/moe.py, SwiGLU experts, softmax
router) runs forward and backward on ``--tokens`` random tokens, in alternating rounds (trident/bench/harness.py's
order) with ``model.moe.grouped_mm`` on (``torch._grouped_mm`` over the experts' runs of rows) and off (one matmul
per expert). Each row: milliseconds per forward and backward (median over rounds, and its spread) and the loop's
time over the grouped one. The issue's target: the grouped path no slower.

    python tools/bench.py moe --ep 2 [--model moe-tiny] [--global-batch 16]   # expert parallelism, 2 ranks

With ``--ep``, a second table: training steps (trident/build.py's parts and ``Trainer.train_step``, as train.py
runs them) of ``--model`` on ``--ep`` local ranks (trident.ranks' pool) at a fixed global batch, ep = 1 (dp only:
every rank all the experts) against ep = ``--ep`` (each rank experts / ep, tokens exchanged by all-to-all), in
alternating rounds from the same weights on the same batches; tokens/s, the ep row over the dp row (the issue's
target: ep 2 at least 0.8x of dp 2), and each variant's last loss (equal: the same step). Not yet measured: the
time spent inside the all-to-all.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch

from trident.bench.harness import (
    Stat,
    Table,
    alternate,
    barrier,
    number,
    pool_backend,
    random_windows,
    rank_device,
    ratio,
    spread,
    tokens_per_s,
)
from trident.build import build_parts, layout_of
from trident.config import Config, ModelConfig, MoEConfig, compose_config
from trident.loop import Trainer
from trident.models.gpt import init_weights
from trident.models.moe import MoE, grouped_mm_fits
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident.ranks import run_distributed

HEADER = ["shape (d x f x E x k)", "precision", "grouped ms", "loop ms", "loop / grouped", "spread (grouped / loop)"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=["256x512x8x2", "512x1024x16x4"], help="d x f x experts x top_k")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per forward")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="forward+backward per timed round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ep", type=int, default=0, help="also train on this many ranks at ep 1 and at this ep (0: no)")
    p.add_argument("--model", default="moe-tiny", help="the --ep table's preset")
    p.add_argument("--global-batch", type=int, default=16, help="the --ep table's sequences per step")
    p.add_argument("--micro-batch", type=int, default=4, help="the --ep table's sequences per micro-batch")


def block(d: int, f: int, experts: int, top_k: int, grouped: bool, dtype: torch.dtype, device: torch.device) -> MoE:
    moe = MoEConfig(experts=experts, top_k=top_k, d_expert=f, grouped_mm=grouped)
    cfg = ModelConfig(d_model=d, n_heads=1, mlp="swiglu", bias=False, n_layers=1, moe=moe)
    m = MoE(cfg)
    holder = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"mlp": m})})})
    init_weights(holder, cfg, 0)  # the same weights for both variants (name-seeded)
    return m.to(device=device, dtype=dtype)


def forward_backward(m: MoE, x: torch.Tensor) -> None:
    m(x.clone().requires_grad_()).float().square().mean().backward()


def run(args: argparse.Namespace) -> list[Table]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = Table(
        f"MoE experts, grouped product vs loop: {args.tokens} tokens, forward + backward on {device.type}; "
        f"{args.rounds} rounds x {args.steps} after {args.warmup} warm-up, medians",
        HEADER,
    )
    for shape in args.shapes:
        d, f, experts, top_k = (int(v) for v in shape.split("x"))
        for precision in args.precision:
            dtype = DTYPES[precision]
            if not grouped_mm_fits((d, f), dtype, device):
                t.add(shape, precision, None, None, None, None)
                t.notes.append(f"{shape} {precision}: no torch._grouped_mm for these widths on {device.type}")
                continue
            x = torch.randn(args.tokens, d, generator=torch.Generator().manual_seed(0)).to(device, dtype)
            blocks = {
                name: block(d, f, experts, top_k, name == "grouped", dtype, device) for name in ("grouped", "loop")
            }

            variants = {name: (lambda _i, m=m, x=x: forward_backward(m, x)) for name, m in blocks.items()}
            timings = alternate(
                variants, warmup=args.warmup, steps=args.steps, rounds=args.rounds, sync=lambda: barrier(device)
            )
            grouped, loop = (Stat.of(timings[n].wall) for n in ("grouped", "loop"))
            t.add(
                shape,
                precision,
                number(1e3 * grouped.median, ".2f"),
                number(1e3 * loop.median, ".2f"),
                ratio(loop.median, grouped.median),
                f"{spread(timings['grouped'].wall)} / {spread(timings['loop'].wall)}",
            )
    return [t, ep_table(args)] if args.ep > 1 else [t]


EP_HEADER = ["variant", "ranks", "tokens/s", "spread", "x dp", "last loss"]


def ep_table(args: argparse.Namespace) -> Table:
    """Training steps of ``args.model`` on ``args.ep`` ranks: dp only against ep = ``args.ep`` (module docstring)."""
    cfg = compose_config(
        args.conf,
        [f"model={args.model}", f"train.global_batch_size={args.global_batch}",
         f"train.micro_batch_size={args.micro_batch}", "train.steps=1000000", "optim.warmup_steps=0"],
    )  # fmt: skip
    job = EpJob(cfg, args.ep, args.warmup, args.steps, args.rounds)
    result = run_distributed(_ep_rank, args.ep, job, backend=pool_backend(args.ep), timeout_s=24 * 3600)[0]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    t = Table(
        f"expert parallelism: model {cfg.model.name}, {args.ep} ranks on {result['device']}, global batch "
        f"{cfg.train.global_batch_size} x {cfg.model.seq_len} tokens, micro-batch {cfg.train.micro_batch_size}; "
        f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, medians",
        EP_HEADER,
    )
    rates = {name: tokens_per_s(tokens, r["wall"]) for name, r in result.items() if name != "device"}
    for name, rate in rates.items():
        t.add(name, args.ep, number(rate.median), spread(result[name]["wall"]),
              ratio(rate.median, rates["ep 1"].median), f"{result[name]['last_loss']:.6f}")  # fmt: skip
    return t


@dataclasses.dataclass
class EpJob:
    cfg: Config
    ep: int
    warmup: int
    steps: int
    rounds: int


def _ep_rank(rank: int, world: int, job: EpJob) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = rank_device(rank, world)
    cfg = job.cfg
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)
    trainers, losses, hooks = {}, {}, []
    for ep in (1, job.ep):
        run_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep))
        groups = build_process_groups(Topology(dp=world, pp=1, tp=1, ep=ep))
        parts = build_parts(run_cfg, layout_of(run_cfg, groups), groups, device)
        trainers[f"ep {ep}"] = Trainer(run_cfg, groups, parts, (data, data))
        hooks.append(parts.optimizer)
        losses[f"ep {ep}"] = []

    def step(name: str):
        trainer = trainers[name]
        return lambda i: losses[name].append(trainer.train_step(i, trainer.micro_batches(i)).loss)

    timings = alternate(
        {name: step(name) for name in trainers},
        warmup=job.warmup,
        steps=job.steps,
        rounds=job.rounds,
        sync=lambda: barrier(device),
    )
    for optimizer in hooks:
        optimizer.remove_hooks()
    out: dict = {"device": device.type}
    for name in trainers:
        out[name] = {"wall": timings[name].wall, "last_loss": losses[name][-1]}
    return out
