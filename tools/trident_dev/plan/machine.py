"""Which profile a plan uses: a known GPU's datasheet, or this machine measured (trident_dev/plan/calibrate.py).

A CPU has no datasheet worth the name, so a plan for one always uses a calibration: the cached one, with whatever
the plan needs that it lacks measured now (a first plan on a machine measures for one to two minutes, a held-out
run of train.py included; the next ones read the cache), or with ``fresh`` everything measured again. A GPU plan
uses the datasheet of ``device`` (h100, h200, a100; by default the GPU this machine has) unless ``fresh`` asks to
measure this GPU instead. A checkout's tools (tools/plan.py, tools/plot_schedule.py) calibrate; ``parallel.auto``
reads a cached calibration or the datasheet (trident/plan/auto.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from pathlib import Path

from trident.config import Config
from trident.errors import ConfigError
from trident.plan.machine import local_device, provisional
from trident.plan.profile import DATASHEETS, DEFAULT_CACHE, Needs, Profile
from trident_dev.plan import residual
from trident_dev.plan.contention import contended

DEVICES = ("cpu", *DATASHEETS)  # what a plan may be for: this machine's CPU or a datasheet


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
    also runs the held-out layout that scales the model (trident_dev/plan/residual.py)."""
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
    from trident_dev.plan.calibrate import calibrate, save_cached  # noqa: PLC0415 (torch.distributed, only when measuring)

    repo = None
    if held_out is not None and device == "cpu":
        needs.run, repo = residual.held_out(cfg, world, held_out[0]), held_out[1]
    if fresh:
        profile = calibrate(needs, placement.ranks_per_node, cache=None, log=log, accept_busy=accept_busy, repo=repo)
        if accept_busy or profile.conditions is None or not contended(profile.conditions):
            with contextlib.suppress(OSError):
                save_cached(profile, DEFAULT_CACHE)
        return profile
    return calibrate(needs, placement.ranks_per_node, log=log, accept_busy=accept_busy, repo=repo)
