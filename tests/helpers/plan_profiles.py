"""A hand-built CPU profile for the planner's tests: round rates, no calibration."""

from __future__ import annotations

from trident.plan.profile import Profile


def hand_built_cpu() -> Profile:
    """Two cores, 24 GB, 0.1 TFLOP/s; every other rate the Profile defaults."""
    return Profile(
        name="test cpu",
        device="cpu",
        source="hand-built",
        memory_bytes=24e9,
        units_per_node=2,
        peak_tflops={"fp32": 0.1, "bf16": 0.1},
    )
