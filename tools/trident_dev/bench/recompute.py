"""``tools/bench.py recompute``: what each recomputation policy keeps and what it costs: one micro-batch's
activations measured beside the estimator's prediction, and the step time against no recomputation.

    python tools/bench.py recompute                                  # gpt-mini, micro-batch 4 x 256 tokens, fp32
    python tools/bench.py recompute --model llama-150m --micro-batch 1 --seq-len 256 --rounds 3 --steps 1 --threads 1
    python tools/bench.py recompute --policies none selective "selective[norm,mlp_act,attn_core]" full/2 full

One process, on the GPU when there is one: the model (``--model``'s preset at ``--seq-len`` tokens) is built and
initialised as train.py builds a chunk, its parameters in the compute dtype (16-bit under bf16 or fp16, as the
ZeRO optimizer keeps them), and wrapped by ``apply_activation_checkpointing`` once per policy, a recomputation
label (models/checkpointing.py ``recompute_label``: ``none``, ``selective``, ``selective[attn_core]``,
``attention``, ``full/2``, ``full``). Per policy:

  activations  the storages one micro-batch's forward (and loss) leaves alive, parameters and batch left out
               (trident/memory/measure.py ``held_by_forward``, as tests/test_memory.py measures them)
  estimate     trident/memory/activations.py's prediction of the same, and its ratio to the measured bytes
  s/step       forward and backward of one micro-batch (under autocast, in the micro-batch's dropout context),
               the median over rounds of alternating blocks (trident_dev/bench/harness.py), its spread, and the median
               over rounds of its ratio to ``none``'s block of the same round (the issue's target: selective at
               most 1.15x); the same in this process's CPU time (its threads together), steadier than the wall
               clock on a CPU shared with other work; ``recompute TFLOP`` the estimator's matmul and attention FLOPs
               recomputed per step
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

import torch

from trident.config import compose_config
from trident.layout import Layout
from trident.memory.activations import activation_bytes, recompute_flops
from trident.memory.measure import held_by_forward
from trident.models.checkpointing import apply_activation_checkpointing, parse_label
from trident.models.gpt import GPT, count_params, init_weights
from trident.parallel.precision import autocast
from trident.parallel.random import model_parallel_rng
from trident.peak import PRECISION_DTYPES
from trident_dev.bench.harness import Table, alternate, barrier, format_bytes, number, spread

HEADER = ["policy", "activations", "estimate", "vs measured", "s/step", "spread", "vs none", "CPU-s/step"]
HEADER += ["CPU vs none", "recompute TFLOP"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--policies", nargs="+", default=["none", "selective", "attention", "full/2", "full"])
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16", "fp16"])
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=2, help="forward + backward steps per timed block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch's intra-op threads (1 steadies timings on a shared CPU)")


def run(args: argparse.Namespace) -> list[Table]:
    cfg = compose_config(args.conf, [f"model={args.model}", f"model.seq_len={args.seq_len}", "wandb.mode=disabled"])
    m = cfg.model
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    rng = model_parallel_rng(cfg.train.seed)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, m.vocab_size, (args.micro_batch, m.seq_len), generator=g).to(device)
    y = torch.randint(0, m.vocab_size, (args.micro_batch, m.seq_len), generator=g).to(device)

    models = {}
    for label in args.policies:
        model = GPT(m, rng=rng)
        init_weights(model, m, cfg.train.seed)
        model.to(device=device, dtype=PRECISION_DTYPES[args.precision])
        name, modules, every = parse_label(label)
        apply_activation_checkpointing(model, name, modules=modules, every=every)
        models[label] = model

    def loss(model: GPT, step: int) -> torch.Tensor:
        with autocast(args.precision, device), rng.context(step, range(len(x))):
            return model.loss_sum(model(x), y)

    def step_of(model: GPT):  # noqa: ANN202
        def step(i: int) -> None:
            loss(model, i).backward()
            model.zero_grad(set_to_none=True)

        return step

    held = {}
    for label, model in models.items():
        rope = [mod.inv_freq for mod in model.modules() if getattr(mod, "inv_freq", None) is not None]
        out, held[label] = held_by_forward(lambda model=model: loss(model, 0), [*model.parameters(), *rope, x, y])
        del out
    timings = alternate(
        {label: step_of(model) for label, model in models.items()},
        warmup=1,
        steps=args.steps,
        rounds=args.rounds,
        sync=lambda: barrier(device),
    )
    layout = Layout(micro_batch_size=args.micro_batch, precision=args.precision, device=device.type)
    t = Table(
        f"{args.model} ({count_params(m) / 1e6:.1f}M params), micro-batch {args.micro_batch} x {m.seq_len} tokens, "
        f"{args.precision} on {device.type}; forward + backward, {args.steps} steps a block, {args.rounds} rounds",
        HEADER,
    )
    first = timings["none" if "none" in timings else args.policies[0]]
    for label in args.policies:
        wall, cpu = timings[label].wall, timings[label].cpu
        predicted = activation_bytes(m, layout, 0, label)
        t.add(
            label,
            format_bytes(held[label]),
            format_bytes(predicted),
            f"{predicted / held[label]:.3f}" if held[label] else "-",
            number(statistics.median(wall), ".3f"),
            spread(wall),
            f"{statistics.median(a / b for a, b in zip(wall, first.wall, strict=True)):.2f}x",
            number(statistics.median(cpu), ".3f"),
            f"{statistics.median(a / b for a, b in zip(cpu, first.cpu, strict=True)):.2f}x",
            number(recompute_flops(m, dataclasses.replace(layout, micro_batches=1), 0, label) / 1e12, ".4f"),
        )
    t.notes.append(
        "activations: storages one micro-batch's forward leaves alive; estimate: trident/memory/activations.py "
        "(to the byte on a CPU; on CUDA from the kernels' signatures); vs none: each round's block over none's."
    )
    return [t]
