"""``tools/bench.py moe``: the mixture-of-experts block's experts as one grouped matrix product against a matmul per
expert, forward and backward.

    python tools/bench.py moe                                   # two shapes, fp32 and bf16, on this machine's device
    python tools/bench.py moe --shapes 1024x2816x8x2 --tokens 8192 --precision bf16

For each shape (``d_model x d_expert x experts x top_k``) one sparse MLP (models/moe.py, SwiGLU experts, softmax
router) runs forward and backward on ``--tokens`` random tokens, in alternating rounds (trident_dev/bench/harness.py's
order) with ``model.moe.grouped_mm`` on (``torch._grouped_mm`` over the experts' runs of rows) and off (one matmul
per expert). Each row: milliseconds per forward and backward (median over rounds, and its spread) and the loop's
time over the grouped one. The issue's target: the grouped path no slower.

    python tools/bench.py moe --ep 2 [--model moe-tiny] [--global-batch 16]   # expert parallelism, 2 ranks
    python tools/bench.py moe --shapes --ep 2 4                                 # ep 1, 2 and 4 on 4 ranks only
    python tools/bench.py moe --shapes --ep 2 --set model.d_model=256 model.moe.experts=8 model.moe.d_expert=512

With ``--ep``, a second table: training steps (trident/build.py's parts and ``Trainer.train_step``, as train.py
runs them) of ``--model`` on max(``--ep``) local ranks (trident_dev.ranks' pool) at a fixed global batch, ep = 1 (dp
only: every rank all the experts) against each ``--ep`` (each rank experts / ep, tokens exchanged by all-to-all),
in alternating rounds from the same weights on the same batches; tokens/s, the ep row over the dp row (the issue's
target: ep 2 at least 0.8x of dp 2), the time rank 0 spent inside the experts' all-to-alls per step (the counts,
the dispatch and the combine, forward and backward: ``ExchangeTimer`` around each call, so waiting for the other
ranks is in it) and its share of the step, rank 0's CPU time per step, and each variant's last loss (the same steps:
equal, to fp32's rounding over many steps). ``--set``: config overrides of the trained model (the line above: 8
experts of 512 on a 256-wide model, where moe-tiny's 4 of 64 on 64 leave the exchanges' fixed cost nothing to hide
behind). ``--shapes`` with no value leaves the grouped-product table out.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from trident.build import build_parts, layout_of
from trident.config import Config, ModelConfig, MoEConfig, compose_config
from trident.loop import Trainer
from trident.models.gpt import init_weights
from trident.models.moe import MoE, grouped_mm_fits
from trident.parallel import comm
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.harness import (
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
from trident_dev.ranks import run_distributed

HEADER = ["shape (d x f x E x k)", "precision", "grouped ms", "loop ms", "loop / grouped", "spread (grouped / loop)"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="*", default=["256x512x8x2", "512x1024x16x4"], help="d x f x experts x top_k")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per forward")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="forward+backward per timed round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ep", type=int, nargs="*", default=[], help="also train at ep 1 and at these eps, on max ranks")
    p.add_argument("--model", default="moe-tiny", help="the --ep table's preset")
    p.add_argument("--global-batch", type=int, default=16, help="the --ep table's sequences per step")
    p.add_argument("--micro-batch", type=int, default=4, help="the --ep table's sequences per micro-batch")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="the --ep table's config overrides")


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
    tables = [t] if args.shapes else []
    return [*tables, ep_table(args)] if args.ep else tables


EP_HEADER = [
    "variant", "ranks", "tokens/s", "spread", "x dp", "all-to-all ms/step", "of the step", "CPU ms/step", "last loss",
]  # fmt: skip


def ep_table(args: argparse.Namespace) -> Table:
    """Training steps of ``args.model`` on ``args.ep`` ranks: dp only against ep = ``args.ep`` (module docstring)."""
    cfg = compose_config(
        args.conf,
        [f"model={args.model}", f"train.global_batch_size={args.global_batch}",
         f"train.micro_batch_size={args.micro_batch}", "train.steps=1000000", "optim.warmup_steps=0", *args.set],
    )  # fmt: skip
    world = max(args.ep)
    job = EpJob(cfg, sorted(set(args.ep) - {1}), args.warmup, args.steps, args.rounds)
    result = run_distributed(_ep_rank, world, job, backend=pool_backend(world), timeout_s=24 * 3600)[0]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    m = cfg.model
    shape = f" ({m.moe.experts} experts of {m.moe.d_expert}, top-{m.moe.top_k}, d_model {m.d_model})"
    t = Table(
        f"expert parallelism: model {cfg.model.name}{shape}, {world} ranks on {result['device']}, global batch "
        f"{cfg.train.global_batch_size} x {cfg.model.seq_len} tokens, micro-batch {cfg.train.micro_batch_size}; "
        f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, medians",
        EP_HEADER,
    )
    rates = {name: tokens_per_s(tokens, r["wall"]) for name, r in result.items() if name != "device"}
    for name, rate in rates.items():
        wall, exchange = Stat.of(result[name]["wall"]).median, Stat.of(result[name]["exchange"]).median
        t.add(name, world, number(rate.median), spread(result[name]["wall"]),
              ratio(rate.median, rates["ep 1"].median), number(1e3 * exchange, ".1f"), f"{100 * exchange / wall:.0f}%",
              number(1e3 * Stat.of(result[name]["cpu"]).median, ".1f"), f"{result[name]['last_loss']:.6f}")  # fmt: skip
    return t


class ExchangeTimer:
    """Seconds inside the experts' all-to-alls, added up until ``take``: ``timing`` wraps the process group's
    exchange that every all-to-all of parallel/comm.py calls, and the wait on its work, from outside the model. On a
    CPU the wall clock around each (gloo's collectives return when done, the wait for the other ranks included), on a
    GPU CUDA events around it on the current stream (read by ``take``, after the step)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def span(self, device: torch.device) -> Iterator[None]:
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.events.append((start, end))
            return
        begin = time.perf_counter()
        yield
        self.seconds += time.perf_counter() - begin

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Every exchange started meanwhile, and its wait, timed."""
        exchange, span = comm._exchange, self.span

        class Timed:
            def __init__(self, work, device: torch.device) -> None:  # noqa: ANN001 (a dist.Work)
                self.work, self.device = work, device

            def wait(self) -> None:
                with span(self.device):
                    self.work.wait()

        def timed(out: torch.Tensor, *args) -> Timed:  # noqa: ANN002
            with span(out.device):
                return Timed(exchange(out, *args), out.device)

        comm._exchange = timed
        try:
            yield
        finally:
            comm._exchange = exchange

    def take(self) -> float:
        """The seconds since the last ``take``."""
        if self.events:
            torch.cuda.synchronize()
            self.seconds += sum(start.elapsed_time(end) for start, end in self.events) / 1e3
            self.events.clear()
        seconds, self.seconds = self.seconds, 0.0
        return seconds


@dataclasses.dataclass
class EpJob:
    cfg: Config
    eps: list[int]
    warmup: int
    steps: int
    rounds: int


def _ep_rank(rank: int, world: int, job: EpJob) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = rank_device(rank, world)
    cfg = job.cfg
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)
    trainers, losses, hooks, timers, exchange = {}, {}, [], {}, {}
    for ep in (1, *job.eps):
        name = f"ep {ep}"
        run_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep))
        groups = build_process_groups(Topology(dp=world, pp=1, tp=1, ep=ep))
        parts = build_parts(run_cfg, layout_of(run_cfg, groups), groups, device)
        trainers[name] = Trainer(run_cfg, groups, parts, (data, data))
        hooks.append(parts.optimizer)
        losses[name], exchange[name], timers[name] = [], [], ExchangeTimer()

    def step(name: str):
        trainer = trainers[name]

        def one(i: int) -> None:
            with timers[name].timing():
                losses[name].append(trainer.train_step(i, trainer.micro_batches(i)).loss)
            exchange[name].append(timers[name].take())

        return one

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
        timed = exchange[name][job.warmup :]  # per step, in order: each round's steps, averaged per round
        rounds = [sum(timed[r * job.steps : (r + 1) * job.steps]) / job.steps for r in range(job.rounds)]
        out[name] = {
            "wall": timings[name].wall,
            "cpu": timings[name].cpu,
            "exchange": rounds,
            "last_loss": losses[name][-1],
        }
    return out
