"""The step-time model checked against one real run of a layout no plan scores, and scaled by what it missed.

Every rate a calibration measures is a micro-benchmark (trident/plan/probes.py); what a whole training step adds
beyond them (the element-wise kernels' real mix, the data loader, hooks, the allocator, how the scheduler shares
the cores over a whole step) is not in any of them: on a 2-core Xeon it priced every plain layout 7-15% short.
So a calibration for a plan (tools/plan.py) also runs train.py once on a *held-out* layout and keeps the ratio of
its measured step to the model's prediction (``Profile.residual``), by which cost.py scales every step.

The held-out layout is plain data parallelism (dp = the world, no tp, cp, pipeline, ZeRO or recomputation) at the
plan's micro-batch, but at a global batch of one micro-batch per rank (two where that is the plan's own batch):
no layout of the plan has that batch, so no layout ``--measure`` scores is the one the model was scaled on.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

from trident.config import Config
from trident.plan.profile import Profile

# One residual per cached calibration: a plan of another config (its held-out run differs) measures and replaces it.

STEPS, WARMUP = 5, 2  # the held-out run's timed steps and the first ones not counted (start-up, allocator growth)
LAYOUT = {
    "parallel.tp": 1,
    "parallel.pp": 1,
    "parallel.vpp": 1,
    "parallel.cp": 1,
    "parallel.ep": 1,
    "parallel.zero": 0,
    "parallel.schedule": "null",
    "parallel.offload.optimizer": "none",
    "parallel.sequence_parallel": "false",
    "train.activation_checkpointing": "none",
}


def _quiet(line: str) -> None:
    pass


def held_out(cfg: Config, world: int, overrides: list[str]) -> dict:
    """The held-out run for a plan of ``cfg`` (made from ``overrides``) on ``world`` ranks: its train.py overrides
    and world (module docstring)."""
    mbs = cfg.train.micro_batch_size
    batch = world * mbs * (2 if world * mbs == cfg.train.global_batch_size else 1)
    layout = {**LAYOUT, "parallel.dp": world, "train.micro_batch_size": mbs, "train.global_batch_size": batch}
    return {"overrides": [*overrides, *(f"{k}={v}" for k, v in layout.items())], "world": world}


def measure_residual(profile: Profile, run: dict, repo: Path, log: Callable[[str], None]) -> float:
    """The held-out ``run``'s measured step over the model's prediction of it with ``profile`` unscaled (1.0 when
    the run is refused or fails: said in ``log``)."""
    from trident.plan import measure  # noqa: PLC0415 (the planner imports the profile this fills)
    from trident.plan.planner import predict  # noqa: PLC0415
    from trident.tool_config import load_config  # noqa: PLC0415

    cfg = load_config(repo / "conf", run["overrides"])
    prediction = predict(cfg, run["world"], dataclasses.replace(profile, residual=1.0))
    with tempfile.TemporaryDirectory(prefix="trident-calibrate-") as root:
        overrides, world = run["overrides"], run["world"]
        (m,) = measure.measure(
            [prediction], overrides, world, repo, Path(root), STEPS, WARMUP, log=_quiet, profiled=False
        )
    if m.step_s is None or m.predicted_step_s is None:
        log(f"calibrating: the held-out run {prediction.label} gave no step ({m.error}): the model is not scaled")
        return 1.0
    residual = m.step_s / m.predicted_step_s
    log(
        f"calibrating: held-out run {prediction.label}, global batch {cfg.train.global_batch_size}: step "
        f"{m.step_s:.3f} s measured, {m.predicted_step_s:.3f} s modelled: every step is scaled by {residual:.3f}"
    )
    return residual
