"""The gradient buffer and its data-parallel reduction.

The reducer owns one flat gradient buffer in ``reduce_dtype`` (fp32 by default, whatever the parameters'
dtype), with a fixed offset for every parameter, laid out in reverse registration order (roughly the order
backward produces gradients) and cut into buckets of about ``bucket_mb``, each padded to a multiple of dp so
it splits into equal contiguous shards.

A parameter's ``.grad`` is only the hand-off from autograd: as soon as it is accumulated, a hook adds it
into the parameter's slice of the buffer and drops it (Megatron's ``main_grad``). So gradients of 16-bit
parameters accumulate in fp32 across micro-batches, and nothing done to ``.grad`` (``zero_grad`` with or
without ``set_to_none``, a library replacing it) can detach or drop what was accumulated. Right before the
optimizer runs, ``attach_grads`` points each parameter's ``.grad`` at its slice of the buffer.

During the backward of the last micro-batch a bucket's reduction starts asynchronously as soon as all its
gradients are in, so communication overlaps the rest of backward; earlier micro-batches only accumulate.
``reduce_bucket`` is the one call that reduces a bucket: an all-reduce here, a reduce-scatter under ZeRO.
The loss is pre-divided by the global token count, so the reduction is a plain SUM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn


@dataclass(eq=False)
class Bucket:
    params: list[nn.Parameter]
    offset: int  # start in the flat buffer
    numel: int  # padded to a multiple of dp_size
    grads: torch.Tensor  # the bucket's slice of the flat buffer
    ready: int = 0
    work: dist.Work | None = field(default=None, repr=False)


def plan_buckets(numels: list[int], bucket_numel: int, dp_size: int) -> list[tuple[list[int], int]]:
    """Greedily group consecutive parameters; return (param indices, padded numel) per bucket.

    A parameter larger than a bucket gets a bucket of its own.
    """
    buckets, current, size = [], [], 0
    for i, n in enumerate(numels):
        if current and size + n > bucket_numel:
            buckets.append((current, size))
            current, size = [], 0
        current.append(i)
        size += n
    if current:
        buckets.append((current, size))
    return [(idx, -(-size // dp_size) * dp_size) for idx, size in buckets]


class GradReducer:
    def __init__(
        self,
        params: list[nn.Parameter],
        dp_group: dist.ProcessGroup,
        bucket_mb: float = 25.0,
        reduce_dtype: torch.dtype = torch.float32,
    ) -> None:
        params = [p for p in params if p.requires_grad]
        if not params:
            raise ValueError("GradReducer needs at least one trainable parameter")
        self.params = params
        self.dp_group = dp_group
        self.dp_size = dist.get_world_size(dp_group)
        element = torch.tensor([], dtype=reduce_dtype).element_size()
        bucket_numel = max(1, int(bucket_mb * 2**20 / element))

        order = list(reversed(params))
        plan = plan_buckets([p.numel() for p in order], bucket_numel, self.dp_size)
        self.buffer = torch.zeros(sum(n for _, n in plan), dtype=reduce_dtype, device=params[0].device)
        self.buckets: list[Bucket] = []
        self._bucket_of: dict[nn.Parameter, Bucket] = {}
        self._grad: dict[nn.Parameter, torch.Tensor] = {}
        offset = 0
        for idx, numel in plan:
            # Views made once and kept: see finish() on why the reducer must own the bucket tensors.
            view = self.buffer[offset : offset + numel]
            bucket = Bucket(params=[order[i] for i in idx], offset=offset, numel=numel, grads=view)
            start = offset
            for p in bucket.params:
                self._grad[p] = self.buffer[start : start + p.numel()].view_as(p)
                self._bucket_of[p] = bucket
                start += p.numel()
            self.buckets.append(bucket)
            offset += numel

        self._sync = True
        self._next = 0  # index of the next bucket to launch
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]

    def grad(self, param: nn.Parameter) -> torch.Tensor:
        """The parameter's gradient: its slice of the buffer, in reduce_dtype."""
        return self._grad[param]

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

    def attach_grads(self) -> None:
        """Point each ``.grad`` at the buffer for an optimizer that reads ``.grad`` (same dtype only)."""
        for p in self.params:
            p.grad = self._grad[p] if p.dtype == self.buffer.dtype else None

    def detach_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def zero_grad(self) -> None:
        self.buffer.zero_()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
