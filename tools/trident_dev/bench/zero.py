"""``tools/bench.py zero``: tokens/s and model-state bytes of trident's ZeRO stages against stage 0, FSDP2 and
DDP + ZeroRedundancyOptimizer.

    python tools/bench.py zero [--worlds 2 4] [--layers 4] [--d-model 256] [--seq-len 128] [--vocab 8192]
        [--variants zero0 ...] [--batch-seq 0] [--micro-batch 4] [--micro-batches 2] [--steps 3] [--rounds 3]
        [--precision fp32] [--state-only]

For each world size, a pool of that many gloo ranks (trident_dev.ranks) trains these variants of one GPT (at tp=1,
so plain torch layers), all from the same initial weights on the same batches (each dp rank its own):

  zero0..zero3  trident at parallel.zero=0..3, built by trident/build.py's ``build_parts`` as train.py builds it
                (model chunks, reducer, ZeRO optimizer, GradStep with global-norm clipping, runner).
  ddp+zro       torch DDP (no_sync on all but the last micro-batch, bucket views as gradients) with
                torch.distributed.optim.ZeroRedundancyOptimizer over AdamW (foreach), clip_grad_norm_: ZeRO-1 as
                torch ships it. Compared with zero1.
  fsdp2         torch.distributed.fsdp.fully_shard on each block and on the model (reshard after forward), AdamW
                (foreach, decay on matrices only, as trident) over the DTensor shards, clip_grad_norm_; gradients
                reduce-scattered every micro-batch, as trident's stage 3 does. Compared with zero3.

Every step is --micro-batches micro-batches of --micro-batch sequences per rank; the timed blocks of --steps steps
alternate between variants over --rounds rounds (trident_dev/bench/harness.py), and the median step time gives
tokens/s (all ranks' tokens); CPU-s/step is the CPU time a step costs all ranks together (compute and gloo
threads), which other load on the machine hardly changes. The first and last loss of every variant are shown:
they must agree.

Model-state bytes per rank are measured on the live tensors after the steps (each storage once: parameters,
gradients, optimizer states; the torch variants' .grad and optimizer state, DTensors by their local shards), the
largest rank's, and set against the formula of parallel/zero/__init__.py (Psi the parameter count, N the dp
size) and, for trident's stages, against trident/memory/estimate.py's prediction (what tools/estimate_memory.py
prints). --state-only steps once and measures each variant in a run of its own (no tokens/s): gpt-small at dp=4 is
``--state-only --worlds 4 --layers 12 --d-model 768 --seq-len 1024 --vocab 50257 --batch-seq 64 --micro-batch 1
--micro-batches 1`` (--batch-seq: shorter sequences than the model's seq_len, so activations stay small).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist

from trident.build import build_parts, layout_of, model_chunks
from trident.config import Config, compose_config, validate
from trident.memory.estimate import estimate
from trident.models.gpt import count_params
from trident.parallel.batch import Batch
from trident.parallel.groups import ProcessGroups, build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.harness import (
    Table,
    adamw_args,
    alternate,
    barrier,
    device_mesh,
    number,
    random_batches,
    ratio,
    spread,
    storage_bytes,
)
from trident_dev.ranks import run_distributed

VARIANTS = ("zero0", "zero1", "zero2", "zero3", "ddp+zro", "fsdp2")
BASELINE = {"zero1": "ddp+zro", "zero3": "fsdp2"}
HEADER = ["dp", "variant", "tokens/s", "spread", "vs zero0", "vs torch", "CPU-s/step", "CPU vs zero0"]
HEADER += ["first loss", "last loss", "state MiB", "formula MiB", "measured / formula", "estimate MiB"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch-seq", type=int, default=0, help="tokens per sequence (0: the model's seq-len)")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--state-only", action="store_true", help="one step per variant, each in a run of its own")


def formula_bytes(variant: str, psi: int, n: int, b: int) -> float:
    """Model-state bytes per rank: parallel/zero/__init__.py's table (b: parameter bytes; masters fp32)."""
    masters = 4 if b != 4 else 0  # fp32 parameters are their own masters
    return {
        "zero0": (b + 4 + masters + 8) * psi,
        "zero1": (b + 4) * psi + (masters + 8) * psi / n,
        "zero2": b * psi + (4 + masters + 8) * psi / n,
        "zero3": (b + 4 + masters + 8) * psi / n,
        "ddp+zro": (4 + 4) * psi + 8 * psi / n,  # fp32 params, gradients as DDP bucket views, sharded AdamW state
        "fsdp2": 16 * psi / n,
    }[variant]


@dataclasses.dataclass
class Job:
    cfg: Config
    variants: list[str]
    batch_seq: int
    micro_batch: int
    micro_batches: int
    steps: int
    rounds: int
    state_only: bool


