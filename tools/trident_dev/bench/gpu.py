"""``tools/bench.py gpu``: trident's training step against a plain PyTorch loop of the same model and against
``torch.compile`` of that loop, with tokens/s, MFU and peak memory beside the estimator's: the GPU check kit's bench
(docs/benchmarks.md#gpu).

    python tools/bench.py gpu --models gpt-small llama-1b --precision bf16      # on a GPU
    python tools/bench.py gpu --device cpu --models gpt-tiny --precision fp32   # the same code on a CPU, in seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Callable

import torch

from trident.build import build_parts, layout_of, model_chunks
from trident.config import Config, compose_config, validate
from trident.device import use_tensor_cores
from trident.loop import Trainer
from trident.memory.estimate import estimate
from trident.models.gpt import flops_per_token
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.compare import (
    Column,
    Comparison,
    Rank,
    Row,
    Run,
    Setting,
    Steps,
    batch_title,
    compare,
    losses,
)
from trident_dev.bench.harness import (
    Table,
    adamw_args,
    format_bytes,
    mfu,
    number,
    peak_flops,
    plain_step,
    random_windows,
    ratio,
    spread,
    storage_bytes,
)

VARIANTS = {"trident": "trident", "plain": "plain torch loop", "compiled": "torch.compile"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", nargs="+", default=["gpt-small", "llama-1b"], help="presets under conf/model")
    p.add_argument("--precision", nargs="+", default=["bf16"], choices=["fp32", "bf16"], help="one table each")
    p.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"], help="auto: the GPU if there is one")
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--seq", type=int, help="tokens per sequence (model.seq_len; default: the preset's)")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="trident's parallel.zero")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=6, help="alternating timed blocks per variant; the median is shown")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each variant first (peak memory's)")
    p.add_argument("--peak-tflops", type=float, help="the device's peak for MFU (default: trident/peak.py's)")
    p.add_argument(
        "--compile-backend",
        default="inductor",
        choices=["inductor", "aot_eager"],
        help="torch.compile's backend (aot_eager: dynamo and AOT autograd without code generation, seconds on a CPU)",
    )
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more train.py overrides")


def build_config(args: argparse.Namespace, model: str, precision: str) -> Config:
    return compose_config(
        args.conf,
        [
            f"model={model}",
            *([f"model.seq_len={args.seq}"] if args.seq else []),
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}",
            f"train.precision={precision}",
            f"parallel.zero={args.zero}",
            "train.steps=1000000",
            "optim.warmup_steps=0",
            *args.set,
        ],
    )


def run(args: argparse.Namespace) -> list[Table]:
    if args.global_batch % args.micro_batch:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by --micro-batch {args.micro_batch}")
    if args.warmup < 1:
        raise SystemExit("--warmup must be at least 1: peak memory is read over the warm-up steps")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but no GPU is visible; use --device auto or cpu")
    device = "cpu" if args.device == "cpu" or not torch.cuda.is_available() else "cuda"
    tables = []
    for model in args.models:
        for precision in args.precision:
            cfg = build_config(args, model, precision)
            job = Job(cfg, device, args.warmup, args.steps, args.rounds, args.compile_backend, args.peak_tflops)
            tables.append(table(job))
    return tables


@dataclasses.dataclass
class Job:
    cfg: Config
    device: str  # cuda | cpu
    warmup: int
    steps: int
    rounds: int
    compile_backend: str = "inductor"
    peak_tflops: float | None = None  # the device's, for MFU; None: trident/peak.py's


def table(job: Job) -> Table:
    """The three variants of ``job`` timed in one rank's process, as one table."""
    cfg = job.cfg
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    flops = flops_per_token(cfg.model)
    labels = dict(VARIANTS)
    if job.compile_backend != "inductor":
        labels["compiled"] += f" ({job.compile_backend})"
    layout = dataclasses.replace(validate(cfg, 1), device=job.device)
    predicted = estimate(cfg.model, layout).worst.peak(layout.recompute)
    # On a GPU the device's share of the prediction; on a CPU everything is host memory.
    predicted = predicted["device"] if job.device == "cuda" else sum(predicted.values())

    def rate(row: Row, name: str | None = None) -> float:
        return (row.out if name is None else row.of(name)).rate(tokens).median

    def peak(row: Row) -> str:
        """The variant's warm-up peak above what was allocated before, plus what it held then."""
        warm = row.out.ranks[0].peak
        return "n/a (cpu)" if warm is None else format_bytes(row.out.figures["held"] + warm)

    columns = [
        Column("variant", lambda r: labels[r.name]),
        Column("precision", lambda r: r.out.figures["precision"]),
        Column("tokens/s", lambda r: number(rate(r))),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("x plain", lambda r: ratio(rate(r), rate(r, "plain"))),
        Column("MFU", lambda r: number(mfu(rate(r), flops, r.info["peak_flops"]), ".2%")),
        Column("peak mem", peak),
        Column("estimate", lambda r: format_bytes(predicted) if r.name == "trident" else None),
        *losses(),
    ]

    title = batch_title(cfg, lambda info: info["device"], job.rounds, job.steps, job.warmup)

    def finite(runs: list[Run]) -> bool:
        return all(math.isfinite(out.losses[-1]) for out in runs[0].outcomes.values())

    def notes(runs: list[Run]) -> list[str]:
        lines = [runs[0].rounds_line(tokens, labels.get)]
        lines.append(
            "peak mem: torch.cuda.max_memory_allocated over the variant's warm-up steps, above what was allocated "
            "before them, plus the storages it held then (its parameters, gradient buffers and optimizer states); "
            "torch.compile shares the plain loop's weights and AdamW state. n/a on a CPU. estimate: "
            "trident/memory/estimate.py's prediction of trident's peak for this layout and batch."
            if job.device == "cuda"
            else "peak mem: n/a on a CPU (no allocator peak; a run's peak resident set is in `tools/bench.py layouts`)."
            " estimate: trident/memory/estimate.py's prediction of trident's host bytes for this layout and batch."
        )
        if not finite(runs):
            lines.append("a variant's loss is not finite: its figures time a broken run")
        return lines

    setting = Setting(_variants, job, world=1, device=job.device)
    return compare(Comparison(title, columns, [setting], job.warmup, job.steps, job.rounds, notes, ok=finite))


