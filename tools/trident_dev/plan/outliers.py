"""Matmul timings that contradict each other: a shape timed slower than one at least as large in every dimension.

A calibration times each matmul shape once, as the median of the runs that fit in a twentieth of a second
(trident_dev/plan/probes.py). On a shared VM a whole sitting can be slow: once, on a 2-core Xeon, ``[128, 256] @
[256, 768]`` came out at 7.7 ms, twenty times the 0.36 ms of the same shape in the next calibration and of
``[128, 256] @ [256, 1024]`` in the same one. Every layout at that micro-batch was then priced 40% over its run.

No kernel does less work slower: a product whose m, n and k are each at most another's, at the same precision,
should not take longer than it. A shape timed ``FACTOR`` times slower than one that contains it is retimed
(``retime``), and keeps the fastest of its timings: on one thread timed by its own CPU time, other load only ever
adds to a timing, so the least one is the kernel's.
"""

from __future__ import annotations

from collections.abc import Callable

FACTOR = 2.0  # how much slower than a shape that contains it a shape may be timed before it is retimed (layouts
# differ: a transposed operand can cost a small shape more than a larger shape's contiguous one, never 2x)
RETRIES = 2  # further timings of a suspect shape


Shape = tuple  # (precision, m, n, k, layout): calibrate's ``Needs.matmuls`` entries


def contradicted(times: dict[Shape, float], factor: float = FACTOR) -> list[Shape]:
    """The shapes of ``times`` timed more than ``factor`` times slower than another of the same precision whose m, n
    and k are each at least theirs, in ``times``' order."""
    out = []
    for shape, seconds in times.items():
        precision, m, n, k = shape[:4]
        for other, other_s in times.items():
            if other is shape or other[0] != precision:
                continue
            if other[1] >= m and other[2] >= n and other[3] >= k and seconds > factor * other_s:
                out.append(shape)
                break
    return out


def retime(
    times: dict[Shape, float], time_one: Callable[[Shape], float], retries: int = RETRIES
) -> dict[Shape, tuple[float, float]]:
    """Retime (``time_one``) each contradicted shape of ``times`` up to ``retries`` times, until it is no longer
    contradicted, keeping its fastest timing, in place. Returns the retimed shapes' (first, kept) seconds."""
    changed: dict[Shape, tuple[float, float]] = {}
    for _ in range(retries):
        suspects = contradicted(times)
        if not suspects:
            break
        for shape in suspects:
            first = changed.get(shape, (times[shape],))[0]
            times[shape] = min(times[shape], time_one(shape))
            changed[shape] = (first, times[shape])
    return changed