def run(args: argparse.Namespace) -> list[Table]:
    cfg = compose_config(
        args.conf,
        [
            "model=gpt-mini",
            "model.name=bench",
            f"model.n_layers={args.layers}",
            f"model.d_model={args.d_model}",
            f"model.n_heads={max(1, args.d_model // 64)}",
            f"model.seq_len={args.seq_len}",
            f"model.vocab_size={args.vocab}",
            f"train.precision={args.precision}",
            "optim.lr=1e-4",
            "optim.warmup_steps=0",
        ],
    )
    # torch's variants are fp32 only: they have no 16-bit parameters with fp32 masters to compare with.
    names = [v for v in args.variants if args.precision == "fp32" or v.startswith("zero")]
    b = 4 if args.precision == "fp32" else 2
    m = cfg.model
    t = Table(
        f"GPT {m.n_layers} layers, d_model {m.d_model}, seq {args.batch_seq or m.seq_len}, vocab {m.vocab_size}, "
        f"{args.precision}; {args.micro_batches} micro-batches of {args.micro_batch} per rank per step; gloo on "
        f"{os.cpu_count()} CPUs" + ("" if args.state_only else f"; {args.rounds} rounds x {args.steps} steps"),
        HEADER,
    )
    psi = count_params(m)
    for world in args.worlds:
        job = Job(cfg, names, args.batch_seq, args.micro_batch, args.micro_batches, args.steps, args.rounds, False)
        if args.state_only:  # each variant in a run of its own, so a large model's states are never held twice
            rows = {}
            for name in names:
                one = dataclasses.replace(job, variants=[name], state_only=True)
                rows.update(run_distributed(_rank, world, one, timeout_s=24 * 3600)[0])
        else:
            rows = run_distributed(_rank, world, job, timeout_s=24 * 3600)[0]
        tokens = job_tokens(job, world)
        rates = {name: tokens / statistics.median(r["wall"]) if r["wall"] else None for name, r in rows.items()}
        for name, r in rows.items():
            tps, cpu = rates[name], r["cpu"] if r["wall"] else None
            zero0 = rows.get("zero0")
            formula = formula_bytes(name, psi, world, b)
            predicted = None
            if name.startswith("zero"):
                par = dataclasses.replace(cfg.parallel, zero=int(name[-1]))
                layout = dataclasses.replace(validate(dataclasses.replace(cfg, parallel=par), world), device="cpu")
                predicted = sum(estimate(m, layout).stages[0].model_states["total"].values())
            t.add(
                world,
                name,
                number(tps),
                spread(r["wall"]) if tps else None,
                ratio(tps, rates.get("zero0")),
                ratio(tps, rates.get(BASELINE.get(name, ""))),
                number(cpu, ".3f"),
                ratio(cpu, zero0 and zero0["cpu"]),
                f"{r['first']:.5f}",
                f"{r['last']:.5f}",
                f"{r['bytes'] / 2**20:.2f}",
                f"{formula / 2**20:.2f}",
                f"{r['bytes'] / formula:.3f}",
                number(predicted and predicted / 2**20, ".2f"),
            )
    t.notes.append(
        f"Psi = {psi:,} parameters, N = dp. state: the largest rank's measured parameters, gradients and optimizer "
        "states; formula: parallel/zero/__init__.py's table; estimate: trident/memory/estimate.py (padding included)."
    )
    return [t]


def job_tokens(job: Job, world: int) -> int:
    return world * job.micro_batches * job.micro_batch * (job.batch_seq or job.cfg.model.seq_len)


class Trident:
    """trident at ``cfg.parallel.zero``, built as train.py builds it."""

    def __init__(self, cfg: Config, groups: ProcessGroups, device: torch.device) -> None:
        self.parts = build_parts(cfg, layout_of(cfg, groups), groups, device)

    def step(self, batches: list[Batch], tokens: int) -> torch.Tensor:
        loss = self.parts.runner.forward_backward(batches, self.parts.chunks[-1].loss_sum, 1.0 / tokens)
        self.parts.optimizer.step.step(1e-4)
        return loss

    def state_bytes(self) -> int:
        return storage_bytes(t for ts in self.parts.optimizer.step.model_state_tensors().values() for t in ts)

    def close(self) -> None:
        self.parts.optimizer.remove_hooks()


