"""What a rank puts into a checkpoint and takes back out: ``Sharded`` boxes of logical tensors under stable keys.

    model/<parameter name>              the parameter's logical tensor (one-process shape, padding never saved)
    optim/<parameter name>/<state>      AdamW's exp_avg and exp_avg_sq (laid out like the parameter), step (0-d)
    rng/dp<d>.pp<p>.tp<t>/cpu|cuda      the generator states of the rank at that layout coordinate

Parameter names are the canonical ``named_parameters()`` names, the same under every layout, and each parameter's
``Placement`` says which box of the logical tensor this rank holds. A tied copy (the last pipeline stage's LM
head, a copy of ``wte.weight``) is not saved: it loads from the tensor it is tied to.

The optimizer's part goes through ``OptimizerState``, so an optimizer that keeps its state another way (ZeRO's
flat fp32 shards owned per dp rank) supplies its own boxes and the checkpointer does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Protocol

import torch
from torch import nn

from trident.checkpoint.dcp import Sharded
from trident.checkpoint.zero_state import MasterState, MomentState
from trident.parallel.placement import placement_of
from trident.parallel.topology import Coord
from trident.parallel.zero.optimizer import ZeroOptimizer

MODEL, OPTIM, RNG = "model/", "optim/", "rng/"


def named_parameters(modules: Iterable[nn.Module]) -> dict[str, nn.Parameter]:
    """Every parameter of this rank's model chunks by canonical name (names are unique across chunks)."""
    params: dict[str, nn.Parameter] = {}
    for module in modules:
        for name, param in module.named_parameters():
            if name in params:
                raise ValueError(f"parameter {name} appears in two model chunks")
            params[name] = param
    return params


def _source(name: str, param: nn.Parameter) -> str:
    """The name a parameter is saved under: its own, or that of the parameter it is a tied copy of."""
    return placement_of(param).tied_to or name


def model_state(params: Mapping[str, nn.Parameter]) -> dict[str, Sharded]:
    """This rank's boxes of every parameter it holds (tied copies left out: their source is saved)."""
    return {
        MODEL + name: Sharded.of(p.detach(), placement_of(p))
        for name, p in params.items()
        if placement_of(p).tied_to is None
    }


def model_destinations(params: Mapping[str, nn.Parameter]) -> dict[str, Sharded]:
    """The boxes to load into: every parameter, a tied copy from its source's key."""
    state: dict[str, Sharded] = {}
    for name, p in params.items():
        wanted = Sharded.of(p.detach(), placement_of(p))
        # A rank holding a parameter and its tied copy asks for the same box twice; DCP fills both.
        state.setdefault(MODEL + _source(name, p), Sharded(wanted.shape)).boxes.extend(wanted.boxes)
    return state


class ModelState(Protocol):
    """How the model weights go into a checkpoint and come back (keys relative to ``model/``): the parameters
    by name (``ParamsByName``), or an optimizer's own fp32 masters (ZeRO: ``sharded_model_state(params)``), which
    are the weights to save when the parameters are 16-bit or sharded. Same keys and logical shapes either way."""

    def sharded_state(self) -> dict[str, Sharded]: ...

    def load_destinations(self, saved: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Sharded], Callable[[], None]]:
        """Boxes to fill, and a function that makes the loaded weights the model's once they are filled."""
        ...


class ParamsByName:
    """The parameters themselves, by name (``model_state`` / ``model_destinations``), loaded in place."""

    def __init__(self, params: Mapping[str, nn.Parameter]) -> None:
        self.params = params

    def sharded_state(self) -> dict[str, Sharded]:
        return {k[len(MODEL) :]: v for k, v in model_state(self.params).items()}

    def load_destinations(self, saved: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Sharded], Callable[[], None]]:
        return {k[len(MODEL) :]: v for k, v in model_destinations(self.params).items()}, lambda: None


def weights_state(optimizer: object, params: Mapping[str, nn.Parameter]) -> ModelState:
    """The optimizer's ``sharded_model_state(params)`` if it has one (ZeRO's masters), else the parameters."""
    return MasterState(optimizer, params) if isinstance(optimizer, ZeroOptimizer) else ParamsByName(params)


class OptimizerState(Protocol):
    """How an optimizer's state goes into a checkpoint and comes back (keys relative to ``optim/``).

    ``StateByName`` is the one for a plain AdamW. An optimizer that keeps its state another way (ZeRO: flat
    fp32 buffers, each dp rank owning a range) provides ``sharded_checkpoint_state(params)`` returning its own.
    Keeping the same keys (``<name>/exp_avg``, ...) and giving boxes of the same logical tensors (a contiguous
    range of a row-major tensor is a few boxes: a partial row, whole rows, a partial row) keeps checkpoints
    loadable with and without it.
    """

    def sharded_state(self) -> dict[str, Sharded]:
        """This rank's boxes of the optimizer state, views of the live tensors."""
        ...

    def load_destinations(self, saved: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Sharded], Callable[[], None]]:
        """Boxes to fill from the ``saved`` keys (with their logical shapes), created fresh so that an optimizer
        that has not stepped yet can load too, and a function that hands them to the optimizer once filled."""
        ...


