"""The step-time model checked against real runs of layouts no plan scores: the framework's work no op is, fitted to
runs of the model's tiny twin, and one scale for what the whole model's run still missed.

Every rate a calibration measures is a micro-benchmark (trident_dev/plan/probes.py); what a whole training step adds
beyond them (the element-wise kernels' real mix, the data loader, hooks, the allocator, how the scheduler shares
the cores over a whole step) is not in any of them: on a 2-core Xeon it priced every plain layout 7-15% short.
So a calibration for a plan (tools/plan.py) also runs train.py once on a *held-out* layout and keeps the ratio of
its measured step to the model's prediction (``Profile.residual``), by which cost.py scales every step.

The held-out layout is plain data parallelism (dp = the world, no tp, cp, pipeline, ZeRO or recomputation) at the
plan's micro-batch, but at a global batch of one micro-batch per rank (two where that is the plan's own batch):
no layout of the plan has that batch, so no layout ``--measure`` scores is the one the model was scaled on.

Some work is no op at all: torch's split of the autograd graph around each action of zb's split backward, the
cp attention's bookkeeping (the ring's quarters and merges, masks) and its waits on a peer, selective
checkpointing's dispatch mode (a Python policy on every op of a checkpointed layer's forward and recomputation).
On a 2-core Xeon with 8 ranks it is most of the step of a layout of many small passes (micro-batch 1, interleaved
chunks), which the model had priced at half the measured step. So a calibration first runs the plan's model's tiny
twin (trident_dev/plan/tiny.py: its kernels cost next to nothing) in small layouts that each add one such kind of work
(``tiny_runs``: a zb-h1 pipeline, cp over two ranks by each parallel.cp_comm, full and selective recomputation, the
cp ring under selective recomputation) and keeps the seconds per action, pass, layer or op (or the fraction) with
which the model gives each run's measured step (``measure_overheads``). The twin is no model a plan ranks. Its runs
add about 15 s each to a calibration at world 8 here (seven of them). On one such calibration the tiny twin's
selective recomputation measured 0.49 s a step against 0.30 s modelled without its dispatch mode (83 us per op),
its full recomputation 0.31 s; at cp 4 on the ring, 0.76 s against 0.55 s with that mode's per op alone (cp's
bookkeeping 1.4 times more).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable
from pathlib import Path

from trident.config import Config
from trident.parallel.context.attention import CP_COMMS
from trident.plan.profile import Profile
from trident_dev.plan import tiny

# One residual per cached calibration: a plan of another config (its held-out run differs) measures and replaces it.

STEPS, WARMUP = 5, 2  # the held-out run's timed steps and the first ones not counted (start-up, allocator growth)
TINY_MICRO = 8  # micro-batches per replica of the tiny twin's runs
LARGEST = 100.0  # the most an overhead is fitted to (seconds; ``selective:cp``: times cp's bookkeeping)
TINY_STEPS, TINY_WARMUP = 12, 4  # its steps are a fraction of a second: more of them, for a steadier median
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
    """The held-out runs for a plan of ``cfg`` (made from ``overrides``) on ``world`` ranks: the data-parallel one's
    train.py overrides and world, and under ``tiny`` the tiny twin's runs (``tiny_runs``) (module docstring)."""
    mbs = cfg.train.micro_batch_size
    batch = world * mbs * (2 if world * mbs == cfg.train.global_batch_size else 1)
    layout = {**LAYOUT, "parallel.dp": world, "train.micro_batch_size": mbs, "train.global_batch_size": batch}
    return {
        "overrides": [*overrides, *(f"{k}={v}" for k, v in layout.items())],
        "world": world,
        "tiny": tiny_runs(cfg, world, overrides),
    }


def tiny_runs(cfg: Config, world: int, overrides: list[str]) -> dict[str, dict]:
    """The tiny twin of ``cfg``'s model in each layout that adds one kind of work beyond the ops (module
    docstring), by the overhead it measures (``Profile.overheads``' keys): its train.py overrides and world; two
    ranks of the layout's kind (pipeline stages, or cp), the rest of ``world`` data parallel (all of it for
    recomputation), ``TINY_MICRO`` micro-batches of one sequence per replica (of two ranks: none where ``world`` is
    odd)."""
    everyone = {
        **LAYOUT,
        "parallel.dp": world,
        "train.micro_batch_size": 1,
        "train.global_batch_size": world * TINY_MICRO,
    }
    layouts = {
        "recompute": {**everyone, "train.activation_checkpointing": "full"},
        "selective": {**everyone, "train.activation_checkpointing": "selective"},
    }
    if world % 2 == 0:
        dp = world // 2
        pairs = {**everyone, "parallel.dp": dp, "train.global_batch_size": dp * TINY_MICRO}
        layouts |= {f"cp:{kind}": {**pairs, "parallel.cp": 2, "parallel.cp_comm": kind} for kind in CP_COMMS}
        layouts["selective:cp"] = {**layouts["cp:ring"], "train.activation_checkpointing": "selective"}
        if cfg.model.n_layers >= 2:
            layouts["split"] = {**pairs, "parallel.pp": 2, "parallel.schedule": "zb-h1"}
    model = tiny.overrides(dataclasses.asdict(cfg.model))
    return {
        name: {"overrides": [*overrides, *model, *(f"{k}={v}" for k, v in layout.items())], "world": world}
        for name, layout in layouts.items()
    }