def torch_state_bytes(model: torch.nn.Module, optimizer_state: dict) -> int:
    """A torch baseline's model states: its parameters, their ``.grad`` and the optimizer's state tensors."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [t for s in optimizer_state.values() for t in s.values() if torch.is_tensor(t)]
    return storage_bytes([*params, *grads, *states])


class TorchDDPZero:
    def __init__(self, cfg: Config, groups: ProcessGroups, device: torch.device) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        (model,) = model_chunks(cfg.model, layout_of(cfg, groups), cfg.train, groups, device)
        self.model = DistributedDataParallel(model, process_group=groups.dp_group, gradient_as_bucket_view=True)
        self.loss_fn, self.clip = model.loss_sum, cfg.optim.grad_clip
        args = adamw_args(model, cfg)
        self.optimizer = ZeroRedundancyOptimizer(
            args.pop("params"), optimizer_class=torch.optim.AdamW, process_group=groups.dp_group, **args
        )

    def step(self, batches: list[Batch], tokens: int) -> torch.Tensor:
        return _torch_step(self.model, self.loss_fn, self.optimizer, self.clip, batches, tokens, self.model.no_sync)

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.optimizer.optim.state)  # the local shard's AdamW

    def close(self) -> None:
        pass


def _torch_step(
    model: torch.nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    optimizer: torch.optim.Optimizer,
    clip: float,
    batches: list[Batch],
    tokens: int,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
) -> torch.Tensor:
    """One step of a torch baseline: every micro-batch's backward (``no_sync`` around all but the last: DDP's
    gradient accumulation), global-norm clipping, AdamW; returns the summed loss."""
    total = torch.zeros(())
    for i, (x, y, *_) in enumerate(batches):
        with no_sync() if no_sync is not None and i < len(batches) - 1 else _nothing():
            loss = loss_fn(model(x), y)
            (loss / tokens).backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return total


class TorchFSDP2:
    def __init__(self, cfg: Config, groups: ProcessGroups, device: torch.device) -> None:
        from torch.distributed.fsdp import fully_shard

        (model,) = model_chunks(cfg.model, layout_of(cfg, groups), cfg.train, groups, device)
        mesh = device_mesh(groups.dp_group, device.type, "dp")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.clip = model, cfg.optim.grad_clip
        self.optimizer = torch.optim.AdamW(**adamw_args(model, cfg))

    def step(self, batches: list[Batch], tokens: int) -> torch.Tensor:
        return _torch_step(self.model, self.model.loss_sum, self.optimizer, self.clip, batches, tokens)

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.optimizer.state)

    def close(self) -> None:
        pass


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def batches_for(step: int, rank: int, world: int, job: Job) -> list[Batch]:
    """This dp rank's micro-batches of ``step``: its own random sequences."""
    length, per_rank = job.batch_seq or job.cfg.model.seq_len, job.micro_batches * job.micro_batch
    first = (step * world + rank) * per_rank
    vocab = job.cfg.model.vocab_size
    return random_batches(vocab, job.micro_batches, job.micro_batch, length, step, 1_000 * step + rank, first)


def _rank(rank: int, world: int, job: Job) -> dict:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cpu")  # gloo: FSDP2 and ZeroRedundancyOptimizer on CPU tensors, as trident
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    cfg = job.cfg
    builders: dict[str, Callable[[], object]] = {
        **{
            f"zero{z}": (
                lambda z=z: Trident(
                    dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=z)), groups, device
                )  # fmt: skip
            )
            for z in range(4)
        },
        "ddp+zro": lambda: TorchDDPZero(cfg, groups, device),
        "fsdp2": lambda: TorchFSDP2(cfg, groups, device),
    }
    tokens = job_tokens(job, world)
    variants = {name: builders[name]() for name in job.variants}
    losses: dict[str, list[float]] = {name: [] for name in variants}

    def train(name: str) -> Callable[[int], None]:
        def step(i: int) -> None:
            loss = variants[name].step(batches_for(i, rank, world, job), tokens)
            dist.all_reduce(loss)
            losses[name].append(loss.item() / tokens)

        return step

    steps = {name: train(name) for name in variants}
    if job.state_only:
        timings = alternate(steps, warmup=1, steps=1, rounds=0)
    else:
        timings = alternate(steps, warmup=1, steps=job.steps, rounds=job.rounds, sync=lambda: barrier(device))
    nbytes = torch.tensor([variants[name].state_bytes() for name in variants], dtype=torch.float64)
    dist.all_reduce(nbytes, op=dist.ReduceOp.MAX)
    # CPU seconds a step costs all ranks together (their compute and gloo threads): unlike wall time, it hardly
    # moves when other processes load the machine.
    cpu_s = torch.tensor([statistics.median(timings[n].cpu or [0.0]) for n in variants], dtype=torch.float64)
    dist.all_reduce(cpu_s)
    for v in variants.values():
        v.close()
    return {
        name: {
            "wall": timings[name].wall,
            "cpu": cpu_s[i].item(),
            "first": losses[name][0],
            "last": losses[name][-1],
            "bytes": int(nbytes[i]),
        }
        for i, name in enumerate(variants)
    }
