"""The gradient buffer and its data-parallel reduction.

The reducer owns one flat gradient buffer in ``reduce_dtype`` (fp32 by default, whatever the parameters'
dtype), with a fixed offset for every parameter, laid out in reverse registration order (roughly the order
backward produces gradients) and cut into buckets of about ``bucket_mb``, each padded to a multiple of dp so
it splits into equal contiguous shards.

A parameter's ``.grad`` is only the hand-off from autograd: as soon as it is accumulated, a hook adds it
into the parameter's slice of the buffer and drops it (Megatron's ``main_grad``). So gradients of 16-bit
parameters accumulate in fp32 across micro-batches, and nothing done to ``.grad`` (``zero_grad`` with or
without ``set_to_none``, a library replacing it) can detach or drop what was accumulated. The optimizer reads the
reduced gradient from the buffer itself (``reduced_grad``), never from ``.grad``.

During the backward of the last micro-batch a bucket's reduction starts asynchronously as soon as all its
gradients are in, so communication overlaps the rest of backward; earlier micro-batches only accumulate.
Under pipeline parallelism a rank holds several model chunks (``chunks``) whose last backwards come at different
times of the schedule: no bucket spans two chunks, and sync is turned on per chunk (``set_sync(True, chunk)``) for
that chunk's last backward only; ``launch_chunk`` then starts whatever of the chunk is left, so each chunk's
buckets are on the wire while the schedule still runs the others, and ``finish`` mostly waits.
``reduce_bucket`` is the one call that reduces a bucket: an all-reduce here, a reduce-scatter under ZeRO.
The loss is pre-divided by the global token count, so the reduction is a plain SUM.

Under expert parallelism (``expert_group``) the expert weights (placement ``expert_split``), in buckets of their
own, reduce over the expert-data-parallel group (the dp ranks holding the same experts) instead of dp; where that
group is one rank (ep = dp) they are summed already and no collective is issued.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trident.parallel.layout import BucketSpan, FlatLayout
from trident.parallel.placement import is_expert


@dataclass(eq=False)
class Bucket:
    params: list[nn.Parameter]
    offset: int  # start in the flat buffer
    numel: int  # padded to a multiple of dp_size
    grads: torch.Tensor  # the bucket's slice of the flat buffer
    span: BucketSpan  # the bucket in the layout
    chunk: int = 0  # the model chunk whose parameters the bucket holds
    group: dist.ProcessGroup | None = None  # what it reduces over: dp, or expert-dp for expert weights
    ready: int = 0
    work: dist.Work | None = field(default=None, repr=False)


def bucket_numel(bucket_mb: float, dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in a bucket of about ``bucket_mb`` MiB."""
    return max(1, int(bucket_mb * 2**20 / torch.tensor([], dtype=dtype).element_size()))


