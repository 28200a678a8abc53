"""Tokens/s of trident's training step against a plain PyTorch loop over the same model and batches.

    python tools/bench_throughput.py [--model gpt-mini] [--micro-batch 4] [--global-batch 32]
    torchrun --nproc-per-node 2 tools/bench_throughput.py     # dp=2: trident's reducer vs torch DDP

Both run in this process from the same initial weights on the same batches, alternating in rounds so
machine noise hits both alike. The baseline is what a user would write with torch alone: autocast,
loss / micro-batches, backward (under DDP's no_sync except on the last micro-batch when dp > 1),
clip_grad_norm_, AdamW, zero_grad, and the loss all-reduced for logging, as trident does.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP

from trident.config import ModelConfig, OptimConfig, TrainConfig
from trident.data.dataset import TokenWindows
from trident.device import pick_backend, pick_device, set_cpu_threads
from trident.loop import Trainer
from trident.models.gpt import GPT, init_weights, lm_loss_sum
from trident.optim import GradStep, ReplicatedUpdate, build_optimizer
from trident.parallel.groups import build_process_groups, init_distributed, shutdown_distributed
from trident.parallel.precision import LossScaler, autocast
from trident.parallel.reducer import GradReducer
from trident.parallel.topology import Topology
from trident.runner import LocalRunner

# The model presets of the checkout this script belongs to (the YAML under conf/ is not inside the package).
PRESETS = Path(__file__).resolve().parent.parent / "conf" / "model"


def model_config(name: str) -> ModelConfig:
    return OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(PRESETS / f"{name}.yaml"))
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=6, help="alternating timed blocks per side; the median is reported")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    args = p.parse_args()

    device = pick_device("auto")
    init_distributed(pick_backend("auto", device), device)
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    if device.type == "cpu":
        set_cpu_threads()
    cfg = model_config(args.model)
    train_cfg = TrainConfig(
        micro_batch_size=args.micro_batch,
        global_batch_size=args.global_batch,
        steps=10**6,
        precision=args.precision,
    )
    optim_cfg = OptimConfig(warmup_steps=0)
    if args.global_batch % (args.micro_batch * world):
        raise SystemExit(
            f"--global-batch {args.global_batch} is not divisible by micro {args.micro_batch} x dp {world}"
        )

    # Random tokens: throughput does not depend on what the tokens say.
    rng = np.random.default_rng(0)
    n_windows = 64 * args.global_batch
    tokens = rng.integers(0, cfg.vocab_size, n_windows * cfg.seq_len + 1).astype(np.int64)
    data = TokenWindows(tokens, cfg.seq_len, 0, n_windows)

    def build() -> GPT:
        model = GPT(cfg)
        init_weights(model, cfg, seed=0)
        return model.to(device)

    # trident: the real Trainer step (fp32 gradient buffer and reducer, global-norm clipping, AdamW, loss all-reduce).
    ours = build()
    chunks = [ours]
    reducer = GradReducer(list(ours.parameters()), groups.dp_group, args.bucket_mb)
    scaler = LossScaler() if args.precision == "fp16" else None
    grad_step = GradStep(
        ReplicatedUpdate(build_optimizer(chunks, optim_cfg), reducer), groups, optim_cfg.grad_clip, scaler
    )
    runner = LocalRunner(chunks, reducer, args.precision)
    trainer = Trainer(
        train_cfg, optim_cfg, groups, chunks, runner, lm_loss_sum, grad_step, data, data, device, 1.0, 1.0,
        checkpointer=None, make_logger=lambda _: None,
    )  # fmt: skip

    # Baseline: torch alone.
    base = build()
    opt = torch.optim.AdamW(
        base.parameters(),
        lr=optim_cfg.lr,
        betas=(optim_cfg.beta1, optim_cfg.beta2),
        weight_decay=optim_cfg.weight_decay,
        fused=device.type == "cuda",
    )
    ddp = DDP(base, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True) if world > 1 else base

    def baseline_step(micro: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        total = torch.zeros((), device=device)
        for i, (x, y) in enumerate(micro):
            last = i == len(micro) - 1
            ctx = ddp.no_sync() if world > 1 and not last else contextlib.nullcontext()
            with ctx:
                with autocast(args.precision, device):
                    logits = ddp(x)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / len(micro)
                loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(base.parameters(), optim_cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(total)
        return total.item() / world

    def run(which: str, first_step: int, n: int) -> tuple[float, float]:
        sync(device)
        start = time.perf_counter()
        loss = 0.0
        for step in range(first_step, first_step + n):
            micro = trainer.micro_batches(step)
            loss = trainer.train_step(step, micro).loss if which == "ours" else baseline_step(micro)
        sync(device)
        return time.perf_counter() - start, loss

    _, loss_ours = run("ours", 0, 1)
    _, loss_base = run("base", 0, 1)
    tokens_per_block = args.steps * args.global_batch * cfg.seq_len
    rates: dict[str, list[float]] = {"ours": [], "base": []}
    for r in range(args.rounds):
        for which in ("ours", "base") if r % 2 == 0 else ("base", "ours"):
            elapsed, _ = run(which, 1 + r * args.steps, args.steps)
            rates[which].append(tokens_per_block / elapsed)
    if rank == 0:
        ours_rate, base_rate = statistics.median(rates["ours"]), statistics.median(rates["base"])
        baseline = "torch DDP" if world > 1 else "plain torch loop"
        print(
            f"model {args.model}, dp {world}, {device.type}, {args.precision}, global batch {args.global_batch} x "
            f"{cfg.seq_len} tokens, micro-batch {args.micro_batch}\n"
            f"first-step loss: trident {loss_ours:.6f}, {baseline} {loss_base:.6f}\n"
            f"trident   {ours_rate:,.0f} tokens/s  (rounds: {', '.join(f'{x:,.0f}' for x in rates['ours'])})\n"
            f"{baseline:<9} {base_rate:,.0f} tokens/s  (rounds: {', '.join(f'{x:,.0f}' for x in rates['base'])})\n"
            f"ratio trident / {baseline}: {ours_rate / base_rate:.3f}",
            flush=True,
        )
    shutdown_distributed()


if __name__ == "__main__":
    main()
