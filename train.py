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
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trident import cli
from trident.checkpoint import Checkpointer
from trident.config import Config, register_configs, to_config, validate
from trident.data.dataset import open_dataset
from trident.device import local_world_size, pick_backend, pick_device, set_cpu_threads, use_tensor_cores
from trident.loop import Trainer
from trident.metrics import MetricsLogger, announce_run, device_peak_tflops
from trident.models.checkpointing import apply_activation_checkpointing
from trident.models.compile import compile_blocks
from trident.models.gpt import GPT, flops_per_token, init_weights
from trident.optim import GradStep, build_optimizer
from trident.parallel.agree import on_one_rank
from trident.parallel.groups import build_process_groups, init_distributed, launch_world_size, shutdown_distributed
from trident.parallel.heartbeat import watch_peers
from trident.parallel.random import model_parallel_rng
from trident.parallel.reducer import GradReducer
from trident.parallel.tensor import sum_grads_over_tp
from trident.parallel.topology import Topology
from trident.precision import LossScaler
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
    peak = device_peak_tflops(device, tr.precision, lg.peak_tflops, lg.cpu_peak_tflops, local_world_size())
    if owns_group and device.type == "cpu":
        set_cpu_threads()

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

    # Dropout streams: the default generator alike on every tp rank, a tensor-parallel one per tp rank.
    rng = model_parallel_rng(tr.seed, groups.tp_rank, device)
    model = GPT(cfg.model, groups.tp_group, sequence_parallel=cfg.parallel.sequence_parallel, rng=rng)
    init_weights(model, cfg.model, tr.seed)
    model.to(device)
    if tr.compile:  # before activation checkpointing, which then wraps the compiled blocks
        compile_blocks(model, device)
    apply_activation_checkpointing(model, tr.activation_checkpointing)
    chunks = [model]
    optimizer = build_optimizer(chunks, cfg.optim)
    reducer = GradReducer([p for c in chunks for p in c.parameters()], groups.dp_group, cfg.parallel.bucket_mb)
    cleanup.callback(reducer.remove_hooks)
    # Under sequence parallelism the parameters every tp rank holds whole saw only that rank's tokens.
    sp_grads = [reducer.grad(p) for c in chunks for p in c.sequence_parallel_params()]
    scaler = LossScaler() if tr.precision == "fp16" else None
    config_dict = dataclasses.asdict(cfg)
    checkpointer = Checkpointer(
        root=checkpoint_root,
        every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        resume=cfg.checkpoint.resume,
        groups=groups,
        modules=chunks,
        optimizer=optimizer,
        config=config_dict,
        tokenizer=dataset.tokenizer_path,
    )
    if groups.is_logging_rank:
        announce_run(cfg, topology, chunks, device, len(train_data), run_dir, peak)
    trainer = Trainer(
        train_cfg=tr,
        optim_cfg=cfg.optim,
        groups=groups,
        model_chunks=chunks,
        runner=LocalRunner(chunks, reducer, tr.precision),
        loss_fn=model.loss_sum,
        grad_step=GradStep(optimizer, reducer, groups, cfg.optim.grad_clip, scaler),
        train_data=train_data,
        val_data=val_data,
        device=device,
        flops_per_token=flops_per_token(cfg.model),
        peak_flops=peak * 1e12 if peak else None,
        checkpointer=checkpointer,
        make_logger=lambda start: MetricsLogger(run_dir, tr.steps, lg, cfg.wandb, config_dict, start),
        stop=stop,
        after_reduce=(lambda: sum_grads_over_tp(sp_grads, groups.tp_group)) if sp_grads else None,
    )
    return trainer.fit()


register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    with cli.user_errors():
        run(to_config(hydra_cfg), Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    cli.launch(main)
