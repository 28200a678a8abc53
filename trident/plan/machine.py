"""Which device a plan is for, and the provisional profile that lists what a plan of it needs measured.

A known GPU plans on its datasheet (trident/plan/profile.py); a CPU or an unknown GPU on a calibration of this
machine, which a checkout's tools take (trident_dev/plan/machine.py ``profile_for``, tools/plan.py --calibrate) and
cache, and which ``parallel.auto`` reads (trident/plan/auto.py).
"""

from __future__ import annotations

import os

from trident.plan.profile import DATASHEETS, Profile, host_memory_bytes


def local_device() -> str:
    """``cpu``, or the datasheet name of this machine's GPU (an unknown GPU is measured: ``cuda``)."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name().lower()
    return next((key for key in DATASHEETS if key in name), "cuda")


def provisional(device: str) -> Profile:
    """A profile whose rates are placeholders, for listing what a plan needs measured (the list depends on the
    layouts and their memory fit, not on the rates)."""
    if device in DATASHEETS:
        return DATASHEETS[device]
    if device == "cuda":
        import torch  # noqa: PLC0415

        memory = torch.cuda.get_device_properties(0).total_memory
        return Profile("cuda", "cuda", "provisional", memory, torch.cuda.device_count(), peak_tflops={"fp32": 1.0})
    peaks = {"fp32": 0.1, "bf16": 0.1, "fp16": 0.1}
    return Profile("cpu", "cpu", "provisional", host_memory_bytes(), os.cpu_count() or 1, peak_tflops=peaks)
