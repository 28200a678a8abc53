"""The training loop: micro-batches -> gradient sync -> the sums placements ask for, unscale, clip -> AdamW;
evaluation, logging and checkpoints around it. ``train.py`` builds a rank's parts (trident/build.py: model
chunks, optimizer, runner) and hands them to a ``Trainer`` with the data, the checkpointer and the logger.

The loss of a step is the mean token loss over the *global* batch: each micro-batch's summed token loss
is divided by the global token count before backward and the gradients are summed over dp ranks, so
neither the dp size nor the micro-batch size changes the math.

How a run ends is decided here too, alike on every rank: it finishes (a summary line), it diverges (an error
naming the step and the last good checkpoint; nothing non-finite is ever saved), or a signal stops it after
the step in flight (a checkpoint of that step, one line, ``Stopped``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from trident.build import RunParts
from trident.checkpoint.files import checkpoint_name, list_checkpoints
from trident.checkpoint.manager import Checkpointer
from trident.config import Config
from trident.data.dataset import TokenWindows, eval_batch_count
from trident.data.sampler import GlobalBatchSampler, ValidationBatches
from trident.divergence import DivergencePolicy
from trident.errors import CheckpointError, DivergenceError, is_lost_peer
from trident.metrics import MetricsLogger, peak_memory_mb, summary_line
from trident.models.gpt import flops_per_token
from trident.optim import lr_at
from trident.parallel.agree import on_one_rank
from trident.parallel.groups import ProcessGroups
from trident.runner import Batch
from trident.signals import Stopped, StopRequest, stop_line


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool


class Trainer:
    def __init__(
        self,
        cfg: Config,
        groups: ProcessGroups,
        parts: RunParts,
        data: tuple[TokenWindows, TokenWindows],
        *,
        checkpointer: Checkpointer | None = None,
        make_logger: Callable[[int], MetricsLogger | None] | None = None,
        stop: StopRequest | None = None,
        peak_flops: float | None = None,
        after_first_step: Callable[[], None] | None = None,
    ) -> None:
        """``data``: the train and validation windows. ``make_logger(start step)`` is called on the logging rank
        only; ``peak_flops`` (all of one rank's device) makes the MFU; ``after_first_step`` runs on every rank
        once the optimizer's state exists (memory accounting)."""
        train_cfg = cfg.train
        self.cfg, self.optim_cfg, self.groups, self.device = train_cfg, cfg.optim, groups, parts.device
        self.model_chunks, self.runner = parts.chunks, parts.runner
        self.loss_fn = parts.chunks[-1].loss_sum  # the loss is computed where the last stage is
        self.grad_step = parts.optimizer.step
        self.train_data, self.val_data = data
        self.flops_per_token, self.peak_flops = flops_per_token(cfg.model), peak_flops
        self.checkpointer, self.stop, self.after_first_step = checkpointer, stop, after_first_step
        self.make_logger = make_logger or (lambda start: None)
        self.sampler = GlobalBatchSampler(len(self.train_data), train_cfg.global_batch_size, train_cfg.seed)
        self.eval_batches = eval_batch_count(train_cfg.eval_batches, len(self.val_data), train_cfg.global_batch_size)
        self.seq_len = self.train_data.seq_len
        self.tokens_per_step = train_cfg.global_batch_size * self.seq_len
        self.divergence = DivergencePolicy(train_cfg.max_skipped_steps, train_cfg.max_nonfinite_losses)
        self.step = 0  # optimizer steps completed
        self.last_checkpoint: Path | None = None  # the newest checkpoint of this run, every one of them finite

    def _to_device(self, windows: tuple[torch.Tensor, torch.Tensor], sample_ids: torch.Tensor, step: int) -> Batch:
        x, y = windows
        return Batch(x, y, sample_ids, step).to(self.device)

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of ``step``, each with its samples' global indices (dropout's masks)."""
        g, mbs = self.groups, self.cfg.micro_batch_size
        windows = self.sampler.micro_batches(step, g.dp_rank, g.dp_size, mbs)
        samples = self.sampler.sample_ids(step, g.dp_rank, g.dp_size, mbs)
        return [self._to_device(self.train_data.batch(w), s, step) for w, s in zip(windows, samples, strict=True)]

    def train_step(self, step: int, micro_batches: list[Batch]) -> StepResult:
        """One optimizer step over this rank's micro-batches of the global batch."""
        scale = self.grad_step.loss_scale
        loss_sum = self.runner.forward_backward(micro_batches, self.loss_fn, scale / self.tokens_per_step)
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
        batches = ValidationBatches(len(self.val_data), self.cfg.global_batch_size, self.eval_batches)
        total = torch.zeros((), device=self.device)
        for b in range(len(batches)):
            windows = batches.micro_batches(b, g.dp_rank, g.dp_size, mbs)
            samples = batches.sample_ids(b, g.dp_rank, g.dp_size, mbs)
            micro = [self._to_device(self.val_data.batch(w), s, b) for w, s in zip(windows, samples, strict=True)]
            total += self.runner.forward_only(micro, self.loss_fn)
        return self._share_loss(total) / (len(batches) * self.tokens_per_step)

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "consumed_samples": self.step * self.cfg.global_batch_size,
            "global_batch_size": self.cfg.global_batch_size,
            "seed": self.cfg.seed,
            "train_windows": len(self.train_data),
            "divergence": self.divergence.state_dict(),
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
        self.divergence.load_state_dict(state.get("divergence", {}))
        self.grad_step.load_state_dict(state)

    def fit(self) -> list[dict]:
        """Train to ``train.steps``; return the metrics row of every step this call ran (on every rank).

        Raises ``DivergenceError`` when the run diverged and ``Stopped`` after a signal, on every rank alike.
        """
        history: list[dict] = []
        if self.checkpointer is not None:
            self.checkpointer.prepare()
            self.checkpointer.maybe_resume(self)
            self.last_checkpoint = self._newest_checkpoint()
        total = self.cfg.steps
        if self.step >= total:
            if self.groups.is_logging_rank:
                print(
                    f"nothing to train: {self.last_checkpoint} is at step {self.step} of train.steps={total}; "
                    "raise train.steps to train on",
                    flush=True,
                )
            return history
        # Created on the logging rank alone (files, wandb); a failure there ends every rank, not just one.
        logger = on_one_rank(lambda: self.make_logger(self.step), self.groups.topology.logging_rank, "start logging")
        # Ranks start at different moments; line them up so the first step's time is not one rank's wait.
        dist.barrier()
        if self.stop is not None:
            self.stop.training(self.step, self.last_checkpoint, prints=self.groups.is_logging_rank)
        first_step, started = self.step, time.perf_counter()
        try:
            self._train(history, logger)
        except RuntimeError as e:
            # A collective failed: another rank is gone. After a signal that is the stop itself, not a bug.
            if not is_lost_peer(e) or self.stop is None or not self.stop.signum:
                raise
            signum = self.stop.signum
            note = " (abandoned: a collective failed, another rank is gone)"
            if self.groups.is_logging_rank:
                print(stop_line(signum, self.step, self.last_checkpoint, note), file=sys.stderr, flush=True)
            raise Stopped(signum, self.step, self.last_checkpoint, history) from None
        finally:
            if logger is not None:
                logger.close()
        if self.groups.is_logging_rank:
            val = next((r["val_loss"] for r in reversed(history) if "val_loss" in r), None)
            tokens = (self.step - first_step) * self.tokens_per_step
            wall = time.perf_counter() - started
            print(summary_line(first_step, self.step, wall, tokens, history[-1]["loss"], val, self.last_checkpoint))
        return history

    def _train(self, history: list[dict], logger: MetricsLogger | None) -> None:
        total = self.cfg.steps
        save_pending = False  # a checkpoint was due at a step whose loss was not finite: save at the next one
        first = self.step
        for step in range(self.step, total):
            start = time.perf_counter()
            result = self.train_step(step, self.micro_batches(step))  # ends in a dp all-reduce
            elapsed = time.perf_counter() - start
            if step == first and self.after_first_step is not None:
                self.after_first_step()  # every rank, once: the optimizer's state exists from its first step on
            self.step = step + 1
            row = self._row(result, step, elapsed)
            if self.cfg.eval_every and (self.step % self.cfg.eval_every == 0 or self.step == total):
                row["val_loss"] = self.evaluate()
            history.append(row)
            if logger is not None:
                logger.log(row)
            if self.stop is not None:
                # The update is applied and logged: a stop abandoning what follows must name this step.
                self.stop.completed(self.step, self.last_checkpoint)

            scaler = self.grad_step.scaler
            reason = self.divergence.verdict(
                result.loss, result.skipped, result.loss_scale if scaler else None, scaler.min_scale if scaler else None
            )
            if reason is not None:
                raise DivergenceError(self._diverged(reason, result))
            # One tiny all-reduce per step: every rank stops after the same step, whichever got the signal.
            signum = self.stop.agreed(self.groups.world_group, self.device) if self.stop is not None else 0
            finite = math.isfinite(result.loss)
            if self.checkpointer is not None:
                save_pending = save_pending or self.checkpointer.due(self.step, total) or bool(signum)
                if save_pending and finite:  # nothing non-finite is ever saved
                    self.checkpointer.save(self)
                    self.last_checkpoint = self.checkpointer.root / checkpoint_name(self.step)
                    save_pending = False
            if self.stop is not None:
                self.stop.completed(self.step, self.last_checkpoint)
            if signum:
                note = "" if finite else f" (not saved: its loss was {result.loss})"
                if self.groups.is_logging_rank:
                    print(stop_line(signum, self.step, self.last_checkpoint, note), file=sys.stderr, flush=True)
                raise Stopped(signum, self.step, self.last_checkpoint, history)

    def _newest_checkpoint(self) -> Path | None:
        """The newest complete checkpoint of this run up to the current step (the one resumed from, if any)."""
        assert self.checkpointer is not None
        mine = [p for p in list_checkpoints(self.checkpointer.root) if p.name <= checkpoint_name(self.step)]
        return mine[-1] if mine else None

    def _diverged(self, reason: str, result: StepResult) -> str:
        scale = f", loss scale {result.loss_scale:g}" if self.grad_step.scaler is not None else ""
        if self.last_checkpoint is not None:
            resume = f"the last good checkpoint is {self.last_checkpoint}: resume from it"
        else:
            resume = "no checkpoint was saved yet: start again"
        return (
            f"training diverged at step {self.step}{scale}: {reason}; {resume} with a lower optim.lr "
            "(or a longer optim.warmup_steps, or train.precision=bf16)"
        )

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
