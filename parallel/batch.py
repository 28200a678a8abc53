"""A micro-batch: its tokens and targets, and where they come from. Dropout derives its masks from the latter
(trident/parallel/random.py), so a micro-batch carries them to whichever runner and pipeline stage computes it."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Batch(NamedTuple):
    tokens: torch.Tensor  # token ids [B, T]
    targets: torch.Tensor  # [B, T]
    sample_ids: torch.Tensor  # [B] global sample indices (step * global batch + position in it), on the CPU
    step: int  # the optimizer step (for validation: the batch's index in the evaluation)

    def to(self, device: torch.device) -> Batch:
        """Tokens and targets on ``device``; the sample ids stay where they are read from."""
        return self._replace(
            tokens=self.tokens.to(device, non_blocking=True), targets=self.targets.to(device, non_blocking=True)
        )
