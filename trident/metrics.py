"""Per-step metrics: ``metrics.jsonl``, a console line per interval, and wandb, all from one rank.

Beside the contract's keys a row carries ``data_ms`` (how long the step waited for its batches: the loader's cost on
the critical path), ``data_read_ms`` (how long reading them took, mostly hidden behind the step before), ``data_share``
(``data_ms`` over the step's time), with a mixture of experts ``moe/aux_loss``, ``moe/load/<layer>`` (max over mean
tokens per expert), ``moe/z_loss`` and ``moe/dropped`` (models/moe.py ``step_stats``), and with ``data.mix``
``tokens/<source>`` (training tokens each source gave so far) and, at evaluations, ``val_loss/<source>``
(``val_loss`` is then their mean weighted by the mixture's weights).
"""

from __future__ import annotations

import json
import math
import resource
import secrets
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from trident.config import Config, LoggingConfig, WandbConfig
from trident.errors import TridentError
from trident.parallel.topology import Topology


def announce_run(
    cfg: Config,
    topology: Topology,
    model_chunks: list[nn.Module],
    device: torch.device,
    train_windows: int,
    run_dir: Path,
    peak_tflops: float | None,
) -> None:
    """The logging rank's opening line, and a note when MFU cannot be computed."""
    n_params = sum(p.numel() for chunk in model_chunks for p in chunk.parameters())
    print(
        f"trident: {cfg.model.name} ({n_params / 1e6:.2f}M params on this rank), world {topology.world_size} "
        f"(dp {topology.dp}{f' x cp {topology.cp}' if topology.cp > 1 else ''} x tp {topology.tp} x pp {topology.pp}), "
        f"{dist.get_backend()} on {device.type}, "
        f"{train_windows} train windows, run dir {run_dir}",
        flush=True,
    )
    if peak_tflops is None:
        print(
            f"note: no peak TFLOP/s known for {torch.cuda.get_device_name(device)}; mfu is logged as null. "
            "Set logging.peak_tflops to its dense peak for MFU",
            flush=True,
        )


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # Linux reports ru_maxrss in KiB: the peak resident size of this process.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def summary_line(
    first_step: int,
    last_step: int,
    wall_s: float,
    tokens: int,
    loss: float | None,
    val_loss: float | None,
    checkpoint: Path | None,
) -> str:
    """The last line of a run: what it did, how fast, where it ended and where its checkpoint is."""
    steps = f"{last_step} steps" if first_step == 0 else f"steps {first_step + 1}-{last_step}"
    parts = [
        f"done: {steps} in {format_duration(wall_s)}",
        f"{tokens / max(wall_s, 1e-9):,.0f} tok/s",
        f"loss {loss:.4f}" if loss is not None else "loss n/a",
        f"val {val_loss:.4f}" if val_loss is not None else "val n/a",
        f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint",
    ]
    return " | ".join(parts)


# The wandb run id lives in the run directory, so a resumed run continues the same wandb run.
WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run_dir: Path, resuming: bool, new_id: str) -> str:
    """The id of this run's wandb run: the one kept in ``run_dir`` when resuming, else ``new_id`` (kept there)."""
    path = run_dir / WANDB_ID_FILE
    if resuming and path.is_file():
        kept = path.read_text().strip()
        if kept:
            return kept
    path.write_text(new_id + "\n")
    return new_id


def _step_of(line: str) -> int | None:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None  # e.g. the half-written last line of a crashed run


def trim_metrics(path: Path, last_step: int) -> None:
    """On resume, rows past the checkpoint are about to be recomputed: keep a backup and drop them."""
    if not path.is_file():
        return
    rows = path.read_text().splitlines()
    keep = [r for r in rows if (step := _step_of(r)) is not None and step <= last_step]
    if len(keep) != len(rows):
        shutil.copyfile(path, path.with_name(f"{path.name}.{int(time.time())}.bak"))
        path.write_text("".join(r + "\n" for r in keep))


class MetricsLogger:
    """Only the logging rank constructs one of these (the others get ``None``)."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        logging_cfg: LoggingConfig,
        wandb_cfg: WandbConfig,
        config: dict,
        start_step: int = 0,
    ) -> None:
        run_dir.mkdir(parents=True, exist_ok=True)  # the logging rank may be on another node than rank 0
        self.path = run_dir / "metrics.jsonl"
        trim_metrics(self.path, start_step)
        self.file = open(self.path, "a")
        self.total_steps = total_steps
        self.interval = logging_cfg.interval
        self.start_step = start_step
        self.start_time = time.perf_counter()
        self.wandb = None
        if wandb_cfg.mode != "disabled":
            import wandb

            run_id = wandb_run_id(run_dir, start_step > 0, secrets.token_hex(4))
            try:
                self.wandb = wandb.init(
                    project=wandb_cfg.project,
                    name=wandb_cfg.name,
                    entity=wandb_cfg.entity,
                    mode=wandb_cfg.mode,
                    dir=str(run_dir),
                    config=config,
                    id=run_id,
                    resume="allow",
                    settings=wandb.Settings(console="off", quiet=True),
                )
            except Exception as e:  # wandb raises its own types (no network, bad key): one line for the user
                raise TridentError(
                    f"wandb.init failed in mode {wandb_cfg.mode}: {e}; use wandb.mode=offline or disabled"
                ) from e

    def log(self, row: dict) -> None:
        # JSON has no Infinity/NaN: a skipped fp16 step's norm is written as null so every parser reads the file.
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])
        step = row["step"]
        if step % self.interval == 0 or step == self.total_steps or step == self.start_step + 1 or "val_loss" in row:
            print(self.console_line(row), flush=True)

    def console_line(self, row: dict) -> str:
        step = row["step"]
        elapsed = time.perf_counter() - self.start_time
        done = step - self.start_step
        eta = elapsed / done * (self.total_steps - step) if done > 0 else 0.0
        parts = [
            f"step {step:>{len(str(self.total_steps))}}/{self.total_steps}",
            f"loss {row['loss']:.4f}",
        ]
        if "val_loss" in row:
            # A mixture's sources' own validation losses follow its weighted mean: "val 3.9 (web 4.1, code 3.2)".
            sources = [f"{k.split('/', 1)[1]} {v:.4f}" for k, v in row.items() if k.startswith("val_loss/")]
            parts.append(f"val {row['val_loss']:.4f}" + (f" ({', '.join(sources)})" if sources else ""))
        parts += [
            f"lr {row['lr']:.2e}",
            f"grad_norm {row['grad_norm']:.3f}",
            f"{row['tokens_per_s']:,.0f} tok/s",
            f"mfu {100 * row['mfu']:.2f}%" if row["mfu"] is not None else "mfu n/a",
            f"mem {row['peak_mem_mb']:,.0f} MB",
        ]
        if "loss_scale" in row:
            parts.append(f"scale {row['loss_scale']:g}")
        if "moe/aux_loss" in row:  # mixture of experts: the aux loss and the most loaded layer's load
            loads = [v for k, v in row.items() if k.startswith("moe/load/")]
            parts.append(f"aux {row['moe/aux_loss']:.4f} load {max(loads, default=0.0):.2f}")
            if "moe/dropped" in row:
                parts.append(f"dropped {100 * row['moe/dropped']:.1f}%")
        if row.get("data_share") is not None:
            parts.append(f"data {100 * row['data_share']:.1f}%")  # the step's wait for its batches
        parts.append(f"eta {format_duration(eta)}")
        return " | ".join(parts)

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
