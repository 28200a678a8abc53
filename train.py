"""Pretrain a GPT.

    python train.py [overrides]                                        # one process
    torchrun --nproc-per-node 8 train.py parallel.tp=2 parallel.pp=4   # 8 ranks

Build config -> topology -> data -> process groups -> model -> optimizer -> loop. Everything that can be
wrong with the config or the data is found before the first collective, so a bad run never hangs.
``run`` is the whole run in this process (config in, per-step metrics out); tests call it directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trident import cli
from trident.checkpoint.manager import Checkpointer
from trident.config import Config, ModelConfig, ParallelConfig, register_configs, resolve_schedule, to_config, validate
from trident.data.dataset import open_dataset
from trident.device import pick_backend, pick_device, set_cpu_threads, use_tensor_cores
from trident.loop import Trainer
from trident.memory import log_model_states
from trident.memory_estimate import Layout, estimate
from trident.metrics import MetricsLogger, announce_run
from trident.models.checkpointing import apply_activation_checkpointing
from trident.models.compile import compile_blocks
from trident.models.gpt import GPT, flops_per_token, init_weights
from trident.optim import GradStep
from trident.optimizer_setup import build_optimizer_setup
from trident.parallel.agree import on_one_rank
from trident.parallel.groups import (
    ProcessGroups,
    build_process_groups,
    init_distributed,
    launch_world_size,
    shutdown_distributed,
)
from trident.parallel.heartbeat import watch_peers
from trident.parallel.pipeline.executor import PipelineRunner
from trident.parallel.pipeline.stages import stage_layers, sum_tied_grads
from trident.parallel.random import RNGTracker, model_parallel_rng
from trident.parallel.tensor import sum_grads_over_tp
from trident.parallel.topology import Topology
from trident.peak import device_peak_tflops
from trident.rundir import take_ownership
from trident.runner import LocalRunner
from trident.signals import StopRequest


def run(cfg: Config, run_dir: Path) -> list[dict]:
    """Train as ``cfg`` says; return every step's metrics row. Joins the default process group if one
    exists (a test's), else creates it (and destroys it at the end).

    Raises ``Stopped`` after SIGTERM / SIGINT (the last completed step saved) and ``DivergenceError`` when the
    losses or gradients stop being finite; either way every rank raises it after the same step.
    """
    owns_group = not dist.is_initialized()
    with contextlib.ExitStack() as cleanup:
        stop = cleanup.enter_context(StopRequest(cfg.train.stop_grace_s))
        history = _build_and_fit(cfg, run_dir, owns_group, stop, cleanup)
    if owns_group:
        shutdown_distributed()
    return history


def _build_and_fit(
    cfg: Config, run_dir: Path, owns_group: bool, stop: StopRequest, cleanup: contextlib.ExitStack
) -> list[dict]:
    # Checks and data preparation need no process group: a problem ends every rank the same way.
    dp = validate(cfg, launch_world_size() if owns_group else dist.get_world_size())
    topology = Topology(dp=dp, pp=cfg.parallel.pp, tp=cfg.parallel.tp)
    device = pick_device(cfg.train.device)
    use_tensor_cores(device)
    dataset = open_dataset(cfg.data, cfg.model.vocab_size)
    tr = cfg.train
    eval_batches = tr.eval_batches if tr.eval_every else None
    train_data, val_data = dataset.split(cfg.model.seq_len, cfg.data.val_fraction, tr.global_batch_size, eval_batches)
    lg = cfg.logging
    if owns_group and device.type == "cpu":
        set_cpu_threads()
    # On a CPU the peak is measured on the threads this rank trains with, so after they are set.
    peak = device_peak_tflops(device, tr.precision, lg.peak_tflops)

    init_distributed(pick_backend(cfg.parallel.backend, device), device, cfg.parallel.timeout_s)
    cleanup.enter_context(watch_peers())  # a collective failing on a dead or stuck rank names it
    groups = build_process_groups(topology, cfg.parallel.timeout_s)
    agreed = [str(run_dir)]
    dist.broadcast_object_list(agreed, src=0)  # ranks started a second apart must share rank 0's run dir
    run_dir = Path(agreed[0])
    checkpoint_root = Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else run_dir / "checkpoints"
    # Rank 0 writes the checkpoints, so it owns the directories for as long as it lives.
    locks = on_one_rank(lambda: take_ownership(run_dir, checkpoint_root), 0, f"lock the run directory {run_dir}")
    for lock in locks or []:
        cleanup.callback(lock.release)

    # Dropout streams: the default generator alike on every tp rank, a tensor-parallel one per tp and pp rank.
    rng = model_parallel_rng(tr.seed, groups.tp_rank, device, groups.pp_rank)
    chunks = _model_chunks(cfg.model, cfg.parallel, groups, rng)
    for chunk in chunks:
        init_weights(chunk, cfg.model, tr.seed)
        chunk.to(device)
        if tr.compile:  # before activation checkpointing, which then wraps the compiled blocks
            compile_blocks(chunk, device)
        apply_activation_checkpointing(chunk, tr.activation_checkpointing)
    # Reducer, optimizer (plain or ZeRO) and step; ZeRO also casts the parameters to the precision's dtype. The
    # tied embedding copies get buckets of their own, so their shards line up across the first and last stage.
    tied = [p for c in chunks for p in c.tied_params()]
    setup = build_optimizer_setup(chunks, cfg, groups, isolate=tied)
    cleanup.callback(setup.remove_hooks)
    config_dict = dataclasses.asdict(cfg)
    checkpointer = Checkpointer(
        root=checkpoint_root,
        every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        resume=cfg.checkpoint.resume,
        groups=groups,
        modules=chunks,
        optimizer=setup.checkpointed,
        config=config_dict,
        tokenizer=dataset.tokenizer_path,
    )
    if groups.is_logging_rank:
        announce_run(cfg, topology, chunks, device, len(train_data), run_dir, peak)
    if cfg.parallel.pp == 1:
        runner = LocalRunner(chunks, setup.reducer, tr.precision)
    else:
        record = lg.pipeline_timings and groups.dp_rank == 0 and groups.tp_rank == 0  # one pipeline's ranks
        runner = PipelineRunner(
            chunks,
            resolve_schedule(cfg.parallel),
            groups.pp_rank,
            groups.pp_ranks,
            groups.pp_group,
            setup.reducer,
            tr.precision,
            cfg.model.d_model,
            seq_divisor=groups.tp_size if cfg.parallel.sequence_parallel else 1,
            timings=run_dir / "pipeline_timings" / f"rank{groups.rank}.jsonl" if record else None,
        )
    # memory.json: each rank's model-state bytes beside the prediction made before launch (tools/estimate_memory.py).
    predicted = estimate(cfg.model, Layout.from_config(cfg, dp, device.type)).to_dict()
    trainer = Trainer(
        train_cfg=tr,
        optim_cfg=cfg.optim,
        groups=groups,
        model_chunks=chunks,
        runner=runner,
        loss_fn=chunks[-1].loss_sum,  # the loss is computed where the last stage is
        grad_step=setup.grad_step,
        train_data=train_data,
        val_data=val_data,
        device=device,
        flops_per_token=flops_per_token(cfg.model),
        peak_flops=peak * 1e12 if peak else None,
        checkpointer=checkpointer,
        make_logger=lambda start: MetricsLogger(run_dir, tr.steps, lg, cfg.wandb, config_dict, start),
        stop=stop,
        after_reduce=_after_reduce(chunks, setup.grad_step, groups),
        after_first_step=lambda: log_model_states(setup.grad_step, groups, run_dir, {"estimate": predicted}),
    )
    return trainer.fit()


def _model_chunks(model: ModelConfig, par: ParallelConfig, groups: ProcessGroups, rng: RNGTracker) -> list[GPT]:
    """This rank's model chunks: chunk c is virtual stage c * pp + pp_rank (trident/parallel/pipeline/stages.py)."""
    stages = par.pp * par.vpp
    chunks = []
    for c in range(par.vpp):
        stage = c * par.pp + groups.pp_rank
        layers = stage_layers(model.n_layers, par.pp, par.vpp, stage)
        sp = par.sequence_parallel
        chunks.append(GPT(model, groups.tp_group, sp, rng, layers, first=stage == 0, last=stage == stages - 1))
    return chunks


def _after_reduce(chunks: list[GPT], grad_step: GradStep, groups: ProcessGroups) -> Callable[[], None] | None:
    """What completes the gradients after the dp reduction: under sequence parallelism, the parameters every tp
    rank holds whole saw only that rank's tokens; across pipeline stages, the two tied embedding copies."""
    sp_grads = grad_step.grad_views([p for c in chunks for p in c.sequence_parallel_params()])
    tied_grads = grad_step.grad_views([p for c in chunks for p in c.tied_params()])
    if not sp_grads and not tied_grads:
        return None

    def after_reduce() -> None:
        sum_grads_over_tp(sp_grads, groups.tp_group)
        sum_tied_grads(tied_grads, groups.embedding_group)

    return after_reduce


register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    with cli.user_errors():
        run(to_config(hydra_cfg), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    cli.launch(main)
