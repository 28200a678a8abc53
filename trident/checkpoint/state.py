"""What a rank puts into a checkpoint and takes back out: ``Sharded`` boxes of logical tensors under stable keys.

    model/<parameter name>              the parameter's logical tensor (one-process shape, padding never saved)
    optim/<parameter name>/<state>      AdamW's exp_avg and exp_avg_sq (laid out like the parameter), step (0-d)
    rng/dp<d>.pp<p>.tp<t>[.cp<c>]/cpu|cuda  the generator states of the rank at that layout coordinate
    buffers/<buffer name>               state outside the gradient (a sparse layer's loss-free balancing bias)

Parameter names are the canonical ``named_parameters()`` names, the same under every layout, and each parameter's
``Placement`` says which box of the logical tensor this rank holds. A tied copy (the last pipeline stage's LM
head, a copy of ``wte.weight``) is not saved: it loads from the tensor it is tied to.

The model weights saved are the ZeRO optimizer's fp32 masters and its AdamW state per piece of its shard
(zero_state.py: ``MasterState``, ``MomentState``), for every stage, 0 included: one optimizer, one mapping.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from trident.checkpoint.sharded import Sharded
from trident.parallel.topology import Coord

MODEL, OPTIM, RNG, BUFFERS = "model/", "optim/", "rng/", "buffers/"


def named_parameters(modules: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """Every parameter of this rank's model chunks by canonical name (names are unique across chunks)."""
    params: dict[str, nn.Parameter] = {}
    for module in modules:
        for name, param in module.named_parameters():
            if name in params:
                raise ValueError(f"parameter {name} appears in two model chunks")
            params[name] = param
    return params


def rng_key(coord: Coord) -> str:
    cp = f".cp{coord.cp}" if coord.cp else ""  # cp rank 0's key is the one a layout without cp has
    return f"{RNG}dp{coord.dp}.pp{coord.pp}.tp{coord.tp}{cp}/"


def rng_state(coord: Coord) -> dict[str, Sharded]:
    """This rank's default generator states, under its own layout coordinate (no other rank writes that key).
    Dropout needs none of them (its masks are derived from the step and the samples: parallel/random.py); they
    are kept for anything else that draws from the default generators."""
    state = {rng_key(coord) + "cpu": Sharded.whole(torch.get_rng_state())}
    if torch.cuda.is_available():
        state[rng_key(coord) + "cuda"] = Sharded.whole(torch.cuda.get_rng_state())
    return state


def rng_destinations(
    coord: Coord, saved: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, Sharded], Callable[[], None]]:
    """Boxes for this coordinate's saved generator states, and a function that restores them once filled."""
    cpu, cuda = rng_key(coord) + "cpu", rng_key(coord) + "cuda"
    out = {k: Sharded.whole(torch.empty(saved[k], dtype=torch.uint8)) for k in (cpu, cuda) if k in saved}

    def restore() -> None:
        if cpu in out:
            torch.set_rng_state(out[cpu].boxes[0][1])
        if cuda in out and torch.cuda.is_available():
            torch.cuda.set_rng_state(out[cuda].boxes[0][1])

    return out, restore
