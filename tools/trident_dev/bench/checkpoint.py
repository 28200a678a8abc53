"""``tools/bench.py checkpoint``: what a checkpoint costs the training steps around it, saved in the foreground
and in the background (``checkpoint.async``), against steps that save nothing.

    python tools/bench.py checkpoint                        # gpt-mini, one rank, a save every 4 steps
    python tools/bench.py checkpoint --model gpt-small --every 8 --world 2

On ``--world`` gloo ranks (trident_dev.ranks' pool, dp = world), train.py's parts (trident/build.py) take training steps
on random batches, and train.py's checkpointer (``build_checkpointer``, once with ``checkpoint.async=false``, once
with ``true``) saves them, into a temporary directory (keep_last 2). Three variants alternate in timed blocks of
``--every`` steps (trident_dev/bench/harness.py's rounds), each block holding one save at its first step:

  no save     the steps alone;
  sync        the save written before the next step starts (training stalls for the whole write);
  async       the state staged in host memory, then written by the rank's writer process while the block's next steps
              run; the block ends waiting for that write, so a write longer than the block is paid for in it.

Each row: the median over rounds of the block's mean step time, its spread, the median over rounds of its ratio to
the no-save block of the same round; the time a save holds training up (sync: the write; async: staging plus the
final wait), and for async the median time of the steps taken while its write ran (the issue's target: within 10%
of a step without a save); CPU-s/step is the rank process's CPU time (its threads together; the writer process's
not included) per step. On a CPU the writer shares the machine's cores with the ranks' compute, so the figures
depend on how many are free.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import tempfile
import time
from pathlib import Path

from trident.build import build_checkpointer, build_parts, layout_of
from trident.config import Config, compose_config, validate
from trident.memory.estimate import estimate
from trident.models.gpt import count_params
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.harness import Table, alternate, barrier, number, random_batches, rank_device, ratio, spread
from trident_dev.ranks import run_distributed

VARIANTS = ("no save", "sync", "async")
HEADER = ["variant", "s/step", "spread", "vs no save", "stall s/save", "step s while writing", "vs no save step"]
HEADER += ["CPU-s/step"]


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
    rounds: int
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
    job = Job(cfg, args.every, args.rounds, args.micro_batch, args.micro_batches, args.seq_len)
    rows = run_distributed(_rank, args.world, job, timeout_s=24 * 3600)[0]
    m = cfg.model
    t = Table(
        f"{args.model} ({count_params(m) / 1e6:.1f}M params), dp {args.world}; {args.micro_batches} micro-batches of "
        f"{args.micro_batch} x {args.seq_len} tokens per rank per step; a save every {args.every} steps; "
        f"{args.rounds} rounds; gloo on {os.cpu_count()} CPUs",
        HEADER,
    )
    base = rows["no save"]["wall"]
    base_step = statistics.median(rows["no save"]["steps"])
    for name in VARIANTS:
        r = rows[name]
        wall = statistics.median(r["wall"])
        writing = statistics.median(r["writing"]) if r["writing"] else None
        stall = statistics.median(r["stall"]) if r["stall"] else None
        t.add(
            name,
            number(wall, ".3f"),
            spread(r["wall"]),
            # Each round's block against the no-save block of the same round: load that drifts cancels out.
            f"{statistics.median(a / b for a, b in zip(r['wall'], base, strict=True)):.2f}x",
            number(stall, ".3f"),
            number(writing, ".3f"),
            ratio(writing, base_step),
            number(statistics.median(r["cpu"]), ".3f"),
        )
    ck = dataclasses.replace(cfg.checkpoint, async_=True)
    layout = dataclasses.replace(validate(dataclasses.replace(cfg, checkpoint=ck), args.world), device="cpu")
    predicted = estimate(m, layout).stages[0].checkpoint_staging
    t.notes.append(
        f"Host staging of the async save: {rows['bytes'] / 2**20:.2f} MiB per rank (a copy of what the rank saves: "
        f"fp32 masters, AdamW moments), kept for the run; trident/memory/estimate.py predicts {predicted / 2**20:.2f} "
        "MiB. s/step: a block's mean, median over rounds. Timings on a shared CPU are noisy."
    )
    return [t]


def _rank(rank: int, world: int, job: Job) -> dict:
    cfg = dataclasses.replace(job.cfg, parallel=dataclasses.replace(job.cfg.parallel, dp=world))
    device = rank_device(rank, world)
    groups = build_process_groups(Topology(dp=world, tp=1, pp=1))
    parts = build_parts(cfg, layout_of(cfg, groups), groups, device)
    tokens = world * job.micro_batches * job.micro_batch * job.seq_len
    batches = [
        b.to(device)
        for b in random_batches(cfg.model.vocab_size, job.micro_batches, job.micro_batch, job.seq_len, 0, rank)
    ]
    progress = _Progress()
    with tempfile.TemporaryDirectory(prefix="trident-bench-checkpoint-") as tmp:
        savers = {}
        for name, background in (("sync", False), ("async", True)):
            ck = dataclasses.replace(cfg.checkpoint, async_=background, keep_last=2, resume="none")
            savers[name] = build_checkpointer(
                dataclasses.replace(cfg, checkpoint=ck), groups, parts, Path(tmp) / name, None
            )
        stats = {name: {"steps": [], "stall": [], "writing": []} for name in VARIANTS}

        def step() -> float:
            start = time.perf_counter()
            parts.runner.forward_backward(batches, parts.chunks[-1].loss_sum, 1.0 / tokens)
            parts.optimizer.step.step(cfg.optim.lr)
            return time.perf_counter() - start

        def variant(name: str) -> object:
            saver = savers.get(name)

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
                    stats[name]["writing" if writing else "steps"].append(seconds)
                    if saver is not None and i % job.every == 0:
                        stats[name]["stall"].append(stall)
                    elif stall:
                        stats[name]["stall"][-1] += stall

            return one

        timings = alternate(
            {name: variant(name) for name in VARIANTS},
            warmup=job.every,
            steps=job.every,
            rounds=job.rounds,
            sync=lambda: barrier(device),
        )
        state_bytes = savers["async"].background.stage.nbytes
    parts.optimizer.remove_hooks()
    rows = {name: {"wall": timings[name].wall, "cpu": timings[name].cpu, **stats[name]} for name in VARIANTS}
    return {**rows, "bytes": state_bytes}
