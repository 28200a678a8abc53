"""``tools/bench.py throughput``: trident's training step against a plain PyTorch loop over the same model and
batches.

    python tools/bench.py throughput [--model gpt-mini] [--micro-batch 4] [--global-batch 32] [--precision bf16]
    python tools/bench.py throughput --dp 2        # dp=2: trident's reducer against torch DDP
    python tools/bench.py throughput --model llama-150m --hf --seq 256 --micro-batch 4 --global-batch 4 \
        --precision fp32 bf16                      # also transformers' LlamaForCausalLM; a table per precision

On ``--dp`` local ranks (trident_dev.ranks' pool), from the same initial weights on the same batches, alternating in
rounds (trident_dev/bench/harness.py):

- trident: what train.py runs, built by trident/build.py: ``build_parts`` (model chunks, the ZeRO optimizer of
  ``--zero`` with its reducer, the runner) and ``Trainer.train_step``. With bf16 or fp16 the parameters are 16-bit,
  cast by the optimizer's precision policy, with fp32 masters and fp32 gradient reduction, as in a run.
- the baseline: what a user would write with torch alone, on the same GPT (``model_chunks``, left in fp32): torch's
  automatic mixed precision (fp32 weights under autocast), loss / micro-batches, backward (under DDP's no_sync
  except on the last micro-batch when dp > 1), clip_grad_norm_, AdamW, zero_grad, the loss all-reduced for logging.
- with ``--hf`` (a Llama-block preset, one process): transformers' ``LlamaForCausalLM`` of the same shape (hidden
  size, layers, heads, kv heads, intermediate size, vocabulary, tied or not, rope_theta, RMSNorm eps, biases;
  ``attn_implementation="sdpa"``), holding the same initial weights (trident/checkpoint/hf.py's mapping), trained by
  the baseline's plain loop (the same AdamW groups, learning rate, clipping and mixed precision) on the same batches:
  its logits through the same fp32 cross-entropy against the same targets.

Each table row: tokens/s (median over rounds) and the spread of its rounds, the row over the plain torch loop
("x baseline") and trident over the row ("trident / this": above 1.00x, trident is faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trident.build import build_parts, layout_of, model_chunks
from trident.checkpoint.hf import LLAMA, architecture, hf_config, to_hf
from trident.config import Config, compose_config
from trident.errors import CheckpointError
from trident.loop import Trainer
from trident.models.gpt import flops_per_token
from trident.parallel.groups import build_process_groups
from trident.parallel.placement import placement_of
from trident.parallel.topology import Topology
from trident_dev.bench.harness import (
    Table,
    adamw_args,
    alternate,
    barrier,
    mfu,
    number,
    peak_flops,
    plain_step,
    pool_backend,
    random_windows,
    rank_device,
    ratio,
    spread,
    tokens_per_s,
)
from trident_dev.ranks import run_distributed

HEADER = [
    "variant",
    "ranks",
    "precision",
    "tokens/s",
    "spread",
    "x baseline",
    "trident / this",
    "MFU",
    "first loss",
    "last loss",
]
HF = "transformers LlamaForCausalLM"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=32)
    p.add_argument("--seq", type=int, help="tokens per sequence (model.seq_len; default: the preset's)")
    p.add_argument("--precision", nargs="+", default=["fp32"], choices=["fp32", "bf16", "fp16"], help="one table each")
    p.add_argument("--hf", action="store_true", help="also transformers' LlamaForCausalLM (Llama blocks, --dp 1)")
    p.add_argument("--dp", type=int, default=1, help="local ranks; >1 compares with torch DDP")
    p.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3], help="trident's parallel.zero")
    p.add_argument("--steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=6, help="alternating timed blocks per side; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps of each side first")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--peak-tflops", type=float, help="one rank's peak for MFU (default: trident/peak.py's)")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more train.py overrides")


def build_config(args: argparse.Namespace, precision: str) -> Config:
    return compose_config(
        args.conf,
        [
            f"model={args.model}",
            *([f"model.seq_len={args.seq}"] if args.seq else []),
            f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.global_batch}",
            f"train.precision={precision}",
            f"parallel.zero={args.zero}",
            f"parallel.bucket_mb={args.bucket_mb}",
            "train.steps=1000000",
            "optim.warmup_steps=0",
            *args.set,
        ],
    )


def run(args: argparse.Namespace) -> list[Table]:
    if args.global_batch % (args.micro_batch * args.dp):
        per_step = args.micro_batch * args.dp
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by --micro-batch x --dp = {per_step}")
    tables = []
    for precision in args.precision:
        cfg = build_config(args, precision)
        if args.hf:
            check_hf(cfg, args.dp)
        tables.append(table(cfg, args.dp, args.warmup, args.steps, args.rounds, args.peak_tflops, args.hf))
    return tables


def check_hf(cfg: Config, dp: int) -> None:
    """Refuse ``--hf`` where transformers' Llama is not the same model, in one line."""
    if dp != 1:
        raise SystemExit("--hf compares one process: use --dp 1")
    try:
        cls = architecture(cfg.model)
    except CheckpointError as e:
        raise SystemExit(f"--hf: {e}") from None
    if cls != LLAMA:
        raise SystemExit(f"--hf needs Llama blocks; model {cfg.model.name} is a {cls}")


