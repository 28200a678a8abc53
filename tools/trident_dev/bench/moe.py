"""``tools/bench.py moe``: the mixture-of-experts block's experts as one grouped matrix product against a matmul per
expert, forward and backward; with ``--ep``, training steps at ep 1 against each ep, with the time in the experts'
all-to-alls (docs/benchmarks.md#moe).

    python tools/bench.py moe                                   # two shapes, fp32 and bf16, on this machine's device
    python tools/bench.py moe --shapes 1024x2816x8x2 --tokens 8192 --precision bf16
    python tools/bench.py moe --ep 2 [--model moe-tiny] [--global-batch 16]   # expert parallelism, 2 ranks
    python tools/bench.py moe --shapes --ep 2 4                                 # ep 1, 2 and 4 on 4 ranks only
    python tools/bench.py moe --shapes --ep 2 --set model.d_model=256 model.moe.experts=8 model.moe.d_expert=512
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
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
from trident_dev.bench.compare import Column, Comparison, Outcome, Rank, Row, Run, Setting, Steps, compare
from trident_dev.bench.harness import Stat, Table, number, random_windows, ratio, spread

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
    settings = []
    for shape in args.shapes:
        d, f, experts, top_k = (int(v) for v in shape.split("x"))
        for precision in args.precision:
            cells = {"shape (d x f x E x k)": shape, "precision": precision}
            if not grouped_mm_fits((d, f), DTYPES[precision], device):
                note = f"{shape} {precision}: no torch._grouped_mm for these widths on {device.type}"
                settings.append(Setting(cells=cells, refused="-", note=note))
                continue
            job = (d, f, experts, top_k, precision, args.tokens)
            settings.append(Setting(_blocks, job, cells, world=None, rows=["grouped"]))

    def ms(out: Outcome) -> str:
        return number(1e3 * out.time.median, ".2f")

    columns = [
        Column("shape (d x f x E x k)"),
        Column("precision"),
        Column("grouped ms", lambda r: ms(r.out)),
        Column("loop ms", lambda r: ms(r.of("loop"))),
        Column("loop / grouped", lambda r: ratio(r.of("loop").time.median, r.out.time.median)),
        Column("spread (grouped / loop)", lambda r: f"{spread(r.out.wall)} / {spread(r.of('loop').wall)}"),
    ]
    title = (
        f"MoE experts, grouped product vs loop: {args.tokens} tokens, forward + backward on {device.type}; "
        f"{args.rounds} rounds x {args.steps} after {args.warmup} warm-up, medians"
    )
    t = compare(Comparison(title, columns, settings, args.warmup, args.steps, args.rounds))
    tables = [t] if args.shapes else []
    return [*tables, ep_table(args)] if args.ep else tables


def _blocks(rank: Rank, job: tuple) -> dict[str, Callable[[], Steps]]:
    d, f, experts, top_k, precision, tokens = job
    dtype, device = DTYPES[precision], rank.device
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(0)).to(device, dtype)

    def variant(grouped: bool) -> Steps:
        m = block(d, f, experts, top_k, grouped, dtype, device)
        return Steps(lambda _i: forward_backward(m, x))

    return {"grouped": lambda: variant(True), "loop": lambda: variant(False)}


def ep_table(args: argparse.Namespace) -> Table:
    """Training steps of ``args.model`` on max(``args.ep``) ranks: dp only against each ep (docs/benchmarks.md)."""
    cfg = compose_config(
        args.conf,
        [f"model={args.model}", f"train.global_batch_size={args.global_batch}",
         f"train.micro_batch_size={args.micro_batch}", "train.steps=1000000", "optim.warmup_steps=0", *args.set],
    )  # fmt: skip
    world = max(args.ep)
    job = EpJob(cfg, sorted(set(args.ep) - {1}), args.warmup, args.steps)
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    m = cfg.model
    shape = f" ({m.moe.experts} experts of {m.moe.d_expert}, top-{m.moe.top_k}, d_model {m.d_model})"

    def title(runs: list[Run]) -> str:
        return (
            f"expert parallelism: model {cfg.model.name}{shape}, {world} ranks on {runs[0].info[0]['device']}, global "
            f"batch {cfg.train.global_batch_size} x {cfg.model.seq_len} tokens, micro-batch "
            f"{cfg.train.micro_batch_size}; {args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up, "
            "medians"
        )

    def exchange(row: Row) -> float:
        return Stat.of(row.out.figures["exchange"]).median

    columns = [
        Column("variant"),
        Column("ranks"),
        Column("tokens/s", lambda r: number(r.out.rate(tokens).median)),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("x dp", lambda r: ratio(r.out.rate(tokens).median, r.of("ep 1").rate(tokens).median)),
        Column("all-to-all ms/step", lambda r: number(1e3 * exchange(r), ".1f")),
        Column("of the step", lambda r: f"{100 * exchange(r) / r.out.time.median:.0f}%"),
        Column("CPU ms/step", lambda r: number(1e3 * Stat.of(r.out.ranks[0].cpu).median, ".1f")),
        Column("last loss", lambda r: f"{r.out.losses[-1]:.6f}"),
    ]
    setting = Setting(_ep_variants, job, {"ranks": world}, world=world)
    return compare(Comparison(title, columns, [setting], args.warmup, args.steps, args.rounds))


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


def _ep_variants(rank: Rank, job: EpJob) -> dict[str, Callable[[], Steps]]:
    world, device = rank.world, rank.device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    rank.info["device"] = device.type
    cfg = job.cfg
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)

    def variant(ep: int) -> Steps:
        run_cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, ep=ep))
        groups = build_process_groups(Topology(dp=world, pp=1, tp=1, ep=ep))
        parts = build_parts(run_cfg, layout_of(run_cfg, groups), groups, device)
        trainer = Trainer(run_cfg, groups, parts, (data, data))
        timer, exchange = ExchangeTimer(), []

        def step(i: int) -> float:
            with timer.timing():
                loss = trainer.train_step(i, trainer.micro_batches(i)).loss
            exchange.append(timer.take())
            return loss

        def figures() -> dict:
            timed = exchange[job.warmup :]  # per step, in order: each round's steps, averaged per round
            rounds = range(len(timed) // job.steps)
            return {"exchange": [sum(timed[r * job.steps : (r + 1) * job.steps]) / job.steps for r in rounds]}

        return Steps(step, close=parts.optimizer.remove_hooks, figures=figures)

    return {f"ep {ep}": (lambda ep=ep: variant(ep)) for ep in (1, *job.eps)}
