"""What a calibration was taken under (when, and the other work on the machine meanwhile), and whether it still
describes the machine: a cached calibration older than ``MAX_AGE_S`` is measured again, and one taken while other
processes kept more than ``BUSY_CORES`` busy is contended (trident_dev/plan/contention.py samples that load). The
machine, thread count and torch version are in the cache key (trident/plan/profile.py ``cache_key``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

BUSY_CORES = 0.25  # the others' median load, in cores, above which a calibration is contended
MAX_AGE_S = 7 * 24 * 3600.0  # a cached calibration older than this is taken again


@dataclass(frozen=True)
class Conditions:
    """What a calibration was taken under: ``taken_at`` (seconds since the epoch), the median cores other
    processes kept busy meanwhile (None: not observable here) of the machine's ``cores``."""

    taken_at: float
    others_cores: float | None
    cores: int

    @property
    def contended(self) -> bool:
        return self.others_cores is not None and self.others_cores > BUSY_CORES

    def stale(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) - self.taken_at > MAX_AGE_S

    def describe(self, now: float | None = None) -> str:
        """E.g. ``taken 12 min ago, other processes busy on 0.02 of 2 cores meanwhile``."""
        age = max(0.0, (now if now is not None else time.time()) - self.taken_at)
        when = (
            f"{age / 60:.0f} min"
            if age < 2 * 3600
            else f"{age / 3600:.0f} h"
            if age < 2 * 86400
            else f"{age / 86400:.0f} days"
        )
        if self.others_cores is None:
            load = "the machine's other load not observable (no /proc)"
        else:
            load = f"other processes busy on {self.others_cores:.2f} of {self.cores} cores meanwhile"
            if self.contended:
                load += f" (contended: above {BUSY_CORES})"
        return f"taken {when} ago, {load}"