def optimizer_state(optimizer: object, params: Mapping[str, nn.Parameter]) -> OptimizerState:
    """The optimizer's own ``sharded_checkpoint_state(params)`` if it has one (ZeRO), else AdamW state by name."""
    return MomentState(optimizer, params) if isinstance(optimizer, ZeroOptimizer) else StateByName(optimizer, params)


class StateByName:
    """Per-parameter optimizer state (AdamW's) keyed by parameter name: ``<name>/<state key>``.

    A state tensor shaped like its parameter is laid out by the parameter's placement; a 0-d one (``step``)
    is the same on every rank. Hyper-parameters are not saved: they come from this run's config.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Mapping[str, nn.Parameter]) -> None:
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if not stepped <= {id(p) for p in params.values()}:
            # Their state would silently be left out (e.g. fp32 master copies of 16-bit parameters).
            raise ValueError("the optimizer steps tensors that are not the model's parameters; give it its own state")
        self.optimizer, self.params = optimizer, params

    def sharded_state(self) -> dict[str, Sharded]:
        out: dict[str, Sharded] = {}
        for name, p in self.params.items():
            placement = placement_of(p)
            if placement.tied_to is not None:
                continue  # a tied copy steps exactly like its source, whose state is saved
            for key, value in self.optimizer.state.get(p, {}).items():
                if not torch.is_tensor(value):
                    raise TypeError(f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor")
                value = value.detach()
                out[f"{name}/{key}"] = Sharded.whole(value) if value.dim() == 0 else Sharded.of(value, placement)
        return out

    def load_destinations(self, saved: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Sharded], Callable[[], None]]:
        out: dict[str, Sharded] = {}
        state: dict[nn.Parameter, dict[str, torch.Tensor]] = {}
        for name, p in self.params.items():
            prefix = _source(name, p) + "/"
            for key in (k for k in saved if k.startswith(prefix)):
                kind = key[len(prefix) :]
                if saved[key] == ():
                    value = torch.zeros((), dtype=torch.float32)
                    wanted = Sharded.whole(value)
                else:
                    # Zeros: padding rows are never saved and must hold no state.
                    value = torch.zeros_like(p, memory_format=torch.contiguous_format)
                    wanted = Sharded.of(value, placement_of(p))
                state.setdefault(p, {})[kind] = value
                out.setdefault(key, Sharded(wanted.shape)).boxes.extend(wanted.boxes)
        return out, lambda: self._install(state)

    def _install(self, state: dict[nn.Parameter, dict[str, torch.Tensor]]) -> None:
        """Through ``load_state_dict``, which puts each tensor where this optimizer keeps it (``step`` on the
        device for fused and capturable kernels); the param groups' hyper-parameters stay this run's."""
        index = {p: i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        groups = [{**g, "params": [index[p] for p in g["params"]]} for g in self.optimizer.param_groups]
        self.optimizer.load_state_dict({"state": {index[p]: s for p, s in state.items()}, "param_groups": groups})


def rng_key(coord: Coord) -> str:
    return f"{RNG}dp{coord.dp}.pp{coord.pp}.tp{coord.tp}/"


def rng_state(coord: Coord) -> dict[str, Sharded]:
    """This rank's generator states, under its own layout coordinate (no other rank writes that key)."""
    state = {rng_key(coord) + "cpu": Sharded.whole(torch.get_rng_state())}
    if torch.cuda.is_available():
        state[rng_key(coord) + "cuda"] = Sharded.whole(torch.cuda.get_rng_state())
    return state


def rng_destinations(
    coord: Coord, saved: Mapping[str, tuple[int, ...]]
) -> tuple[dict[str, Sharded], Callable[[], None]]:
    """Boxes for this coordinate's saved generator states, and a function that restores them once filled."""
    cpu, cuda = rng_key(coord) + "cpu", rng_key(coord) + "cuda"
    out = {k: Sharded.whole(torch.empty(saved[k], dtype=torch.uint8)) for k in (cpu, cuda) if k in saved}

    def restore() -> None:
        if cpu in out:
            torch.set_rng_state(out[cpu].boxes[0][1])
        if cuda in out and torch.cuda.is_available():
            torch.cuda.set_rng_state(out[cuda].boxes[0][1])

    return out, restore
