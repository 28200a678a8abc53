"""One profiled step of a rank (``logging.profile_step``): torch's profiler around it, and ``<run
dir>/step_profile/rank<r>.json`` holding its events (``Event``: name, thread, start and end in seconds, where it ran,
a GPU's correlation ids), the step's seconds, the wait for its batches and, on a CPU, the main thread's wait for a
core meanwhile. ``tools/plan.py --measure`` splits them into what the planner's step-time model separates
(trident_dev/plan/breakdown.py). train.py gives the Trainer ``step_profiler``'s callable."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

STEP_MARK = "trident.step"  # record_function around the profiled step
PASSES_MARK = "trident.passes"  # around the forward and backward passes of the step (trident/loop.py)
ANNOTATIONS = ("trident.", "ProfilerStep", "Optimizer.")  # record_function spans (a GPU's copies of them too)


@dataclass(frozen=True)
class Event:
    """One profiler event: ``name``, the ``thread`` it ran on, its ``start`` and ``end`` in seconds; on a GPU also
    where it ran (``device``: cpu or cuda), the profiler's correlation id (``corr``: a host op's own; a kernel's,
    which its launch shares) and, of a kernel or a CUDA runtime call (the launch), the id of the host op it is for
    (``link``)."""

    name: str
    thread: int
    start: float
    end: float
    device: str = "cpu"
    corr: int = 0
    link: int = 0


def run_queue_s() -> float | None:
    """Seconds the calling thread has waited for a core since it started (None: not reported here)."""
    import threading  # noqa: PLC0415

    try:
        fields = Path(f"/proc/self/task/{threading.get_native_id()}/schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


def profile_events(prof: object) -> list[Event]:
    """A finished ``torch.profiler.profile``'s events (times in seconds). On a GPU also each kernel's own correlation
    id (``corr``, which its launch shares) and the host op's it is for (``link``), read from the profiler's raw
    events where torch's events do not carry it (torch before 2.12); the device's copies of ``record_function``
    spans are left out (they are no kernels)."""
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    links: dict[tuple, int] = {}
    for k in raw.events() if raw is not None else ():
        device = k.device_type().name != "CPU"
        links[(k.correlation_id(), device, None if device else k.name())] = k.linked_correlation_id()
    out = []
    for e in prof.events():  # type: ignore[attr-defined]
        device = e.device_type.name != "CPU"
        if device and (getattr(e, "is_user_annotation", False) or e.name.startswith(ANNOTATIONS)):
            continue
        link = getattr(e, "linked_correlation_id", None)
        if link is None:
            link = links.get((e.id, device, None if device else e.name), 0)
        where = "cuda" if device else "cpu"
        out.append(Event(e.name, e.thread, e.time_range.start / 1e6, e.time_range.end / 1e6, where, e.id, link or 0))
    return out


class StepProfile:
    """Profiles one step of a rank (``start`` before it, ``finish`` after) and writes its events to ``path``."""

    def __init__(self, path: Path, cuda: bool = False) -> None:
        from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415

        self.path, self.cuda = path, cuda
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        self._prof = profile(activities=activities)
        self._mark = record_function(STEP_MARK)

    def start(self) -> None:
        self._prof.__enter__()
        self._queued = run_queue_s()
        self._mark.__enter__()

    def finish(self, data_s: float) -> None:
        if self.cuda:  # the step's kernels inside its mark: a GPU runs behind the host that launches them
            import torch  # noqa: PLC0415

            torch.cuda.synchronize()
        self._mark.__exit__(None, None, None)
        queued = run_queue_s()
        self._prof.__exit__(None, None, None)
        events = profile_events(self._prof)
        step = next(e for e in events if e.name == STEP_MARK)
        waited = queued - self._queued if queued is not None and self._queued is not None else None
        out = {"step_s": step.end - step.start, "data_s": data_s, "waited_s": waited, "cuda": self.cuda}
        out["events"] = [dataclasses.astuple(e) for e in events]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(out) + "\n")


def step_profiler(step: int, directory: Path, rank: int, cuda: bool) -> Callable[[int], StepProfile | None]:
    """What the Trainer calls before each step (0-based): at ``step`` (1-based) a started ``StepProfile`` writing
    this rank's events under ``directory``, else None."""

    def at(index: int) -> StepProfile | None:
        if index + 1 != step:
            return None
        profiler = StepProfile(directory / f"rank{rank}.json", cuda)
        profiler.start()
        return profiler

    return at
