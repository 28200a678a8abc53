"""The training loop: micro-batches -> gradient sync -> unscale, clip -> AdamW; evaluation, logging and
checkpoints around it. ``train.py`` builds the parts and hands them to a ``Trainer``: the runner (the local
one, or a pipeline schedule), the model chunks, the loss function (plain or vocab-parallel cross-entropy),
the optimizer step (``GradStep``, or ZeRO's) and a hook run after the gradient reduction (tied or
sequence-parallel gradients).

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
from trident.optim import GradStep, lr_at
from trident.parallel.agree import on_one_rank
from trident.parallel.groups import ProcessGroups
from trident.runner import Batch, LossFn, Runner


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
        model_chunks: list[nn.Module],
        runner: Runner,
        loss_fn: LossFn,
        grad_step: GradStep,
        train_data: TokenWindows,
        val_data: TokenWindows,
        device: torch.device,
        flops_per_token: float,
        peak_flops: float | None,
        checkpointer: Checkpointer | None,
        make_logger: Callable[[int], MetricsLogger | None],
        after_reduce: Callable[[], None] | None = None,
    ) -> None:
        self.cfg, self.optim_cfg, self.groups = train_cfg, optim_cfg, groups
        self.model_chunks, self.runner, self.loss_fn, self.grad_step = model_chunks, runner, loss_fn, grad_step
        self.after_reduce = after_reduce
        self.train_data, self.val_data, self.device = train_data, val_data, device
        self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
        self.checkpointer, self.make_logger = checkpointer, make_logger
        self.sampler = GlobalBatchSampler(len(train_data), train_cfg.global_batch_size, train_cfg.seed)
        self.seq_len = train_data.seq_len
        self.tokens_per_step = train_cfg.global_batch_size * self.seq_len
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
        scale = self.grad_step.loss_scale
        loss_sum = self.runner.forward_backward(micro_batches, self.loss_fn, scale / self.tokens_per_step)
        if self.after_reduce is not None:
            self.after_reduce()
        grad_norm, skipped = self.grad_step.step(lr_at(step, self.optim_cfg, self.cfg.steps))
        loss = self._share_loss(loss_sum) / self.tokens_per_step
        return StepResult(loss=loss, grad_norm=grad_norm, loss_scale=scale, skipped=skipped)

    def _share_loss(self, loss_sum: torch.Tensor) -> float:
        """Sum the last stage's loss over dp and hand it to every pipeline stage, so every rank (the logging
        rank among them) knows the step's loss and can act on it alike."""
        dist.all_reduce(loss_sum, group=self.groups.dp_group)
        if self.groups.pp_size > 1:
            dist.broadcast(loss_sum, src=self.groups.pp_ranks[-1], group=self.groups.pp_group)
        return loss_sum.item()

    def evaluate(self) -> float:
        """Mean token loss over a fixed set of validation windows (the same at every evaluation)."""
        g, mbs = self.groups, self.cfg.micro_batch_size
        batches = ValidationBatches(len(self.val_data), self.cfg.global_batch_size, self.cfg.eval_batches)
        total = torch.zeros((), device=self.device)
        for b in range(len(batches)):
            ids = batches.micro_batches(b, g.dp_rank, g.dp_size, mbs)
            total += self.runner.forward_only([self._to_device(self.val_data.batch(i)) for i in ids], self.loss_fn)
        return self._share_loss(total) / (len(batches) * self.tokens_per_step)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "consumed_samples": self.step * self.cfg.global_batch_size,
            "global_batch_size": self.cfg.global_batch_size,
            "seed": self.cfg.seed,
            "train_windows": len(self.train_data),
            **self.grad_step.state_dict(),
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
        self.grad_step.load_state_dict(state)

    def fit(self) -> list[dict]:
        """Train to ``train.steps``; return the metrics row of every step this call ran (on every rank)."""
        history: list[dict] = []
        if self.checkpointer is not None:
            self.checkpointer.prepare()
            self.checkpointer.maybe_resume(self)
        if self.step >= self.cfg.steps:
            return history
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
                history.append(row)
                if logger is not None:
                    logger.log(row)
                if self.checkpointer is not None and self.checkpointer.due(self.step, total):
                    self.checkpointer.save(self)
        finally:
            if logger is not None:
                logger.close()
        return history

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
        if self.grad_step.scaler is not None:
            row["loss_scale"] = result.loss_scale
        if result.skipped:
            row["skipped"] = True
        return row
