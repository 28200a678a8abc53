"""The true global gradient norm, and with it the non-finite verdict every rank agrees on.

Each gradient element of the one-process model must be counted exactly once, whichever rank holds it:

- split over tp (a column of qkv, a vocab block): every tp rank counts its own block;
- replicated over tp (a LayerNorm gain, a row-parallel bias): only tp rank 0 counts it;
- a tied copy (the last pipeline stage's copy of the embedding as LM head): only the original counts;
- replicated over dp (gradients all-reduced, ZeRO < 2): only dp rank 0 counts; sharded over dp (ZeRO 2/3):
  every dp rank counts its shard;
- an expert block (split over the ep group, reduced over the expert-dp group): each rank of the first ep group
  (dp x cp rank < ep) counts its own experts.

Every rank adds its counted squares and one all-reduce over the whole world sums them. A piece a rank does
not count is multiplied by zero rather than skipped, so a NaN or Inf anywhere still poisons the sum: the
result, and so the fp16 overflow verdict and the clip coefficient, is the same number on every rank.

No collective is needed where every rank holds the same whole gradient: one process, or the dp replicas of a
model with no tp and one pipeline stage after the dp all-reduce (``GlobalGradNorm(replicated=True)``). Each rank
then counts everything itself, plus the zeros (NaN where the norm is not finite) the other replicas would have
added: bit for bit what the all-reduce returns.
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
    if placement.expert_split:  # experts (ep > 1): each counted on the ranks of one ep group
        return dp_sharded or groups.grad_rank < placement.ep_size
    return dp_sharded or groups.grad_rank == 0  # one of the dp x cp ranks that hold the same reduced gradient


class GlobalGradNorm:
    """``global_grad_norm`` of a fixed list of gradient pieces (a step's: the buffers never move), which of them
    this rank counts decided once instead of at every step. ``replicated``: every rank holds these same pieces,
    whole (dp replicas after the dp all-reduce, tp = pp = 1), so each computes the norm itself, no collective."""

    def __init__(
        self,
        grads: Sequence[tuple[torch.Tensor, Placement]],
        groups: ProcessGroups,
        dp_sharded: bool = False,
        replicated: bool = False,
    ) -> None:
        if replicated and (groups.tp_size > 1 or groups.pp_size > 1 or groups.ep_size > 1):
            raise ValueError("replicated gradients: every rank must hold the whole model (tp = pp = ep = 1)")
        self.counted = [g for g, p in grads if counts_here(p, groups, dp_sharded or replicated)]
        self.others = [g for g, p in grads if not counts_here(p, groups, dp_sharded or replicated)]
        self.device = grads[0][0].device if grads else torch.device("cpu")
        self.replicas = groups.grad_size if replicated else 1
        # Each collective is a hand-off to gloo's thread, and at dp > 1 a meeting of every rank.
        self.group = groups.world_group if groups.topology.world_size > 1 and not replicated else None

    def __call__(self) -> torch.Tensor:
        """L2 norm of the whole model's gradient as one vector; identical on every rank (a 0-dim fp32 tensor)."""
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.counted:
            norm = get_total_norm(self.counted).float()
            squares = squares + norm.square()
            if self.replicas > 1:  # the other replicas' 0 * norm, as the all-reduce would add them
                squares = squares + 0.0 * norm
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
