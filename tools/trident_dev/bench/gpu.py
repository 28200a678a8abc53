"""``tools/bench.py gpu``: trident's training step against a plain PyTorch loop of the same model and against
``torch.compile`` of that loop, with tokens/s, MFU and peak memory: the GPU check kit's bench.

    python tools/bench.py gpu --models gpt-small llama-1b --precision bf16      # on a GPU
    python tools/bench.py gpu --device cpu --models gpt-tiny --precision fp32   # the same code on a CPU, in seconds

One process (a one-rank pool of trident_dev.ranks: nccl on a GPU, gloo on the CPU), from the same initial weights on
the same batches, alternating in rounds (trident_dev/bench/harness.py):

- trident: what train.py runs, built by trident/build.py (``build_parts``: the model, the ZeRO optimizer of
  ``--zero`` with its reducer, the runner) and stepped by ``Trainer.train_step``. With bf16 the parameters are bf16
  with fp32 masters and fp32 gradient reduction, as in a run.
- plain torch loop: what nanoGPT's train.py does with the same GPT module and nothing of trident's machinery: fp32
  weights under bf16 autocast, the loss through fp32 cross-entropy / micro-batches, backward, clip_grad_norm_, fused
  AdamW on a GPU (foreach on a CPU) at the same learning-rate schedule, zero_grad.
- torch.compile: ``torch.compile`` of that same module, stepped by the same loop with the same optimizer (they share
  weights and AdamW state: the compiled module is a view of the plain one, so it costs no second copy of a 1B model).

Figures, per row: tokens/s (median over rounds, and the spread of its rounds), over the plain loop's; MFU against
trident/peak.py's figure for the device (the 6N + attention FLOPs of models/gpt.py's ``flops_per_token``, as a run's
metrics); peak memory, on a GPU ``torch.cuda.max_memory_allocated`` of the variant's own warm-up steps (see
``warm_up``); and beside trident's peak the memory estimator's prediction for the same layout and batch
(trident/memory/estimate.py). On a CPU there is no allocator peak to read, so peak memory is n/a there.
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
from trident_dev.bench.harness import (
    Table,
    adamw_args,
    alternate,
    barrier,
    format_bytes,
    mfu,
    number,
    peak_flops,
    plain_step,
    pool_backend,
    random_windows,
    rank_device,
    ratio,
    spread,
    storage_bytes,
    tokens_per_s,
)
from trident_dev.ranks import run_distributed

HEADER = [
    "variant",
    "precision",
    "tokens/s",
    "spread",
    "x plain",
    "MFU",
    "peak mem",
    "estimate",
    "first loss",
    "last loss",
]
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
    backend = pool_backend(1) if job.device == "cuda" else "gloo"
    result = run_distributed(_rank, 1, job, backend=backend, timeout_s=24 * 3600)[0]
    cfg = job.cfg
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    rates = {name: tokens_per_s(tokens, r["wall"]) for name, r in result["variants"].items()}
    t = Table(
        f"model {cfg.model.name}, {result['device']}, {cfg.train.precision}, global batch "
        f"{cfg.train.global_batch_size} x {cfg.model.seq_len} tokens, micro-batch {cfg.train.micro_batch_size}, "
        f"zero {cfg.parallel.zero}; {job.rounds} rounds x {job.steps} steps after {job.warmup} warm-up",
        HEADER,
    )
    flops = flops_per_token(cfg.model)
    labels = dict(VARIANTS)
    if job.compile_backend != "inductor":
        labels["compiled"] += f" ({job.compile_backend})"
    for name, r in result["variants"].items():
        rate = rates[name]
        t.add(
            labels[name],
            r["precision"],
            number(rate.median),
            spread(r["wall"]),
            ratio(rate.median, rates["plain"].median),
            number(mfu(rate.median, flops, result["peak_flops"]), ".2%"),
            "n/a (cpu)" if r["peak_bytes"] is None else format_bytes(r["peak_bytes"]),
            format_bytes(result["estimate_bytes"]) if name == "trident" else None,
            f"{r['first_loss']:.6f}",
            f"{r['last_loss']:.6f}",
        )
    rounds_line = "; ".join(
        f"{labels[name]} {', '.join(number(tokens / s) for s in r['wall'])}" for name, r in result["variants"].items()
    )
    t.notes.append(f"rounds (tokens/s): {rounds_line}. spread: (fastest - slowest round) / median.")
    t.notes.append(
        "peak mem: torch.cuda.max_memory_allocated over the variant's warm-up steps, above what was allocated before "
        "them, plus the storages it held then (its parameters, gradient buffers and optimizer states); torch.compile "
        "shares the plain loop's weights and AdamW state. n/a on a CPU. estimate: trident/memory/estimate.py's "
        "prediction of trident's peak for this layout and batch."
        if result["device_type"] == "cuda"
        else "peak mem: n/a on a CPU (no allocator peak; a run's peak resident set is in `tools/bench.py layouts`). "
        "estimate: trident/memory/estimate.py's prediction of trident's host bytes for this layout and batch."
    )
    if not all(math.isfinite(r["last_loss"]) for r in result["variants"].values()):
        t.notes.append("a variant's loss is not finite: its figures time a broken run")
        t.ok = False
    return t


def held_bytes(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Device bytes a torch model and its optimizer hold between steps: parameters, gradients, AdamW state."""
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    tensors += [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return storage_bytes(t for t in tensors if t.is_cuda)


def warm_up(step: Callable[[int], float], steps: int, device: torch.device, held: int) -> tuple[int | None, list]:
    """Run ``steps`` untimed steps; return the variant's peak device bytes (None on a CPU) and their losses.

    The other variants stay allocated while one warms up, and stay still: what its steps allocate above the bytes
    allocated before them is its own, and ``held`` (its storages before the first step) is what it brought. The
    first steps allocate the gradients and AdamW's state, so their peak is the steady one."""
    if device.type != "cuda":
        return None, [step(i) for i in range(steps)]
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    losses = [step(i) for i in range(steps)]
    torch.cuda.synchronize(device)
    return held + torch.cuda.max_memory_allocated(device) - before, losses


def _rank(rank: int, world: int, job: Job) -> dict:
    cfg, precision = job.cfg, job.cfg.train.precision
    device = rank_device(rank, world) if job.device == "cuda" else torch.device("cpu")
    if device.type == "cpu":
        torch.set_num_threads(os.cpu_count() or 1)
    use_tensor_cores(device)  # as train.py: fp32 matmuls are TF32 on a GPU, which the fp32 peak assumes
    torch._dynamo.reset()  # a pool rank may have compiled another model for an earlier table
    groups = build_process_groups(Topology(dp=1, pp=1, tp=1))
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)

    # Built and warmed up one after another, each measured while the ones before it sit still (``warm_up``).
    parts = build_parts(cfg, layout_of(cfg, groups), groups, device)
    trainer = Trainer(cfg, groups, parts, (data, data), prefetch=False)
    losses: dict[str, list[float]] = {}
    peaks: dict[str, int | None] = {}
    states = [t for ts in parts.optimizer.zero.model_state_tensors().values() for t in ts if t.is_cuda]

    def ours(step: int) -> float:
        return trainer.train_step(step, trainer.micro_batches(step)).loss

    peaks["trident"], losses["trident"] = warm_up(ours, job.warmup, device, storage_bytes(states))

    (model,) = model_chunks(
        cfg.model, layout_of(cfg, groups), cfg.train, groups, device
    )  # the same initial weights, left fp32: torch's own autocast
    on_cuda = device.type == "cuda"
    opt = torch.optim.AdamW(**adamw_args(model, cfg, foreach=not on_cuda, fused=on_cuda))
    compiled = torch.compile(model, backend=job.compile_backend)

    def torch_step(net: torch.nn.Module, step: int) -> float:
        return plain_step(net, opt, trainer.micro_batches(step), cfg, step).item()

    steps = {"trident": ours, "plain": lambda s: torch_step(model, s), "compiled": lambda s: torch_step(compiled, s)}
    for name in ("plain", "compiled"):
        peaks[name], losses[name] = warm_up(steps[name], job.warmup, device, held_bytes(model, opt))

    def record(name: str) -> Callable[[int], None]:
        # Each variant's step count runs on from its warm-up, so its learning rate and batches continue.
        return lambda step: losses[name].append(steps[name](job.warmup + step))

    timings = alternate(
        {name: record(name) for name in steps},
        warmup=0,
        steps=job.steps,
        rounds=job.rounds,
        sync=lambda: barrier(device),
    )
    parts.optimizer.remove_hooks()
    layout = dataclasses.replace(validate(cfg, 1), device=device.type)
    predicted = estimate(cfg.model, layout).worst
    predicted_peak = predicted.peak(layout.recompute)
    trident_dtype = str(next(parts.chunks[0].parameters()).dtype).removeprefix("torch.")
    autocast_note = "" if precision == "fp32" else f", {precision} autocast"
    dtypes = {
        "trident": f"{trident_dtype} parameters",
        "plain": f"float32 weights{autocast_note}",
        "compiled": f"float32 weights{autocast_note}",
    }
    return {
        "device": torch.cuda.get_device_name(device) if on_cuda else f"cpu ({torch.get_num_threads()} threads)",
        "device_type": device.type,
        "peak_flops": peak_flops(device, precision, job.peak_tflops, 1),
        # On a GPU the device's share of the prediction; on a CPU everything is host memory.
        "estimate_bytes": predicted_peak["device"] if on_cuda else sum(predicted_peak.values()),
        "variants": {
            name: {
                "wall": timings[name].wall,
                "precision": dtypes[name],
                "peak_bytes": peaks[name],
                "first_loss": losses[name][0],
                "last_loss": losses[name][-1],
            }
            for name in steps
        },
    }
