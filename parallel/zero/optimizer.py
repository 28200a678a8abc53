"""ZeRO's distributed optimizer (stages 0-3): each dp rank steps only its shard of the fp32 master weights.

The shard is this rank's chunk of every bucket of the flat layout (parallel/layout.py), the same elements
whose reduced gradient the reducer leaves it (``reduced_grad(span)``) and whose parameters it writes back
(``store.shard(span)``, parallel/zero/params.py). At stage 0 the "shard" is the whole layout (16-bit parameters
still need fp32 masters). Each bucket's shard is a ``Segment``; a segment cuts parameters into ``Piece``s, and
torch's AdamW (its fused kernel, on GPU and CPU alike) steps one 1-D view of the masters per piece, in two param groups
(weight decay on pieces of >= 2-D parameters only: ``_adamw``). AdamW's state therefore lives per
piece, exactly the shape of this rank's share.

Masters: with fp32 parameters the master of a segment on the accelerator *is* the parameter shard (no copy);
with 16-bit ones it is an fp32 copy, cast into the parameter shard after each step.

Offload (``offload_ratio`` r): the first r of the shard's elements (in segment order, a segment cut where the
ratio falls) keep masters and Adam moments on the host, in pinned memory when CUDA exists, and step with a
second, CPU AdamW; their gradients are copied to a host buffer first and their updated masters copied back into
the parameter shard. The accelerator's part steps at the same time: its kernels are queued before the host step
runs (Twin-Flow). On a CPU-only machine "host" and "accelerator" are the same memory and the same code runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from trident.parallel.layout import BucketSpan, FlatLayout, Piece
from trident.parallel.placement import Placement, is_expert, placement_of
from trident.parallel.zero.muon import MuonPieces, MuonPlan, muon_entry


class Store(Protocol):
    dtype: torch.dtype

    def shard(self, span: BucketSpan) -> torch.Tensor: ...

    def publish(self) -> None: ...

    def tensors(self) -> list[torch.Tensor]: ...


class ShardReducer(Protocol):
    params: list[nn.Parameter]

    def reduced_grad(self, span: BucketSpan) -> torch.Tensor: ...

    def grad_tensors(self) -> list[torch.Tensor]: ...

    def zero_grad(self) -> None: ...


@dataclass(eq=False)
class Segment:
    """A contiguous run [start, stop) of the flat layout that this rank steps, all on one side of the offload cut."""

    span: BucketSpan
    start: int
    stop: int
    on_host: bool
    pieces: list[Piece]
    master: torch.Tensor | None = field(repr=False)  # fp32 (None until it is known to be the parameter shard)
    grad: torch.Tensor | None = field(repr=False)  # the reduced gradient, where the reducer keeps it
    param: torch.Tensor | None = field(repr=False)  # where the updated weights go, in param dtype
    host_grad: torch.Tensor | None = field(default=None, repr=False)  # the gradient's host copy (offload)

    @property
    def numel(self) -> int:
        return self.stop - self.start

    def view(self, t: torch.Tensor, piece: Piece) -> torch.Tensor:
        """A segment-shaped tensor's elements that belong to ``piece``."""
        return t[piece.flat - self.start : piece.flat - self.start + piece.numel]


def shard_segments(
    layout: FlatLayout, rank: int, shards: int, host_numel: int, expert: tuple[int, int] | None = None
) -> list[tuple[BucketSpan, int, int, bool]]:
    """This rank's share of every bucket as (span, start, stop, on_host) runs, the first ``host_numel`` elements
    (in bucket order) on the host: a bucket's shard is cut in two where that count runs out. ``expert``: (rank,
    shards) of the buckets of expert weights (their expert-dp group), if not ``rank`` and ``shards``."""
    out, seen = [], 0
    for span in layout.spans:
        start, stop = span.shard(*(expert if expert and is_expert(span.params[0]) else (rank, shards)))
        cut = min(stop, max(start, start + host_numel - seen))
        if cut > start:
            out.append((span, start, cut, True))
        if stop > cut:
            out.append((span, cut, stop, False))
        seen += stop - start
    return out


def _pinned(numel: int) -> torch.Tensor:
    return torch.zeros(numel, dtype=torch.float32, pin_memory=torch.cuda.is_available())


