"""AdamW with decoupled weight decay on matrices only, the warm-up + cosine learning-rate schedule, and the
step that applies a rank's reduced gradients (unscale, global norm, clip, update) whatever holds them."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol

import torch
from torch import nn

from trident.config import OptimConfig
from trident.parallel.groups import ProcessGroups
from trident.parallel.norms import global_grad_norm
from trident.parallel.placement import Placement, placement_of
from trident.parallel.precision import LossScaler
from trident.parallel.reducer import GradReducer


def build_optimizer(model_chunks: list[nn.Module], cfg: OptimConfig) -> torch.optim.AdamW:
    """Decay the 2-D weights (linear layers, embeddings); leave biases and LayerNorm gains alone."""
    params = [p for chunk in model_chunks for p in chunk.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    on_cuda = params[0].is_cuda
    # fused is fastest on GPU; foreach batches the per-tensor kernels on CPU.
    return torch.optim.AdamW(
        groups,
        lr=cfg.lr,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=on_cuda,
        foreach=None if on_cuda else True,
    )


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warm-up from lr/warmup to lr over warmup_steps, then cosine decay to min_lr at total_steps.

    ``step`` counts optimizer steps from 0, so step 0 already has a non-zero learning rate.
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


class Update(Protocol):
    """What ``GradStep`` drives: where this rank's reduced gradients are, and how they become a step.

    ``ReplicatedUpdate`` (below) is plain data parallelism; ZeRO's ``ZeroOptimizer`` (parallel/zero/) shards it.
    """

    dp_sharded: bool  # the gradients are disjoint dp shards (each dp rank counts its own in the norm)

    def grads(self) -> list[torch.Tensor]: ...

    def grad_pieces(self) -> list[tuple[torch.Tensor, Placement]]: ...

    def grad_views(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]: ...

    def apply(self, lr: float) -> None: ...

    def zero_grad(self) -> None: ...

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]: ...


class ReplicatedUpdate:
    """Every dp rank steps the whole model: one torch AdamW over the parameters, whose ``.grad`` point at the
    reducer's all-reduced fp32 buffer during the step."""

    dp_sharded = False

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: GradReducer) -> None:
        self.optimizer, self.reducer = optimizer, reducer

    def grads(self) -> list[torch.Tensor]:
        return [self.reducer.buffer]

    def grad_pieces(self) -> list[tuple[torch.Tensor, Placement]]:
        return [(self.reducer.grad(p), placement_of(p)) for p in self.reducer.params]

    def grad_views(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        return [self.reducer.grad(p) for p in params]

    def apply(self, lr: float) -> None:
        set_lr(self.optimizer, lr)
        self.reducer.attach_grads()
        self.optimizer.step()
        self.reducer.detach_grads()

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The parameters (fp32, so they are also the masters), the reducer's flat gradient buffer and AdamW's
        moments (and its per-parameter step counters)."""
        states = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"params": list(self.reducer.params), "grads": [self.reducer.buffer], "optimizer": states}


class GradStep:
    """Unscale, measure, clip and apply the gradients this rank holds reduced (an ``Update``'s).

    The norm is the global one (parallel/norms.py): every rank of every group clips by the same number
    and agrees on whether the step overflowed. With fp16 the loss scaler lives here, since the scale and the
    overflow verdict are two halves of one policy. A step whose gradients are not finite is skipped, never
    applied; when skipping means the run has diverged is the trainer's call (trident/divergence.py).
    """

    def __init__(
        self,
        update: Update,
        groups: ProcessGroups,
        grad_clip: float,
        scaler: LossScaler | None = None,
    ) -> None:
        self.update, self.groups = update, groups
        self.grad_clip, self.scaler = grad_clip, scaler
        self.pieces = update.grad_pieces()
        self.grads = update.grads()

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def step(self, lr: float) -> tuple[float, bool]:
        """Apply this step's gradients at learning rate ``lr``; return (global grad norm, skipped)."""
        if self.loss_scale != 1.0:
            self._scale(1.0 / self.loss_scale)
        norm = global_grad_norm(self.pieces, self.groups, dp_sharded=self.update.dp_sharded)
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            if self.grad_clip > 0:
                self._scale(torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0))
            self.update.apply(lr)
        self.update.zero_grad()
        if self.scaler:
            self.scaler.update(skipped)
        return norm.item(), skipped

    def _scale(self, factor: float | torch.Tensor) -> None:
        for g in self.grads:
            g.mul_(factor)

    def grad_views(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The reduced gradient this rank holds of each of ``params``, for sums over other groups after the
        dp reduction (sequence-parallel gradients over tp)."""
        return self.update.grad_views(params)

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor holding this rank's model state, by kind: "params", "grads", "optimizer" (masters,
        moments). Views may repeat a storage; memory accounting counts storages."""
        return self.update.model_state_tensors()

    def state_dict(self) -> dict:
        return {"loss_scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
