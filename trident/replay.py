"""``train.replay_every=N``: every N-th step's forward and backward run twice from the same weights and batch, and
every rank compares the two bitwise (its loss, and each gradient buffer's digest: the int64 sum of its bytes, which
any one flipped bit changes). trident's math is deterministic for a layout, so two healthy computations agree to
the bit. A mismatch is one line naming the step, the ranks and what differed; the run stops (exit code 5) or, with
``train.replay_action=warn``, goes on with the second computation. Gradients are compared after the dp reduction,
so a replica that miscomputed shows on its whole dp group (its loss names it); at dp = 1 each rank's are its own.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from trident.errors import TridentError
from trident.models.moe import moe_layers


class ReplayMismatch(TridentError):
    """Two computations of one step from the same weights and batch differed: a device miscomputed."""

    agreed = True
    exit_code = 5


def grad_digest(tensors: list[torch.Tensor]) -> list[int]:
    """Per tensor, the int64 sum of its bytes (on its device; one number comes back each)."""
    sums = [t.detach().reshape(-1).view(torch.uint8).sum(dtype=torch.int64) for t in tensors if t.numel()]
    return torch.stack(sums).tolist() if sums else []


class Replay:
    """Runs and compares the second computation of a due step (``check``); every rank calls it at the same steps."""

    def __init__(
        self,
        every: int,
        action: str,
        grads: Callable[[], list[torch.Tensor]],
        zero_grad: Callable[[], None],
        chunks: list[nn.Module],
    ) -> None:
        self.every, self.action, self.grads, self.zero_grad = every, action, grads, zero_grad
        self.moe = list(moe_layers(chunks).values())

    def due(self, step: int) -> bool:
        return self.every > 0 and (step + 1) % self.every == 0

    def check(self, step: int, loss_sum: torch.Tensor, again: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Compare step ``step``'s computation (its ``loss_sum``, the gradients now in the buffers) with ``again``
        (the same forward and backward); return the loss to go on with."""
        first = (loss_sum.detach().clone(), grad_digest(self.grads()))
        routed = [(m.step_sums.clone(), m.step_counts.clone()) for m in self.moe]  # the step's routing, once
        self.zero_grad()
        second = again()
        for m, (sums, counts) in zip(self.moe, routed, strict=True):
            m.step_sums.copy_(sums)
            m.step_counts.copy_(counts)
        differed = []
        if not torch.equal(first[0], second.detach()):
            differed.append(f"the loss ({first[0].item()!r} then {second.item()!r})")
        grads = grad_digest(self.grads())
        bad = [i for i, (a, b) in enumerate(zip(first[1], grads, strict=True)) if a != b]
        if bad:
            differed.append(f"gradient buffer{'s' * (len(bad) > 1)} {', '.join(map(str, bad))} of {len(grads)}")
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, differed)
        ranks = [f"rank {r}: {' and '.join(d)}" for r, d in enumerate(everyone) if d]
        if ranks:
            line = f"train.replay_every: step {step + 1} computed twice from the same weights and batch differed on "
            line += "; ".join(ranks) + " (a device miscomputed"
            if self.action != "warn":
                raise ReplayMismatch(line + "; the step was not applied)")
            if dist.get_rank() == 0:
                print(f"warning: {line}; going on with the second computation)", flush=True)
        return second
