"""Randomness under tensor parallelism: Megatron's model-parallel RNG tracker, and dropout drawing from it.

Where an activation is replicated over the tp group (the residual stream without sequence parallelism),
every tp rank must drop the same elements, or the copies diverge. Where each rank holds a different piece
(its attention heads, its sequence shard), the masks must differ, or the pieces are dropped in lockstep.
The default generator, seeded alike on every tp rank, is the replicated stream; the tracker keeps named
streams seeded per tp rank and swaps one into the default generator for the length of a ``fork``.

Recomputation must redraw the same masks. torch.utils.checkpoint restores the default generator before it
recomputes, but not the tracker's streams, which have moved on by then: ``checkpoint_contexts`` is the
``context_fn`` that puts them back as they were in the original forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

TENSOR_PARALLEL = "tensor-parallel"
# Megatron's offset: keeps the tp streams clear of the default stream's seed.
_TP_SEED_OFFSET = 2718
_PP_SEED_STRIDE = 100


def _default_generator(device: torch.device) -> torch.Generator:
    """The generator that random kernels on ``device`` draw from."""
    if device.type == "cpu":
        return torch.default_generator
    module = getattr(torch, device.type)  # torch.cuda and its peers share this interface
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class RNGTracker:
    """Named generator states for one device, each used through ``fork``."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG stream {name!r} already exists")
        gen = _default_generator(self.device)
        outer = gen.get_state()
        gen.manual_seed(seed)
        self.states[name] = gen.get_state()
        gen.set_state(outer)

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL) -> Iterator[None]:
        """Draw from stream ``name`` inside the block; the default generator is left as it was."""
        gen = _default_generator(self.device)
        outer = gen.get_state()
        gen.set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = gen.get_state()
            gen.set_state(outer)

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states)  # get_state() returns fresh tensors, so a shallow copy is a snapshot

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = dict(states)

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for torch.utils.checkpoint (use_reentrant=False). It is called as the original forward
        starts, so the streams are captured here and restored around the recomputation (each one: a split
        backward, as zero-bubble pipeline schedules run, recomputes once for the input and once for the weights)."""
        return contextlib.nullcontext(), _AsAt(self, self.get_states())


class _AsAt:
    """The tracker's streams as they were at ``states`` for the length of a block, then as they were before.

    The recomputation runs in backward, long after the forward: the streams must move on from where they are
    now, not from where the recomputation leaves them. Reusable, unlike a generator-based context manager."""

    def __init__(self, tracker: RNGTracker, states: dict[str, torch.Tensor]) -> None:
        self.tracker, self.states = tracker, states
        self.outer: list[dict[str, torch.Tensor]] = []

    def __enter__(self) -> None:
        self.outer.append(self.tracker.get_states())
        self.tracker.set_states(self.states)

    def __exit__(self, *exc: object) -> None:
        self.tracker.set_states(self.outer.pop())


def model_parallel_rng(seed: int, tp_rank: int, device: torch.device | str = "cpu", pp_rank: int = 0) -> RNGTracker:
    """Seed the default generator with ``seed`` (the same on every tp rank: the replicated stream) and return
    a tracker whose tensor-parallel stream is seeded ``seed + 2718 + 100 * pp_rank + tp_rank``: pipeline stages
    hold different layers, so their streams must not repeat one another's masks (Megatron's offsets)."""
    torch.manual_seed(seed)
    tracker = RNGTracker(device)
    tracker.add(TENSOR_PARALLEL, seed + _TP_SEED_OFFSET + _PP_SEED_STRIDE * pp_rank + tp_rank)
    return tracker


def drawing_from(rng: RNGTracker | None) -> contextlib.AbstractContextManager:
    """The tracker's tensor-parallel stream, or the default generator when there is no tracker."""
    return rng.fork() if rng is not None else contextlib.nullcontext()


class Dropout(nn.Module):
    """Dropout whose mask comes from ``rng``'s tensor-parallel stream (for an activation that differs across
    tp ranks), or from the default generator with no tracker (for one replicated across tp)."""

    def __init__(self, p: float, rng: RNGTracker | None = None) -> None:
        super().__init__()
        self.p, self.rng = p, rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        with drawing_from(self.rng):
            return F.dropout(x, self.p, training=True)
