"""The true global gradient norm, and with it the non-finite verdict every rank agrees on.

Each gradient element of the one-process model must be counted exactly once, whichever rank holds it:

- split over tp (a column of qkv, a vocab block): every tp rank counts its own block;
- replicated over tp (a LayerNorm gain, a row-parallel bias): only tp rank 0 counts it;
- a tied copy (the last pipeline stage's copy of the embedding as LM head): only the original counts;
- replicated over dp (gradients all-reduced, ZeRO < 2): only dp rank 0 counts; sharded over dp (ZeRO 2/3):
  every dp rank counts its shard.

Every rank adds its counted squares and one all-reduce over the whole world sums them. A piece a rank does
not count is multiplied by zero rather than skipped, so a NaN or Inf anywhere still poisons the sum: the
result, and so the fp16 overflow verdict and the clip coefficient, is the same number on every rank.
One process needs no collective: its sum is its own.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.nn.utils import get_total_norm

from trident.parallel.groups import ProcessGroups
from trident.parallel.placement import Placement


def counts_here(placement: Placement, groups: ProcessGroups, dp_sharded: bool) -> bool:
    """Whether this rank is the one that counts a gradient of this placement in the global norm."""
    if placement.tied_to is not None:
        return False
    if placement.split_dim is None and groups.tp_rank != 0:
        return False
    return dp_sharded or groups.dp_rank == 0


class GlobalGradNorm:
    """``global_grad_norm`` of a fixed list of gradient pieces (a step's: the buffers never move), which of them
    this rank counts decided once instead of at every step."""

    def __init__(
        self, grads: Sequence[tuple[torch.Tensor, Placement]], groups: ProcessGroups, dp_sharded: bool = False
    ) -> None:
        self.counted = [g for g, p in grads if counts_here(p, groups, dp_sharded)]
        self.others = [g for g, p in grads if not counts_here(p, groups, dp_sharded)]
        self.device = grads[0][0].device if grads else torch.device("cpu")
        # One process: no collective (each one a hand-off to gloo's thread and back).
        self.group = groups.world_group if groups.topology.world_size > 1 else None

    def __call__(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient as one vector; identical on every rank (a 0-dim fp32 tensor)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.counted:
            squares = squares + get_total_norm(self.counted).float().square()
        if self.others:
            squares = squares + 0.0 * get_total_norm(self.others).float()
        if self.group is not None:
            dist.all_reduce(squares, group=self.group)
        return squares.sqrt()


def global_grad_norm(
    grads: Sequence[tuple[torch.Tensor, Placement]], groups: ProcessGroups, dp_sharded: bool = False
) -> torch.Tensor:
    """L2 norm of the whole model's gradient as one vector; identical on every rank (a 0-dim fp32 tensor).

    ``grads`` are this rank's gradient pieces with the placement of the parameter each belongs to.
    """
    return GlobalGradNorm(grads, groups, dp_sharded)()
