"""The gradient sums a parameter needs after the data-parallel reduction, read from its placement.

    "tp"         sequence parallelism: a parameter every tp rank holds whole saw only its rank's tokens
    "embedding"  the tied embedding split over the first and last pipeline stage: both copies take the sum
                 (over the embedding group when the two stages are on two ranks; on the rank itself when it
                 holds both, as zb-v's V placement does: stage 0 and stage 2P - 1 are chunks of pp rank 0)

Each group's gradients go in one all-reduce (flattened, or in place when there is one), so a step pays one
collective per group whatever the parameter count. Afterwards the gradients are bit-identical across the group,
as the parameters must stay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from trident.parallel.groups import ProcessGroups
from trident.parallel.placement import GRAD_SUMS, placement_of

GradViews = Callable[[Iterable[nn.Parameter]], list[torch.Tensor]]


def all_reduce_flat(grads: Sequence[torch.Tensor], group: dist.ProcessGroup | None) -> None:
    """Sum ``grads`` over ``group`` in place, in one all-reduce. A no-op with no group or a group of one."""
    if not grads or group is None or dist.get_world_size(group) == 1:
        return
    if len(grads) == 1 and grads[0].is_contiguous():  # the tied embedding alone: in place, no copies
        dist.all_reduce(grads[0], group=group)
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, summed in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(summed.view_as(g))


class GradSums:
    """Sum, after the dp reduction, the gradients whose placement asks for it, over the group it names.

    ``grad_views`` gives the reduced gradient this rank holds of each parameter (under ZeRO, its pieces of
    the dp shard: ranks of one tp or embedding group share the layout, so their pieces line up)."""

    def __init__(self, params: Iterable[nn.Parameter], grad_views: GradViews, groups: ProcessGroups) -> None:
        params = list(params)
        process_group = {"tp": groups.tp_group, "embedding": groups.embedding_group}
        assert set(process_group) == set(GRAD_SUMS)
        self.sums = []
        self.pairs: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # (source, copy) on this rank
        for name in GRAD_SUMS:
            marked = [p for p in params if name in placement_of(p).grad_sums]
            copies = [p for p in marked if placement_of(p).tied_to is not None]
            if name == "embedding" and copies and len(copies) < len(marked):
                # Both copies here: the sum is theirs alone (the embedding group's other end holds neither).
                sources = [p for p in marked if placement_of(p).tied_to is None]
                self.pairs.append((grad_views(sources), grad_views(copies)))
            elif marked:
                self.sums.append((grad_views(marked), process_group[name]))

    def __call__(self) -> None:
        for grads, group in self.sums:
            all_reduce_flat(grads, group)
        for sources, copies in self.pairs:
            # Their pieces line up (each in a bucket of its own, sharded alike), as across the embedding group.
            for source, copy in zip(sources, copies, strict=True):
                source.add_(copy)
                copy.copy_(source)
