"""``tools/bench.py checkpoint``: what a checkpoint costs the training steps around it, saved in the foreground
and in the background (``checkpoint.async``), against steps that save nothing (docs/benchmarks.md#checkpoint).

    python tools/bench.py checkpoint                        # gpt-mini, one rank, a save every 4 steps
    python tools/bench.py checkpoint --model gpt-small --every 8 --world 2
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from trident.build import build_checkpointer, build_parts, layout_of
from trident.config import Config, compose_config, validate
from trident.memory.estimate import estimate
from trident.models.gpt import count_params
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.compare import Column, Comparison, Outcome, Rank, Run, Setting, Steps, compare, per_round
from trident_dev.bench.harness import Table, number, random_batches, ratio, spread

VARIANTS = ("no save", "sync", "async")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--world", type=int, default=1, help="ranks (dp)")
    p.add_argument("--every", type=int, default=4, help="steps per timed block; one save at its first step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (at most the model's seq_len)")


@dataclasses.dataclass
class Job:
    cfg: Config
    every: int
    micro_batch: int
    micro_batches: int
    seq_len: int


@dataclasses.dataclass
class _Progress:
    """What the checkpointer asks of a trainer: the step, and a state to keep beside the tensors."""

    step: int = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def run(args: argparse.Namespace) -> list[Table]:
    cfg = compose_config(args.conf, [f"model={args.model}", "optim.warmup_steps=0", "wandb.mode=disabled"])
    job = Job(cfg, args.every, args.micro_batch, args.micro_batches, args.seq_len)
    m = cfg.model
    title = (
        f"{args.model} ({count_params(m) / 1e6:.1f}M params), dp {args.world}; {args.micro_batches} micro-batches of "
        f"{args.micro_batch} x {args.seq_len} tokens per rank per step; a save every {args.every} steps; "
        f"{args.rounds} rounds; gloo on {os.cpu_count()} CPUs"
    )

    def median(out: Outcome, key: str) -> float | None:
        values = out.figures[key]
        return statistics.median(values) if values else None

    columns = [
        Column("variant"),
        Column("s/step", lambda r: number(r.out.time.median, ".3f")),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("vs no save", lambda r: f"{per_round(r.out.wall, r.of('no save').wall):.2f}x"),
        Column("stall s/save", lambda r: number(median(r.out, "stall"), ".3f")),
        Column("step s while writing", lambda r: number(median(r.out, "writing"), ".3f")),
        Column(
            "vs no save step",
            lambda r: ratio(median(r.out, "writing"), median(r.of("no save"), "steps")),
        ),
        Column("CPU-s/step", lambda r: number(statistics.median(r.out.ranks[0].cpu), ".3f")),
    ]
    ck = dataclasses.replace(cfg.checkpoint, async_=True)
    layout = dataclasses.replace(validate(dataclasses.replace(cfg, checkpoint=ck), args.world), device="cpu")
    predicted = estimate(m, layout).stages[0].checkpoint_staging

    def notes(runs: list[Run]) -> list[str]:
        staged = runs[0].outcomes["async"].state
        return [
            f"Host staging of the async save: {staged / 2**20:.2f} MiB per rank (a copy of what the rank saves: "
            f"fp32 masters, AdamW moments), kept for the run; trident/memory/estimate.py predicts "
            f"{predicted / 2**20:.2f} MiB. s/step: a block's mean, median over rounds. Timings on a shared CPU are "
            "noisy."
        ]

    setting = Setting(_variants, job, world=args.world, backend="gloo")
    return [compare(Comparison(title, columns, [setting], args.every, args.every, args.rounds, notes))]


def _variants(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    """Three variants of the same parts, each block of ``job.every`` steps holding one save at its first step."""
    world, device = rank.world, rank.device
    cfg = dataclasses.replace(job.cfg, parallel=dataclasses.replace(job.cfg.parallel, dp=world))
    groups = build_process_groups(Topology(dp=world, tp=1, pp=1))
    parts = build_parts(cfg, layout_of(cfg, groups), groups, device)
    tokens = world * job.micro_batches * job.micro_batch * job.seq_len
    batches = [
        b.to(device)
        for b in random_batches(cfg.model.vocab_size, job.micro_batches, job.micro_batch, job.seq_len, 0, rank.rank)
    ]
    progress = _Progress()
    tmp = Path(tempfile.mkdtemp(prefix="trident-bench-checkpoint-"))

    def step() -> float:
        start = time.perf_counter()
        parts.runner.forward_backward(batches, parts.chunks[-1].loss_sum, 1.0 / tokens)
        parts.optimizer.step.step(cfg.optim.lr)
        return time.perf_counter() - start

    def variant(name: str, background: bool | None) -> Steps:
        saver = None
        if background is not None:
            ck = dataclasses.replace(cfg.checkpoint, async_=background, keep_last=2, resume="none")
            saver = build_checkpointer(dataclasses.replace(cfg, checkpoint=ck), groups, parts, tmp / name, None)
        stats = {"steps": [], "stall": [], "writing": []}

        def one(i: int) -> None:
            stall = 0.0
            if saver is not None and i % job.every == 0:
                progress.step += 1  # every save its own step: none replaces another
                start = time.perf_counter()
                saver.save(progress)
                stall = time.perf_counter() - start
            writing = saver is not None and saver.background is not None and saver.background.writing
            seconds = step()
            if saver is not None and i % job.every == job.every - 1:
                start = time.perf_counter()
                saver.wait()  # the block pays for a write it did not hide
                stall += time.perf_counter() - start
            if i >= job.every:  # the warm-up block is not counted
                stats["writing" if writing else "steps"].append(seconds)
                if saver is not None and i % job.every == 0:
                    stats["stall"].append(stall)
                elif stall:
                    stats["stall"][-1] += stall

        def close() -> None:
            if background:  # the last: the saves are done
                parts.optimizer.remove_hooks()
                shutil.rmtree(tmp, ignore_errors=True)

        staged = (lambda: saver.background.stage.nbytes) if background else None
        return Steps(one, state=staged, close=close, figures=lambda: stats)

    return {name: (lambda n=name, b=b: variant(n, b)) for name, b in zip(VARIANTS, (None, False, True), strict=True)}
