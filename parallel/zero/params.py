"""Where ZeRO keeps the parameters: whole on every rank (stages 0-2) or sharded over dp (stage 3).

Both stores hand the optimizer this rank's shard of each bucket of the flat layout (parallel/layout.py) in the
parameter dtype, ``shard(span)``, to write the updated weights into, and ``publish()`` makes the update visible
to the model.

``FlatParams`` (stages 0-2): every parameter is a view of one flat buffer with the layout of the gradient
buffer, so ``publish`` all-gathers each bucket in place, in the parameter dtype: the input is the rank's own
chunk of the output (NCCL's and gloo's in-place all-gather).

``ShardedParams`` (stage 3): each bucket (one transformer block, or the embeddings with the final LayerNorm)
has a full buffer whose storage is allocated only while the bucket is gathered, and a persistent shard. The
parameters are views of the full buffer; ``free`` resizes its storage to zero and ``gather`` allocates it again
and all-gathers into it. Tensors autograd saved in forward are views of the same storage, so the gather before
backward brings them back too (the technique of FSDP's flat parameters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from trident.parallel.layout import BucketSpan, FlatLayout
from trident.parallel.placement import is_expert


def _fill(buffer: torch.Tensor, params: list[nn.Parameter], offsets: list[int]) -> None:
    """Copy the parameters' values (cast to the buffer's dtype) into it and make them views of it."""
    for p, start in zip(params, offsets, strict=True):
        view = buffer[start : start + p.numel()]
        view.copy_(p.detach().reshape(-1))
        p.data = view.view(p.shape)


class FlatParams:
    """Stages 0-2: the parameters as views of one flat ``dtype`` buffer; ``shards`` > 1 all-gathers updates."""

    def __init__(
        self,
        layout: FlatLayout,
        dtype: torch.dtype,
        dp_group: dist.ProcessGroup,
        shards: int,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``expert_group``: where the buckets of expert weights (ep > 1) are sharded and gathered instead of dp."""
        params = layout.params
        self.dp_group, self.shards = dp_group, shards
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=params[0].device)
        _fill(self.flat, params, [layout.offset[p] for p in params])
        self._buckets = [self.flat[span.offset : span.offset + span.numel] for span in layout.spans]
        experts = expert_group is not None
        self._groups = [expert_group if experts and is_expert(s.params[0]) else dp_group for s in layout.spans]
        shard_of = [(dist.get_rank(g), dist.get_world_size(g)) if shards > 1 else (0, 1) for g in self._groups]
        self._shards = [self.flat[slice(*s.shard(*r))] for s, r in zip(layout.spans, shard_of, strict=True)]
        self._work: list[dist.Work] = []

    @property
    def dtype(self) -> torch.dtype:
        return self.flat.dtype

    def shard(self, span: BucketSpan) -> torch.Tensor:
        return self._shards[span.index]

    def publish(self) -> None:
        """All-gather every bucket's updated shards (all launched, then all waited)."""
        if self.shards == 1:
            return
        # Handles kept until the next publish replaces them (see GradReducer.finish).
        # A bucket sharded over a group of one (expert weights at ep = dp) is its own shard, already updated.
        self._work = [
            dist.all_gather_single(bucket, shard, group=group, async_op=True)
            for bucket, shard, group in zip(self._buckets, self._shards, self._groups, strict=True)
            if shard.numel() < bucket.numel()
        ]
        for work in self._work:
            work.wait()

    def tensors(self) -> list[torch.Tensor]:
        return [self.flat]


class ShardedParams:
    """Stage 3: each bucket's parameters live as this rank's shard and are gathered only while in use."""

    def __init__(
        self,
        layout: FlatLayout,
        dtype: torch.dtype,
        dp_group: dist.ProcessGroup,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        """``expert_group``: where the buckets of expert weights (ep > 1) are sharded and gathered instead of dp."""
        self.layout, self.dp_group = layout, dp_group
        experts = expert_group is not None
        self._groups = [expert_group if experts and is_expert(s.params[0]) else dp_group for s in layout.spans]
        device = layout.params[0].device
        self._full: list[torch.Tensor] = []
        self._shards: list[torch.Tensor] = []
        for span, group in zip(layout.spans, self._groups, strict=True):
            full = torch.zeros(span.numel, dtype=dtype, device=device)
            _fill(full, span.params, [layout.offset[p] - span.offset for p in span.params])
            start, stop = span.shard(dist.get_rank(group), dist.get_world_size(group))
            self._shards.append(full[start - span.offset : stop - span.offset].clone())
            self._full.append(full)
        self._nbytes = [full.untyped_storage().nbytes() for full in self._full]
        # A gather in flight (its work is waited once only: a second wait on gloo copies its result again),
        # and the last work, kept once waited (see GradReducer.finish).
        self._work: list[dist.Work | None] = [None] * len(layout.spans)
        self._in_flight = [False] * len(layout.spans)
        self._gathered = [True] * len(layout.spans)
        for span in layout.spans:
            self.free(span)
        self.peak_full_bytes = 0  # the most full-buffer memory gathered at once (the estimator's ``gathered``)

    @property
    def dtype(self) -> torch.dtype:
        return self._shards[0].dtype

    def shard(self, span: BucketSpan) -> torch.Tensor:
        return self._shards[span.index]

    def publish(self) -> None:
        """A bucket is gathered from its updated shard the next time it is used; one gathered now (a forward
        without its backward) is gathered again, so no full buffer outlives the update."""
        for span in self.layout.spans:
            if self._gathered[span.index]:
                self.free(span)
                self.gather(span)

    def gather(self, span: BucketSpan, wait: bool = True) -> None:
        """Allocate the bucket's full buffer and all-gather it (``wait=False``: a prefetch, waited later)."""
        i = span.index
        if not self._gathered[i]:
            self._full[i].untyped_storage().resize_(self._nbytes[i])
            shard, group = self._shards[i], self._groups[i]
            self._gathered[i] = True
            if shard.numel() == self._full[i].numel():  # a group of one (expert weights at ep = dp): no collective
                self._full[i].copy_(shard)
            else:
                self._work[i] = dist.all_gather_single(self._full[i], shard, group=group, async_op=True)
                self._in_flight[i] = True
            self.peak_full_bytes = max(self.peak_full_bytes, self.full_bytes())
        if wait:
            self._finish(i)

    def _finish(self, i: int) -> None:
        if self._in_flight[i]:
            self._work[i].wait()
            self._in_flight[i] = False

    def free(self, span: BucketSpan) -> None:
        """Release the bucket's full buffer; its parameters keep their shapes and point at no memory."""
        i = span.index
        if not self._gathered[i]:
            return
        self._finish(i)
        self._full[i].untyped_storage().resize_(0)
        self._gathered[i] = False

    def full_bytes(self) -> int:
        """Bytes of full buffers currently allocated (0 when every bucket is freed)."""
        return sum(full.untyped_storage().nbytes() for full in self._full)

    def tensors(self) -> list[torch.Tensor]:
        return [*self._shards, *self._full]
