"""``tools/bench.py zero``: tokens/s and model-state bytes of trident's ZeRO stages against stage 0, FSDP2 and
DDP + ZeroRedundancyOptimizer, at each world size; model-state bytes against parallel/zero's formula and the
estimator (docs/benchmarks.md#zero).

    python tools/bench.py zero [--worlds 2 4] [--layers 4] [--d-model 256] [--seq-len 128] [--vocab 8192]
        [--variants zero0 ...] [--batch-seq 0] [--micro-batch 4] [--micro-batches 2] [--steps 3] [--rounds 3]
        [--precision fp32] [--state-only]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
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
from trident_dev.bench.compare import Column, Comparison, Rank, Row, Setting, Steps, compare
from trident_dev.bench.harness import (
    Table,
    adamw_args,
    device_mesh,
    number,
    random_batches,
    ratio,
    spread,
    storage_bytes,
)

VARIANTS = ("zero0", "zero1", "zero2", "zero3", "ddp+zro", "fsdp2")
BASELINE = {"zero1": "ddp+zro", "zero3": "fsdp2"}


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
    psi = count_params(m)
    job = Job(cfg, names, args.batch_seq, args.micro_batch, args.micro_batches)
    # --state-only: each variant in a run of its own, so a large model's states are never held twice
    jobs = [dataclasses.replace(job, variants=[n]) for n in names] if args.state_only else [job]
    settings = [Setting(_variants, j, {"dp": w}, world=w, device="cpu") for w in args.worlds for j in jobs]

    def rate(row: Row, name: str | None = None) -> float | None:
        out = row.out if name is None else row.of(name)
        return out.rate(job_tokens(job, row.cells["dp"])).median if out is not None and out.wall else None

    def cpu(row: Row, name: str | None = None) -> float | None:
        out = row.out if name is None else row.of(name)
        return out.cpu_s if out is not None and out.wall else None

    def formula(row: Row) -> float:
        return formula_bytes(row.name, psi, row.cells["dp"], b)

    def predicted(row: Row) -> float | None:
        if not row.name.startswith("zero"):
            return None
        par = dataclasses.replace(cfg.parallel, zero=int(row.name[-1]))
        layout = validate(dataclasses.replace(cfg, parallel=par), row.cells["dp"])
        return sum(estimate(m, dataclasses.replace(layout, device="cpu")).stages[0].model_states["total"].values())

    columns = [
        Column("dp"),
        Column("variant"),
        Column("tokens/s", lambda r: number(rate(r))),
        Column("spread", lambda r: spread(r.out.wall) if rate(r) else None),
        Column("vs zero0", lambda r: ratio(rate(r), rate(r, "zero0"))),
        Column("vs torch", lambda r: ratio(rate(r), rate(r, BASELINE.get(r.name, "")))),
        Column("CPU-s/step", lambda r: number(cpu(r), ".3f")),
        Column("CPU vs zero0", lambda r: ratio(cpu(r), cpu(r, "zero0"))),
        Column("first loss", lambda r: f"{r.out.losses[0]:.5f}"),
        Column("last loss", lambda r: f"{r.out.losses[-1]:.5f}"),
        Column("state MiB", lambda r: f"{r.out.state / 2**20:.2f}"),
        Column("formula MiB", lambda r: f"{formula(r) / 2**20:.2f}"),
        Column("measured / formula", lambda r: f"{r.out.state / formula(r):.3f}"),
        Column("estimate MiB", lambda r: number(predicted(r) and predicted(r) / 2**20, ".2f")),
    ]
    title = (
        f"GPT {m.n_layers} layers, d_model {m.d_model}, seq {args.batch_seq or m.seq_len}, vocab {m.vocab_size}, "
        f"{args.precision}; {args.micro_batches} micro-batches of {args.micro_batch} per rank per step; gloo on "
        f"{os.cpu_count()} CPUs" + ("" if args.state_only else f"; {args.rounds} rounds x {args.steps} steps")
    )
    notes = [
        f"Psi = {psi:,} parameters, N = dp. state: the largest rank's measured parameters, gradients and optimizer "
        "states; formula: parallel/zero/__init__.py's table; estimate: trident/memory/estimate.py (padding included)."
    ]
    steps, rounds = (1, 0) if args.state_only else (args.steps, args.rounds)
    return [compare(Comparison(title, columns, settings, warmup=1, steps=steps, rounds=rounds, notes=notes))]


def job_tokens(job: Job, world: int) -> int:
    return world * job.micro_batches * job.micro_batch * (job.batch_seq or job.cfg.model.seq_len)


class _Trained(Steps):
    """A variant's step on this dp rank's batches: its summed loss, all-reduced, per token."""

    def __init__(self, batches: Callable[[int], list[Batch]], tokens: int) -> None:
        super().__init__()
        self.batches, self.tokens = batches, tokens

    def step(self, i: int) -> float:
        loss = self.train(self.batches(i))
        dist.all_reduce(loss)
        return loss.item() / self.tokens

    def train(self, batches: list[Batch]) -> torch.Tensor:
        raise NotImplementedError


class Trident(_Trained):
    """trident at ``cfg.parallel.zero``, built as train.py builds it."""

    def __init__(self, cfg: Config, groups: ProcessGroups, device: torch.device, *data: object) -> None:
        super().__init__(*data)
        self.parts = build_parts(cfg, layout_of(cfg, groups), groups, device)

    def train(self, batches: list[Batch]) -> torch.Tensor:
        loss = self.parts.runner.forward_backward(batches, self.parts.chunks[-1].loss_sum, 1.0 / self.tokens)
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


class TorchDDPZero(_Trained):
    def __init__(self, cfg: Config, groups: ProcessGroups, device: torch.device, *data: object) -> None:
        super().__init__(*data)
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        (model,) = model_chunks(cfg.model, layout_of(cfg, groups), cfg.train, groups, device)
        self.model = DistributedDataParallel(model, process_group=groups.dp_group, gradient_as_bucket_view=True)
        self.loss_fn, self.clip = model.loss_sum, cfg.optim.grad_clip
        args = adamw_args(model, cfg)
        self.optimizer = ZeroRedundancyOptimizer(
            args.pop("params"), optimizer_class=torch.optim.AdamW, process_group=groups.dp_group, **args
        )

    def train(self, batches: list[Batch]) -> torch.Tensor:
        model, tokens = self.model, self.tokens
        return _torch_step(model, self.loss_fn, self.optimizer, self.clip, batches, tokens, model.no_sync)

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.optimizer.optim.state)  # the local shard's AdamW


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


class TorchFSDP2(_Trained):
    def __init__(self, cfg: Config, groups: ProcessGroups, device: torch.device, *data: object) -> None:
        super().__init__(*data)
        from torch.distributed.fsdp import fully_shard

        (model,) = model_chunks(cfg.model, layout_of(cfg, groups), cfg.train, groups, device)
        mesh = device_mesh(groups.dp_group, device.type, "dp")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.clip = model, cfg.optim.grad_clip
        self.optimizer = torch.optim.AdamW(**adamw_args(model, cfg))

    def train(self, batches: list[Batch]) -> torch.Tensor:
        return _torch_step(self.model, self.model.loss_sum, self.optimizer, self.clip, batches, self.tokens)

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.optimizer.state)


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


def _variants(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    world = rank.world
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = rank.device  # gloo: FSDP2 and ZeroRedundancyOptimizer on CPU tensors, as trident
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    cfg = job.cfg
    data = (lambda i: batches_for(i, rank.rank, world, job), job_tokens(job, world))
    builders: dict[str, Callable[[], Steps]] = {
        **{
            f"zero{z}": (
                lambda z=z: Trident(
                    dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, zero=z)), groups, device, *data
                )  # fmt: skip
            )
            for z in range(4)
        },
        "ddp+zro": lambda: TorchDDPZero(cfg, groups, device, *data),
        "fsdp2": lambda: TorchFSDP2(cfg, groups, device, *data),
    }
    return {name: builders[name] for name in job.variants}
