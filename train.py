"""Pretrain a GPT.

    python train.py [overrides]                          # one process
    torchrun --nproc-per-node 8 train.py [overrides]     # data parallel over 8 ranks

Build config -> topology -> data -> process groups -> model -> optimizer -> loop. Everything that can be
wrong with the config or the data is found before the first collective, so it never hangs.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import hydra
import torch
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from trident.checkpoint import Checkpointer
from trident.config import Config, register_configs, to_config, validate
from trident.data.dataset import TokenDataset
from trident.data.prepare import resolve_dataset
from trident.device import local_rank, local_world_size, pick_backend, pick_device, set_cpu_threads
from trident.errors import TridentError, one_line
from trident.loop import Trainer
from trident.metrics import MetricsLogger, device_peak_tflops
from trident.models.checkpointing import apply_activation_checkpointing
from trident.models.gpt import GPT, flops_per_token, init_weights
from trident.optim import build_optimizer
from trident.parallel.groups import (
    build_process_groups,
    init_distributed,
    launch_world_size,
    shutdown_distributed,
)
from trident.parallel.reducer import GradReducer
from trident.parallel.topology import Topology


def run(cfg: Config, run_dir: Path) -> None:
    # Checks and data preparation need no process group: a problem ends every rank the same way.
    dp = validate(cfg, launch_world_size())
    topology = Topology(dp=dp, pp=cfg.parallel.pp, tp=cfg.parallel.tp)
    device = pick_device(cfg.train.device)
    backend = pick_backend(cfg.parallel.backend, device)
    if device.type == "cuda":
        # "fp32" trains with TF32 tensor-core matmuls on GPU (as Megatron and torchtitan do); the MFU peak assumes it.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dataset = TokenDataset(resolve_dataset(cfg.data, cfg.model.vocab_size))
    train_data, val_data = dataset.split(cfg.model.seq_len, cfg.data.val_fraction, cfg.train.global_batch_size)
    peak = device_peak_tflops(
        device, cfg.train.precision, cfg.logging.peak_tflops, cfg.logging.cpu_peak_tflops, local_world_size()
    )
    if device.type == "cpu":
        set_cpu_threads()

    init_distributed(backend, device, cfg.parallel.timeout_s)
    groups = build_process_groups(topology, cfg.parallel.timeout_s)
    agreed = [str(run_dir)]
    dist.broadcast_object_list(agreed, src=0)  # ranks started a second apart must share rank 0's run dir
    run_dir = Path(agreed[0])

    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    init_weights(model, cfg.model, cfg.train.seed)
    model.to(device)
    apply_activation_checkpointing(model, cfg.train.activation_checkpointing)
    optimizer = build_optimizer(model, cfg.optim)
    reducer = GradReducer(list(model.parameters()), groups.dp_group, cfg.parallel.bucket_mb)

    config_dict = dataclasses.asdict(cfg)
    checkpointer = Checkpointer(
        root=Path(cfg.checkpoint.dir).expanduser() if cfg.checkpoint.dir else run_dir / "checkpoints",
        every=cfg.checkpoint.every,
        keep_last=cfg.checkpoint.keep_last,
        resume=cfg.checkpoint.resume,
        groups=groups,
        model=model,
        optimizer=optimizer,
        config=config_dict,
        tokenizer=dataset.tokenizer_path,
    )

    def make_logger(start_step: int) -> MetricsLogger:
        return MetricsLogger(run_dir, cfg.train.steps, cfg.logging, cfg.wandb, config_dict, start_step)

    if groups.is_logging_rank:
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"trident: {cfg.model.name} ({n_params / 1e6:.2f}M params), world {topology.world_size} "
            f"(dp {topology.dp} x tp {topology.tp} x pp {topology.pp}), {backend} on {device.type}, "
            f"{len(train_data)} train windows, run dir {run_dir}",
            flush=True,
        )
        if peak is None:
            print(
                f"note: no peak TFLOP/s known for {torch.cuda.get_device_name(device)}; mfu is logged as null. "
                "Set logging.peak_tflops to its dense peak for MFU",
                flush=True,
            )
    Trainer(
        train_cfg=cfg.train,
        optim_cfg=cfg.optim,
        groups=groups,
        model=model,
        optimizer=optimizer,
        reducer=reducer,
        train_data=train_data,
        val_data=val_data,
        device=device,
        flops_per_token=flops_per_token(cfg.model),
        peak_flops=peak * 1e12 if peak else None,
        checkpointer=checkpointer,
        make_logger=make_logger,
    ).fit()
    reducer.remove_hooks()
    shutdown_distributed()


register_configs()


def fail(message: str, every_rank: bool = False) -> None:
    """Print ``error: message`` and exit 2. An error every rank reaches alike is printed once per node;
    one that only some ranks hit is printed by each of them, so it is never lost when the launcher
    kills the rest."""
    if every_rank or local_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    shutdown_distributed(barrier=False)
    sys.exit(2)


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    try:
        cfg = to_config(hydra_cfg)
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except TridentError as e:
        fail(str(e), every_rank=not e.agreed)
    except OSError as e:  # a full disk, a directory that cannot be written: the environment, not a bug
        fail(f"{e}; free space or point the path at a writable directory", every_rank=True)


def cli() -> None:
    """Hydra's own errors (an unknown preset, a value of the wrong type, an unwritable hydra.run.dir) end
    the same way as ours. Hydra prints them over several lines unless HYDRA_FULL_ERROR=1 makes it raise;
    a user who set that themselves gets the full traceback."""
    wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    # Hydra's branch comes first: its MissingConfigException (an unknown preset) is an IOError too.
    try:
        main()
    except (HydraException, OmegaConfBaseException) as e:
        if wants_traceback:
            raise
        cause = e.__cause__
        detail = f"\n{str(cause).splitlines()[0]}" if isinstance(cause, OmegaConfBaseException) else ""
        # Hydra appends its search path to a missing-preset message: noise for the user.
        fail(one_line(str(e).split("Config search path:")[0] + detail))
    except OSError as e:  # main() handles its own, so this is Hydra making the run directory
        if wants_traceback:
            raise
        fail(f"cannot create the run directory: {e}; set hydra.run.dir to a writable directory")


if __name__ == "__main__":
    cli()