def table(
    cfg: Config, dp: int, warmup: int, steps: int, rounds: int, peak_tflops: float | None, hf: bool = False
) -> Table:
    """trident's step, the torch baseline of ``cfg`` on ``dp`` ranks and (``hf``) transformers' Llama, one table."""
    job = Job(cfg, warmup, steps, rounds, peak_tflops, hf)
    result = run_distributed(_rank, dp, job, backend=pool_backend(dp), timeout_s=24 * 3600)[0]
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    baseline = "torch DDP" if dp > 1 else "plain torch loop"
    rates = {name: tokens_per_s(tokens, r["wall"]) for name, r in result["variants"].items()}
    t = Table(
        f"model {cfg.model.name}, dp {dp}, {result['device']}, {cfg.train.precision}, global batch "
        f"{cfg.train.global_batch_size} x {cfg.model.seq_len} tokens, micro-batch {cfg.train.micro_batch_size}, "
        f"zero {cfg.parallel.zero}; {rounds} rounds x {steps} steps after {warmup} warm-up",
        HEADER,
    )
    autocast_note = "" if cfg.train.precision == "fp32" else f", {cfg.train.precision} autocast"
    dtypes = result["param_dtypes"]
    precisions = {"trident": f"{dtypes['trident']} parameters", baseline: f"{dtypes[baseline]} weights{autocast_note}"}
    if HF in dtypes:
        precisions[HF] = f"{dtypes[HF]} weights{autocast_note}"
    for name, r in result["variants"].items():
        rate = rates[name]
        t.add(
            name,
            dp,
            precisions[name],
            number(rate.median),
            spread(r["wall"]),
            ratio(rate.median, rates[baseline].median),
            ratio(rates["trident"].median, rate.median),
            number(mfu(rate.median, flops_per_token(cfg.model), result["peak_flops"]), ".2%"),
            f"{r['first_loss']:.6f}",
            f"{r['last_loss']:.6f}",
        )
    rounds_line = "; ".join(
        f"{name} {', '.join(number(tokens / s) for s in r['wall'])}" for name, r in result["variants"].items()
    )
    t.notes.append(f"rounds (tokens/s): {rounds_line}. spread: (fastest - slowest round) / median.")
    return t


@dataclasses.dataclass
class Job:
    cfg: Config
    warmup: int
    steps: int
    rounds: int
    peak_tflops: float | None
    hf: bool = False


