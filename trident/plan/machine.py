"""Which profile a plan uses: a known GPU's datasheet, or this machine measured (trident/plan/calibrate.py).

A CPU has no datasheet worth the name, so a plan for one always uses a calibration: the cached one, with whatever
the plan needs that it lacks measured now (a first plan on a machine measures for one to two minutes, a held-out
run of train.py included; the next ones read the cache), or with ``fresh`` everything measured again. A GPU plan
uses the datasheet of ``device`` (h100, h200, a100; by default the GPU this machine has) unless ``fresh`` asks to
measure this GPU instead.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path

from trident.config import Config
from trident.errors import ConfigError
from trident.plan import residual
from trident.plan.profile import DATASHEETS, DEFAULT_CACHE, Needs, Profile, host_memory_bytes, save_cached

DEVICES = ("cpu", *DATASHEETS)


def local_device() -> str:
    """``cpu``, or the datasheet name of this machine's GPU (an unknown GPU is measured: ``cuda``)."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((key for key in DATASHEETS if key in name), "cuda")


def provisional(device: str) -> Profile:
    """A profile whose rates are placeholders, for listing what a plan needs measured (the list depends on the
    layouts and their memory fit, not on the rates)."""
    if device in DATASHEETS:
        return DATASHEETS[device]
    if device == "cuda":
        import torch  # noqa: PLC0415

        memory = torch.cuda.get_device_properties(0).total_memory
        return Profile("cuda", "cuda", "provisional", memory, torch.cuda.device_count(), peak_tflops={"fp32": 1.0})
    peaks = {"fp32": 0.1, "bf16": 0.1, "fp16": 0.1}
    return Profile("cpu", "cpu", "provisional", host_memory_bytes(), os.cpu_count() or 1, peak_tflops=peaks)


def profile_for(
    cfg: Config,
    world: int,
    device: str | None = None,
    nodes: int | None = None,
    fresh: bool = False,
    log: Callable[[str], None] = print,
    one_layout: bool = False,
    progress: Callable[[int, int, float], None] | None = None,
    accept_busy: bool = False,
    held_out: tuple[list[str], Path] | None = None,
) -> Profile:
    """The profile to plan ``cfg`` on ``world`` ranks of ``device`` with (module docstring). A calibration measures
    what the planner needs for every layout of ``cfg``, or with ``one_layout`` (tools/plot_schedule.py --plan) only
    what the prediction of ``cfg``'s own layout needs; that layout refused by train.py raises its ConfigError.
    ``progress`` is the planner's (trident/plan/planner.py ``plan``) while it lists what a calibration measures;
    ``accept_busy``: cache a calibration taken while other processes kept the machine busy (plan/calibrate.py).
    ``held_out``: (the overrides ``cfg`` was made from, the repository whose train.py runs them): a CPU calibration
    also runs the held-out layout that scales the model (trident/plan/residual.py)."""
    from trident.plan.planner import placement_for, plan, predict  # noqa: PLC0415 (the planner imports this module's users)

    device = device or local_device()
    if device not in (*DEVICES, "cuda"):
        raise ConfigError(f"--device {device} is not known; use one of {', '.join(DEVICES)}")
    if device in DATASHEETS and not fresh:
        return dataclasses.replace(DATASHEETS[device])
    if device in DATASHEETS and local_device() != device:
        raise ConfigError(f"--calibrate measures this machine, which has no {device.upper()}; plan with its datasheet")
    guess = provisional(device)
    placement = placement_for(guess, world, nodes)
    if one_layout:
        needs = Needs(precisions={cfg.train.precision})
        predict(cfg, world, guess, nodes, needs=needs)  # lists what the prediction prices into ``needs``
    else:
        needs = plan(cfg, world, guess, nodes, progress=progress).needs
    from trident.plan.calibrate import calibrate  # noqa: PLC0415 (torch.distributed, only when measuring)

    repo = None
    if held_out is not None and device == "cpu":
        needs.run, repo = residual.held_out(cfg, world, held_out[0]), held_out[1]
    if fresh:
        profile = calibrate(needs, placement.ranks_per_node, cache=None, log=log, accept_busy=accept_busy, repo=repo)
        if accept_busy or profile.conditions is None or not profile.conditions.contended:
            with contextlib.suppress(OSError):
                save_cached(profile, DEFAULT_CACHE)
        return profile
    return calibrate(needs, placement.ranks_per_node, log=log, accept_busy=accept_busy, repo=repo)
