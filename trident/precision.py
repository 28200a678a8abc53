"""Mixed precision: autocast for the compute dtype with fp32 parameters (the master weights), and a
dynamic loss scaler for fp16, whose narrow exponent range would otherwise underflow small gradients."""

from __future__ import annotations

import contextlib

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=COMPUTE_DTYPES[precision])


class LossScaler:
    """Multiply the loss by ``scale``; on overflow skip the step and halve it, after
    ``growth_interval`` clean steps double it (the policy of torch.amp.GradScaler and Megatron)."""

    def __init__(self, init_scale: float = 2.0**16, growth_interval: int = 1000, min_scale: float = 1.0) -> None:
        self.scale = init_scale
        self.growth_interval = growth_interval
        self.min_scale = min_scale
        self.clean_steps = 0

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale = max(self.min_scale, self.scale / 2)
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.scale *= 2
            self.clean_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "clean_steps": self.clean_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.clean_steps = int(state["clean_steps"])