def held_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Device bytes a torch model and its optimizer hold between steps: parameters, gradients, AdamW state."""
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return storage_bytes(t for t in tensors if t.is_cuda)


def _variants(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    """Built and warmed up one after another, each measured while the ones before it sit still: what its warm-up
    allocates above the bytes allocated before is its own, and its storages before its first step (``held``) are
    what it brought. The first steps allocate the gradients and AdamW's state, so their peak is the steady one."""
    cfg, precision, device = job.cfg, job.cfg.train.precision, rank.device
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    use_tensor_cores(device)  # as train.py: fp32 matmuls are TF32 on a GPU, which the fp32 peak assumes
    torch._dynamo.reset()  # a pool rank may have compiled another model for an earlier table
    groups = build_process_groups(Topology(dp=1, pp=1, tp=1))
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)
    on_cuda = device.type == "cuda"
    rank.info.update(
        device=torch.cuda.get_device_name(device) if on_cuda else f"cpu ({torch.get_num_threads()} threads)",
        peak_flops=peak_flops(device, precision, job.peak_tflops, 1),
    )
    autocast_note = "" if precision == "fp32" else f", {precision} autocast"
    shared: dict = {}

    def trident() -> Steps:
        parts = build_parts(cfg, layout_of(cfg, groups), groups, device)
        trainer = shared["trainer"] = Trainer(cfg, groups, parts, (data, data), prefetch=False)
        states = [t for ts in parts.optimizer.zero.model_state_tensors().values() for t in ts if t.is_cuda]
        dtype = str(next(parts.chunks[0].parameters()).dtype).removeprefix("torch.")
        figures = {"precision": f"{dtype} parameters", "held": storage_bytes(states)}
        step = lambda i: trainer.train_step(i, trainer.micro_batches(i)).loss  # noqa: E731
        return Steps(step, close=parts.optimizer.remove_hooks, figures=lambda: figures)

    def torch_loop(net: torch.nn.Module) -> Steps:
        model, opt, trainer = shared["model"], shared["opt"], shared["trainer"]
        figures = {"precision": f"float32 weights{autocast_note}", "held": held_bytes(model, opt)}
        step = lambda i: plain_step(net, opt, trainer.micro_batches(i), cfg, i).item()  # noqa: E731
        return Steps(step, figures=lambda: figures)

    def plain() -> Steps:
        (model,) = model_chunks(  # the same initial weights, left fp32: torch's own autocast
            cfg.model, layout_of(cfg, groups), cfg.train, groups, device
        )
        shared["model"] = model
        shared["opt"] = torch.optim.AdamW(**adamw_args(model, cfg, foreach=not on_cuda, fused=on_cuda))
        return torch_loop(model)

    def compiled() -> Steps:
        # The plain loop's module and AdamW: the compiled module is a view of it, no second copy of the weights.
        return torch_loop(torch.compile(shared["model"], backend=job.compile_backend))

    return {"trident": trident, "plain": plain, "compiled": compiled}
