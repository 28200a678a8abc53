"""``tools/bench.py pp``: pipeline schedules against one process and against torch.distributed.pipelining, in one
invocation: tokens/s, CPU time, the measured bubble beside the formula, stage 0's activations; and the dp reduction
each schedule leaves exposed at dp x pp ranks (docs/benchmarks.md#pp).

    python tools/bench.py pp                          # small sizes: a few minutes on a CPU
    python tools/bench.py pp --layers 16 --d-model 256 --micro 16
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from trident.build import build_parts, layout_of, model_chunks
from trident.config import Config, compose_config, validate
from trident.errors import ConfigError
from trident.parallel.batch import Batch
from trident.parallel.groups import build_process_groups
from trident.parallel.pipeline.schedules import (
    B,
    F,
    I,
    W,
    build_schedule,
    holder_of,
    simulate,
    stage_of,
    stage_placement,
)
from trident.parallel.topology import Topology
from trident_dev.bench.compare import Column, Comparison, Rank, Row, Setting, Steps, compare
from trident_dev.bench.harness import SavedBytes, Table, number, one_rank_groups, random_batches, ratio, spread
from trident_dev.schedule_theory import bubble_formula, idle_fractions

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")
TORCH_SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zb-v": "ScheduleZBVZeroBubble",
}
VPP = {"interleaved": 2, "zb-v": 2}  # model chunks per rank; 1 for the others
HEADER = ["pp", "schedule", "tokens/s", "spread", "pp=1 tokens/s", "vs pp=1", "torch tokens/s", "vs torch"]
HEADER += ["CPU vs torch"]
HEADER += ["bubble", "formula", "act. peak (stage 0)"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step (M)")
    p.add_argument("--mbs", type=int, default=2, help="sequences per micro-batch")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    p.add_argument("--exposed-dp", type=int, default=2, help="dp of the exposed-reduction table (0: no table)")
    p.add_argument("--exposed-pp", type=int, default=2, help="pp of the exposed-reduction table")
    p.add_argument(
        "--receive-lead",
        type=int,
        default=None,
        help="ticks before its send that trident posts a receive (default: gloo's 1; 0 is NCCL's plan, as before)",
    )


@dataclasses.dataclass
class Job:
    cfg: Config  # the pipeline layout
    one: Config  # the same model in one process
    steps: int
    warmup: int
    timings: Path
    lead: int | None = None  # PipelineRunner.lead, None: the backend's


def run(args: argparse.Namespace) -> list[Table]:
    base = [
        "model=gpt-mini",
        "model.name=bench",
        f"model.n_layers={args.layers}",
        f"model.d_model={args.d_model}",
        "model.n_heads=4",
        f"model.seq_len={args.seq_len}",
        f"model.vocab_size={args.vocab}",
        f"train.micro_batch_size={args.mbs}",
        f"train.global_batch_size={args.micro * args.mbs}",
    ]
    one = compose_config(args.conf, base)
    tokens = args.micro * args.mbs * args.seq_len
    title = (
        f"GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}; M={args.micro} micro-batches of "
        f"{args.mbs}; {tokens} tokens a step; tokens/s are medians of {args.steps} steps; {os.cpu_count()} cores, "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )
    notes = [
        "bubble: idle / step time of the worst rank; formula: the schedule's, as idle / step time (zb-v: its lists "
        "simulated with the measured F, I, W costs)."
    ]
    with tempfile.TemporaryDirectory(prefix="bench-pp-") as tmp:
        settings = []
        for pp in args.pp:
            for schedule in args.schedules:
                vpp = VPP.get(schedule, 1)
                layout = [f"parallel.pp={pp}", f"parallel.vpp={vpp}", f"parallel.schedule={schedule}"]
                cfg = compose_config(args.conf, [*base, *layout])
                cells = {"pp": pp, "schedule": schedule}
                try:
                    validate(cfg, pp)  # as train.py decides
                except ConfigError as e:
                    settings.append(Setting(cells=cells, refused=f"refused: {e}"))
                    continue
                job = Job(cfg, one, args.steps, args.warmup, Path(tmp) / f"pp{pp}-{schedule}", args.receive_lead)
                settings.append(Setting(_pipelines, job, cells, world=pp, device="cpu", rows=["trident"]))
        cells: dict[Path, dict[str, str]] = {}  # a row's cells after pp and schedule, computed once

        def cell(header: str) -> Callable[[Row], str]:
            return lambda r: cells.setdefault(r.job.timings, dict(zip(HEADER[2:], row(r, tokens), strict=True)))[header]

        columns = [Column("pp"), Column("schedule"), *(Column(h, cell(h)) for h in HEADER[2:])]
        t = compare(Comparison(title, columns, settings, args.warmup, 1, args.steps, notes))
        tables = [t]
        if args.exposed_dp > 0:
            tables.append(exposed_table(args, base, Path(tmp)))
    return tables


EXPOSED_HEADER = ["dp x pp", "schedule", "exposed (ms)", "range", "step (ms)"]


def exposed_table(args: argparse.Namespace, base: list[str], tmp: Path) -> Table:
    """Each schedule at dp x pp ranks: the dp reduction left after the schedule."""
    dp, pp = args.exposed_dp, args.exposed_pp
    settings = []
    for schedule in args.schedules:
        vpp = VPP.get(schedule, 1)
        overrides = [*base, f"parallel.dp={dp}", f"parallel.pp={pp}", f"parallel.vpp={vpp}"]
        overrides[overrides.index(f"train.global_batch_size={args.micro * args.mbs}")] = (
            f"train.global_batch_size={dp * args.micro * args.mbs}"
        )
        cfg = compose_config(args.conf, [*overrides, f"parallel.schedule={schedule}"])
        cells = {"dp x pp": f"{dp} x {pp}", "schedule": schedule}
        try:
            validate(cfg, dp * pp)
        except ConfigError as e:
            settings.append(Setting(cells=cells, refused=f"refused: {e}"))
            continue
        job = Job(cfg, cfg, args.steps, args.warmup, tmp / f"exposed-{schedule}")
        settings.append(Setting(_exposed, job, cells, world=dp * pp, device="cpu"))

    def exposed(row: Row) -> list[float]:
        job = row.job
        rows = [  # the ranks of dp rank 0's pipeline, one file each
            [json.loads(line) for line in path.read_text().splitlines()]
            for path in sorted(job.timings.glob("rank*.jsonl"))
        ]
        steps = zip(*(rs[job.warmup : job.warmup + job.steps] for rs in rows), strict=True)
        return [1e3 * max(r["reduce"][1] - r["reduce"][0] for r in step) for step in steps]

    columns = [
        Column("dp x pp"),
        Column("schedule"),
        Column("exposed (ms)", lambda r: number(statistics.median(exposed(r)), ".1f")),
        Column("range", lambda r: f"{min(exposed(r)):.1f}-{max(exposed(r)):.1f}"),
        Column("step (ms)", lambda r: number(1e3 * statistics.median(r.out.ranks[0].wall), ".1f")),
    ]
    title = (
        f"The dp reduction left exposed per step, dp={dp} x pp={pp} ranks, same GPT and batch size per dp rank "
        f"(M={args.micro}): each chunk's buckets started during its last backward"
    )
    notes = [
        "exposed: the reducer's finish() after the rank's last action, worst pipeline rank, median over steps and "
        "the lowest-highest step; step: median step time."
    ]
    return compare(Comparison(title, columns, settings, args.warmup, 1, args.steps, notes))


def _exposed(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    cfg, device = job.cfg, rank.device
    par = cfg.parallel
    groups = build_process_groups(Topology(dp=par.dp, pp=par.pp, tp=1))
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    micro = cfg.train.global_batch_size // cfg.train.micro_batch_size // par.dp
    parts = build_parts(cfg, layout_of(cfg, groups), groups, device, timings_dir=job.timings)

    def step(i: int) -> None:
        mbs, seq = cfg.train.micro_batch_size, cfg.model.seq_len
        batches = random_batches(cfg.model.vocab_size, micro, mbs, seq, i, 1000 * groups.dp_rank + i)
        parts.runner.forward_backward(batches, parts.chunks[-1].loss_sum, 1.0 / tokens)
        parts.optimizer.zero.zero_grad()

    return {"step": lambda: Steps(step, close=parts.optimizer.remove_hooks)}


def row(r: Row, tokens: int) -> list[str]:
    """The cells of one pipeline's row after pp and schedule: trident's timings, torch's, one process's."""
    job, info = r.job, r.info
    cfg = job.cfg
    layout = validate(cfg, cfg.parallel.pp)
    pp, vpp, micro, schedule = layout.pp, layout.vpp, layout.micro_batches, layout.schedule
    ours_tps, base_tps = tokens / r.out.time.median, tokens / r.of("one").time.median
    per_rank = [
        [json.loads(line)["spans"] for line in (job.timings / f"rank{k}.jsonl").read_text().splitlines()]
        for k in range(pp)
    ]
    steps = [list(step) for step in zip(*(rows[job.warmup : job.warmup + job.steps] for rows in per_rank), strict=True)]
    bubble, costs = measured_bubble(steps)
    if schedule == "zb-h1":
        b = bubble_formula(schedule, pp, vpp, micro, {"F": costs[F], "I": costs[I], "W": costs[W]})
    elif schedule == "zb-v":  # no formula for unequal costs: its lists simulated with the measured ones
        measured = {F: costs[F], I: costs[I], W: costs[W], B: costs[I] + costs[W]}
        spans = simulate(build_schedule(schedule, pp, vpp, micro), vpp, measured, stage_placement(schedule))
        b = max(idle_fractions(spans, pp))
    else:
        b = bubble_formula(schedule, pp, vpp, micro)
    formula = b / (1 + b)  # idle over busy -> idle over the step
    theirs = r.run.outcomes.get("torch")
    torch_tps = tokens / theirs.time.median if theirs else None
    peak = r.out.figures.get("peak")
    return [
        number(ours_tps),
        spread(r.out.wall),
        number(base_tps),
        ratio(ours_tps, base_tps),
        number(torch_tps) if torch_tps else f"n/a: {info.get('torch_error')}",
        ratio(ours_tps, torch_tps),
        ratio(theirs.cpu_s, r.out.cpu_s) if theirs else "-",
        f"{bubble:.3f}",
        f"{formula:.3f}",
        f"{peak / 2**20:.2f} MiB" if peak is not None else "-",
    ]


def measured_bubble(spans_per_step: list[list[list]]) -> tuple[float, dict[str, float]]:
    """Worst rank's idle / step time, median over steps; and the mean duration of each kind of action."""
    fractions, costs = [], {}
    for step in spans_per_step:
        t0 = min(s[3] for rank in step for s in rank)
        t1 = max(s[4] for rank in step for s in rank)
        busy = [sum(s[4] - s[3] for s in rank) for rank in step]
        fractions.append(max((t1 - t0 - b) / (t1 - t0) for b in busy))
        for rank in step:
            for kind, *_, start, end in rank:
                costs.setdefault(kind, []).append(end - start)
    return statistics.median(fractions), {k: statistics.mean(v) for k, v in costs.items()}


