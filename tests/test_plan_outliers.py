"""A calibration's matmul timings that contradict each other (trident_dev/plan/outliers.py): a shape timed slower than
one at least as large in every dimension is timed again, and keeps its fastest timing."""

from __future__ import annotations

import dataclasses

import torch

from tests.test_plan import cpu_profile
from trident.plan.profile import Needs, matmul_key
from trident_dev.plan import calibrate, outliers

SMALL, LARGE, OTHER = ("fp32", 128, 768, 256, "nt"), ("fp32", 128, 1024, 256, "nt"), ("fp32", 64, 64, 64, "nn")


def test_a_shape_slower_than_one_that_contains_it_is_contradicted() -> None:
    times = {SMALL: 7.7e-3, LARGE: 4.9e-4, OTHER: 1e-5}
    assert outliers.contradicted(times) == [SMALL]
    assert outliers.contradicted({**times, SMALL: 3.6e-4}) == []
    # Not contained (m larger), or another precision: no contradiction.
    assert outliers.contradicted({("fp32", 256, 768, 256, "nt"): 7.7e-3, LARGE: 4.9e-4}) == []
    assert outliers.contradicted({("bf16", 128, 768, 256, "nt"): 7.7e-3, LARGE: 4.9e-4}) == []
    # Within the factor a layout may cost: kept.
    assert outliers.contradicted({SMALL: 1.9 * 4.9e-4, LARGE: 4.9e-4}) == []


def test_a_contradicted_shape_is_retimed_and_keeps_its_fastest_timing() -> None:
    times = {SMALL: 7.7e-3, LARGE: 4.9e-4}
    again = iter([6e-3, 3.6e-4])
    timed: list[tuple] = []

    def time_one(shape: tuple) -> float:
        timed.append(shape)
        return next(again)

    changed = outliers.retime(times, time_one)
    assert timed == [SMALL, SMALL] and changed == {SMALL: (7.7e-3, 3.6e-4)} and times[SMALL] == 3.6e-4
    # A shape that really is that slow is timed RETRIES times more, and keeps what it measured.
    times = {SMALL: 7.7e-3, LARGE: 4.9e-4}
    changed = outliers.retime(times, lambda shape: 8e-3)
    assert changed == {SMALL: (7.7e-3, 7.7e-3)} and times[SMALL] == 7.7e-3


def test_a_calibration_retimes_a_matmul_its_sitting_timed_slow_and_says_so(monkeypatch) -> None:
    """measure_compute with real matmuls, of which the first timing of one shape comes out twenty times slow (as a
    sitting on a shared VM once did): the profile keeps its retimed figure, below the larger shape's, and the log
    names it."""
    real = calibrate.time_matmul
    slowed: list[tuple] = []

    def time_matmul(precision: str, m: int, n: int, k: int, layout: str, device: torch.device) -> float:
        seconds = real(precision, m, n, k, layout, device)
        if (precision, m, n, k, layout) == SMALL and not slowed:
            slowed.append(SMALL)
            return 20 * seconds
        return seconds

    monkeypatch.setattr(calibrate, "time_matmul", time_matmul)
    profile = dataclasses.replace(cpu_profile(), matmuls={})
    lines: list[str] = []
    calibrate.measure_compute(profile, Needs(matmuls={SMALL, LARGE}), torch.device("cpu"), lines.append)
    assert slowed == [SMALL]
    assert profile.matmuls[matmul_key(*SMALL)] <= outliers.FACTOR * profile.matmuls[matmul_key(*LARGE)]
    assert any(matmul_key(*SMALL) in line and "retimed" in line for line in lines)
