"""``tools/bench.py throughput``: trident's training step against a plain PyTorch loop over the same model and
batches (``--dp`` > 1: torch DDP; ``--hf``: also transformers' LlamaForCausalLM), tokens/s and MFU
(docs/benchmarks.md#throughput).

    python tools/bench.py throughput [--model gpt-mini] [--micro-batch 4] [--global-batch 32] [--precision bf16]
    python tools/bench.py throughput --dp 2        # dp=2: trident's reducer against torch DDP
    python tools/bench.py throughput --model llama-150m --hf --seq 256 --micro-batch 4 --global-batch 4 \\
        --precision fp32 bf16                      # also transformers' LlamaForCausalLM; a table per precision
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trident.build import build_parts, layout_of, model_chunks
from trident.checkpoint.hf import LLAMA, architecture
from trident.config import Config, compose_config
from trident.errors import CheckpointError
from trident.loop import Trainer
from trident.models.gpt import flops_per_token
from trident.parallel.groups import build_process_groups
from trident.parallel.placement import placement_of
from trident.parallel.topology import Topology
from trident_dev.bench import harness
from trident_dev.bench.compare import Column, Comparison, Rank, Setting, Steps, batch_title, compare, losses
from trident_dev.bench.harness import Table, number, ratio, spread
from trident_dev.export import hf_config, to_hf

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
    tokens = cfg.train.global_batch_size * cfg.model.seq_len
    baseline = "torch DDP" if dp > 1 else "plain torch loop"
    setting = Setting(_variants, Job(cfg, peak_tflops, hf), {"ranks": dp}, world=dp)

    rate = lambda row, name=None: (row.out if name is None else row.of(name)).rate(tokens).median  # tokens/s

    columns = [
        Column("variant"),
        Column("ranks"),
        Column("precision", lambda r: r.out.figures["precision"]),
        Column("tokens/s", lambda r: number(rate(r))),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("x baseline", lambda r: ratio(rate(r), rate(r, baseline))),
        Column("trident / this", lambda r: ratio(rate(r, "trident"), rate(r))),
        Column("MFU", lambda r: number(harness.mfu(rate(r), flops_per_token(cfg.model), r.info["peak_flops"]), ".2%")),
        *losses(),
    ]

    title = batch_title(cfg, lambda info: f"dp {dp}, {info['device']}", rounds, steps, warmup)
    return compare(
        Comparison(title, columns, [setting], warmup, steps, rounds, lambda runs: [runs[0].rounds_line(tokens)])
    )


@dataclasses.dataclass
class Job:
    cfg: Config
    peak_tflops: float | None
    hf: bool = False


def _dtype(module: torch.nn.Module) -> str:
    return str(next(module.parameters()).dtype).removeprefix("torch.")


def _variants(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    cfg, world, device = job.cfg, rank.world, rank.device
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    data = harness.random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)
    rank.info.update(
        device=device.type, peak_flops=harness.peak_flops(device, cfg.train.precision, job.peak_tflops, world)
    )
    autocast_note = "" if cfg.train.precision == "fp32" else f", {cfg.train.precision} autocast"
    on_cuda = device.type == "cuda"  # AdamW decays matrices only, as trident's optimizer steps
    parts = build_parts(cfg, layout_of(cfg, groups), groups, device)
    trainer = Trainer(cfg, groups, parts, (data, data))

    def one_process() -> torch.nn.Module:
        """The same initial weights, left fp32: torch's own mixed precision."""
        (model,) = model_chunks(cfg.model, layout_of(cfg, groups), cfg.train, groups, device)
        return model

    def torch_loop(net: torch.nn.Module, params: torch.nn.Module, ddp: bool) -> Steps:
        """``plain_step`` (under DDP's no_sync but the last micro-batch), the loss averaged over the ranks."""
        optimizer = torch.optim.AdamW(**harness.adamw_args(params, cfg, foreach=not on_cuda, fused=on_cuda))

        def step(i: int) -> float:
            total = harness.plain_step(net, optimizer, trainer.micro_batches(i), cfg, i, no_sync=ddp)
            dist.all_reduce(total)
            return total.item() / world

        return Steps(step, figures=lambda: {"precision": f"{_dtype(params)} weights{autocast_note}"})

    def baseline() -> Steps:
        model = one_process()
        net = DDP(model, bucket_cap_mb=cfg.parallel.bucket_mb, gradient_as_bucket_view=True) if world > 1 else model
        return torch_loop(net, model, world > 1)

    def hf() -> Steps:
        model = hf_llama(cfg, one_process()).to(device)
        return torch_loop(_Logits(model), model, False)

    variants = {
        "trident": lambda: Steps(
            lambda i: trainer.train_step(i, trainer.micro_batches(i)).loss,
            close=parts.optimizer.remove_hooks,
            # what the optimizer's precision policy made them
            figures=lambda: {"precision": f"{_dtype(parts.chunks[0])} parameters"},
        ),
        "torch DDP" if world > 1 else "plain torch loop": baseline,
    }
    if job.hf:
        variants[HF] = hf
    return variants


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
