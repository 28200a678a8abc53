"""Collectives as autograd functions, each taking ``(x, group)``: a forward and its adjoint.

Megatron's tensor-parallel regions. A region between a column-parallel and a row-parallel linear works on
per-rank pieces; these functions are its borders:

    copy_to_region           identity             | all-reduce          X enters replicated, dX summed over tp
    reduce_from_region       all-reduce           | identity            partial sums leave as one tensor
    gather_last_dim          all-gather last dim  | keep own slice
    split_last_dim           keep own slice       | all-gather last dim
    gather_sequence          all-gather sequence  | reduce-scatter      sequence parallelism: shard -> whole
    reduce_scatter_sequence  reduce-scatter seq.  | all-gather          sequence parallelism: partial -> shard

Activations are ``[batch, seq, ...]``, so the sequence dim is dim 1. Tensors travel flat and contiguous, the
one form every backend accepts (gloo takes all-gather and reduce-scatter only as a flat concatenation).
Nothing here assumes CUDA. A collective never writes into its input: autograd may hand one gradient tensor
to several consumers (an add's backward gives the same tensor to both operands).

Expert parallelism's all-to-all (rows to each rank, a count to each) has no Function here: ``all_to_all`` sends and
waits, ``start_all_to_all`` puts the rows on the wire asynchronously so that a layer computes while they travel, and
models/moe.py's Functions put the rows in order around them, the reverse exchange in backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

SEQ_DIM = 1


# torch renamed the flat collectives; pyproject allows torch >= 2.4, which has only the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class GroupShape:
    """A group's rank and size with no processes behind it: what a layer reads to shape its parameters when a model
    is built on the meta device to be counted (the memory estimator, trident/memory/params.py). Never a group to
    communicate over: a collective given one fails."""

    rank: int
    size: int


def rank_and_size(group: dist.ProcessGroup | GroupShape | None) -> tuple[int, int]:
    """This rank's index in ``group`` and the group's size; no group is a group of one."""
    if group is None:
        return 0, 1
    if isinstance(group, GroupShape):
        return group.rank, group.size
    return dist.get_rank(group), dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)
    dist.all_reduce(out, group=group)
    return out


def _all_gather(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, rank 0's first."""
    size = dist.get_world_size(group)
    dim %= x.dim()
    x = x.contiguous()
    out = x.new_empty((size, *x.shape))
    _all_gather_flat(out.view(-1), x.view(-1), group=group)
    # [tp, ..., n, ...] -> [..., tp * n, ...]: a view when dim is 0, one copy otherwise.
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's block of ``dim``."""
    size = dist.get_world_size(group)
    dim %= x.dim()
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of a tensor of shape {tuple(x.shape)} does not split over {size} ranks")
    blocks = x.unflatten(dim, (size, -1)).movedim(dim, 0).contiguous()  # [tp, ..., n / tp, ...]
    out = blocks.new_empty(blocks.shape[1:])
    _reduce_scatter_flat(out.view(-1), blocks.view(-1), group=group)
    return out


def _split(x: torch.Tensor, group: dist.ProcessGroup, dim: int) -> torch.Tensor:
    """This rank's block of ``dim`` (a copy, like every other result here)."""
    rank, size = rank_and_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"dim {dim} of a tensor of shape {tuple(x.shape)} does not split over {size} ranks")
    return x.chunk(size, dim)[rank].contiguous()


class CopyToRegion(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (each rank used X for its own slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class ReduceFromRegion(torch.autograd.Function):
    """All-reduce forward (partial sums -> the whole); identity backward (each rank's part had slope 1)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim forward; backward keeps this rank's slice of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _split(grad, ctx.group, -1), None


class SplitLastDim(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group, -1), None


class GatherSequence(torch.autograd.Function):
    """All-gather the sequence shards forward; backward reduce-scatters: every rank's gradient of the whole
    sequence is a partial sum (it came through that rank's slice of the next weight)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter(grad, ctx.group, SEQ_DIM), None


class ReduceScatterSequence(torch.autograd.Function):
    """Sum partial results and keep this rank's sequence shard forward; backward all-gathers the shards'
    gradients (each rank's partial result fed every position)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter(x, group, SEQ_DIM)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather(grad, ctx.group, SEQ_DIM), None


# Typed entry points. A group of one is the identity both ways: no collective, no copy.


def copy_to_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else CopyToRegion.apply(x, group)


def reduce_from_region(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ReduceFromRegion.apply(x, group)


def gather_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else GatherLastDim.apply(x, group)


def split_last_dim(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else SplitLastDim.apply(x, group)


def gather_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else GatherSequence.apply(x, group)


def reduce_scatter_sequence(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    return x if dist.get_world_size(group) == 1 else ReduceScatterSequence.apply(x, group)


class InFlight:
    """An all-to-all on the wire (``start_all_to_all``; ``work`` None: one already done): ``wait`` returns the rows
    received. The work keeps the tensors it sends and fills alive until then, and is dropped on this thread (see
    parallel/reducer.py's finish)."""

    def __init__(self, out: torch.Tensor, work: dist.Work | None) -> None:
        self.out, self.work = out, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


def _exchange(
    out: torch.Tensor, x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup
) -> dist.Work:
    """``x``'s rows sent (``send`` to each rank) into ``out`` (``recv`` from each), started: the process group's own
    call, not ``dist.all_to_all_single``, whose checks and logging wrapper cost tens of microseconds a call (an
    exchange per sparse layer, micro-batch and direction). Every tensor here is dense and real, of one dtype."""
    return group.alltoall_base(out, x, recv, send, dist.AllToAllOptions())


def all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows ``[sum(send), ...]`` of ``x``: the first ``send[0]`` to rank 0 of ``group``, the next to rank 1, ...;
    returns the ``sum(recv)`` rows received, rank 0's first (no gradient)."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    _exchange(out, x.contiguous(), send, recv, group).wait()
    return out


def start_all_to_all(x: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup) -> InFlight:
    """``all_to_all``'s exchange of ``x``, started (async, no gradient): what to compute while the rows travel goes
    between this and ``wait``."""
    out = x.new_empty((sum(recv), *x.shape[1:]))
    return InFlight(out, _exchange(out, x.contiguous(), send, recv, group))
