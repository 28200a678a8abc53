"""Memory per rank: predicted before launch, and measured in a run. Imports run one way: each module imports only
modules listed above it.

    measure      what a rank really holds: model states by kind and place, each storage once (memory.json), and the
                 activations a forward keeps for backward (``held_by_forward``)
    params       the parameters each rank holds: its model chunks, built as the runtime builds them on the meta device
    trace        activations traced: a rank's real model chunk run for one micro-batch on fake tensors, what it
                 keeps for backward counted by ``held_by_forward``
    activations  activations predicted: the traced chunks (or, where the trace cannot run, per layer after
                 Korthikanti et al.), a sparse layer's MLP, the loss's backward, the schedule's walk
    states       model states predicted: the flat layout, its ZeRO sharding, offload, staging and gathered buffers
    estimate     the whole prediction of every pipeline stage (``estimate``), what tools/estimate_memory.py prints

The prediction is checked to the byte against real ranks on a CPU (tests/test_memory.py); train.py writes both into
``<run dir>/memory.json``.
"""
