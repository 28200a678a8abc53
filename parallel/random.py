"""Dropout masks derived, not streamed: every mask is a pure function of (run seed, optimizer step, global sample
index, site), where a site is a global layer index and which of its dropouts it is (``EMBEDDING``, ``ATTENTION``
probabilities, ``ATTENTION_RESIDUAL``, ``MLP_RESIDUAL``).

A site's mask is defined on the logical (one-process) tensor of one sample: ``[T, d]`` for the residual stream
and the embeddings, ``[n_heads, T, T]`` for the attention probabilities. A rank draws that whole tensor from a
generator seeded by a hash of those numbers, on the activation's device, and keeps the part it holds: its heads
under tensor parallelism, its sequence shard under sequence parallelism, everything where the activation is
replicated over tp (every tp rank then drops the same elements, as the copies must). Under context parallelism a
rank holds some tokens of each sample, not a block: it keeps the mask's rows (and for the attention probabilities
its queries' rows and the gathered keys' columns) at those tokens' places in the window, each sample's own. So:

- no generator state needs saving: a checkpoint resumes exactly under any layout;
- pipeline stages hold different layers, hence different sites, and never repeat one another's masks;
- recomputation (full or selective activation checkpointing, a split backward that recomputes twice) redraws the
  same masks, once ``checkpoint_contexts`` has put back the micro-batch the forward ran on;
- every layout (dp, tp, pp, cp, sequence parallelism, micro-batch size) drops exactly what one process drops.

The cost: at tp > 1 each rank draws the full logical mask of its samples and keeps 1/tp of it (for the attention
probabilities, tp x the RNG work of a per-rank stream). A counter-based draw of just the slice (a Philox offset
per slice, on CUDA) would avoid it; not done yet.

Which micro-batch is running is the tracker's context (``RNGTracker.context(step, sample_ids)``), set by the
runners around each micro-batch's forward; the model receives the tracker at construction.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Sequence

import torch
from torch import nn

# Which dropout of a layer a site is. The embedding's has no layer: it is layer -1.
EMBEDDING, ATTENTION, ATTENTION_RESIDUAL, MLP_RESIDUAL = range(4)
EMBEDDING_LAYER = -1


def mask_seed(seed: int, step: int, sample: int, layer: int, kind: int) -> int:
    """The generator seed of one sample's mask at one site (63 bits of a hash: no two inputs share a stream)."""
    digest = hashlib.blake2b(struct.pack("<5q", seed, step, sample, layer, kind), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class RNGTracker:
    """The run's seed and the micro-batch now running (its optimizer step and global sample indices): all a
    dropout mask is derived from. One per rank, shared by its model chunks."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.step: int | None = None
        self.sample_ids: tuple[int, ...] | None = None
        self._generators: dict[torch.device, torch.Generator] = {}

    def context(self, step: int, sample_ids: torch.Tensor | Sequence[int]) -> _Context:
        """The micro-batch of ``step`` whose samples are ``sample_ids`` (one per row), for the length of a block."""
        ids = sample_ids.tolist() if isinstance(sample_ids, torch.Tensor) else sample_ids
        return _Context(self, step, tuple(int(i) for i in ids))

    def checkpoint_contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for torch.utils.checkpoint (use_reentrant=False). It is called as the original forward
        starts, so the micro-batch is captured here and put back around each recomputation, which runs in
        backward, outside the runner's context (twice for a split backward, as zero-bubble schedules run)."""
        return contextlib.nullcontext(), _Context(self, self.step, self.sample_ids)

    def keep_mask(
        self,
        p: float,
        layer: int,
        kind: int,
        logical_shape: Sequence[int],
        shard: tuple[int, int, int] | None,
        device: torch.device,
        picked: dict[int, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Which elements dropout keeps, for the running micro-batch: bool ``[batch, *held]``.

        ``logical_shape``: one sample's tensor in one process. ``shard``: ``(dim, rank, parts)`` when this rank
        holds block ``rank`` of ``parts`` along ``dim`` of it, None when it holds all of it. ``picked``: ``{dim:
        indices}`` when along ``dim`` it holds the elements at ``indices`` (``[batch or 1, n]``, each sample's or
        one for all; context parallelism's tokens), on ``device``."""
        if self.sample_ids is None or self.step is None:
            raise RuntimeError(
                "dropout in training needs the micro-batch's step and sample ids: run the forward inside "
                "rng.context(step, sample_ids) (the runners do)"
            )
        index: tuple[slice, ...] = ()
        if shard is not None:
            dim, rank, parts = shard
            size = logical_shape[dim] // parts
            index = (slice(None),) * dim + (slice(rank * size, (rank + 1) * size),)
        gen = self._generator(device)
        masks = []
        picked = {dim: rows.reshape(-1, rows.shape[-1]) for dim, rows in (picked or {}).items()}
        for i, sample in enumerate(self.sample_ids):
            gen.manual_seed(mask_seed(self.seed, self.step, sample, layer, kind))
            mask = torch.rand(logical_shape, generator=gen, device=device)[index]
            for dim, rows in picked.items():
                mask = mask.index_select(dim, rows[i if len(rows) > 1 else 0])
            masks.append(mask >= p)
        return torch.stack(masks)

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device)
        return self._generators[device]


class _Context:
    """The tracker's micro-batch set for the length of a block, then put back as it was. Reusable and reentrant
    (a stack), unlike a generator-based context manager: a recomputation may enter it more than once."""

    def __init__(self, tracker: RNGTracker, step: int | None, sample_ids: tuple[int, ...] | None) -> None:
        self.tracker, self.step, self.sample_ids = tracker, step, sample_ids
        self.outer: list[tuple[int | None, tuple[int, ...] | None]] = []

    def __enter__(self) -> None:
        t = self.tracker
        self.outer.append((t.step, t.sample_ids))
        t.step, t.sample_ids = self.step, self.sample_ids

    def __exit__(self, *exc: object) -> None:
        t = self.tracker
        t.step, t.sample_ids = self.outer.pop()


def model_parallel_rng(seed: int) -> RNGTracker:
    """The tracker dropout derives its masks from. The default generator, which no mask draws from, is seeded
    with ``seed`` too, so that anything else random in a run starts alike on every rank."""
    torch.manual_seed(seed)
    return RNGTracker(seed)


def dropout_context(model: nn.Module, step: int, sample_ids: torch.Tensor) -> contextlib.AbstractContextManager:
    """The micro-batch context of ``model``'s tracker (a runner's forward of one micro-batch); nothing for a model
    without one."""
    rng = getattr(model, "rng", None)
    return rng.context(step, sample_ids) if rng is not None else contextlib.nullcontext()


class Dropout(nn.Module):
    """Dropout of site (``layer``, ``kind``) with a derived mask (see the module docstring).

    ``x`` is ``[batch, *held]``: this rank's part of ``batch`` samples' logical tensors, which are
    ``held`` with dim ``shard_dim`` (of one sample) multiplied by ``parts`` when sharded (this rank's block is
    ``rank``), or ``held`` itself when ``shard_dim`` is None. Under context parallelism the call names the tokens
    held (``tokens``: ``{dim: (logical size, indices [batch or 1, n])}``); a shard of the same dim (sequence
    parallelism) is then this rank's block of those indices. At ``p`` 0 it returns ``x`` as it is."""

    def __init__(
        self,
        p: float,
        rng: RNGTracker | None,
        layer: int,
        kind: int,
        shard_dim: int | None = None,
        rank: int = 0,
        parts: int = 1,
    ) -> None:
        super().__init__()
        self.p, self.rng, self.layer, self.kind = p, rng, layer, kind
        self.shard = None if shard_dim is None or parts == 1 else (shard_dim, rank, parts)

    def forward(self, x: torch.Tensor, tokens: dict[int, tuple[int, torch.Tensor]] | None = None) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.rng is None:
            raise RuntimeError("dropout in training needs the model's RNG tracker (rng=model_parallel_rng(seed))")
        logical, shard, picked = list(x.shape[1:]), self.shard, {}
        for dim, (size, index) in (tokens or {}).items():
            if shard is not None and shard[0] == dim:
                _, rank, parts = shard
                n = index.shape[-1] // parts
                index, shard = index[..., rank * n : (rank + 1) * n], None
            logical[dim], picked[dim] = size, index
        if shard is not None:
            logical[shard[0]] *= shard[2]
        keep = self.rng.keep_mask(self.p, self.layer, self.kind, logical, shard, x.device, picked)
        if len(keep) != len(x):
            raise ValueError(f"a micro-batch of {len(x)} samples has {len(keep)} sample ids")
        return x * keep * (1.0 / (1.0 - self.p))

    def extra_repr(self) -> str:
        return f"p={self.p}, layer={self.layer}, kind={self.kind}, shard={self.shard}"