class Masters:
    """This rank's segments of the flat layout and their fp32 masters, read from the parameters before a store
    casts them to its dtype (so built first). ``stage`` >= 1 shards over ``dp_group``; stage 0 keeps everything
    on every rank. Expert weights (``expert_group``, ep > 1) are sharded over their expert-dp group."""

    def __init__(
        self,
        layout: FlatLayout,
        param_dtype: torch.dtype,
        dp_group: dist.ProcessGroup,
        stage: int,
        offload_ratio: float = 0.0,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layout, self.stage, self.param_dtype = layout, stage, param_dtype
        self.dp_sharded = stage >= 1
        self.shards = dist.get_world_size(dp_group) if self.dp_sharded else 1
        self.rank = dist.get_rank(dp_group) if self.dp_sharded else 0
        expert = (dist.get_rank(expert_group), dist.get_world_size(expert_group)) if expert_group is not None else None
        self.expert = expert if self.dp_sharded else None
        device = layout.params[0].device
        shard_numel = sum(stop - start for _, start, stop, _ in self._runs(0))
        runs = self._runs(round(offload_ratio * shard_numel))
        alias = param_dtype == torch.float32  # fp32 parameters on the accelerator are their own masters

        numel = {side: sum(stop - start for _, start, stop, on_host in runs if on_host == side) for side in (0, 1)}
        self.host_masters, self.host_grads = _pinned(numel[1]), _pinned(numel[1])
        self.device_masters = torch.zeros(0 if alias else numel[0], dtype=torch.float32, device=device)
        self.segments: list[Segment] = []
        used = [0, 0]
        for span, start, stop, on_host in runs:
            n, at = stop - start, used[on_host]
            used[on_host] += n
            if on_host:
                master, host_grad = self.host_masters[at : at + n], self.host_grads[at : at + n]
            else:
                master, host_grad = (None if alias else self.device_masters[at : at + n]), None
            pieces = layout.pieces(span, start, stop)
            self.segments.append(Segment(span, start, stop, on_host, pieces, master, None, None, host_grad))
            if master is not None:  # the fp32 values, read before the store casts the parameters
                for piece in pieces:
                    value = piece.param.detach().reshape(-1)[piece.start : piece.stop]
                    self.segments[-1].view(master, piece).copy_(value)

    def _runs(self, host_numel: int) -> list[tuple[BucketSpan, int, int, bool]]:
        return shard_segments(self.layout, self.rank, self.shards, host_numel, self.expert)

    def shard_start(self, span: BucketSpan) -> int:
        """Where this rank's shard of ``span`` starts in the flat layout."""
        sharded_as = self.expert if self.expert and is_expert(span.params[0]) else (self.rank, self.shards)
        return span.shard(*sharded_as)[0]


class ZeroOptimizer:
    """Step this rank's shard of fp32 master weights with AdamW and publish the updated parameters.

    ``masters`` (built before ``store``, which casts the parameters to its dtype) say what this rank steps;
    ``store.shard(span)`` is where the weights go, ``reducer.reduced_grad(span)`` where their gradients are.
    ``GradStep`` (trident/optim.py) drives it through the methods below.
    """

    def __init__(
        self, masters: Masters, store: Store, reducer: ShardReducer, adamw: dict, muon: MuonPlan | None = None
    ) -> None:
        """``muon``: the matrices Muon steps (parallel/zero/muon.py), the rest AdamW; None: AdamW alone."""
        if store.dtype != masters.param_dtype:
            raise ValueError(f"the parameter store holds {store.dtype}, expected {masters.param_dtype}")
        self.layout, self.reducer, self.store, self.stage = masters.layout, reducer, store, masters.stage
        self.dp_sharded = masters.dp_sharded
        self.host_masters, self.host_grads = masters.host_masters, masters.host_grads
        self.device_masters, self.segments = masters.device_masters, masters.segments
        for seg in self.segments:
            at = seg.start - masters.shard_start(seg.span)
            seg.param = store.shard(seg.span)[at : at + seg.numel]
            seg.grad = reducer.reduced_grad(seg.span)[at : at + seg.numel]
            if seg.master is None:
                seg.master = seg.param

        # One 1-D master view per piece, its gradient view attached once (the buffers never move).
        self._views: dict[Piece, torch.Tensor] = {}
        sides: dict[bool, list[tuple[torch.Tensor, bool]]] = {True: [], False: []}
        stepped_by_muon = set() if muon is None else {p for p, _ in muon.params}
        entries = []
        for seg in self.segments:
            grads = seg.host_grad if seg.on_host else seg.grad
            for piece in seg.pieces:
                view = seg.view(seg.master, piece)
                view.grad = seg.view(grads, piece)
                self._views[piece] = view
                if piece.param in stepped_by_muon:
                    entries.append(muon_entry(piece, view, view.grad))
                else:
                    sides[seg.on_host].append((view, piece.param.dim() >= 2))
        self.host_optimizer = _adamw(sides[True], adamw)
        self.device_optimizer = _adamw(sides[False], adamw)
        self.muon = None if muon is None else MuonPieces(muon, entries)
        self._muon_views = {id(e.master) for e in entries}
        others = (self.device_optimizer, self.host_optimizer, self.muon)
        self.optimizers: list[torch.optim.Optimizer] = [o for o in others if o is not None]

    # What GradStep (trident/optim.py) calls.

    def grads(self) -> list[torch.Tensor]:
        """The reduced gradients this rank steps from, to unscale and clip in place."""
        return [seg.grad for seg in self.segments]

    def grad_pieces(self) -> list[tuple[torch.Tensor, Placement]]:
        """Each piece's gradient with its parameter's placement, for the global norm (pieces of a parameter
        keep its placement: its tp split and ties; over dp they are disjoint shards when ``dp_sharded``)."""
        return [(seg.view(seg.grad, piece), placement_of(piece.param)) for seg in self.segments for piece in seg.pieces]

    def grad_views(self, params: Iterable[nn.Parameter]) -> list[torch.Tensor]:
        """The reduced gradient this rank holds of each of ``params`` (its pieces). Ranks with the same layout
        (tp peers) hold the same pieces, so a sum over them (sequence-parallel gradients) lines up."""
        wanted = set(params)
        return [seg.view(seg.grad, pc) for seg in self.segments for pc in seg.pieces if pc.param in wanted]

    def apply(self, lr: float) -> None:
        """Step the masters at ``lr`` (the gradients already unscaled and clipped) and publish the weights."""
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        host = [seg for seg in self.segments if seg.on_host]
        for seg in host:
            seg.host_grad.copy_(seg.grad, non_blocking=True)
        copied = _record_event(host)
        if self.device_optimizer is not None:
            self.device_optimizer.step()  # on a GPU: queued kernels, running while the host steps
        if self.host_optimizer is not None:
            if copied is not None:
                copied.synchronize()
            self.host_optimizer.step()
        if self.muon is not None:
            if copied is not None and self.host_optimizer is None:
                copied.synchronize()
            self.muon.update(lr)
        for seg in self.segments:
            if seg.master is not seg.param:
                seg.param.copy_(seg.master, non_blocking=True)
        self.store.publish()

    def zero_grad(self) -> None:
        self.reducer.zero_grad()

    def model_state_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Parameters as they live, gradient buffers (reducer's and the host copy), masters that are not the
        parameters themselves, and AdamW's moments and step counters."""
        states = [t for opt in self.optimizers for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
        return {
            "params": self.store.tensors(),
            "grads": [*self.reducer.grad_tensors(), self.host_grads],
            "optimizer": [self.host_masters, self.device_masters, *states],
        }

    # What checkpoints read (trident/checkpoint/zero_state.py).

    def pieces(self) -> Iterable[tuple[Segment, Piece]]:
        for seg in self.segments:
            for piece in seg.pieces:
                yield seg, piece

    def master(self, piece: Piece) -> torch.Tensor:
        return self._views[piece]

    def optimizer_of(self, seg: Segment, piece: Piece) -> torch.optim.Optimizer:
        """The optimizer holding ``piece``'s state: Muon's for its matrices, else the AdamW of its side."""
        if id(self._views[piece]) in self._muon_views:
            return self.muon
        return self.host_optimizer if seg.on_host else self.device_optimizer

    def publish_masters(self) -> None:
        """After the masters were loaded: cast them into the parameters and publish, as a step does."""
        for seg in self.segments:
            if seg.master is not seg.param:
                seg.param.copy_(seg.master)
        self.store.publish()


def _record_event(host: list[Segment]) -> torch.cuda.Event | None:
    """On CUDA, an event after the gradients' copies to the host (the host step waits for it, nothing else)."""
    if not host or not host[0].grad.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def _adamw(views: list[tuple[torch.Tensor, bool]], adamw: dict) -> torch.optim.AdamW | None:
    """AdamW over 1-D master views: decay on pieces of matrices only. torch's fused kernel on every device: on a CPU
    one pass over each view where foreach makes about ten (3.4 ms a step against 0.7 ms for gpt-tiny's 0.9M fp32
    parameters on 2 threads), the same update up to the last bit of rounding."""
    if not views:
        return None
    decay = [v for v, d in views if d]
    no_decay = [v for v, d in views if not d]
    groups = [{"params": decay, "weight_decay": adamw["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=adamw["lr"], betas=adamw["betas"], eps=adamw["eps"], fused=True
    )