class GradReducer:
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
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("GradReducer needs at least one trainable parameter")
        experts = {id(p) for p in params if is_expert(p)}
        if experts and expert_group is None:
            raise ValueError("expert weights split over ep need the expert-data-parallel group (expert_group)")
        self.params = params
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        # ``isolate``: parameters each in a bucket of their own; ``chunks``: no bucket spans two; the expert weights
        # in buckets of their own, beside the others (FlatLayout.by_size's ``apart``).
        numel = bucket_numel(bucket_mb, reduce_dtype)
        apart = [p for p in params if id(p) in experts]
        self.layout = FlatLayout.by_size(params, numel, self.dp_size, isolate, chunks, apart)
        chunk_of = {id(p): c for c, ps in enumerate(chunks) for p in ps}
        self.buffer = torch.zeros(self.layout.numel, dtype=reduce_dtype, device=params[0].device)
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        self._grad: dict[nn.Parameter, torch.Tensor] = {}
        for span in self.layout.spans:
            # Views made once and kept: see finish() on why the reducer must own the bucket tensors.
            view = self.buffer[span.offset : span.offset + span.numel]
            chunk = chunk_of.get(id(span.params[0]), 0)
            group = expert_group if id(span.params[0]) in experts else dp_group
            bucket = Bucket(span.params, span.offset, span.numel, view, span, chunk, group=group)
            for p in bucket.params:
                start = self.layout.offset[p]
                self._grad[p] = self.buffer[start : start + p.numel()].view_as(p)
                self._bucket_of[p] = bucket
            self.buckets.append(bucket)

        # Each chunk's buckets, in layout order, and the index in that list of the next one to launch.
        self._chunks: dict[int, list[Bucket]] = {}
        for bucket in self.buckets:
            self._chunks.setdefault(bucket.chunk, []).append(bucket)
        self._next = dict.fromkeys(self._chunks, 0)
        self._syncing: set[int] = set(self._chunks)  # chunks whose buckets launch as their gradients come in
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's gradient: its slice of the buffer, in reduce_dtype."""
        return self._grad[param]

    def reduced_grad(self, span: BucketSpan) -> torch.Tensor:
        """What this rank holds reduced of a bucket's gradient after ``finish``: all of it (an all-reduce)."""
        return self.buckets[span.index].grads

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding gradients: the flat buffer."""
        return [self.buffer]

    def set_sync(self, enabled: bool, chunk: int | None = None) -> None:
        """Call before each micro-batch's backward: True only for the last one of the step. ``chunk``: only that
        model chunk's buckets (a pipeline's chunks each have their own last backward); None: every chunk."""
        chunks = self._chunks if chunk is None else [chunk]
        self._syncing = self._syncing | set(chunks) if enabled else self._syncing - set(chunks)

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        if param.grad is None:  # a weight whose gradient waits for W (parallel/wgrad.py): autograd gave it nothing
            return
        self._grad[param].add_(param.grad)
        param.grad = None
        bucket = self._bucket_of[param]
        if bucket.chunk not in self._syncing or self.dp_size == 1:
            return
        bucket.ready += 1
        # Collectives must be issued in the same order on every rank, so a chunk's buckets start strictly in
        # bucket order (as torch DDP does), even if autograd finishes a later one first.
        buckets, c = self._chunks[bucket.chunk], bucket.chunk
        while self._next[c] < len(buckets) and self._is_ready(buckets[self._next[c]]):
            self._launch(buckets[self._next[c]])

    def launch_chunk(self, chunk: int) -> None:
        """Start the reduction of every bucket of ``chunk`` not started yet (buckets some of whose parameters got
        no gradient), in bucket order: call once the chunk's last backward of the step is done, at the same point
        of the schedule on every dp rank."""
        if self.dp_size == 1:
            return
        buckets = self._chunks[chunk]
        while self._next[chunk] < len(buckets):
            self._launch(buckets[self._next[chunk]])

    @staticmethod
    def _is_ready(bucket: Bucket) -> bool:
        return bucket.ready == len(bucket.params)

    def reduce_bucket(self, bucket: Bucket) -> dist.Work:
        """Start the reduction of one bucket over dp: the one call ZeRO turns into a reduce-scatter."""
        return dist.all_reduce(bucket.grads, group=bucket.group, async_op=True)

    def _launch(self, bucket: Bucket) -> None:
        if bucket.group is None or dist.get_world_size(bucket.group) > 1:  # expert-dp of one (ep = dp): summed
            bucket.work = self.reduce_bucket(bucket)
        self._next[bucket.chunk] += 1

    def finish(self) -> None:
        """Wait for every bucket's reduction; buckets whose parameters got no gradient are reduced now."""
        if self.dp_size == 1:
            return
        for chunk in self._chunks:
            self.launch_chunk(chunk)
        for bucket in self.buckets:
            # Keep the handle until the next launch replaces it. Whoever drops the last reference to a
            # finished work frees its tensors, which takes the GIL; on gloo's worker thread that aborts
            # the process if the interpreter is shutting down ("terminate called without an active
            # exception"). Held here, the last reference is always dropped on this thread.
            if bucket.work is not None:
                bucket.work.wait()
            bucket.ready = 0
        self._next = dict.fromkeys(self._chunks, 0)

    def zero_grad(self) -> None:
        self.buffer.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
