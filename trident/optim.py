"""The warm-up + cosine learning-rate schedule, and the step that finishes and applies a rank's reduced
gradients: the sums their placements ask for, unscale, global norm, clip, and the ZeRO optimizer's update (the
one optimizer of every stage, 0 included: parallel/zero/optimizer.py)."""

from __future__ import annotations

import math

import torch
from torch import nn

from trident.config import ModelConfig, OptimConfig
from trident.models.matrices import matrices_of
from trident.parallel.grad_sums import GradSums
from trident.parallel.groups import ProcessGroups
from trident.parallel.norms import GlobalGradNorm
from trident.parallel.placement import placement_of
from trident.parallel.precision import LossScaler
from trident.parallel.zero.muon import MuonPlan, MuonSettings
from trident.parallel.zero.optimizer import ZeroOptimizer


def lr_at(step: int, cfg: OptimConfig, total_steps: int) -> float:
    """Linear warm-up from lr/warmup to lr over warmup_steps, then cosine decay to min_lr at total_steps.

    ``step`` counts optimizer steps from 0, so step 0 already has a non-zero learning rate.
    """
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def muon_plan(chunks: list[nn.Module], m: ModelConfig, opt: OptimConfig, groups: ProcessGroups) -> MuonPlan | None:
    """``optim.name=muon``: the matrix parameters of this rank's chunks Muon steps, in order (None: AdamW alone)."""
    if opt.name != "muon":
        return None
    settings = MuonSettings(
        lr_ratio=opt.muon_lr / opt.lr,
        weight_decay=opt.muon_weight_decay,
        momentum=opt.muon_momentum,
        nesterov=opt.muon_nesterov,
        ns_steps=opt.muon_ns_steps,
        coefficients=tuple(opt.muon_ns_coefficients),
        adjust_lr=opt.muon_adjust_lr,
        ns_dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[opt.muon_ns_dtype],
    )
    params = []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            matrices = matrices_of(name, placement_of(p).shape, m) if p.requires_grad else None
            if matrices is not None and placement_of(p).tied_to is None:
                params.append((p, matrices))
    return MuonPlan(settings, params, groups.tp_group, groups.grad_group)


def optimizer_summary(m: ModelConfig, opt: OptimConfig) -> list[str]:
    """Under Muon, what each parameter of the model gets, a line per kind (train.py prints them once at start)."""
    if opt.name != "muon":
        return []
    from trident.models.gpt import GPT

    with torch.device("meta"):
        model = GPT(m)
    kinds: dict[str, list[str]] = {}
    for name, p in model.named_parameters():
        short = ".".join(part for part in name.split(".") if not part.isdigit())
        matrices = matrices_of(name, placement_of(p).shape, m)
        kind = "AdamW" if matrices is None else f"Muon, {matrices.describe(placement_of(p).shape)}"
        kinds.setdefault(kind, []).append(short)
    return [f"optimizer: {kind}: {', '.join(dict.fromkeys(names))}" for kind, names in kinds.items()]


class GradStep:
    """Complete, unscale, measure, clip and apply the gradients this rank holds reduced (the ZeRO optimizer's).

    The norm is the global one (parallel/norms.py): every rank of every group clips by the same number
    and agrees on whether the step overflowed. With fp16 the loss scaler lives here, since the scale and the
    overflow verdict are two halves of one policy. A step whose gradients are not finite is skipped, never
    applied; when skipping means the run has diverged is the trainer's call (trident/divergence.py).
    """

    def __init__(
        self,
        update: ZeroOptimizer,
        groups: ProcessGroups,
        grad_clip: float,
        scaler: LossScaler | None = None,
    ) -> None:
        self.update, self.groups = update, groups
        self.grad_clip, self.scaler = grad_clip, scaler
        self.pieces = update.grad_pieces()
        self.grads = update.grads()
        # Sums over tp (sequence-parallel replicas) and across stages (the tied embedding), as placed.
        self.grad_sums = GradSums(update.reducer.params, update.grad_views, groups)
        # Stage 0 with no tp, one stage and no ep: every rank holds the same all-reduced gradient, so its own norm.
        replicated = not update.dp_sharded and groups.tp_size == groups.pp_size == groups.ep_size == 1
        self.norm = GlobalGradNorm(self.pieces, groups, dp_sharded=update.dp_sharded, replicated=replicated)

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale if self.scaler else 1.0

    def step(self, lr: float) -> tuple[float, bool]:
        """Apply this step's gradients at learning rate ``lr``; return (global grad norm, skipped)."""
        self.grad_sums()
        if self.loss_scale != 1.0:
            self._scale(1.0 / self.loss_scale)
        norm = self.norm()
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

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor holding this rank's model state, by kind: "params", "grads", "optimizer" (masters,
        moments). Views may repeat a storage; memory accounting counts storages."""
        return self.update.model_state_tensors()

    def state_dict(self) -> dict:
        return {"loss_scaler": self.scaler.state_dict() if self.scaler else None}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])
