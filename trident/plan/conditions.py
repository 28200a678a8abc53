"""When a calibration was taken and the other work on the machine meanwhile, and whether it still describes the
machine: a cached calibration older than ``MAX_AGE_S`` is measured again. The others' load is sampled, and a
calibration taken under too much of it called contended, by trident_dev/plan/contention.py. The machine, thread
count and torch version are in the cache key (trident/plan/profile.py ``cache_key``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

MAX_AGE_S = 7 * 24 * 3600.0  # a cached calibration older than this is taken again


@dataclass(frozen=True)
class Conditions:
    """What a calibration was taken under: ``taken_at`` (seconds since the epoch), the median cores other
    processes kept busy meanwhile (None: not observable here) of the machine's ``cores``."""

    taken_at: float
    others_cores: float | None
    cores: int

    def stale(self, now: float | None = None) -> bool:
        return (now if now is not None else time.time()) - self.taken_at > MAX_AGE_S