def _rank(rank: int, world: int, job: Job) -> dict:
    cfg = job.cfg
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = rank_device(rank, world)
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)

    parts = build_parts(cfg, layout_of(cfg, groups), groups, device)
    trainer = Trainer(cfg, groups, parts, (data, data))

    (model,) = model_chunks(
        cfg.model, layout_of(cfg, groups), cfg.train, groups, device
    )  # the same weights, left fp32: torch's own mixed precision
    on_cuda = device.type == "cuda"  # AdamW decays matrices only, as trident's optimizer steps
    opt = torch.optim.AdamW(**adamw_args(model, cfg, foreach=not on_cuda, fused=on_cuda))
    ddp = DDP(model, bucket_cap_mb=cfg.parallel.bucket_mb, gradient_as_bucket_view=True) if world > 1 else model
    precision = cfg.train.precision

    def torch_step(net: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int, no_sync: bool) -> float:
        """``plain_step`` (under DDP's no_sync but the last micro-batch), the loss averaged over the ranks."""
        total = plain_step(net, optimizer, trainer.micro_batches(step), cfg, step, no_sync)
        dist.all_reduce(total)
        return total.item() / world

    def baseline_step(step: int) -> float:
        return torch_step(ddp, opt, step, no_sync=world > 1)

    losses: dict[str, list[float]] = {"trident": [], "base": [], "hf": []}

    def ours(step: int) -> None:
        losses["trident"].append(trainer.train_step(step, trainer.micro_batches(step)).loss)

    def base(step: int) -> None:
        losses["base"].append(baseline_step(step))

    variants = {"trident": ours, "base": base}
    baseline = "torch DDP" if world > 1 else "plain torch loop"
    labels = {"trident": "trident", "base": baseline}
    dtype = {
        "trident": next(parts.chunks[0].parameters()).dtype,  # what the optimizer's precision policy made them
        baseline: next(model.parameters()).dtype,
    }
    if job.hf:
        hf = hf_llama(cfg, model).to(device)
        hf_opt = torch.optim.AdamW(**adamw_args(hf, cfg, foreach=not on_cuda, fused=on_cuda))
        logits = _Logits(hf)
        variants["hf"] = lambda step: losses["hf"].append(torch_step(logits, hf_opt, step, no_sync=False))
        labels["hf"] = HF
        dtype[HF] = next(hf.parameters()).dtype

    timings = alternate(variants, warmup=job.warmup, steps=job.steps, rounds=job.rounds, sync=lambda: barrier(device))
    parts.optimizer.remove_hooks()
    peak = peak_flops(device, precision, job.peak_tflops, world)
    return {
        "device": device.type,
        "peak_flops": peak,
        "param_dtypes": {name: str(d).removeprefix("torch.") for name, d in dtype.items()},
        "variants": {
            label: {"wall": timings[name].wall, "first_loss": losses[name][0], "last_loss": losses[name][-1]}
            for name, label in labels.items()
        },
    }


class _Logits(torch.nn.Module):
    """A Hugging Face causal LM as token ids -> logits, without its KV cache."""

    def __init__(self, lm: torch.nn.Module) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x, use_cache=False).logits


def hf_llama(cfg: Config, model: torch.nn.Module) -> torch.nn.Module:
    """transformers' LlamaForCausalLM of ``cfg.model``'s shape, with the weights of the one-process ``model``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    m = cfg.model
    # The config.json an export writes (trident/checkpoint/hf.py), so the two models are the same by one mapping.
    exported = {k: v for k, v in hf_config(m).items() if k not in ("architectures", "model_type", "torch_dtype")}
    config = LlamaConfig(**exported, attn_implementation="sdpa")
    hf = LlamaForCausalLM(config)
    # Our logical tensors: the one-process parameters without the embedding's padding rows.
    logical = {
        name: p.detach()[tuple(slice(0, n) for n in placement_of(p).shape)] for name, p in model.named_parameters()
    }
    missing, unexpected = hf.load_state_dict(to_hf(logical, m), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if m.tie_embeddings else set()):  # tied: it is embed_tokens
        raise RuntimeError(f"LlamaForCausalLM does not take our weights: missing {missing}, unexpected {unexpected}")
    hf.train()
    return hf
