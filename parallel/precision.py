"""Mixed precision: the policy of which dtype parameters, activations and gradient reductions use, and a
dynamic loss scaler for fp16, whose narrow exponent range would otherwise underflow small gradients.

bf16 and fp16 keep the model's parameters in 16 bits (so are its activations, and every parameter all-gather),
with the fp32 master weights in the optimizer (parallel/zero/), and gradients accumulated and reduced in fp32 in
the reducer's buffer. Autocast stays on around the forward: matmuls already run in the parameters' dtype, and the
ops torch keeps in fp32 under autocast (softmax, norms, losses) keep their range. fp32 is plain fp32.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class PrecisionPolicy:
    param_dtype: torch.dtype  # the model's parameters as they live and are all-gathered
    compute_dtype: torch.dtype  # activations
    reduce_dtype: torch.dtype  # gradient accumulation and reduction

    @property
    def loss_scaling(self) -> bool:
        return self.param_dtype == torch.float16


def precision_policy(precision: str) -> PrecisionPolicy:
    """``train.precision`` as a policy: parameters and activations in it, gradients reduced in fp32."""
    dtype = COMPUTE_DTYPES[precision]
    return PrecisionPolicy(param_dtype=dtype, compute_dtype=dtype, reduce_dtype=torch.float32)


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
