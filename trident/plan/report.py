"""The overrides that launch a planned layout (``parallel.auto``'s line, tools/plan.py's table and command)."""

from __future__ import annotations

from trident.config import Config
from trident.layout import config_keys, override_value
from trident.plan.planner import Prediction


def launch_overrides(p: Prediction, base: Config) -> list[str]:
    """The overrides that turn ``base`` (the config the plan was made for) into this layout: only the keys that
    differ (dp always follows from the world size)."""
    theirs = config_keys(base)
    mine = {key: override_value(value) for key, value in p.layout.keys().items()}
    out = [f"{k}={v}" for k, v in mine.items() if v != theirs[k] and k != "parallel.dp"]
    if base.parallel.dp is not None:
        out.insert(0, "parallel.dp=null")
    return out
