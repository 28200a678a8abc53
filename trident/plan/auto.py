"""``parallel.auto=true``: train.py launches the planner's best layout for the world it was given.

Every rank plans alone, before any process group exists, so the plan has to come out the same on each: it uses
only what every rank reads alike: the datasheet of a known GPU, or on a CPU this machine's cached calibration
(``tools/plan.py --calibrate``) and, without one, a nominal CPU profile (the ranking then rests on FLOPs and bytes
alone). Nothing is measured here. Layout keys given on the command line with ``parallel.auto=true`` stay as given:
the plan only chooses among the layouts that have them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from trident.config import Config
from trident.errors import ConfigError
from trident.layout import with_keys
from trident.memory.measure import format_bytes
from trident.plan.machine import local_device, provisional
from trident.plan.planner import Plan, Prediction, given_keys, placement_for, plan
from trident.plan.profile import DATASHEETS, Profile, load_cached
from trident.plan.report import launch_overrides
from trident.plan.shared import digest, once_per_node


def auto_profile(cfg: Config, world: int) -> Profile:
    """The profile every rank of a launch reads alike (module docstring)."""
    device = "cpu" if cfg.train.device == "cpu" else local_device()
    if device in DATASHEETS:
        return DATASHEETS[device]
    guess = provisional(device)
    placement = placement_for(guess, world)
    cached = load_cached(guess.device, placement.ranks_per_node, placement.threads)
    if cached is not None:
        return cached
    if device == "cuda":
        raise ConfigError(
            f"parallel.auto=true: no profile of this GPU; run `python tools/plan.py --world {world} --calibrate` once "
            "to measure it, or set the layout keys yourself"
        )
    return dataclasses.replace(guess, name="cpu (nominal)", source="not calibrated: FLOPs and bytes at nominal rates")


def choose(cfg: Config, world: int, given: Iterable[str] = ()) -> tuple[Config, str]:
    """The config with the planner's best layout for ``world`` ranks that keeps the ``given`` overrides' layout keys,
    and the one line that says which and why. Raises ConfigError when no layout fits. The ranks of a node plan
    once between them (trident/plan/shared.py)."""
    profile = auto_profile(cfg, world)
    keys = given_keys(given)
    key = digest(cfg, world, sorted(keys.items()), profile.to_dict())
    answer = once_per_node(key, lambda: _choose(cfg, world, keys, profile))
    if "error" in answer:
        raise ConfigError(answer["error"])
    return with_keys(cfg, answer["keys"]), answer["line"]


def _choose(cfg: Config, world: int, keys: dict[str, str], profile: Profile) -> dict:
    """``choose``'s answer as JSON: the best layout's keys and its line, or the refusal's line."""
    try:
        best, count = _best(cfg, world, keys, profile)
    except ConfigError as e:
        return {"error": str(e)}
    fixed = f" with {' '.join(f'{k}={v}' for k, v in keys.items())}" if keys else ""
    launch = " ".join(launch_overrides(best, cfg)) or "the layout as configured"
    line = (
        f"parallel.auto: {best.label}, the best of {count} layouts{fixed} for {world} ranks by the planner on "
        f"{profile.name}: {best.tokens_per_s:,.0f} tokens/s and {format_bytes(sum(best.peak.values()))} per rank "
        f"predicted ({launch})"
    )
    return {"keys": best.layout.keys(), "line": line}


def _best(cfg: Config, world: int, keys: dict[str, str], profile: Profile) -> tuple[Prediction, int]:
    """The best of the layouts with the given keys, and how many of them were examined (accepted by the validator).
    Only those are planned, and only as far as their best needs (``plan``'s ``top``); the whole space only to say
    why none fits."""
    result: Plan = plan(cfg, world, profile, keep=keys, top=1)  # ranks only the layouts that have the keys
    if result.ranked:
        return result.ranked[0], result.examined
    result = plan(cfg, world, profile, top=1) if keys else result
    reasons = {line for _, line in result.refused}
    if not result.examined and len(reasons) == 1:
        raise ConfigError(reasons.pop())  # the model or batch itself is wrong, whatever the layout
    head = f"parallel.auto=true: no layout of {world} ranks"
    if not result.examined:
        example = min(reasons, key=len) if reasons else "none to try"
        why = f"is accepted for {cfg.model.name} with a global batch of {cfg.train.global_batch_size} ({example})"
    elif not result.ranked:
        why = f"fits {cfg.model.name} in {format_bytes(profile.usable_fraction * profile.memory_bytes)}"
    else:
        why = f"has {' '.join(f'{k}={v}' for k, v in keys.items())} (others fit)"
    raise ConfigError(f"{head} {why}; launch another number of processes or change the batch or the given keys")