def batches_for(cfg: Config, step: int) -> list[Batch]:
    tr = cfg.train
    micro = tr.global_batch_size // tr.micro_batch_size
    first = step * tr.global_batch_size
    return random_batches(cfg.model.vocab_size, micro, tr.micro_batch_size, cfg.model.seq_len, step, step, first)


def _pipelines(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    cfg, device, pp = job.cfg, rank.device, rank.world
    groups = build_process_groups(Topology(dp=1, pp=pp, tp=1))
    alone = dist.new_group([0])  # every rank takes part in creating it; only rank 0 is in it
    tokens = cfg.train.global_batch_size * cfg.model.seq_len

    def trident() -> Steps:
        layout = layout_of(cfg, groups)
        parts = build_parts(cfg, layout, groups, device, timings_dir=job.timings)
        if job.lead is not None:
            parts.runner.lead = job.lead

        def ours(step: int) -> None:
            parts.runner.forward_backward(batches_for(cfg, step), parts.chunks[-1].loss_sum, 1.0 / tokens)
            parts.optimizer.zero.zero_grad()

        def figures() -> dict:
            """One more step (every rank runs the same schedule), its saved activations measured on rank 0."""
            if rank.rank == 0 and layout.schedule in ("gpipe", "1f1b"):
                saved = SavedBytes()
                with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                    ours(0)
                return {"peak": saved.peak}
            ours(0)
            return {}

        return Steps(ours, close=parts.optimizer.remove_hooks, figures=figures)

    variants = {"trident": trident}
    try:
        step = torch_pipeline(cfg, groups, device, rank.rank)
        variants["torch"] = lambda: Steps(step)
    except Exception as e:  # a schedule torch cannot build for this layout
        rank.info["torch_error"] = f"{type(e).__name__}: {e}".splitlines()[0][:60]
    variants["one"] = lambda: Steps(one_process(job.one, alone, device, rank.rank))
    return variants


def torch_pipeline(cfg: Config, groups, device: torch.device, rank: int):
    """torch.distributed.pipelining's schedule of the same name over this rank's stage modules."""
    import torch.distributed.pipelining as pipelining

    layout = layout_of(cfg, groups)
    pp, vpp, schedule = layout.pp, layout.vpp, layout.schedule
    placement = stage_placement(schedule)
    chunks = model_chunks(cfg.model, layout, cfg.train, groups, device)
    stages = [
        pipelining.PipelineStage(c, stage_of(i, rank, pp, placement), pp * vpp, device, group=groups.pp_group)
        for i, c in enumerate(chunks)
    ]
    last = holder_of(pp * vpp - 1, pp, placement)[0]  # the rank with the loss (zb-v: rank 0, the first too)
    micro = cfg.train.global_batch_size // cfg.train.micro_batch_size
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    loss_fn = lambda out, y: chunks[-1].loss_sum(out, y) / tokens  # noqa: E731
    cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
    sched = cls(stages[0] if len(stages) == 1 and schedule != "zb-h1" else stages, micro, loss_fn)

    def step(i: int) -> None:
        batches = batches_for(cfg, i)
        x, y = torch.cat([b.tokens for b in batches]), torch.cat([b.targets for b in batches])
        kwargs = {"target": y, "losses": []} if rank == last else {}
        sched.step(x, **kwargs) if rank == 0 else sched.step(**kwargs)
        for c in chunks:
            c.zero_grad(set_to_none=True)

    return step


def one_process(one: Config, alone: dist.ProcessGroup, device: torch.device, rank: int):
    """The whole model on rank 0 (the other ranks wait): the pp=1 baseline, timed between the pipelines' steps."""
    if rank != 0:
        return lambda step: None
    (model,) = model_chunks(
        one.model, layout_of(one, one_rank_groups(alone)), one.train, one_rank_groups(alone), device
    )
    tokens = one.train.global_batch_size * one.model.seq_len

    def step(i: int) -> None:
        for x, y, *_ in batches_for(one, i):
            (model.loss_sum(model(x), y) / tokens).backward()
        model.zero_grad(set_to_none=True)

    return step
