"""Benchmarks, one subcommand each, over one harness (trident_dev/bench/): every figure is a median over alternating
rounds, every table markdown, and trident's side is built as train.py builds it (trident/build.py).

    python tools/bench.py layouts --model gpt-mini --layouts 1 dp=2 tp=2 --compile both --baseline
    python tools/bench.py matrix                       # layouts against one process; exit 1 if an fp32 one is off
    python tools/bench.py throughput --precision bf16  # trident's step vs a plain PyTorch loop (--dp 2: vs DDP)
    python tools/bench.py throughput --model llama-150m --hf --seq 256 --global-batch 4 --precision fp32 bf16
                                                       # and transformers' LlamaForCausalLM, same batches
    python tools/bench.py tp --tp 2                    # tensor parallelism (+SP) vs torch DTensor and one process
    python tools/bench.py pp --pp 2 4                  # each schedule vs torch.distributed.pipelining, bubble
    python tools/bench.py zero --worlds 2 4            # ZeRO 0-3 vs FSDP2 and DDP + ZeroRedundancyOptimizer
    python tools/bench.py prepare --mb 200             # prepare_data's tokens/s at 1 and 2 workers vs the batch API
    python tools/bench.py loader                       # reading batches: its share of a real loop's step
    python tools/bench.py gpu --models gpt-small llama-1b --precision bf16
                                                       # trident vs a plain loop vs torch.compile: MFU, peak memory
    python tools/bench.py checkpoint                   # step time with no save, a sync save, an async save
    python tools/bench.py recompute                    # each recomputation: activations measured and estimated,
                                                       # step time against none
    python tools/bench.py moe                          # MoE experts: one grouped product vs a matmul per expert
    python tools/bench.py cp                           # context parallelism: cp 1, 2, 4 with each exchange vs dp=2,
                                                       # activation bytes per rank and tokens/s
    python tools/bench.py moe --ep 2                   # ... and training steps at ep 1 against ep 2 on 2 ranks,
                                                       #     with the time in the all-to-alls
    python tools/bench.py replay --tp 2 --pp 2             # train.replay_every=N's cost against no replay
    python tools/bench.py optim --plot optim.png       # Muon vs AdamW at equal tokens, each at its best lr of a
                                                       # sweep: losses, step-time overhead, loss curves

``python tools/bench.py <subcommand> --help`` says what each measures. ``--out FILE`` also writes the tables.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parent.parent
SUBCOMMANDS = (
    "layouts",
    "matrix",
    "throughput",
    "tp",
    "pp",
    "zero",
    "loader",
    "prepare",
    "gpu",
    "checkpoint",
    "recompute",
    "moe",
    "cp",
    "replay",
    "optim",
)


def parse(argv: list[str] | None = None) -> tuple[ModuleType, argparse.Namespace]:
    """The subcommand's module and its arguments (``args.conf``: this checkout's conf/)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name in SUBCOMMANDS:
        module = modules[name] = importlib.import_module(f"trident_dev.bench.{name}")
        p = sub.add_parser(
            name,
            help=module.__doc__.split("\n\n")[0].split(": ", 1)[-1].replace("\n", " "),
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(p)
        p.add_argument("--out", type=Path, help="also write the tables (markdown) here")
    args = parser.parse_args(argv)
    args.conf, args.repo = REPO / "conf", REPO
    return modules[args.command], args


def main(argv: list[str] | None = None) -> int:
    module, args = parse(argv)
    tables = module.run(args)
    text = "\n\n".join(t.markdown() for t in tables)
    print(text, flush=True)
    if args.out:
        args.out.write_text(text + "\n")
    return 0 if all(t.ok for t in tables) else 1


if __name__ == "__main__":
    sys.exit(main())
