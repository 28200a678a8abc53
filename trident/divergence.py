"""When a run has diverged: the policy that stops it, with its reason, instead of training on ``nan``.

Its inputs (the step's loss, whether the optimizer skipped the step, the loss scale) are the same on every
rank: the loss is shared by ``Trainer._share_loss`` and the skip follows from the global gradient norm
(parallel/norms.py). So every rank reaches the same verdict at the same step with no collective of its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class DivergencePolicy:
    """``max_skipped_steps`` steps in a row skipped (gradients not finite; with fp16, loss-scale overflows), a skip
    with the fp16 loss scale already at its floor (halving it cannot help any more), or ``max_nonfinite_losses``
    non-finite losses in a row: the run has diverged."""

    max_skipped_steps: int
    max_nonfinite_losses: int
    skipped_in_a_row: int = 0
    nonfinite_in_a_row: int = 0

    def verdict(self, loss: float, skipped: bool, loss_scale: float | None, min_scale: float | None) -> str | None:
        """Count one step; return why the run must stop, or None."""
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skipped else 0
        self.nonfinite_in_a_row = 0 if math.isfinite(loss) else self.nonfinite_in_a_row + 1
        if self.nonfinite_in_a_row >= self.max_nonfinite_losses:
            return f"the loss was {loss} for {self.nonfinite_in_a_row} steps in a row (train.max_nonfinite_losses)"
        if skipped and loss_scale is not None and min_scale is not None and loss_scale <= min_scale:
            return f"the gradients overflowed with the fp16 loss scale already at its floor {min_scale:g}"
        if self.skipped_in_a_row >= self.max_skipped_steps:
            n = self.skipped_in_a_row
            return f"the gradients were not finite {n} steps in a row, all skipped (train.max_skipped_steps)"
        return None

    def state_dict(self) -> dict:
        return {"skipped_in_a_row": self.skipped_in_a_row, "nonfinite_in_a_row": self.nonfinite_in_a_row}

    def load_state_dict(self, state: dict) -> None:
        self.skipped_in_a_row = int(state.get("skipped_in_a_row", 0))
        self.nonfinite_in_a_row = int(state.get("nonfinite_in_a_row", 0))
