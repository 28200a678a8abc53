"""Tokens/s and model-state bytes of trident's ZeRO stages against stage 0, FSDP2 and DDP + ZeroRedundancyOptimizer.

    python tools/bench_zero.py [--worlds 2,4] [--layers 4] [--d-model 256] [--seq-len 128] [--vocab 8192]
        [--variants zero0,...] [--batch-seq 0] [--micro-batch 4] [--micro-batches 2] [--steps 3] [--rounds 3]
        [--precision fp32] [--state-only]

One invocation spawns a gloo group of each size in --worlds on this machine (CPU) and trains, on every rank, these
variants of one GPT (models/gpt.py at tp=1, so plain torch layers), all from the same initial weights (trident's
name-seeded init) on the same batches (each dp rank its own micro-batches):

  zero0..zero3  trident: build_optimizer_setup (the reducer, the ZeRO optimizer, GradStep with global-norm clipping)
                and a LocalRunner, as train.py wires them, at parallel.zero=0..3.
  ddp+zro       torch DDP (no_sync on all but the last micro-batch, bucket views as gradients) with
                torch.distributed.optim.ZeroRedundancyOptimizer over AdamW (foreach), clip_grad_norm_: ZeRO-1 as
                torch ships it. Compared with zero1.
  fsdp2         torch.distributed.fsdp.fully_shard on each block and on the model (reshard after forward), AdamW
                (foreach) over the DTensor shards, clip_grad_norm_; gradients reduce-scattered every micro-batch, as
                trident's stage 3 does. Compared with zero3.

Every step is --micro-batches micro-batches of --micro-batch sequences per rank; the timed blocks of --steps steps
alternate between variants over --rounds rounds so machine noise hits all alike, and the median step time gives
tokens/s (all ranks' tokens); CPU-s/step is the CPU time a step costs all ranks together (compute and gloo threads),
which other load on the machine hardly changes. The first and last step's loss of every variant are printed: they
must agree.

Model-state bytes per rank are measured on the live tensors after the steps (each storage once: parameters,
gradients, optimizer states; the torch variants' .grad and optimizer state, DTensors by their local shards) and
set against the formula of parallel/zero/__init__.py with Psi the model's parameter count and N the dp size.
--state-only steps once and measures each variant in processes of its own (no tokens/s): gpt-small at dp=4 is
``--state-only --worlds 4 --layers 12 --d-model 768 --seq-len 1024 --vocab 50257 --batch-seq 64 --micro-batch 1
--micro-batches 1`` (--batch-seq: shorter sequences than the model's seq_len, so activations stay small).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from trident.config import Config, ModelConfig, OptimConfig
from trident.models.gpt import GPT, init_weights
from trident.optim import build_optimizer
from trident.optimizer_setup import build_optimizer_setup
from trident.parallel.batch import Batch
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident.runner import LocalRunner

VARIANTS = ("zero0", "zero1", "zero2", "zero3", "ddp+zro", "fsdp2")
BASELINE = {"zero1": "ddp+zro", "zero3": "fsdp2"}


def formula_bytes(variant: str, psi: int, n: int, b: int) -> float:
    """Model-state bytes per rank: parallel/zero/__init__.py's table (b: parameter bytes; masters fp32)."""
    masters = 4 if b != 4 else 0  # fp32 parameters are their own masters
    return {
        "zero0": (4 + 4 + 8) * psi if b == 4 else (b + 4 + 4 + 8) * psi,
        "zero1": (b + 4) * psi + (masters + 8) * psi / n,
        "zero2": b * psi + (4 + masters + 8) * psi / n,
        "zero3": (b + 4 + masters + 8) * psi / n if b != 4 else 16 * psi / n,
        "ddp+zro": (4 + 4) * psi + 8 * psi / n,  # fp32 params, gradients as DDP bucket views, sharded AdamW state
        "fsdp2": 16 * psi / n,
    }[variant]


