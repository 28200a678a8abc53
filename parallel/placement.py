"""What each parameter is, as data: its logical (one-process) shape, the dim split across the tensor-parallel
group, the padding of that dim, the parameter it is tied to, and which sums its gradient needs beyond dp.

Init, checkpoints, the gradient norm, ZeRO, the gradient sums and export read this one description; none of
them guesses from parameter names or local shapes.

Gradient sums after the data-parallel reduction (``grad_sums``, read by parallel/grad_sums.py):

    "tp"          a parameter every tp rank holds whole under sequence parallelism (LayerNorms, row-parallel
                  biases, wpe): each rank's backward saw only its own tokens, so its gradient is a partial sum
    "embedding"   one of the two copies of the tied embedding when the first and last pipeline stage are on
                  different ranks (``wte.weight`` there, ``lm_head.weight`` here): both take the summed gradient

A split parameter is padded along ``split_dim`` to ``padded`` (the embedding's vocab rows, rounded up so
they split evenly and matmuls stay aligned) and tp rank r holds the contiguous block
``[r*k, (r+1)*k)`` of the padded tensor, k = padded / tp_size. Only the part below the logical size is real:
that is what a checkpoint saves, at its global offset, so a checkpoint never depends on tp or on padding.

    wte.weight, logical [600, 64], split_dim 0, padded 640, tp 2:
        tp rank 0 holds rows [0, 320)   all real
        tp rank 1 holds rows [320, 640) real rows [320, 600), then 40 zero padding rows

Expert weights (``ep_size`` > 1, models/moe.py) are split along dim 0, the expert dim of their stacked rows, over
the expert-parallel group instead: ep rank r holds the contiguous block ``[r*k, (r+1)*k)``, k = rows / ep_size,
whole on every tp rank (no ``split_dim``). Their gradients reduce over the expert-data-parallel group, not dp.

    experts.up, logical [8 * 32, 64] (8 experts of 32 rows), ep 2:
        ep rank 0 holds rows [0, 128)     experts 0-3
        ep rank 1 holds rows [128, 256)   experts 4-7
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

GRAD_SUMS = ("tp", "embedding")


@dataclass(frozen=True)
class Placement:
    shape: tuple[int, ...]  # the logical (one-process, unpadded) shape
    split_dim: int | None = None  # the tensor dim split over the tp group; None: each tp rank holds all of it
    tp_rank: int = 0
    tp_size: int = 1
    padded: int | None = None  # size of split_dim after padding; None: no padding
    tied_to: str | None = None  # canonical name of the parameter this one is a copy of (same values)
    grad_sums: tuple[str, ...] = ()  # groups its gradient is summed over after the dp reduction: "tp", "embedding"
    ep_rank: int = 0
    ep_size: int = 1  # > 1: dim 0 split in ep_size equal blocks over the expert-parallel group (expert weights)

    def __post_init__(self) -> None:
        unknown = set(self.grad_sums) - set(GRAD_SUMS)
        if unknown:
            raise ValueError(f"unknown gradient sums {sorted(unknown)}; known: {', '.join(GRAD_SUMS)}")
        if self.ep_size > 1 and (self.split_dim is not None or self.shape[0] % self.ep_size):
            raise ValueError(f"an expert split needs dim 0 of {self.shape} divisible by {self.ep_size}, no tp split")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {self.ep_rank} is outside ep_size {self.ep_size}")
        if self.split_dim is None:
            if self.padded is not None:
                raise ValueError("padding needs a split_dim")
            return
        if not 0 <= self.split_dim < len(self.shape):
            raise ValueError(f"split_dim {self.split_dim} is not a dim of {self.shape}")
        if self.padded_size < self.shape[self.split_dim] or self.padded_size % self.tp_size:
            raise ValueError(
                f"dim {self.split_dim} of {self.shape} padded to {self.padded_size} does not split over {self.tp_size}"
            )
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")

    @property
    def padded_size(self) -> int:
        assert self.split_dim is not None
        return self.padded if self.padded is not None else self.shape[self.split_dim]

    @property
    def block(self) -> int:
        """Length of this rank's block along split_dim, padding included."""
        return self.padded_size // self.tp_size

    @property
    def expert_split(self) -> bool:
        """Split over the expert-parallel group: its gradient reduces over the expert-data-parallel group."""
        return self.ep_size > 1

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.expert_split:
            return (self.shape[0] // self.ep_size, *self.shape[1:])
        if self.split_dim is None:
            return self.shape
        return tuple(self.block if d == self.split_dim else n for d, n in enumerate(self.shape))

    @property
    def offsets(self) -> tuple[int, ...]:
        """Where this rank's block starts in the logical tensor."""
        if self.expert_split:
            return (self.ep_rank * self.local_shape[0], *(0,) * (len(self.shape) - 1))
        return tuple(self.tp_rank * self.block if d == self.split_dim else 0 for d in range(len(self.shape)))

    @property
    def real(self) -> int:
        """How many of this rank's rows along split_dim are real (the rest is padding)."""
        assert self.split_dim is not None
        start = self.tp_rank * self.block
        return max(0, min(self.block, self.shape[self.split_dim] - start))

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """Shape of the real part of this rank's block: what a checkpoint saves at ``offsets``."""
        if self.split_dim is None:
            return self.local_shape
        return tuple(self.real if d == self.split_dim else n for d, n in enumerate(self.shape))

    @property
    def replicated_over_tp(self) -> bool:
        """Every tp rank holds the same values (a LayerNorm gain, a row-parallel bias)."""
        return self.split_dim is None or self.tp_size == 1

    def real_part(self, local: torch.Tensor) -> torch.Tensor:
        """A view of the real (unpadded) part of this rank's local tensor."""
        self._check_local(local)
        if self.split_dim is None:
            return local
        return local.narrow(self.split_dim, 0, self.real)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's local tensor cut from the logical one-process tensor (padding rows are zero)."""
        if tuple(full.shape) != self.shape:
            raise ValueError(f"expected the logical shape {self.shape}, got {tuple(full.shape)}")
        if self.expert_split:
            return full.narrow(0, self.offsets[0], self.local_shape[0]).clone()
        if self.split_dim is None:
            return full.clone()
        local = torch.zeros(self.local_shape, dtype=full.dtype, device=full.device)
        # A rank past the logical end (all padding) copies nothing; narrow still wants a start inside the tensor.
        start = min(self.tp_rank * self.block, self.shape[self.split_dim])
        self.real_part(local).copy_(full.narrow(self.split_dim, start, self.real))
        return local

    def _check_local(self, local: torch.Tensor) -> None:
        if tuple(local.shape) != self.local_shape:
            raise ValueError(f"a local tensor of {self} has shape {self.local_shape}, got {tuple(local.shape)}")


def set_placement(param: nn.Parameter, placement: Placement) -> nn.Parameter:
    if tuple(param.shape) != placement.local_shape:
        raise ValueError(f"parameter of shape {tuple(param.shape)} does not match {placement}")
    param.placement = placement
    return param


def placement_of(param: torch.Tensor) -> Placement:
    """A parameter's placement; every parameter of a trident model has one, so a missing one is a bug."""
    placement = getattr(param, "placement", None)
    if placement is None:
        raise AttributeError(f"parameter of shape {tuple(param.shape)} has no placement; set one with set_placement")
    return placement


def is_expert(param: nn.Parameter) -> bool:
    """An expert weight split over the ep group: its gradient and ZeRO shards live on the expert-dp group."""
    placement = getattr(param, "placement", None)
    return placement is not None and placement.expert_split


def replicated(param: nn.Parameter) -> nn.Parameter:
    """A parameter every tp rank holds whole."""
    return set_placement(param, Placement(tuple(param.shape)))


def add_grad_sum(param: nn.Parameter, group: str) -> nn.Parameter:
    """Mark ``param``'s gradient as one to sum over ``group`` ("tp" or "embedding") after the dp reduction."""
    placement = placement_of(param)
    if group not in placement.grad_sums:
        set_placement(param, dataclasses.replace(placement, grad_sums=(*placement.grad_sums, group)))
    return param
