"""A run's profiled steps (``<run dir>/step_profile``, written by trident/step_profile.py) split into what the
planner's step-time model separates, each rank's by its device (a CPU's by its host's ops, trident_dev/plan/
breakdown.py; a GPU's by the device's timeline, trident_dev/plan/device_split.py), and the ranks' averaged."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from trident.step_profile import Event
from trident_dev.plan.breakdown import CATEGORIES, split_step, with_core_wait
from trident_dev.plan.device_split import split_device_step


def read_splits(directory: Path) -> list[dict]:
    """Every rank's ``{"step_s", "split"}`` from the profiled steps written under ``directory`` (``<run
    dir>/step_profile``, trident/step_profile.py): a CPU step split by its host's ops, less the wait for a core;
    a GPU step by the device's timeline (trident_dev/plan/device_split.py)."""
    out = []
    for path in sorted(directory.glob("rank*.json")):
        try:
            d = json.loads(path.read_text())
        except ValueError:
            continue
        events = [Event(*e) for e in d["events"]]
        if d["cuda"]:
            split = split_device_step(events, d["data_s"])
        else:
            split = split_step(events, d["data_s"])
            if d["waited_s"] is not None:
                split = with_core_wait(split, d["waited_s"])
        out.append({"step_s": d["step_s"], "split": split})
    return out


def mean_split(splits: Sequence[dict], step_s: float | None = None) -> dict[str, float] | None:
    """The ranks' mean seconds of each category; with ``step_s`` (the run's median step, not profiled) scaled so
    that they sum to it (the profiled step is one step, and the profiler's own cost is in it)."""
    if not splits:
        return None
    mean = {k: sum(s["split"].get(k, 0.0) for s in splits) / len(splits) for k in CATEGORIES}
    total = sum(mean.values())
    if step_s is not None and total > 0:
        mean = {k: v * step_s / total for k, v in mean.items()}
    return mean
