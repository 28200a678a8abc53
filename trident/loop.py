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

from trident.checkpoint import Checkpointer
from trident.config import OptimConfig, TrainConfig
from trident.data.dataset import TokenWindows
from trident.data.sampler import GlobalBatchSampler, ValidationBatches
from trident.errors import CheckpointError
from trident.metrics import MetricsLogger, peak_memory_mb
from trident.models.gpt import lm_loss_sum
from trident.optim import GradStep, lr_at, set_lr
from trident.parallel.agree import on_one_rank
from trident.parallel.groups import ProcessGroups
from trident.parallel.reducer import GradReducer
from trident.precision import LossScaler, autocast

Batch = tuple[torch.Tensor, torch.Tensor]


class LocalRunner:
    """Runs micro-batches through the whole model held by this rank (no pipeline parallelism).

    The seam a pipeline schedule replaces: the trainer only calls ``forward_backward`` and ``forward_only``
    and gets back this rank's summed token loss.
    """

    def __init__(self, model: nn.Module, reducer: GradReducer, precision: str) -> None:
        self.model, self.reducer, self.precision = model, reducer, precision

    def forward_backward(self, micro_batches: list[Batch], loss_multiplier: float) -> torch.Tensor:
        """Forward and backward of every micro-batch; gradient sync runs during the last one's backward."""
        self.model.train()
        total = torch.zeros((), device=micro_batches[0][0].device)
        for i, (x, y) in enumerate(micro_batches):
            self.reducer.set_sync(i == len(micro_batches) - 1)
            with autocast(self.precision, x.device):
                logits = self.model(x)
            loss = lm_loss_sum(logits, y)
            (loss * loss_multiplier).backward()
            total += loss.detach()
        return total

    @torch.no_grad()
    def forward_only(self, micro_batches: list[Batch]) -> torch.Tensor:
        self.model.eval()
        total = torch.zeros((), device=micro_batches[0][0].device)
        for x, y in micro_batches:
            with autocast(self.precision, x.device):
                total += lm_loss_sum(self.model(x), y)
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
        peak_flops: float | None,
        checkpointer: Checkpointer,
        make_logger: Callable[[int], MetricsLogger],
    ) -> None:
        self.cfg, self.optim_cfg, self.groups = train_cfg, optim_cfg, groups
        self.model, self.optimizer, self.reducer = model, optimizer, reducer
        self.train_data, self.val_data, self.device = train_data, val_data, device
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.checkpointer, self.make_logger = checkpointer, make_logger
        self.sampler = GlobalBatchSampler(len(train_data), train_cfg.global_batch_size, train_cfg.seed)
        self.seq_len = train_data.seq_len
        self.tokens_per_step = train_cfg.global_batch_size * self.seq_len
        self.runner = LocalRunner(model, reducer, train_cfg.precision)
        self.scaler = LossScaler() if train_cfg.precision == "fp16" else None
        self.grad_step = GradStep(optimizer, reducer, optim_cfg.grad_clip, fp16=self.scaler is not None)
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
        loss_sum = self.runner.forward_backward(micro_batches, scale / self.tokens_per_step)
        self.reducer.finish()
        grad_norm, found_inf = self.grad_step.step(scale)
        if self.scaler:
            self.scaler.update(found_inf)

        dist.all_reduce(loss_sum, group=self.groups.dp_group)
        loss = loss_sum.item() / self.tokens_per_step
        return StepResult(loss=loss, grad_norm=grad_norm, loss_scale=scale, skipped=found_inf)

    def evaluate(self) -> float:
        """Mean token loss over a fixed set of validation windows (the same at every evaluation)."""
        g, mbs = self.groups, self.cfg.micro_batch_size
        batches = ValidationBatches(len(self.val_data), self.cfg.global_batch_size, self.cfg.eval_batches)
        total = torch.zeros((), device=self.device)
        for b in range(len(batches)):
            ids = batches.micro_batches(b, g.dp_rank, g.dp_size, mbs)
            total += self.runner.forward_only([self._to_device(self.val_data.batch(i)) for i in ids])
        dist.all_reduce(total, group=g.dp_group)
        return total.item() / (len(batches) * self.tokens_per_step)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "consumed_samples": self.step * self.cfg.global_batch_size,
            "global_batch_size": self.cfg.global_batch_size,
            "seed": self.cfg.seed,
            "train_windows": len(self.train_data),
            "loss_scaler": self.scaler.state_dict() if self.scaler else None,
        }

    def load_state_dict(self, state: dict) -> None:
        # Each of these fixes which samples come next: resuming with another value would silently
        # train on a different stream than the run that was interrupted.
        mine = {"global_batch_size": self.cfg.global_batch_size, "seed": self.cfg.seed}
        mine["train_windows"] = len(self.train_data)
        keys = {"global_batch_size": "train.global_batch_size", "seed": "train.seed", "train_windows": "data.*"}
        for key, value in mine.items():
            if state[key] != value:
                raise CheckpointError(
                    f"the checkpoint was trained with {keys[key]} giving {key}={state[key]}, this run has {value}; "
                    "resume with the same settings (and data), or set checkpoint.resume=none in a new checkpoint.dir"
                )
        self.step = state["step"]
        if self.scaler and state.get("loss_scaler"):
            self.scaler.load_state_dict(state["loss_scaler"])

    def fit(self) -> None:
        self.checkpointer.prepare()
        self.checkpointer.maybe_resume(self)
        if self.step >= self.cfg.steps:
            return
        # Created on the logging rank alone (files, wandb); a failure there ends every rank, not just one.
        logger = on_one_rank(lambda: self.make_logger(self.step), self.groups.topology.logging_rank, "start logging")
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
            "mfu": tokens_per_s * self.flops_per_token / (self.peak_flops * world) if self.peak_flops else None,
            "peak_mem_mb": peak_memory_mb(self.device),
            "step_time_s": elapsed,
            "tokens": (step + 1) * self.tokens_per_step,
        }
        if self.scaler is not None:
            row["loss_scale"] = result.loss_scale
        if result.skipped:
            row["skipped"] = True
        return row
