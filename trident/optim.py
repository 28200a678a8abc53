"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine learning-rate schedule."""

from __future__ import annotations

import math

import torch
from torch import nn

from trident.config import OptimConfig
from trident.errors import TridentError
from trident.parallel.reducer import GradReducer


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """Decay the 2-D weights (linear layers, embeddings); leave biases and LayerNorm gains alone."""
    params = [p for p in model.parameters() if p.requires_grad]
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
    """Unscale, measure, clip and apply the gradients in the data-parallel reducer's flat buffer.

    Every parameter's ``.grad`` is a view into that buffer and it is identical on every dp rank after
    the reduction, so the global norm is one local norm (bucket padding is zero). A ZeRO optimizer
    offers the same ``step(loss_scale) -> (grad_norm, found_inf)`` over its gradient shards.
    """

    # Non-finite gradients without fp16 loss scaling mean the run has diverged; stop rather than skip forever.
    MAX_BAD_STEPS = 5

    def __init__(self, optimizer: torch.optim.Optimizer, reducer: GradReducer, grad_clip: float, fp16: bool) -> None:
        self.optimizer, self.reducer, self.grad_clip, self.fp16 = optimizer, reducer, grad_clip, fp16
        self.bad_steps = 0

    def step(self, loss_scale: float) -> tuple[float, bool]:
        grads = self.reducer.buffer
        if loss_scale != 1.0:
            grads.mul_(1.0 / loss_scale)
        norm = grads.norm(2)
        found_inf = not bool(torch.isfinite(norm))
        if not found_inf:
            if self.grad_clip > 0:
                grads.mul_(torch.clamp(self.grad_clip / (norm + 1e-6), max=1.0))
            self.optimizer.step()
        self.reducer.zero_grad()
        self.bad_steps = self.bad_steps + 1 if found_inf and not self.fp16 else 0
        if self.bad_steps >= self.MAX_BAD_STEPS:
            raise TridentError(
                f"gradients were not finite for {self.bad_steps} steps in a row: the run diverged; "
                "lower optim.lr, raise optim.warmup_steps or use train.precision=fp32"
            )
        return norm.item(), found_inf
