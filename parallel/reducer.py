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
``reduce_bucket`` is the one call that reduces a bucket: an all-reduce here, a reduce-scatter under ZeRO.
The loss is pre-divided by the global token count, so the reduction is a plain SUM.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from trident.parallel.layout import FlatLayout, Span


@dataclass(eq=False)
class Bucket:
    params: list[nn.Parameter]
    offset: int  # start in the flat buffer
    numel: int  # padded to a multiple of dp_size
    grads: torch.Tensor  # the bucket's slice of the flat buffer
    span: Span  # the bucket in the layout
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
    ) -> None:
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("GradReducer needs at least one trainable parameter")
        self.params = params
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        # ``isolate``: parameters each in a bucket of their own (see FlatLayout.by_size).
        self.layout = FlatLayout.by_size(params, bucket_numel(bucket_mb, reduce_dtype), self.dp_size, isolate)
        self.buffer = torch.zeros(self.layout.numel, dtype=reduce_dtype, device=params[0].device)
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        self._grad: dict[nn.Parameter, torch.Tensor] = {}
        for span in self.layout.spans:
            # Views made once and kept: see finish() on why the reducer must own the bucket tensors.
            view = self.buffer[span.offset : span.offset + span.numel]
            bucket = Bucket(params=span.params, offset=span.offset, numel=span.numel, grads=view, span=span)
            for p in bucket.params:
                start = self.layout.offset[p]
                self._grad[p] = self.buffer[start : start + p.numel()].view_as(p)
                self._bucket_of[p] = bucket
            self.buckets.append(bucket)

        self._sync = True
        self._next = 0  # index of the next bucket to launch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's gradient: its slice of the buffer, in reduce_dtype."""
        return self._grad[param]

    def reduced_grad(self, span: Span) -> torch.Tensor:
        """What this rank holds reduced of a bucket's gradient after ``finish``: all of it (an all-reduce)."""
        return self.buckets[span.index].grads

    def grad_tensors(self) -> list[torch.Tensor]:
        """Every tensor holding gradients: the flat buffer."""
        return [self.buffer]

    def set_sync(self, enabled: bool) -> None:
        """Call before each micro-batch's backward: True only for the last one of the step."""
        self._sync = enabled

    def _on_grad_ready(self, param: nn.Parameter) -> None:
        self._grad[param].add_(param.grad)
        param.grad = None
        if not self._sync or self.dp_size == 1:
            return
        self._bucket_of[param].ready += 1
        # Collectives must be issued in the same order on every rank, so buckets start strictly in
        # bucket order (as torch DDP does), even if autograd finishes a later one first.
        while self._next < len(self.buckets) and self._is_ready(self.buckets[self._next]):
            self._launch(self.buckets[self._next])

    @staticmethod
    def _is_ready(bucket: Bucket) -> bool:
        return bucket.ready == len(bucket.params)

    def reduce_bucket(self, bucket: Bucket) -> dist.Work:
        """Start the reduction of one bucket over dp: the one call ZeRO turns into a reduce-scatter."""
        return dist.all_reduce(bucket.grads, group=self.dp_group, async_op=True)

    def _launch(self, bucket: Bucket) -> None:
        bucket.work = self.reduce_bucket(bucket)
        self._next += 1

    def finish(self) -> None:
        """Wait for every bucket's reduction; buckets whose parameters got no gradient are reduced now."""
        if self.dp_size == 1:
            return
        while self._next < len(self.buckets):
            self._launch(self.buckets[self._next])
        for bucket in self.buckets:
            # Keep the handle until the next launch replaces it. Whoever drops the last reference to a
            # finished work frees its tensors, which takes the GIL; on gloo's worker thread that aborts
            # the process if the interpreter is shutting down ("terminate called without an active
            # exception"). Held here, the last reference is always dropped on this thread.
            bucket.work.wait()
            bucket.ready = 0
        self._next = 0

    def zero_grad(self) -> None:
        self.buffer.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
