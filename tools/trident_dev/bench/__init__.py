"""Benchmarks: one harness (``harness.py``: alternating timed rounds, medians and spreads, tokens/s, MFU, memory,
one markdown table), one comparison the timed subcommands declare their settings, variants and columns to
(``compare.py``), and the subcommands of ``tools/bench.py``, one module each (what each measures:
docs/benchmarks.md); those that train build trident's side through trident/build.py as train.py does:

    layouts     several layouts of one preset as real ``torchrun train.py`` runs (``runs.py``): tokens/s, MFU, memory
    matrix      many layouts' loss and gradient-norm curves against the one-process run
    throughput  trident's training step against a plain PyTorch loop (dp=1) or torch DDP (dp>1)
    tp          tensor parallelism (+SP) against torch DTensor's (``dtensor_model.py``) and one process; the
                collectives it sends (``collectives.py``)
    pp          every pipeline schedule against torch.distributed.pipelining and one process; bubble, activations
    zero        ZeRO stages 0-3 against FSDP2 and DDP + ZeroRedundancyOptimizer; model-state bytes vs the formula
    loader      what reading the batches costs a real training step, from the loop's own timings
    prepare     tools/prepare_data.py's rate at 1 and more workers against the tokenizer's batch API
    gpu         trident's step against a plain loop and torch.compile of it: tokens/s, MFU, peak memory (a GPU)
    checkpoint  step time with no save, a foreground save and a background one (checkpoint.async)
    recompute   each recomputation policy: one micro-batch's activations measured and estimated, step time vs none
    moe         the experts as one grouped product against a matmul per expert; training at ep 1 against each ep
    cp          context parallelism: cp 1, 2, 4 with each exchange against dp, activation bytes per rank, tokens/s
    replay      train.replay_every=N's step time against no replay on one layout
    optim       Muon against AdamW, each over a small learning-rate sweep: real runs' curves (a PNG) and step times
"""
