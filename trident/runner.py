"""Runners: how one step's micro-batches go through the model chunks this rank holds.

The trainer calls only ``forward_backward`` and ``forward_only`` and gets back this rank's summed token loss,
which is real where the loss is computed (the last pipeline stage) and zero elsewhere. ``LocalRunner`` runs
the whole model on this rank; a pipeline schedule is another runner with the same two calls. Each runner
ends ``forward_backward`` with the data-parallel reduction finished, since only it knows which backward
is the last one of the step. Around each training forward a runner sets the micro-batch (its step and sample
ids) on the model's RNG tracker, which dropout derives its masks from.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from trident.parallel.batch import Batch
from trident.parallel.precision import autocast
from trident.parallel.random import dropout_context
from trident.parallel.reducer import GradReducer

# (model output, targets) -> summed token loss in fp32; the caller divides by the global token count. The last chunk
# is given the targets, and a GPT's then returns that loss itself, the LM head fused with it (GPT.head).
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class Runner(Protocol):
    def forward_backward(self, micro_batches: list[Batch], loss_fn: LossFn, loss_multiplier: float) -> torch.Tensor:
        """Forward and backward of every micro-batch, gradients reduced over dp; return the summed loss."""
        ...

    def forward_only(self, micro_batches: list[Batch], loss_fn: LossFn) -> torch.Tensor: ...

    # The most activation sets (micro-batch x model chunk) held for backward at once in a training step so far.
    peak_activation_sets: int


class LocalRunner:
    """The whole model on this rank (no pipeline parallelism): one model chunk."""

    def __init__(self, model_chunks: list[nn.Module], reducer: GradReducer, precision: str) -> None:
        if len(model_chunks) != 1:
            raise ValueError(f"LocalRunner runs one model chunk, got {len(model_chunks)}")
        self.model, self.reducer, self.precision = model_chunks[0], reducer, precision
        # The most activation sets (micro-batch x chunk) held for backward at once: one, micro-batch after
        # micro-batch (memory.json's ``activation_sets``, beside the estimator's walk of the same order).
        self.peak_activation_sets = 0

    def forward_backward(self, micro_batches: list[Batch], loss_fn: LossFn, loss_multiplier: float) -> torch.Tensor:
        self.model.train()
        if hasattr(self.model, "set_loss_multiplier"):  # its auxiliary losses' gradient, the token loss's
            self.model.set_loss_multiplier(loss_multiplier)
        total = torch.zeros((), device=micro_batches[0].tokens.device)
        for i, batch in enumerate(micro_batches):
            # Gradient sync overlaps the backward of the last micro-batch only.
            self.reducer.set_sync(i == len(micro_batches) - 1)
            x = batch.tokens
            with autocast(self.precision, x.device), dropout_context(self.model, batch.step, batch.sample_ids):
                output = self.model(
                    x,
                    documents=batch.documents,
                    positions=batch.positions,
                    index=batch.index,
                    keys=batch.keys,
                    targets=batch.targets,
                )
            loss = loss_fn(output, batch.targets)
            del output
            self.peak_activation_sets = max(self.peak_activation_sets, 1)
            (loss * loss_multiplier).backward()
            total += loss.detach()
        self.reducer.finish()
        return total

    @torch.no_grad()
    def forward_only(self, micro_batches: list[Batch], loss_fn: LossFn) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros((), device=micro_batches[0].tokens.device)
        for batch in micro_batches:
            with autocast(self.precision, batch.tokens.device):
                output = self.model(
                    batch.tokens,
                    documents=batch.documents,
                    positions=batch.positions,
                    index=batch.index,
                    keys=batch.keys,
                    targets=batch.targets,
                )
            total += loss_fn(output, batch.targets)
        return total
