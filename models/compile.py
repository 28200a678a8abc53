"""``train.compile`` as an applier: each transformer block's forward compiled with ``torch.compile``; ``auto`` (the
default) compiles on CUDA, where inductor's fused kernels pay (docs/benchmarks.md: 1.16-1.73x a plain loop on one
H200), and stays eager on a CPU, where compiling costs tens of seconds of C++ a run for little (``compiles``).

Only the blocks: they are the same code ``n_layers`` times, so one compilation serves them all (dynamo treats
the block as an input, not a constant), while the embedding, the head and the vocab-parallel loss stay eager.
The compiled forward is set on the block instance, so no wrapper module appears and parameter names (and with
them checkpoints) do not change.

Apply it *before* activation checkpointing: ``full`` and ``selective`` then checkpoint the compiled block (selective's
contexts keep and replay the same outputs as in an eager block), and ``attention`` leaves the recomputed attention
core as an eager island inside it (dynamo cannot trace a checkpoint whose ``context_fn`` restores the RNG tracker's
micro-batch). Each dropout runs eagerly (an island: its layer and kind are ints dynamo would specialize on, one
recompilation per layer), so its masks, and their replay in recomputation, are the eager ones; inductor's
``fallback_random`` would keep any other random op as eager draws it.
"""

from __future__ import annotations

import os
import shutil

import torch
from torch import nn

from trident.errors import ConfigError
from trident.parallel.random import Dropout


def compiles(setting: str | bool, device: torch.device) -> bool:
    """Whether ``train.compile`` compiles the blocks on ``device``: ``auto`` on CUDA only."""
    value = str(setting).lower()
    return device.type == "cuda" if value == "auto" else value == "true"


def check_toolchain(device: torch.device) -> None:
    """On a CPU, inductor compiles C++: without a compiler the first step would fail deep inside torch."""
    cxx = os.environ.get("CXX") or "g++"
    if device.type == "cpu" and shutil.which(cxx) is None:
        raise ConfigError(
            f"train.compile=true on a CPU needs a C++ compiler for torch.compile ({cxx} is not on PATH); "
            "install one (or set CXX), or use train.compile=false"
        )


def compile_blocks(model: nn.Module, device: torch.device, retains_graph: bool = False) -> None:
    """Compile the forward of every block in ``model.layers`` (a model chunk: all layers, or a pipeline stage's).
    ``retains_graph``: backward runs in passes over a retained graph (zb-h1's and zb-v's I then W), which a compiled
    backward that donates its saved buffers refuses ("non-empty donated buffers requires ... retain_graph=False"):
    AOTAutograd's buffer donation is then turned off for the process (a run's: it holds one model)."""
    check_toolchain(device)
    if retains_graph:
        import torch._functorch.config as functorch_config

        functorch_config.donated_buffer = False
    for module in model.modules():  # the module docstring's eager dropouts (compiled, their frame recompiled for
        # every (layer, kind) pair: 8 C++ builds and then the cache limit at 8 layers). Marked here, on this run's
        # modules, not with a decorator, which would import dynamo into every process that imports the model.
        if isinstance(module, Dropout) and "forward" not in vars(module):
            module.forward = torch.compiler.disable(module.forward)
    for block in model.layers.values():
        block.forward = torch.compile(block.forward, options={"fallback_random": True})
