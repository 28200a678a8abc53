"""Gradient reduction under ZeRO: the reduce-scatter that leaves each dp rank its shard of every bucket.

Stage 1 (``ScatterReducer``): the full fp32 gradient buffer of parallel/reducer.py, accumulated over the
micro-batches as at stage 0; on the last micro-batch each bucket is reduce-scattered instead of all-reduced,
in place: the rank's shard of the bucket, ``[o + r*n/dp, o + (r+1)*n/dp)``, ends up holding the sum over dp
(NCCL and gloo both accept an output that is the input's own rank-th chunk). The rest of the buffer keeps this
rank's local, unreduced gradients, which nothing reads.

Stages 2 and 3 (``ShardedGradReducer``): no full buffer. A bucket's gradients go into a staging buffer as
backward produces them; the moment the bucket is complete it is reduce-scattered into this rank's persistent
fp32 shard (``shard``, 1/dp of the layout), overlapping the rest of backward, and the staging buffer goes back to
a pool. This happens for every micro-batch, as DeepSpeed's stage 2 does: with gradient accumulation a shard can
only accumulate what was reduced, so a step sends the gradients once per micro-batch. Accumulation across
micro-batches costs no extra buffer: before a bucket's reduce-scatter the rank adds what its shard already holds
into its own chunk of the staging buffer, and the collective's sum overwrites the shard with the new total.

A staging buffer is allocated when its bucket's first gradient arrives and its memory released (its storage
resized to zero) as soon as its reduce-scatter has been waited for. The emptied tensor object itself is kept until
the bucket's next launch replaces it: a gloo worker thread that released the last reference to a collective's
tensor would take the GIL to free it, which aborts an interpreter that is shutting down (see GradReducer.finish).
At most ``MAX_IN_FLIGHT`` (2) reduce-scatters are waited for later (a launch waits for the oldest beyond that), so
the staging memory is the buckets being filled plus at most two in flight.

Buckets launch in a fixed order, the same on every dp rank: the layout's, or at stage 3 under pipeline parallelism
one order per model chunk (``chains``), since a rank runs its chunks' backward passes interleaved: each chunk's
buckets then launch once per backward of that chunk, whatever the schedule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Sequence

import torch
import torch.distributed as dist
from torch import nn

from trident.parallel.layout import BucketSpan, FlatLayout
from trident.parallel.placement import is_expert
from trident.parallel.reducer import Bucket, GradReducer


class ScatterReducer(GradReducer):
    """Stage 1: the stage-0 buffer and accumulation, each bucket reduce-scattered into this rank's shard of it."""

    def __init__(
        self,
        params: list[nn.Parameter],
        dp_group: dist.ProcessGroup,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype = torch.float32,
        isolate: Collection[nn.Parameter] = (),
        chunks: Sequence[Collection[nn.Parameter]] = (),
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        super().__init__(params, dp_group, bucket_mb, reduce_dtype, isolate, chunks, expert_group)
        # Made once and kept, like the bucket views (a collective's tensors must outlive its work). An expert
        # bucket is sharded over the expert-dp group it reduces over (its padding to dp divides that group too).
        self._shards = [
            self.buffer[slice(*b.span.shard(dist.get_rank(b.group), dist.get_world_size(b.group)))]
            for b in self.buckets
        ]

    def reduce_bucket(self, bucket: Bucket) -> dist.Work:
        return dist.reduce_scatter_single(
            self._shards[bucket.span.index], bucket.grads, group=bucket.group, async_op=True
        )

    def reduced_grad(self, span: BucketSpan) -> torch.Tensor:
        """This rank's shard of the bucket: the only part that holds the sum over dp."""
        return self._shards[span.index]


class ShardedGradReducer:
    """Stages 2 and 3: only this rank's fp32 shard of the gradients is kept (``shard``, layout.numel / dp).

    ``on_reduced(span)`` is called once a bucket's reduce-scatter has been launched (stage 3 frees the bucket's
    gathered parameters then), ``on_finish()`` once ``finish`` has reduced the step. ``chains``: lists of span
    indices, each launched in its own cyclic order (default: one chain, the layout's order). Same calls as
    ``GradReducer``; ``set_sync`` is accepted and changes nothing, since every micro-batch is reduced.
    """

    def __init__(
        self,
        layout: FlatLayout,
        dp_group: dist.ProcessGroup,
        reduce_dtype: torch.dtype,
        device: torch.device,
        on_reduced: Callable[[BucketSpan], None] | None = None,
        on_finish: Callable[[], None] | None = None,
        chains: Sequence[Sequence[int]] | None = None,
        expert_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layout, self.params = layout, layout.params
        self.dp_group, self.on_reduced, self.on_finish = dp_group, on_reduced, on_finish
        self.dp_size, self.dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        # Each bucket's group: dp, or for a bucket of expert weights (ep > 1, a bucket of their own) expert-dp.
        experts = expert_group is not None
        self._groups = [expert_group if experts and is_expert(s.params[0]) else dp_group for s in layout.spans]
        self._sharded = [(dist.get_rank(g), dist.get_world_size(g)) for g in self._groups]  # (rank, shards)
        numel = sum(span.numel // n for span, (_, n) in zip(layout.spans, self._sharded, strict=True))
        self.shard = torch.zeros(numel, dtype=reduce_dtype, device=device)
        self._shards: list[torch.Tensor] = []
        start = 0
        for span, (_, shards) in zip(layout.spans, self._sharded, strict=True):
            size = span.numel // shards
            self._shards.append(self.shard[start : start + size])
            start += size
        n = len(layout.spans)
        self._staging: list[torch.Tensor | None] = [None] * n  # being filled by this pass's backward
        self._seen: list[set[nn.Parameter]] = [set() for _ in range(n)]
        # The latest reduce-scatter of each bucket and its staging tensor, both kept until the next launch of the
        # bucket (the tensor emptied once waited). A gloo work must be waited once only: a second wait copies its
        # result into the output again.
        self._work: list[dist.Work | None] = [None] * n
        self._sent: list[torch.Tensor | None] = [None] * n
        self._dtype, self._device = reduce_dtype, device
        self.peak_staging_bytes = 0  # the most staging memory held at once
        self._in_flight: deque[int] = deque()  # launched buckets not waited for yet, oldest first
        # Each chain's next bucket to launch: a chain's buckets launch strictly in its order on every rank.
        self._chains = [list(c) for c in chains] if chains is not None else [list(range(n))]
        self._chain_of = {i: c for c, chain in enumerate(self._chains) for i in chain}
        self._next = [0] * len(self._chains)
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in self.params]

    MAX_IN_FLIGHT = 2

    def set_sync(self, enabled: bool, chunk: int | None = None) -> None:
        """Nothing to decide: each micro-batch's gradients are reduce-scattered as they are produced."""

    def launch_chunk(self, chunk: int) -> None:
        """Nothing left to start: a bucket is reduce-scattered the moment it is complete (``finish`` starts the
        ones a pass left incomplete)."""

    def reduced_grad(self, span: BucketSpan) -> torch.Tensor:
        """This rank's shard of the bucket's gradient, summed over dp and over the step's micro-batches."""
        return self._shards[span.index]

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding gradients: the shard, and the staging buffers allocated now (none between steps)."""
        return [self.shard, *(t for t in [*self._staging, *self._sent] if t is not None)]

    def _staging_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in [*self._staging, *self._sent] if t is not None)

    def _new_staging(self, numel: int) -> torch.Tensor:
        staging = torch.zeros(numel, dtype=self._dtype, device=self._device)
        self.peak_staging_bytes = max(self.peak_staging_bytes, self._staging_bytes() + staging.nbytes)
        return staging

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a weight whose gradient waits for W (parallel/wgrad.py): autograd gave it nothing
            return
        span = self.layout.span_of[param]
        i = span.index
        if self._staging[i] is None:
            self._recycle()
            self._staging[i] = self._new_staging(span.numel)
        start = self.layout.offset[param] - span.offset
        self._staging[i][start : start + param.numel()].add_(param.grad.reshape(-1))
        param.grad = None
        # A parameter seen twice before its bucket launched (a bucket left incomplete by a micro-batch) only
        # adds to the staged sum, which is still right.
        self._seen[i].add(param)
        c = self._chain_of[i]
        chain, spans = self._chains[c], self.layout.spans
        while True:
            j = chain[self._next[c]]
            if self._staging[j] is None or len(self._seen[j]) < len(spans[j].params):
                break
            self._launch(c)
            if self._next[c] == 0:
                break

    def _launch(self, c: int) -> None:
        """Launch chain ``c``'s next bucket."""
        i = self._chains[c][self._next[c]]
        span = self.layout.spans[i]
        staging = self._staging[i]
        if staging is None:  # finish() reducing a bucket none of whose parameters got a gradient
            staging = self._new_staging(span.numel)
        self._wait(i)  # the shard must hold the previous micro-batch's total before it is added in
        start, stop = span.shard(*self._sharded[i])
        staging[start - span.offset : stop - span.offset].add_(self._shards[i])
        self._sent[i] = staging
        if self._sharded[i][1] == 1:  # a group of one (expert weights at ep = dp): the staged sum is the total
            self._shards[i].copy_(staging)
            staging.untyped_storage().resize_(0)
        else:
            self._work[i] = dist.reduce_scatter_single(self._shards[i], staging, group=self._groups[i], async_op=True)
            self._in_flight.append(i)
        # Bound the staging memory: at most MAX_IN_FLIGHT launched reductions hold a staging buffer at once.
        while len(self._in_flight) > self.MAX_IN_FLIGHT:
            self._wait(self._in_flight[0])
        self._staging[i], self._seen[i] = None, set()
        self._next[c] = (self._next[c] + 1) % len(self._chains[c])
        if self.on_reduced is not None:
            self.on_reduced(span)

    def _wait(self, i: int) -> None:
        """Wait for bucket i's reduce-scatter, if one is running, and release its staging memory."""
        if i in self._in_flight:
            self._work[i].wait()
            self._sent[i].untyped_storage().resize_(0)
            self._in_flight.remove(i)

    def _recycle(self) -> None:
        """Release the staging memory of the reduce-scatters that have finished."""
        for i in list(self._in_flight):
            if self._work[i].is_completed():
                self._wait(i)

    def finish(self) -> None:
        """Launch the buckets a pass left incomplete (parameters with no gradient) and wait for every bucket."""
        for c, chain in enumerate(self._chains):
            if self._next[c] > 0 or any(self._staging[i] is not None for i in chain):
                while True:
                    self._launch(c)
                    if self._next[c] == 0:
                        break
        for i in range(len(self.layout.spans)):
            self._wait(i)
        if self.on_finish is not None:
            self.on_finish()

    def zero_grad(self) -> None:
        self.shard.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
