"""The training loop: micro-batches -> gradient sync -> the sums placements ask for, unscale, clip -> AdamW;
evaluation, logging and checkpoints around it. ``train.py`` builds a rank's parts (trident/build.py: model
chunks, optimizer, runner) and hands them to a ``Trainer`` with the data, the checkpointer and the logger.

The loss of a step is the mean token loss over the *global* batch: each micro-batch's summed token loss
is divided by the global token count before backward and the gradients are summed over dp ranks, so
neither the dp size nor the micro-batch size changes the math.

How a run ends is decided here too, alike on every rank: it finishes (a summary line), it diverges (an error
naming the step and the last good checkpoint; nothing non-finite is ever saved), or a signal stops it after
the step in flight (a checkpoint of that step, one line, ``Stopped``).

The Trainer is one object's life (build, step, evaluate, save, end), so it stays whole past ~400 lines.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from trident.build import RunParts
from trident.checkpoint.files import checkpoint_name, list_checkpoints
from trident.checkpoint.manager import Checkpointer
from trident.config import Config
from trident.data.dataset import TokenWindows, eval_batch_count
from trident.data.loader import BatchLoader, Windows
from trident.data.mixture import MixedWindows, MixtureSampler
from trident.data.sampler import Batches, GlobalBatchSampler, ValidationBatches
from trident.divergence import DivergencePolicy
from trident.errors import CheckpointError, DivergenceError, is_lost_peer
from trident.metrics import MetricsLogger, peak_memory_mb, summary_line
from trident.models.gpt import flops_per_token
from trident.models.moe import step_stats
from trident.optim import lr_at
from trident.parallel.agree import on_one_rank
from trident.parallel.groups import ProcessGroups
from trident.parallel.pipeline.schedules import holder_of, stage_placement
from trident.replay import Replay
from trident.runner import Batch
from trident.signals import Stopped, StopRequest, stop_line
from trident.step_profile import PASSES_MARK


def cp_balance(micro_batches: list[Batch]) -> float:
    """The most attended (query, key) pairs a cp rank computed this step over their mean (parallel/context/)."""
    per_rank = [sum(pairs) for pairs in zip(*(b.cp_pairs for b in micro_batches), strict=True)]
    return max(per_rank) * len(per_rank) / sum(per_rank)


class StepProfiler(Protocol):
    """A profile of one step, started: ``finish`` with the seconds the step waited for its batches."""

    def finish(self, data_s: float) -> None: ...


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    loss_scale: float
    skipped: bool
    moe: dict[str, float] = field(default_factory=dict)  # models/moe.py step_stats: aux loss, expert load


@dataclass(frozen=True)
class RunServices:
    """What train.py gives the loop beyond the step: the ``checkpointer``; ``make_logger(start step)``, called on
    the logging rank only; the ``stop`` request signals set; ``peak_flops`` (all of one rank's device), which
    makes the MFU; ``after_first_step``, run on every rank once the optimizer's state exists (memory accounting);
    ``profiler``, called with each step (0-based) before it runs, a started profiler of that step or None
    (trident/step_profile.py for ``logging.profile_step``)."""

    checkpointer: Checkpointer | None = None
    make_logger: Callable[[int], MetricsLogger | None] | None = None
    stop: StopRequest | None = None
    peak_flops: float | None = None
    after_first_step: Callable[[], None] | None = None
    profiler: Callable[[int], StepProfiler | None] | None = None


class Trainer:
    def __init__(
        self,
        cfg: Config,
        groups: ProcessGroups,
        parts: RunParts,
        data: tuple[Windows, TokenWindows | Mapping[str, TokenWindows]],
        services: RunServices | None = None,
        *,
        eos_id: int | None = None,
        prefetch: bool = True,
    ) -> None:
        """``data``: the training windows (one dataset's, or a mixture's: ``MixedWindows``) and the validation
        windows (one set, or one per source by name). ``services``: what a run gives the loop beyond the step
        (``RunServices``; none: a bare loop, as tests and benchmarks drive it). ``eos_id``: the dataset's, which
        ``data.document_mask`` needs. ``prefetch``: read the next step's batches in the background."""
        services = services or RunServices()
        train_cfg, layout = cfg.train, parts.layout
        self.cfg, self.optim_cfg, self.groups, self.device = train_cfg, cfg.optim, groups, parts.device
        self.model_chunks, self.runner = parts.chunks, parts.runner
        self.loss_fn = parts.chunks[-1].loss_sum  # the loss is computed where the last stage is
        # The global rank of this pipeline that holds the last stage (the last pp rank, or under zb-v's V the first).
        last, _ = holder_of(layout.chunks - 1, layout.pp, stage_placement(layout.schedule))
        self.loss_rank = groups.pp_ranks[last]
        self.grad_step = parts.optimizer.step
        zero, tr = parts.optimizer.zero, train_cfg
        self.replay = Replay(tr.replay_every, tr.replay_action, zero.grads, zero.zero_grad, parts.chunks)
        self.profiler = services.profiler
        self.train_data, val = data
        self.flops_per_token, self.peak_flops = flops_per_token(cfg.model), services.peak_flops
        self.moe = cfg.model.moe
        # Under sequence parallelism each tp rank routes its own tokens: their routing is summed over tp too.
        self.routing_tp_group = groups.tp_group if layout.sequence_parallel and groups.tp_size > 1 else None
        self.checkpointer, self.stop, self.after_first_step = (
            services.checkpointer,
            services.stop,
            services.after_first_step,
        )
        self.make_logger = services.make_logger or (lambda start: None)
        gbs = train_cfg.global_batch_size
        self.mixture = self.train_data if isinstance(self.train_data, MixedWindows) else None
        if self.mixture is not None:
            self.sampler: Batches = self.mixture.sampler(gbs, train_cfg.seed)
        else:
            self.sampler = GlobalBatchSampler(len(self.train_data), gbs, train_cfg.seed)
        # The validation sets by source name ("" alone: one dataset), each with its own number of batches.
        self.val_sets = dict(val) if isinstance(val, Mapping) else {"": val}
        self.val_batches = {
            name: ValidationBatches(len(v), gbs, eval_batch_count(train_cfg.eval_batches, len(v), gbs))
            for name, v in self.val_sets.items()
        }
        self.seq_len = self.train_data.seq_len
        self.tokens_per_step = gbs * self.seq_len
        if layout.document_mask and eos_id is None:
            raise ValueError("data.document_mask needs the dataset's eos_id")
        self.loader = BatchLoader(
            self.train_data,
            self.sampler,
            groups.dp_rank,
            groups.dp_size,
            layout.micro_batch_size,
            self.device,
            eos_id if layout.document_mask else None,
            prefetch,
            groups.cp_rank,
            groups.cp_size,
        )
        self.divergence = DivergencePolicy(train_cfg.max_skipped_steps, train_cfg.max_nonfinite_losses)
        self.step = 0  # optimizer steps completed
        self._loss_work: dist.Work | None = None  # the last step's loss sum over dp (train_step)
        self.last_checkpoint: Path | None = None  # the newest checkpoint of this run, every one of them finite

    def micro_batches(self, step: int) -> list[Batch]:
        """This rank's micro-batches of ``step``, each with its samples' global indices (dropout's masks), read
        now (the loop itself reads through ``self.loader.get``, ahead of time)."""
        return self.loader.read(step)

    def train_step(self, step: int, micro_batches: list[Batch]) -> StepResult:
        """One optimizer step over this rank's micro-batches of the global batch."""
        scale = self.grad_step.loss_scale
        # The gradient each token's loss gets, one road: the runner scales the token loss and gives it to the MoE
        # layers' auxiliary losses (GPT.set_loss_multiplier).
        passes = lambda: self.runner.forward_backward(micro_batches, self.loss_fn, scale / self.tokens_per_step)  # noqa: E731
        with torch.profiler.record_function(PASSES_MARK):  # a profiled step's passes (trident/step_profile.py)
            loss_sum = passes()
        if self.replay.due(step):  # the same passes again, compared bit for bit (trident/replay.py)
            loss_sum = self.replay.check(step, loss_sum, passes)
        shared = self._share_loss(loss_sum)  # on the wire while the optimizer steps
        grad_norm, skipped = self.grad_step.step(lr_at(step, self.optim_cfg, self.cfg.steps))
        # The loss-free bias moves after the step (not after a skipped one); the routing of every stage's sparse
        # layers is in every row.
        pp_group = self.groups.pp_group if self.groups.pp_size > 1 else None
        moe = step_stats(self.model_chunks, self.moe, self.groups.grad_group, pp_group, self.routing_tp_group, skipped)
        loss = shared() / self.tokens_per_step
        return StepResult(loss=loss, grad_norm=grad_norm, loss_scale=scale, skipped=skipped, moe=moe)

    def _share_loss(self, loss_sum: torch.Tensor) -> Callable[[], float]:
        """Sum the last stage's loss over dp and hand it to every pipeline stage, so every rank (the logging
        rank among them) knows the step's loss and can act on it alike; the call returned waits for it. With one
        stage the sum is started now, asynchronously, and travels while the optimizer steps."""
        if self.groups.pp_size > 1 or self.groups.grad_size == 1:
            return lambda: self._share(loss_sum).item()
        # Held until the next step's replaces it (see GradReducer.finish on dropping a finished work).
        self._loss_work = dist.all_reduce(loss_sum, group=self.groups.grad_group, async_op=True)

        def wait() -> float:
            self._loss_work.wait()
            return loss_sum.item()

        return wait

    def _share(self, sums: torch.Tensor) -> torch.Tensor:
        """``sums`` summed over dp (and cp: each cp rank's is its tokens' part), from the last pipeline stage (a group
        of one rank: no collective)."""
        if self.groups.grad_size > 1:
            dist.all_reduce(sums, group=self.groups.grad_group)
        if self.groups.pp_size > 1:
            dist.broadcast(sums, src=self.loss_rank, group=self.groups.pp_group)
        return sums

    def evaluate_sources(self) -> dict[str, float]:
        """Mean token loss over each validation set's fixed windows (the same at every evaluation), by name."""
        totals = []
        for name, batches in self.val_batches.items():
            total = torch.zeros((), device=self.device)
            for b in range(len(batches)):
                total += self.runner.forward_only(self.loader.read(b, self.val_sets[name], batches), self.loss_fn)
            totals.append(total)
        shared = self._share(torch.stack(totals)).tolist()  # one collective for every source
        per_step = self.tokens_per_step
        return {name: s / (len(b) * per_step) for (name, b), s in zip(self.val_batches.items(), shared, strict=True)}

    def evaluate(self) -> float:
        """The validation loss: one dataset's, or a mixture's sources' weighted by the mixture's weights."""
        return self._val_row(self.evaluate_sources())["val_loss"]

    def _val_row(self, losses: dict[str, float]) -> dict[str, float]:
        """``val_loss``, and with a mixture ``val_loss/<source>`` too, ``val_loss`` being their mean weighted by the
        mixture's weights (the loss on the training distribution, not the mean over all sources' windows)."""
        if self.mixture is None:
            return {"val_loss": losses[""]}
        w = self.mixture.weights
        mean = sum(wi * losses[n] for n, wi in zip(self.mixture.names, w, strict=True)) / sum(w)
        return {"val_loss": mean, **{f"val_loss/{name}": loss for name, loss in losses.items()}}

    def tokens_per_source(self, steps: int) -> dict[str, int]:
        """The training tokens each source of the mixture gave the first ``steps`` steps (closed form)."""
        if self.mixture is None:
            return {}
        assert isinstance(self.sampler, MixtureSampler)
        counts = self.sampler.counts_before(steps * self.cfg.global_batch_size)
        return {name: c * self.seq_len for name, c in zip(self.mixture.names, counts, strict=True)}

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "consumed_samples": self.step * self.cfg.global_batch_size,
            "global_batch_size": self.cfg.global_batch_size,
            "seed": self.cfg.seed,
            "train_windows": len(self.train_data),
            **({"mix": self._mix_state()} if self.mixture is not None else {}),
            "divergence": self.divergence.state_dict(),
            **self.grad_step.state_dict(),
        }

    def _mix_state(self) -> list | None:
        """The mixture's sources as the checkpoint records them: [name, training windows, integer weight] each."""
        if self.mixture is None:
            return None
        assert isinstance(self.sampler, MixtureSampler)
        return [
            [n, size, w]
            for n, size, w in zip(self.mixture.names, self.sampler.sizes, self.sampler.weights, strict=True)
        ]

    def load_state_dict(self, state: dict) -> None:
        # Each of these fixes which samples come next: resuming with another value would silently
        # train on a different stream than the run that was interrupted. Another mixture says so first.
        self._check_mix(state.get("mix"))
        mine = {"global_batch_size": self.cfg.global_batch_size, "seed": self.cfg.seed}
        mine["train_windows"] = len(self.train_data)
        keys = {"global_batch_size": "train.global_batch_size", "seed": "train.seed", "train_windows": "data.*"}
        for key, value in mine.items():
            if state.get(key) != value:
                raise CheckpointError(
                    f"the checkpoint was trained with {keys[key]} giving {key}={state.get(key)}, this run has "
                    f"{value}; resume with the same settings (and data), or set checkpoint.resume=none in a new "
                    "checkpoint.dir"
                )
        self.step = state["step"]
        self.divergence.load_state_dict(state.get("divergence", {}))
        self.grad_step.load_state_dict(state)

    def _check_mix(self, saved: list | None) -> None:
        """Refuse a checkpoint whose data stream this run's data.mix would not continue. A mixture of one source
        draws exactly the batches of that dataset alone (trident/data/mixture.py), so a one-dataset checkpoint
        resumes as ``data.mix=[DIR:1]`` and back (``train_windows`` is checked beside this)."""
        mine = self._mix_state()
        one = (saved is None or len(saved) == 1) and (mine is None or len(mine) == 1)
        if saved == mine or one and (saved is None or mine is None):
            return

        def said(mix: list | None) -> str:
            if mix is None:
                return "one dataset (data.dataset_dir, no data.mix)"
            entries = [f"{name}:{weight}" for name, _, weight in mix]
            if [e[:1] + e[2:] for e in saved or []] == [e[:1] + e[2:] for e in mine or []]:  # the sources' sizes differ
                entries = [f"{name}:{weight} ({size} windows)" for name, size, weight in mix]
            return "data.mix=[" + ",".join(entries) + "]"

        raise CheckpointError(
            f"the checkpoint was trained on {said(saved)}, this run has {said(mine)}: another data stream; resume "
            "with the checkpoint's data, or set checkpoint.resume=none in a new checkpoint.dir to start afresh"
        )

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
            self.loader.close()
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
            profiler = self.profiler(step) if self.profiler is not None else None
            start = time.perf_counter()
            # The step's batches were read while the last step ran: ``waited`` is what reading still cost it.
            batches, waited = self.loader.get(step, last=total)
            result = self.train_step(step, batches)  # ends in a dp all-reduce
            elapsed = time.perf_counter() - start
            if profiler is not None:
                profiler.finish(waited)
            if step == first and self.after_first_step is not None:
                self.after_first_step()  # every rank, once: the optimizer's state exists from its first step on
            self.step = step + 1
            row = self._row(result, step, elapsed)
            row.update(data_ms=1e3 * waited, data_read_ms=1e3 * self.loader.last_read_s, data_share=waited / elapsed)
            row.update({f"tokens/{name}": n for name, n in self.tokens_per_source(self.step).items()})
            if batches[0].cp_pairs is not None:
                row["cp_balance"] = cp_balance(batches)
            if self.cfg.eval_every and (self.step % self.cfg.eval_every == 0 or self.step == total):
                row.update(self._val_row(self.evaluate_sources()))
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
                if self.checkpointer is not None:
                    self._saved(self.checkpointer.wait())  # the last good checkpoint is named once it is complete
                raise DivergenceError(self._diverged(reason, result))
            # One tiny all-reduce per step: every rank stops after the same step, whichever got the signal.
            signum = self.stop.agreed(self.groups.world_group, self.device) if self.stop is not None else 0
            finite = math.isfinite(result.loss)
            if self.checkpointer is not None:
                save_pending = save_pending or self.checkpointer.due(self.step, total) or bool(signum)
                if save_pending and finite:  # nothing non-finite is ever saved
                    self._saved(self.checkpointer.save(self))
                    save_pending = False
                if signum or self.step == total:  # a stop and the end of the run wait for a save in the background
                    self._saved(self.checkpointer.wait())
            if self.stop is not None:
                self.stop.completed(self.step, self.last_checkpoint)
            if signum:
                note = "" if finite else f" (not saved: its loss was {result.loss})"
                if self.groups.is_logging_rank:
                    print(stop_line(signum, self.step, self.last_checkpoint, note), file=sys.stderr, flush=True)
                raise Stopped(signum, self.step, self.last_checkpoint, history)

    def _saved(self, checkpoint: Path | None) -> None:
        """Note a checkpoint known to be complete (with ``checkpoint.async``, a save is named only once written)."""
        if checkpoint is not None:
            self.last_checkpoint = checkpoint

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
        row.update(result.moe)
        return row
