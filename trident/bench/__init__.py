"""Benchmarks: one harness (``harness.py``: alternating timed rounds, medians and spreads, tokens/s, MFU, memory,
one markdown table) and the subcommands of ``tools/bench.py`` over it, each building trident's side through
trident/build.py as train.py does:

    layouts     several layouts of one preset as real ``torchrun train.py`` runs (``runs.py``): tokens/s, MFU, memory
    matrix      many layouts' loss and gradient-norm curves against the one-process run
    throughput  trident's training step against a plain PyTorch loop (dp=1) or torch DDP (dp>1)
    tp          tensor parallelism (+SP) against torch DTensor's and one process; the collectives it sends
    pp          every pipeline schedule against torch.distributed.pipelining and one process; bubble, activations
    zero        ZeRO stages 0-3 against FSDP2 and DDP + ZeroRedundancyOptimizer; model-state bytes vs the formula
    checkpoint  step time with no save, a foreground save and a background one (checkpoint.async)
"""
