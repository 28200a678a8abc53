"""``tools/bench.py moe``: the mixture-of-experts block's experts as one grouped matrix product against a matmul per
expert, forward and backward.

    python tools/bench.py moe                                   # two shapes, fp32 and bf16, on this machine's device
    python tools/bench.py moe --shapes 1024x2816x8x2 --tokens 8192 --precision bf16

For each shape (``d_model x d_expert x experts x top_k``) one sparse MLP (models/moe.py, SwiGLU experts, softmax
router) runs forward and backward on ``--tokens`` random tokens, in alternating rounds (trident/bench/harness.py's
order) with ``model.moe.grouped_mm`` on (``torch._grouped_mm`` over the experts' runs of rows) and off (one matmul
per expert). Each row: milliseconds per forward and backward (median over rounds, and its spread) and the loop's
time over the grouped one. The issue's target: the grouped path no slower.
"""

from __future__ import annotations

import argparse

import torch

from trident.bench.harness import Stat, Table, alternate, barrier, number, ratio, spread
from trident.config import ModelConfig, MoEConfig
from trident.models.gpt import init_weights
from trident.models.moe import MoE, grouped_mm_fits

HEADER = ["shape (d x f x E x k)", "precision", "grouped ms", "loop ms", "loop / grouped", "spread (grouped / loop)"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", nargs="+", default=["256x512x8x2", "512x1024x16x4"], help="d x f x experts x top_k")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per forward")
    p.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="forward+backward per timed round")
    p.add_argument("--warmup", type=int, default=2)


def block(d: int, f: int, experts: int, top_k: int, grouped: bool, dtype: torch.dtype, device: torch.device) -> MoE:
    moe = MoEConfig(experts=experts, top_k=top_k, d_expert=f, grouped_mm=grouped)
    cfg = ModelConfig(d_model=d, n_heads=1, mlp="swiglu", bias=False, n_layers=1, moe=moe)
    m = MoE(cfg)
    holder = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"mlp": m})})})
    init_weights(holder, cfg, 0)  # the same weights for both variants (name-seeded)
    return m.to(device=device, dtype=dtype)


def forward_backward(m: MoE, x: torch.Tensor) -> None:
    m(x.clone().requires_grad_()).float().square().mean().backward()


def run(args: argparse.Namespace) -> list[Table]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    t = Table(
        f"MoE experts, grouped product vs loop: {args.tokens} tokens, forward + backward on {device.type}; "
        f"{args.rounds} rounds x {args.steps} after {args.warmup} warm-up, medians",
        HEADER,
    )
    for shape in args.shapes:
        d, f, experts, top_k = (int(v) for v in shape.split("x"))
        for precision in args.precision:
            dtype = DTYPES[precision]
            if not grouped_mm_fits((d, f), dtype, device):
                t.add(shape, precision, None, None, None, None)
                t.notes.append(f"{shape} {precision}: no torch._grouped_mm for these widths on {device.type}")
                continue
            x = torch.randn(args.tokens, d, generator=torch.Generator().manual_seed(0)).to(device, dtype)
            blocks = {
                name: block(d, f, experts, top_k, name == "grouped", dtype, device) for name in ("grouped", "loop")
            }

            variants = {name: (lambda _i, m=m, x=x: forward_backward(m, x)) for name, m in blocks.items()}
            timings = alternate(
                variants, warmup=args.warmup, steps=args.steps, rounds=args.rounds, sync=lambda: barrier(device)
            )
            grouped, loop = (Stat.of(timings[n].wall) for n in ("grouped", "loop"))
            t.add(
                shape,
                precision,
                number(1e3 * grouped.median, ".2f"),
                number(1e3 * loop.median, ".2f"),
                ratio(loop.median, grouped.median),
                f"{spread(timings['grouped'].wall)} / {spread(timings['loop'].wall)}",
            )
    return [t]