def with_overhead(profile: Profile, name: str, seconds: float) -> Profile:
    """``profile`` with the overhead ``name`` (``tiny_runs``' names, ``Profile.overheads``' keys) at ``seconds``."""
    return dataclasses.replace(profile, overheads={**profile.overheads, name: seconds})


def measure_overheads(profile: Profile, runs: dict[str, dict], repo: Path, log: Callable[[str], None]) -> Profile:
    """``profile`` with each overhead of ``runs`` (``tiny_runs``) at the seconds with which the model (``profile``
    unscaled) gives the step its run measures (0 where it already gives as much, or the run fails: said in
    ``log``)."""
    from trident.plan.planner import predict  # noqa: PLC0415 (the planner imports the profile this fills)
    from trident_dev.tool_config import load_config  # noqa: PLC0415

    base = dataclasses.replace(profile, residual=1.0)
    for name, run in runs.items():
        cfg = load_config(repo / "conf", run["overrides"])
        base = with_overhead(base, name, 0.0)
        measured, label = _measured_step(cfg, run, base, repo)
        if measured is None:
            log(f"calibrating: the tiny twin's {label} gave no step: its {name} overhead is not measured")
            continue

        step = _step_of(cfg, run["world"], base, name, predict)
        seconds = _fit(step, measured)
        what = {
            "split": "split backward action",
            "recompute": "layer recomputed",
            "selective": "op under selective checkpointing",
            "cp:ring": "ring quarter",
        }.get(name, "cp pass")
        said = f"{1e3 * seconds:.2f} ms of a rank's compute per {what}"
        if name == "selective:cp":  # a fraction, not seconds
            said = f"cp's bookkeeping takes {seconds:.2f} times more under selective checkpointing"
        log(
            f"calibrating: the tiny twin's {label}: step {measured:.3f} s measured, {step(0.0):.3f} s modelled from "
            f"its ops: {said}"
        )
        base = with_overhead(base, name, seconds)
    return dataclasses.replace(base, residual=profile.residual)


def _step_of(cfg: Config, world: int, profile: Profile, name: str, predict: Callable) -> Callable[[float], float]:
    """The model's step of ``cfg`` on ``world`` ranks with the overhead ``name`` at the seconds given."""
    return lambda seconds: predict(cfg, world, with_overhead(profile, name, seconds)).time.step


def _fit(step: Callable[[float], float], measured: float) -> float:
    """The seconds (at least 0, at most about ``LARGEST``) at which ``step``, growing with them, gives
    ``measured``: bisected."""
    low, high = 0.0, 1e-3
    if step(low) >= measured:
        return 0.0
    while step(high) < measured and high < LARGEST:
        low, high = high, 2 * high
    for _ in range(30):
        mid = (low + high) / 2
        low, high = (mid, high) if step(mid) < measured else (low, mid)
    return low


def _measured(cfg: Config, run: dict, profile: Profile, repo: Path, steps: int, warmup: int) -> tuple:
    """(the measure.Measurement of a run of ``run`` for ``steps`` steps, the median after ``warmup``; the model's
    prediction of it with ``profile``)."""
    from trident.plan.planner import predict  # noqa: PLC0415
    from trident_dev.plan import measure  # noqa: PLC0415

    prediction = predict(cfg, run["world"], profile)
    with tempfile.TemporaryDirectory(prefix="trident-calibrate-") as root:
        (m,) = measure.measure(
            [prediction], run["overrides"], run["world"], repo, Path(root), steps, warmup, log=_quiet, profiled=False
        )
    return m, prediction


def _measured_step(cfg: Config, run: dict, profile: Profile, repo: Path) -> tuple[float | None, str]:
    """The median step of a run of the tiny twin's ``run`` and its layout's label (None: it failed or was
    refused)."""
    m, prediction = _measured(cfg, run, profile, repo, TINY_STEPS, TINY_WARMUP)
    return m.step_s, prediction.label


def measure_residual(profile: Profile, run: dict, repo: Path, log: Callable[[str], None]) -> float:
    """The held-out ``run``'s measured step over the model's prediction of it with ``profile`` unscaled (1.0 when
    the run is refused or fails: said in ``log``)."""
    from trident_dev.tool_config import load_config  # noqa: PLC0415 (the planner imports the profile this fills)

    cfg = load_config(repo / "conf", run["overrides"])
    m, prediction = _measured(cfg, run, dataclasses.replace(profile, residual=1.0), repo, STEPS, WARMUP)
    if m.step_s is None or m.predicted_step_s is None:
        log(f"calibrating: the held-out run {prediction.label} gave no step ({m.error}): the model is not scaled")
        return 1.0
    residual = m.step_s / m.predicted_step_s
    log(
        f"calibrating: held-out run {prediction.label}, global batch {cfg.train.global_batch_size}: step "
        f"{m.step_s:.3f} s measured, {m.predicted_step_s:.3f} s modelled: every step is scaled by {residual:.3f}"
    )
    return residual
