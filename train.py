"""Pretrain a GPT.

    python train.py [overrides]                                        # one process
    torchrun --nproc-per-node 8 train.py parallel.tp=2 parallel.pp=4   # 8 ranks

The build story: config -> checks -> data -> process groups -> this rank's parts (model chunks, optimizer,
runner: trident/build.py) -> checkpointer -> the loop. With ``checkpoint.init_from`` the model's shape comes from
that source (``main``) and its weights fill the chunks before the optimizer is built (trident/checkpoint/init_from.py).
Everything that can be wrong with the config or the data is found before the first collective, so a bad run never
hangs. ``run`` is the whole run in this process (config in, per-step metrics out); tests and tools call it directly.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Sequence
from pathlib import Path

import hydra
import torch.distributed as dist
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from trident import cli
from trident.build import build_checkpointer, build_parts
from trident.checkpoint.init_from import adopt_init_from, check_init_from, load_init_weights
from trident.config import Config, register_configs, to_config, validate
from trident.data.mixture import open_training_data
from trident.data.vocab import adopt_data_vocab
from trident.device import pick_backend, pick_device, set_cpu_threads, use_tensor_cores
from trident.launcher import launcher_pid, stop_when_orphaned
from trident.loop import RunServices, Trainer
from trident.memory.activations import activation_sets
from trident.memory.estimate import estimate
from trident.memory.measure import log_model_states
from trident.metrics import MetricsLogger, announce_run
from trident.optim import optimizer_summary
from trident.parallel.groups import (
    build_process_groups,
    init_distributed,
    launch_rank,
    launch_world_size,
    shutdown_distributed,
)
from trident.parallel.heartbeat import watch_peers
from trident.parallel.topology import Topology
from trident.peak import device_peak_tflops
from trident.plan.auto import choose as choose_layout
from trident.rundir import claim_run_dir
from trident.signals import StopRequest
from trident.step_profile import step_profiler


def run(cfg: Config, run_dir: Path, given: Sequence[str] = ()) -> list[dict]:
    """Train as ``cfg`` says; return every step's metrics row. Joins the default process group if one exists
    (a test's), else creates it and destroys it at the end. Raises ``Stopped`` after SIGTERM / SIGINT (the last
    completed step saved) and ``DivergenceError`` when losses or gradients stop being finite, on every rank.
    ``given``: the command line's overrides, whose layout keys ``parallel.auto`` keeps."""
    owns_group = not dist.is_initialized()
    with contextlib.ExitStack() as cleanup:
        stop = cleanup.enter_context(StopRequest(cfg.train.stop_grace_s))
        if (launcher := launcher_pid()) is not None:  # under torchrun: no training on, orphaned, if it dies
            cleanup.callback(stop_when_orphaned(launcher, launch_rank()).set)
        # Checks and data need no process group: a problem ends every rank the same way, before any collective.
        world = launch_world_size() if owns_group else dist.get_world_size()
        if cfg.parallel.auto:  # every rank plans alike (trident/plan/auto.py), before anything depends on the layout
            cfg, line = choose_layout(cfg, world, given)
            if (dist.get_rank() if not owns_group else launch_rank()) == 0:
                print(line, flush=True)
        tr, layout = cfg.train, validate(cfg, world)
        init_from = check_init_from(cfg, run_dir)  # None when resuming this run's own checkpoint
        topology = Topology(dp=layout.dp, pp=layout.pp, tp=layout.tp, cp=layout.cp, ep=layout.ep)
        device = pick_device(tr.device)
        use_tensor_cores(device)
        eval_batches = tr.eval_batches if tr.eval_every else None
        # One dataset, or data.mix's sources (trident/data/mixture.py), split into training and validation windows.
        data = open_training_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len, tr.global_batch_size, eval_batches)
        if owns_group and device.type == "cpu":
            set_cpu_threads()
        peak = device_peak_tflops(device, tr.precision, cfg.logging.peak_tflops)  # on the threads set just above

        init_distributed(pick_backend(cfg.parallel.backend, device), device, cfg.parallel.timeout_s)
        cleanup.enter_context(watch_peers())  # a collective failing on a dead or stuck rank names it
        groups = build_process_groups(topology, cfg.parallel.timeout_s)
        run_dir, checkpoint_root = claim_run_dir(run_dir, cfg.checkpoint.dir, cleanup)

        timings = run_dir / "pipeline_timings" if cfg.logging.pipeline_timings else None
        load = (lambda chunks: load_init_weights(chunks, init_from)) if init_from else None
        parts = build_parts(cfg, layout, groups, device, timings, load)
        if init_from is not None and groups.is_logging_rank:
            print(f"initialised from the {init_from.what} {init_from.path} (step 0, fresh optimizer)", flush=True)
        cleanup.callback(parts.optimizer.remove_hooks)
        checkpointer = build_checkpointer(cfg, groups, parts, checkpoint_root, data.tokenizer_path)
        if groups.is_logging_rank:
            announce_run(cfg, topology, parts.chunks, device, len(data.train), run_dir, peak)
            for line in optimizer_summary(cfg.model, cfg.optim):  # optim.name=muon: what each parameter gets
                print(line, flush=True)
        # memory.json: each rank's model-state bytes beside the prediction made before launch, which the logging
        # rank alone writes and so alone makes, for the run's own recomputation (tools/estimate_memory.py prices the
        # others): its activations are traced, a trace per policy (gpt-tiny: ~0.3 s of a core for one, ~1 s for all).
        predicted = estimate(cfg.model, layout, policies=()).to_dict() if groups.is_logging_rank else None
        # memory.json: the most activation sets this rank held in its first step, beside the schedule walk's count.
        sets = activation_sets(layout, groups.pp_rank, cfg.model)
        config_dict = dataclasses.asdict(cfg)
        profiler = None
        if cfg.logging.profile_step:
            profiler = step_profiler(
                cfg.logging.profile_step, run_dir / "step_profile", groups.rank, device.type == "cuda"
            )
        services = RunServices(
            checkpointer=checkpointer,
            make_logger=lambda start: MetricsLogger(run_dir, tr.steps, cfg.logging, cfg.wandb, config_dict, start),
            stop=stop,
            peak_flops=peak * 1e12 if peak else None,
            after_first_step=lambda: log_model_states(
                parts.optimizer.step,
                groups,
                run_dir,
                {"estimate": predicted} if predicted is not None else None,
                {"activation_sets": {"measured": parts.runner.peak_activation_sets, "predicted": sets}},
            ),
            profiler=profiler,
        )
        trainer = Trainer(cfg, groups, parts, data.pair, services, eos_id=data.eos_id)
        history = trainer.fit()
    if owns_group:
        shutdown_distributed()
    return history


register_configs()
CONF_DIR = Path(__file__).resolve().parent / "conf"


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(hydra_cfg: DictConfig) -> None:
    with cli.user_errors():
        hydra = HydraConfig.get()
        run_dir = Path(hydra.runtime.output_dir)
        # checkpoint.init_from: the model keys not on the command line take the source's values.
        cfg = adopt_init_from(to_config(hydra_cfg), hydra.overrides.task, CONF_DIR, run_dir)
        # model.vocab_size left out: the data's tokenizer's (trident/data/vocab.py).
        cfg, line = adopt_data_vocab(cfg, hydra.overrides.task)
        if line is not None and launch_rank() == 0:
            print(line, flush=True)
        run(cfg, run_dir, hydra.overrides.task)


if __name__ == "__main__":
    cli.launch(main)
