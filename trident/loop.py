"""The training loop: micro-batches -> gradient sync -> unscale, clip -> AdamW; evaluation, logging and
checkpoints around it. ``train.py`` builds the parts and hands them to a ``Trainer``.

The loss of a step is the mean token loss over the *global* batch: each micro-batch's summed token loss
is divided by the global token count before backward and the gradients are summed over dp ranks, so
neither the dp size nor the micro-batch size changes the math.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from models.gpt import lm_loss_sum
from parallel.groups import ProcessGroups
from parallel.reducer import GradReducer
from trident.checkpoint import Checkpointer
from trident.config import OptimConfig, TrainConfig
from trident.data.dataset import TokenWindows
from trident.data.sampler import GlobalBatchSampler, ValidationBatches
from trident.errors import CheckpointError
from trident.metrics import MetricsLogger, peak_memory_mb
from trident.optim import lr_at, set_lr
from trident.precision import LossScaler, autocast

Batch = tuple[torch.Tensor, torch.Tensor]


def forward_backward(
    model: nn.Module,
    micro_batches: list[Batch],
    reducer: GradReducer,
    loss_multiplier: float,
    precision: str,
) -> torch.Tensor:
    """Run every micro-batch forward and backward; return the summed token loss (detached).

    Gradient sync is switched on for the last micro-batch only, so its all-reduces overlap its backward.
    This is the seam a pipeline schedule replaces.
    """
    device = micro_batches[0][0].device
    total = torch.zeros((), device=device)
    for i, (x, y) in enumerate(micro_batches):
        reducer.set_sync(i == len(micro_batches) - 1)
        with autocast(precision, device):
            logits = model(x)
        loss = lm_loss_sum(logits, y)
        (loss * loss_multiplier).backward()
        total += loss.detach()
    return total


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool


class Trainer:
    def __init__(
        self,
        train_cfg: TrainConfig,
        optim_cfg: OptimConfig,
        groups: ProcessGroups,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        reducer: GradReducer,
        train_data: TokenWindows,
        val_data: TokenWindows,
        device: torch.device,
        flops_per_token: float,
        peak_flops: float,
        checkpointer: Checkpointer,
        make_logger: Callable[[int], MetricsLogger | None],
    ) -> None:
        self.cfg, self.optim_cfg, self.groups = train_cfg, optim_cfg, groups
        self.model, self.optimizer, self.reducer = model, optimizer, reducer
        self.train_data, self.val_data, self.device = train_data, val_data, device
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.checkpointer, self.make_logger = checkpointer, make_logger
        self.sampler = GlobalBatchSampler(len(train_data), train_cfg.global_batch_size, train_cfg.seed)
        self.seq_len = train_data.seq_len
        self.tokens_per_step = train_cfg.global_batch_size * self.seq_len
        self.scaler = LossScaler() if train_cfg.precision == "fp16" else None
        self.step = 0  # optimizer steps completed

    def _to_device(self, batch: Batch) -> Batch:
        x, y = batch
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def micro_batches(self, step: int) -> list[Batch]:
        g = self.groups
        ids = self.sampler.micro_batches(step, g.dp_rank, g.dp_size, self.cfg.micro_batch_size)
        return [self._to_device(self.train_data.batch(i)) for i in ids]

    def train_step(self, step: int, micro_batches: list[Batch]) -> StepResult:
        """One optimizer step over this rank's micro-batches of the global batch."""
        set_lr(self.optimizer, lr_at(step, self.optim_cfg, self.cfg.steps))
        scale = self.scaler.scale if self.scaler else 1.0
        self.model.train()
        loss_sum = forward_backward(
            self.model, micro_batches, self.reducer, scale / self.tokens_per_step, self.cfg.precision
        )
        self.reducer.finish()

        grads = self.reducer.buffer  # every parameter's .grad is a view into it
        if scale != 1.0:
            grads.mul_(1.0 / scale)
        grad_norm = grads.norm(2)  # bucket padding is zero, so this is the global norm
        found_inf = not bool(torch.isfinite(grad_norm))
        if not found_inf:
            clip = self.optim_cfg.grad_clip
            if clip > 0:
                grads.mul_(torch.clamp(clip / (grad_norm + 1e-6), max=1.0))
            self.optimizer.step()
        if self.scaler:
            self.scaler.update(found_inf)
        self.reducer.zero_grad()

        dist.all_reduce(loss_sum, group=self.groups.dp_group)
        loss = loss_sum.item() / self.tokens_per_step
        return StepResult(loss=loss, grad_norm=grad_norm.item(), loss_scale=scale, skipped=found_inf)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over a fixed set of validation windows (the same at every evaluation)."""
        g, mbs = self.groups, self.cfg.micro_batch_size
        batches = ValidationBatches(len(self.val_data), self.cfg.global_batch_size, self.cfg.eval_batches)
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for b in range(len(batches)):
            for ids in batches.micro_batches(b, g.dp_rank, g.dp_size, mbs):
                x, y = self._to_device(self.val_data.batch(ids))
                with autocast(self.cfg.precision, self.device):
                    logits = self.model(x)
                total += lm_loss_sum(logits, y)
        dist.all_reduce(total, group=g.dp_group)
        return total.item() / (len(batches) * self.tokens_per_step)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "consumed_samples": self.step * self.cfg.global_batch_size,
            "global_batch_size": self.cfg.global_batch_size,
            "seed": self.cfg.seed,
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["global_batch_size"] != self.cfg.global_batch_size:
            raise CheckpointError(
                f"the checkpoint was trained with train.global_batch_size={state['global_batch_size']}; resuming "
                f"with {self.cfg.global_batch_size} would change which samples come next: keep it the same"
            )
        self.step = state["step"]
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])

    def fit(self) -> None:
        self.checkpointer.maybe_resume(self)
        if self.step >= self.cfg.steps:
            return
        logger = self.make_logger(self.step)
        total = self.cfg.steps
        # Ranks start at different moments; line them up so the first step's time is not one rank's wait.
        dist.barrier()
        try:
            for step in range(self.step, total):
                start = time.perf_counter()
                result = self.train_step(step, self.micro_batches(step))  # ends in a dp all-reduce
                elapsed = time.perf_counter() - start
                self.step = step + 1
                row = self._row(result, step, elapsed)
                if self.cfg.eval_every and (self.step % self.cfg.eval_every == 0 or self.step == total):
                    row["val_loss"] = self.evaluate()
                if logger is not None:
                    logger.log(row)
                if self.checkpointer.due(self.step, total):
                    self.checkpointer.save(self)
        finally:
            if logger is not None:
                logger.close()

    def _row(self, result: StepResult, step: int, elapsed: float) -> dict:
        tokens_per_s = self.tokens_per_step / elapsed
        world = self.groups.topology.world_size
        row = {
            "step": step + 1,
            "loss": result.loss,
            "lr": lr_at(step, self.optim_cfg, self.cfg.steps),
            "grad_norm": result.grad_norm,
            "tokens_per_s": tokens_per_s,
            "mfu": tokens_per_s * self.flops_per_token / (self.peak_flops * world),
            "peak_mem_mb": peak_memory_mb(self.device),
            "step_time_s": elapsed,
            "tokens": (step + 1) * self.tokens_per_step,
        }
        if self.scaler is not None:
            row["loss_scale"] = result.loss_scale
        if result.skipped:
            row["skipped"] = True
        return row
