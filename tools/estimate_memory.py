"""Per-rank memory of a launch, predicted before it: parameters, gradients, optimizer states and activations.

    python tools/estimate_memory.py model=gpt-small parallel.dp=4 parallel.zero=2 train.precision=bf16
    python tools/estimate_memory.py model=gpt-1.3b parallel.tp=2 parallel.pp=4 --world 64 \\
        train.micro_batch_size=2 train.global_batch_size=512 train.activation_checkpointing=selective
    python tools/estimate_memory.py model=llama-8b parallel.tp=16 parallel.zero=1 --world 64 train.precision=bf16

Takes train.py's own overrides (the same YAML under conf/, validated the same way) and the launch's world size
(default: parallel.dp x tp x pp, dp 1 when left out). Prints, like DeepSpeed's estimator, the model-state bytes
per device and per host of every ZeRO stage and offload option at this layout, then the breakdown of the layout
asked for on its most loaded pipeline stage: model states, transient buffers, and activations under each
recomputation policy with the micro-batches the schedule keeps in flight. ``--device cpu`` predicts a CPU run,
where everything lives in host memory; ``--json`` prints the prediction as JSON. The formulas and their
sources are in trident/memory/; trident/memory/measure.py measures the same figures in a run (memory.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from trident.config import Config, validate
from trident.errors import ConfigError
from trident.layout import Layout
from trident.memory.estimate import Estimate, estimate
from trident.memory.measure import format_bytes
from trident_dev.tool_config import default_world, load_config

CONF = Path(__file__).resolve().parent.parent / "conf"


def option_rows(cfg: Config, world: int, device: str) -> list[tuple[str, Estimate | str, bool]]:
    """Every ZeRO stage with and without optimizer offload at this layout: (label, estimate or why it is
    refused, whether it is the layout asked for)."""
    par = cfg.parallel
    ratio = par.offload.ratio if par.offload.optimizer == "cpu" else 1.0
    rows = []
    for zero in range(4):
        for offload in ("none", "cpu"):
            variant = dataclasses.replace(
                cfg,
                parallel=dataclasses.replace(
                    par, zero=zero, offload=dataclasses.replace(par.offload, optimizer=offload, ratio=ratio)
                ),
            )
            label = f"zero={zero}" + (f", offload.optimizer=cpu, offload.ratio={ratio:g}" if offload == "cpu" else "")
            asked = zero == par.zero and offload == par.offload.optimizer
            try:
                layout = layout_on(variant, world, device)
            except ConfigError as e:
                rows.append((label, str(e), asked))
                continue
            rows.append((label, estimate(variant.model, layout), asked))
    return rows


def _cell(n: int) -> str:
    return f"{format_bytes(n):>10}"


def layout_on(cfg: Config, world: int, device: str) -> Layout:
    """The layout train.py would launch for ``cfg`` on ``world`` ranks, each driving a ``device``."""
    return dataclasses.replace(validate(cfg, world), device=device)


def report(cfg: Config, world: int, device: str) -> str:
    layout = layout_on(cfg, world, device)
    asked = estimate(cfg.model, layout)
    worst = asked.worst
    policy = layout.recompute
    lines = [
        f"Estimated memory per rank for {cfg.model.name} ({asked.total_params / 1e6:.2f}M parameters), "
        f"world {world} = dp {layout.dp} x tp {layout.tp} x pp {layout.pp}"
        + (f" (vpp {layout.vpp})" if layout.vpp > 1 else "")
        + f", {layout.precision} on {device}",
        f"micro-batch {layout.micro_batch_size} x {cfg.model.seq_len} tokens, "
        f"{layout.micro_batches} micro-batches per step"
        + (f", {layout.schedule} schedule" if layout.schedule else "")
        + f", sequence parallel {'on' if layout.sequence_parallel else 'off'}, recomputation {policy}",
        "",
        f"Model states and peak per rank (most loaded pipeline stage; activations with recomputation {policy}):",
        "  per device |   per host | peak device |   peak host | options",
    ]
    for label, est, is_asked in option_rows(cfg, world, device):
        mark = " (asked)" if is_asked else ""
        if isinstance(est, str):
            lines.append(f"  {'-':>10} | {'-':>10} | {'-':>11} | {'-':>11} | {label}: refused: {est}")
            continue
        w = est.worst
        states, peak = w.model_states["total"], w.peak(policy)
        lines.append(
            f"  {_cell(states['device'])} | {_cell(states['host'])} | {_cell(peak['device']):>11} | "
            f"{_cell(peak['host']):>11} | {label}{mark}"
        )
    lines += [
        "",
        f"The layout asked for, pipeline stage {worst.stage} of {layout.pp} "
        f"({worst.params / 1e6:.2f}M parameters on each of its ranks):",
        "                                         device       host",
    ]
    names = {"params": "parameters", "grads": "gradients", "optimizer": "optimizer states", "total": "model states"}
    for kind, name in names.items():
        v = worst.model_states[kind]
        lines.append(f"  {name:<36} {_cell(v['device'])} {_cell(v['host'])}")
    place = worst.compute_place
    transient = [("gradient staging (zero 2-3)", worst.staging), ("gathered parameters (zero 3)", worst.gathered)]
    for p in worst.activations:
        transient.append((f"activations, recomputation {p}", worst.activations[p]))
    flops = {f"activations, recomputation {p}": f for p, f in worst.recompute_flops.items()}
    if worst.backward_transient(policy):
        what = "loss's gradients" if worst.loss_backward >= worst.recompute[policy] else f"recomputation ({policy})"
        transient.append((f"backward transient: {what}", worst.backward_transient(policy)))
    for name, n in transient:
        if n:
            cells = (_cell(n), _cell(0)) if place == "device" else (_cell(0), _cell(n))
            recomputed = f"  recomputes {flops[name] / 1e12:.3g} TFLOP a step" if name in flops else ""
            lines.append(f"  {name:<36} {cells[0]} {cells[1]}{recomputed}")
    if worst.checkpoint_staging:
        lines.append(f"  {'checkpoint staging (checkpoint.async)':<36} {_cell(0)} {_cell(worst.checkpoint_staging)}")
    peak = worst.peak(policy)
    lines.append(f"  {'peak (recomputation ' + policy + ')':<36} {_cell(peak['device'])} {_cell(peak['host'])}")
    if asked.activations_are == "bound":
        balanced = worst.activations_balanced[policy]
        lines += [
            "",
            "Experts: activations are the worst routing's (every token's experts on one ep rank), a bound no routing",
            f"exceeds; a balanced routing keeps {format_bytes(balanced)} ({policy}).",
        ]
    lines += [
        "",
        "Not included: allocator fragmentation, communication buffers, the CUDA context.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", help="train.py's overrides, e.g. model=gpt-small parallel.tp=2")
    p.add_argument("--world", type=int, help="processes launched (default: parallel.dp x tp x pp)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="what each rank drives")
    p.add_argument("--json", action="store_true", help="print the prediction of the layout as JSON")
    args = p.parse_intermixed_args(argv)
    try:
        cfg = load_config(CONF, args.overrides)
        world = args.world or default_world(cfg)
        if args.json:
            print(json.dumps(estimate(cfg.model, layout_on(cfg, world, args.device)).to_dict(), indent=1))
        else:
            print(report(cfg, world, args.device))
    except ConfigError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
