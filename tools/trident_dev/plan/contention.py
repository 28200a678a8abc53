"""Other work on the machine while a calibration measures it, and whether a calibration still describes the machine.

A calibration times small kernels and collectives on shared cores: another process keeping a core busy stretches
every timing, and a plan priced from them ranks layouts by the other job's load. ``OtherLoad`` samples, while the
calibration runs, the cores the machine keeps busy (``/proc/stat``) minus those this process and its descendants
(the calibration's ranks) use (``/proc/PID/stat``), every ``interval`` seconds; the median over the samples is the
other work's share, robust to the one sample in which a rank exited with its time unaccounted. A calibration
whose others kept more than ``BUSY_CORES`` busy is contended: the planner says so and does not cache it
(trident_dev/plan/calibrate.py), unless told to accept it; then the plan's first lines say it was contended.

A cached calibration carries its ``Conditions`` (trident/plan/conditions.py: when it was taken, the others' load
then, and ``MAX_AGE_S``); ``contended`` and ``describe_conditions`` read them here, where the load is sampled.

On a system without ``/proc`` nothing is sampled and the load is unknown (None): never called contended.
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from pathlib import Path

from trident.plan.conditions import Conditions
from trident.plan.profile import Profile

PROC = Path("/proc")
INTERVAL_S = 0.5  # a sample costs ~4 ms of this process (a walk of /proc): 1% of a core
BUSY_CORES = 0.25  # the others' median load, in cores, above which a calibration is contended


def _busy_jiffies() -> int:
    """Clock ticks every CPU of the machine has spent busy since boot (user, nice, system, irq, softirq, steal)."""
    fields = (PROC / "stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return user + nice + system + irq + softirq + steal


def _processes() -> dict[int, tuple[int, int]]:
    """Every process: pid -> (parent pid, clock ticks of CPU it has used, all its threads)."""
    out: dict[int, tuple[int, int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            text = (entry / "stat").read_text()
        except OSError:  # gone since listed
            continue
        rest = text[text.rfind(")") + 2 :].split()  # after "pid (comm) ": state ppid ... utime stime (fields 14, 15)
        out[int(entry.name)] = (int(rest[1]), int(rest[11]) + int(rest[12]))
    return out


def _tree(processes: dict[int, tuple[int, int]], root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in processes.items():
        children.setdefault(parent, []).append(pid)
    mine, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in mine:
            mine.add(pid)
            todo.extend(children.get(pid, ()))
    return mine


class OtherLoad:
    """A context manager sampling, in a thread of its own, the cores processes outside this one's tree keep busy.
    ``cores()`` is the median over the samples taken (None without ``/proc``, or before the first interval)."""

    def __init__(self, interval: float = INTERVAL_S, root: int | None = None) -> None:
        self.interval = interval
        self.root = root if root is not None else os.getpid()
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _read(self) -> tuple[float, int, dict[int, int]] | None:
        try:
            processes = _processes()
            total = _busy_jiffies()
        except (OSError, ValueError, IndexError):
            return None
        mine = _tree(processes, self.root)
        return time.monotonic(), total, {pid: processes[pid][1] for pid in mine if pid in processes}

    def _run(self) -> None:
        last = self._read()
        while last is not None and not self._stop.wait(self.interval):
            now = self._read()
            if now is None:
                return
            seconds = now[0] - last[0]
            # Ours: each process of the tree now, less what it had used at the last sample (0 if it is new).
            ours = sum(ticks - last[2].get(pid, 0) for pid, ticks in now[2].items())
            others = (now[1] - last[1] - ours) / self._tick / seconds
            self.samples.append(max(0.0, others))
            last = now

    def __enter__(self) -> OtherLoad:
        if (PROC / "stat").is_file():
            self._thread = threading.Thread(target=self._run, name="trident-other-load", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def cores(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None

    def conditions(self) -> Conditions:
        return Conditions(taken_at=time.time(), others_cores=self.cores(), cores=os.cpu_count() or 1)


def contended(conditions: Conditions) -> bool:
    """Whether other processes kept more than ``BUSY_CORES`` busy while the calibration measured."""
    return conditions.others_cores is not None and conditions.others_cores > BUSY_CORES


def describe_conditions(conditions: Conditions, now: float | None = None) -> str:
    """E.g. ``taken 12 min ago, other processes busy on 0.02 of 2 cores meanwhile``."""
    age = max(0.0, (now if now is not None else time.time()) - conditions.taken_at)
    when = (
        f"{age / 60:.0f} min"
        if age < 2 * 3600
        else f"{age / 3600:.0f} h"
        if age < 2 * 86400
        else f"{age / 86400:.0f} days"
    )
    if conditions.others_cores is None:
        load = "the machine's other load not observable (no /proc)"
    else:
        load = f"other processes busy on {conditions.others_cores:.2f} of {conditions.cores} cores meanwhile"
        if contended(conditions):
            load += f" (contended: above {BUSY_CORES})"
    return f"taken {when} ago, {load}"


def describe_profile(profile: Profile) -> str:
    """The figures a plan is priced with: a datasheet's, or a calibration's and the conditions it was taken in."""
    what = f"{profile.name} [{profile.source}]"
    return what if profile.conditions is None else f"{what}, {describe_conditions(profile.conditions)}"
