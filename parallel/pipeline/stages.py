"""Where the layers go: P pipeline ranks x V chunks = S virtual stages, each a contiguous run of layers.

Virtual stage s holds layers [s * L / S, (s + 1) * L / S) under their global indices, so parameter names are the
one-process names whatever the layout. Which rank and chunk hold stage s is the schedule's placement
(parallel/pipeline/schedules.py ``stage_of``): chunk * P + pp_rank, or under zb-v's V pp_rank and 2P - 1 - pp_rank.
The embedding is on stage 0 and the final LayerNorm, LM head and loss on stage S - 1. With P = 2, V = 2 and 8 layers
in loops (zb-v swaps stages 2 and 3: rank 0 holds layers 0-1 and 6-7):

    rank 0: chunk 0 = stage 0, layers 0-1 (+ embedding)    chunk 1 = stage 2, layers 4-5
    rank 1: chunk 0 = stage 1, layers 2-3                  chunk 1 = stage 3, layers 6-7 (+ norm, head, loss)

The LM head is tied to the embedding. When the two are on different stages, the last stage holds a copy
(``Placement.tied_to = "wte.weight"``) that starts equal to the embedding and receives the same update: the two
copies' gradients are summed over the embedding group (first and last stage) after the data-parallel reduction
(their placements say so: ``grad_sums`` "embedding", parallel/grad_sums.py); under zb-v both stages are chunks of
rank 0, which sums the two itself.
"""

from __future__ import annotations


def stage_layers(n_layers: int, pp: int, vpp: int, stage: int) -> range:
    """Global indices of the layers of virtual stage ``stage``."""
    stages = pp * vpp
    if n_layers % stages:
        raise ValueError(f"{n_layers} layers do not split over pp {pp} x vpp {vpp} = {stages} stages")
    if not 0 <= stage < stages:
        raise ValueError(f"stage {stage} is outside pp {pp} x vpp {vpp} = {stages} stages")
    per = n_layers // stages
    return range(stage * per, (stage + 1) * per)
