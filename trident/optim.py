"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trident.config import OptimConfig
from trident.parallel.groups import ProcessGroups
from trident.parallel.norms import global_grad_norm
from trident.parallel.placement import placement_of
from trident.parallel.reducer import GradReducer
from trident.precision import LossScaler


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


class GradStep:
    """Unscale, measure, clip and apply the gradients held in the reducer's fp32 buffer.

    The norm is the global one (parallel/norms.py): every rank of every group clips by the same number
    and agrees on whether the step overflowed. With fp16 the loss scaler lives here, since the scale and the
    overflow verdict are two halves of one policy. A step whose gradients are not finite is skipped, never
    applied; when skipping means the run has diverged is the trainer's call (trident/divergence.py). A ZeRO
    optimizer offers the same ``scaler``, ``loss_scale``, ``step(lr) -> (grad_norm, skipped)`` and state over its
    gradient shards.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        reducer: GradReducer,
        groups: ProcessGroups,
        grad_clip: float,
        scaler: LossScaler | None = None,
    ) -> None:
        self.optimizer, self.reducer, self.groups = optimizer, reducer, groups
        self.grad_clip, self.scaler = grad_clip, scaler
        self.pieces = [(reducer.grad(p), placement_of(p)) for p in reducer.params]

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def step(self, lr: float) -> tuple[float, bool]:
        """Apply this step's gradients at learning rate ``lr``; return (global grad norm, skipped)."""
        grads = self.reducer.buffer
        if self.loss_scale != 1.0:
            grads.mul_(1.0 / self.loss_scale)
        norm = global_grad_norm(self.pieces, self.groups)
        skipped = not bool(torch.isfinite(norm))
        if not skipped:
            if self.grad_clip > 0:
                grads.mul_(torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0))
            set_lr(self.optimizer, lr)
            self.reducer.attach_grads()
            self.optimizer.step()
            self.reducer.detach_grads()
        self.reducer.zero_grad()
        if self.scaler:
            self.scaler.update(skipped)
        return norm.item(), skipped

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor holding this rank's model state: the parameters (fp32, so they are also the masters),
        the reducer's flat gradient buffer and AdamW's moments (and its per-parameter step counters)."""
        states = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return {"params": list(self.reducer.params), "grads": [self.reducer.buffer], "optimizer": states}

    def state_dict(self) -> dict:
        return {"loss_scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