def storages(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        seen[s.data_ptr()] = max(seen.get(s.data_ptr(), 0), s.nbytes())
    return sum(seen.values())


def torch_state_bytes(model: torch.nn.Module, optimizer_state: dict) -> int:
    """A torch baseline's model states: its parameters, their ``.grad`` and the optimizer's state tensors."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    states = [t for s in optimizer_state.values() for t in s.values() if torch.is_tensor(t)]
    return storages([*params, *grads, *states])


class Trident:
    def __init__(self, cfg: Config, groups, zero: int) -> None:
        self.model = GPT(cfg.model)
        init_weights(self.model, cfg.model, seed=0)
        cfg.parallel.zero = zero
        self.setup = build_optimizer_setup([self.model], cfg, groups)
        self.runner = LocalRunner([self.model], self.setup.reducer, cfg.train.precision)

    def step(self, batches: list[Batch], tokens: int) -> torch.Tensor:
        loss = self.runner.forward_backward(batches, self.model.loss_sum, 1.0 / tokens)
        self.setup.grad_step.step(1e-4)
        return loss

    def state_bytes(self) -> int:
        return storages([t for ts in self.setup.grad_step.model_state_tensors().values() for t in ts])


class TorchDDPZero:
    def __init__(self, cfg: Config, groups) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        model = GPT(cfg.model)
        init_weights(model, cfg.model, seed=0)
        self.model = DistributedDataParallel(model, process_group=groups.dp_group, gradient_as_bucket_view=True)
        self.loss_fn, self.clip = model.loss_sum, cfg.optim.grad_clip
        o = cfg.optim
        self.optimizer = ZeroRedundancyOptimizer(
            model.parameters(),
            optimizer_class=torch.optim.AdamW,
            process_group=groups.dp_group,
            lr=o.lr,
            betas=(o.beta1, o.beta2),
            eps=o.eps,
            weight_decay=o.weight_decay,
            foreach=True,
        )

    def step(self, batches: list[Batch], tokens: int) -> torch.Tensor:
        total = torch.zeros(())
        for i, (x, y, _, _) in enumerate(batches):
            context = self.model.no_sync() if i < len(batches) - 1 else _nothing()
            with context:
                loss = self.loss_fn(self.model(x), y)
                (loss / tokens).backward()
            total += loss.detach()
        # DDP averages over dp; trident's loss is pre-divided by the global token count and summed.
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return total

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.optimizer.optim.state)  # the local shard's AdamW


class TorchFSDP2:
    def __init__(self, cfg: Config, groups) -> None:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard

        model = GPT(cfg.model)
        init_weights(model, cfg.model, seed=0)
        mesh = DeviceMesh.from_group(groups.dp_group, "cpu")
        for block in model.layers.values():
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        self.model, self.clip = model, cfg.optim.grad_clip
        self.optimizer = build_optimizer([model], cfg.optim)

    def step(self, batches: list[Batch], tokens: int) -> torch.Tensor:
        total = torch.zeros(())
        for x, y, _, _ in batches:
            loss = self.model.loss_sum(self.model(x), y)
            (loss / tokens).backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return total

    def state_bytes(self) -> int:
        return torch_state_bytes(self.model, self.optimizer.state)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def batches_for(step: int, rank: int, args: argparse.Namespace) -> list[Batch]:
    gen = torch.Generator().manual_seed(1_000 * step + rank)
    length = args.batch_seq or args.seq_len
    tokens = torch.randint(0, args.vocab, (args.micro_batches, args.micro_batch, length + 1), generator=gen)
    mbs = args.micro_batch
    return [Batch(t[:, :-1], t[:, 1:], torch.arange(m * mbs, (m + 1) * mbs), step) for m, t in enumerate(tokens)]


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace, results: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    model = ModelConfig(
        name="bench",
        n_layers=args.layers,
        d_model=args.d_model,
        n_heads=args.d_model // 64,
        seq_len=args.seq_len,
        vocab_size=args.vocab,
    )
    cfg = Config(model=model, optim=OptimConfig(lr=1e-4, warmup_steps=0))
    cfg.train.precision = args.precision
    builders: dict[str, Callable[[], object]] = {
        **{f"zero{z}": (lambda z=z: Trident(cfg, groups, z)) for z in range(4)},
        "ddp+zro": lambda: TorchDDPZero(cfg, groups),
        "fsdp2": lambda: TorchFSDP2(cfg, groups),
    }
    if args.precision != "fp32":
        builders.pop("ddp+zro")
        builders.pop("fsdp2")
    builders = {name: build for name, build in builders.items() if name in (args.only or args.variants)}
    tokens = world * args.micro_batches * args.micro_batch * (args.batch_seq or args.seq_len)
    losses: dict[str, list[float]] = {name: [] for name in builders}
    times: dict[str, list[float]] = {name: [float("nan")] for name in builders}
    cpu: dict[str, list[float]] = {name: [float("nan")] for name in builders}
    nbytes: dict[str, int] = {}
    variants: dict[str, object] = {}

    def train(name: str, step: int) -> None:
        loss = variants[name].step(batches_for(step, rank, args), tokens)
        dist.all_reduce(loss)
        losses[name].append(loss.item() / tokens)

    for name, build in builders.items():  # untimed first step: warm-up, and the first loss
        variants[name] = build()
        train(name, 0)
        if args.state_only:
            nbytes[name] = variants[name].state_bytes()
    if not args.state_only:
        times = {name: [] for name in variants}
        cpu = {name: [] for name in variants}
        step = {name: 1 for name in variants}
        for _ in range(args.rounds):
            for name in variants:
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    train(name, step[name])
                    step[name] += 1
                dist.barrier()
                times[name].append((time.perf_counter() - start) / args.steps)
                cpu[name].append((time.process_time() - start_cpu) / args.steps)
        nbytes = {name: variant.state_bytes() for name, variant in variants.items()}
    state = torch.tensor([nbytes[name] for name in builders], dtype=torch.float64)
    dist.all_reduce(state, op=dist.ReduceOp.MAX)
    # CPU seconds a step costs all ranks together (their compute and gloo threads): unlike wall time, it hardly
    # moves when other processes load the machine.
    cpu_s = torch.tensor([statistics.median(cpu[name]) for name in builders], dtype=torch.float64)
    dist.all_reduce(cpu_s)
    if rank == 0:
        with torch.device("meta"):
            psi = sum(p.numel() for p in GPT(model).parameters())
        results.put(
            {
                "world": world,
                "psi": psi,
                "rows": [
                    (
                        name,
                        tokens / statistics.median(times[name]),
                        cpu_s[i].item(),
                        losses[name][0],
                        losses[name][-1],
                        int(state[i]),
                    )
                    for i, name in enumerate(builders)
                ],
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="a subset of " + ",".join(VARIANTS))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--batch-seq", type=int, default=0, help="tokens per sequence (0: the model's seq-len)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    parser.add_argument(
        "--state-only", action="store_true", help="one step per variant, each in its own ranks: bytes only"
    )
    args = parser.parse_args()
    args.only, args.variants = None, args.variants.split(",")
    b = 4 if args.precision == "fp32" else 2
    ctx = mp.get_context("spawn")
    print(
        f"GPT {args.layers} layers, d_model {args.d_model}, seq {args.seq_len}, vocab {args.vocab}, {args.precision}; "
        f"{args.micro_batches} micro-batches of {args.micro_batch} per rank per step; gloo on {os.cpu_count()} CPUs"
    )
    header = (
        f"{'dp':>3}  {'variant':<8}{'tokens/s':>10}{'vs zero0':>10}{'vs torch':>10}{'CPU-s/step':>11}{'vs zero0':>9}"
        f"{'first loss':>12}{'last loss':>11}{'state MiB':>11}{'formula':>9}{'ratio':>7}"
    )
    for world in (int(w) for w in args.worlds.split(",")):
        # --state-only: each variant in processes of its own, so a large model's states are never held twice.
        names = [v for v in args.variants if args.precision == "fp32" or v.startswith("zero")]  # torch: fp32 only
        runs = [argparse.Namespace(**{**vars(args), "only": v}) for v in names] if args.state_only else [args]
        rows = {}
        for run in runs:
            results = ctx.SimpleQueue()
            mp.start_processes(run_rank, args=(world, free_port(), run, results), nprocs=world, start_method="spawn")
            got = results.get()
            rows.update({name: row for name, *row in got["rows"]})
        print(f"\nPsi = {got['psi']:,} parameters, N = dp = {world}\n" + header)
        for name, (tps, cpu_s, first, last, nbytes) in rows.items():
            speed = vs_zero0 = versus = cost = cost_vs = ""
            if not args.state_only:
                speed, cost = f"{tps:,.0f}", f"{cpu_s:.3f}"
                if "zero0" in rows:
                    vs_zero0, cost_vs = f"{tps / rows['zero0'][0]:.2f}x", f"{cpu_s / rows['zero0'][1]:.2f}x"
                if name in BASELINE and BASELINE[name] in rows:
                    versus = f"{tps / rows[BASELINE[name]][0]:.2f}x"
            formula = formula_bytes(name, got["psi"], world, b)
            print(
                f"{world:>3}  {name:<8}{speed:>10}{vs_zero0:>10}{versus:>10}{cost:>11}{cost_vs:>9}"
                f"{first:>12.5f}{last:>11.5f}{nbytes / 2**20:>11.2f}{formula / 2**20:>9.2f}{nbytes / formula:>7.3f}"
            )


if __name__ == "__main__":
    main()
