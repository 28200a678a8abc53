"""Megatron-style tensor-parallel layers and the vocab-parallel cross-entropy (fused with the LM head, in chunks).

Each layer takes its tp group in the constructor, holds only its slice of every split parameter, and declares
each parameter's ``Placement`` (logical shape, split dim, tp rank and size, padding): init, checkpoints and the
gradient norm read that, never the local shape. With no group, or a group of one, a layer is exactly its
plain torch counterpart: the same kernels, no collective, no copy.

Sequence parallelism (``sequence_parallel=True``): outside the column -> row regions, activations are
``[batch, seq / tp, ...]`` shards. A column-parallel layer all-gathers its input along the sequence instead of
taking it replicated, and a row-parallel layer reduce-scatters its output instead of all-reducing it: the same
bytes as the all-reduce, with LayerNorm and dropout done once per token instead of on every tp rank.
Parameters every tp rank holds whole then see only their rank's tokens, so their gradients are partial sums
that are completed after backward: the model marks them (``Placement.grad_sums``: "tp"), and
parallel/grad_sums.py sums them over tp after the dp reduction.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trident.parallel.comm import (
    copy_to_region,
    gather_last_dim,
    gather_sequence,
    rank_and_size,
    reduce_from_region,
    reduce_scatter_sequence,
    split_last_dim,
)
from trident.parallel.fp8 import Fp8Spec, maybe_fp8_linear
from trident.parallel.placement import Placement, set_placement
from trident.parallel.wgrad import WeightGradStore


def tp_split_error(key: str, value: int, tp: int) -> str | None:
    """A one-line message if ``value`` does not split over ``tp`` ranks, naming the nearest values that do."""
    if value % tp == 0:
        return None
    below, above = value // tp * tp, (value // tp + 1) * tp
    sizes = " or ".join(str(v) for v in (below, above) if v > 0)
    divisors = [d for d in range(1, value + 1) if value % d == 0]
    smaller = max(d for d in divisors if d < tp)
    larger = [d for d in divisors if d > tp][:1]
    tps = " or ".join(str(d) for d in [smaller, *larger])
    return f"{key}={value} is not divisible by parallel.tp={tp}; use {key}={sizes}, or parallel.tp={tps}"


def kv_heads_error(n_heads: int, n_kv_heads: int, tp: int) -> str | None:
    """A one-line message if the key/value heads can neither be split over ``tp`` ranks (tp divides them) nor
    replicated (each rank's query heads all in one kv group: tp a multiple of them), naming the tp values that do."""
    if n_kv_heads % tp == 0 or tp % n_kv_heads == 0:
        return None
    valid = [t for t in range(1, n_heads + 1) if n_heads % t == 0 and (n_kv_heads % t == 0 or t % n_kv_heads == 0)]
    return (
        f"model.n_kv_heads={n_kv_heads} neither splits over nor replicates across parallel.tp={tp} (tp must divide "
        f"the kv heads or be a multiple of them); use parallel.tp={' or '.join(map(str, valid))}"
    )


def _check_split(key: str, value: int, tp: int) -> None:
    if error := tp_split_error(key, value, tp):
        raise ValueError(error)


def _parameter(placement: Placement) -> nn.Parameter:
    # Zeros, not garbage: padding rows must be zero, and a model used before init_weights stays finite.
    return set_placement(nn.Parameter(torch.zeros(placement.local_shape)), placement)


class ColumnParallelLinear(nn.Module):
    """Y = X W^T + b with W split by output rows: tp rank r holds W[r*k:(r+1)*k] and b[r*k:(r+1)*k]
    (k = out / tp) and computes Y[..., r*k:(r+1)*k]; X enters replicated (its gradient is summed over tp),
    or with sequence parallelism as a sequence shard that is all-gathered."""

    fp8: Fp8Spec | None = None  # FP8 GEMMs (parallel/fp8.py enable_fp8)
    wgrad: WeightGradStore | None = None  # the weight gradient deferred to W (parallel/wgrad.py)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = rank_and_size(tp_group)
        _check_split("out_features", out_features, tp_size)
        self.tp_group, self.tp_size = tp_group, tp_size
        self.gather_output = gather_output
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.weight = _parameter(Placement((out_features, in_features), 0, tp_rank, tp_size))
        if bias:
            self.bias = _parameter(Placement((out_features,), 0, tp_rank, tp_size))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.local(self.enter(x))

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """The input as the tp region takes it: replicated (its gradient summed over tp) or, with sequence
        parallelism, the whole sequence gathered. Layers that share one input enter it once (attention's q, kv)."""
        if self.tp_size == 1:
            return x
        return gather_sequence(x, self.tp_group) if self.sequence_parallel else copy_to_region(x, self.tp_group)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's output columns of an input already entered."""
        y = maybe_fp8_linear(x, self.weight, self.bias, self.fp8, self.wgrad)
        return gather_last_dim(y, self.tp_group) if self.gather_output and self.tp_size > 1 else y


class ReplicatedColumnLinear(nn.Module):
    """A linear layer of ``parts`` output blocks that fewer than tp ranks would share: every tp rank holds all of
    it and computes block ``tp_rank * parts // tp`` (grouped-query attention's key/value heads when there are fewer
    of them than tp ranks, as Megatron replicates them). The input is one already entered into the tp region (by
    the column-parallel layer beside it). Each rank's gradient covers only its block, for its own share of the
    uses: the sum over tp is the gradient, so the weight is marked for one (``grad_sums`` "tp")."""

    fp8: Fp8Spec | None = None  # FP8 GEMMs (parallel/fp8.py enable_fp8)

    def __init__(
        self, in_features: int, out_features: int, parts: int, tp_group: dist.ProcessGroup | None, bias: bool = True
    ) -> None:
        super().__init__()
        tp_rank, tp_size = rank_and_size(tp_group)
        if out_features % parts or tp_size % parts:
            raise ValueError(f"{parts} blocks of {out_features} rows cannot be shared by {tp_size} tp ranks")
        block = out_features // parts
        self.rows = slice(tp_rank * parts // tp_size * block, (tp_rank * parts // tp_size + 1) * block)
        grad_sums = ("tp",) if tp_size > 1 else ()
        self.weight = _parameter(Placement((out_features, in_features), grad_sums=grad_sums))
        if bias:
            self.bias = _parameter(Placement((out_features,), grad_sums=grad_sums))
        else:
            self.register_parameter("bias", None)

    def local(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[self.rows]
        return maybe_fp8_linear(x, self.weight[self.rows], bias, self.fp8)


class RowParallelLinear(nn.Module):
    """Y = X W^T + b with W split by input columns: tp rank r holds W[:, r*k:(r+1)*k] (k = in / tp) and
    multiplies X[..., r*k:(r+1)*k]; the partial products are summed over tp (all-reduce, or with sequence
    parallelism a reduce-scatter to sequence shards) and b, held whole by every rank, is added once."""

    fp8: Fp8Spec | None = None  # FP8 GEMMs (parallel/fp8.py enable_fp8)
    wgrad: WeightGradStore | None = None  # the weight gradient deferred to W (parallel/wgrad.py)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        tp_group: dist.ProcessGroup | None = None,
        bias: bool = True,
        input_is_parallel: bool = True,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = rank_and_size(tp_group)
        _check_split("in_features", in_features, tp_size)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("a sequence-parallel RowParallelLinear takes its input already split (input_is_parallel)")
        self.tp_group, self.tp_size = tp_group, tp_size
        self.input_is_parallel = input_is_parallel
        self.sequence_parallel = sequence_parallel and tp_size > 1
        self.weight = _parameter(Placement((out_features, in_features), 1, tp_rank, tp_size))
        if bias:
            self.bias = _parameter(Placement((out_features,)))
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return maybe_fp8_linear(x, self.weight, self.bias, self.fp8, self.wgrad)
        if not self.input_is_parallel:
            x = split_last_dim(x, self.tp_group)
        partial = maybe_fp8_linear(x, self.weight, None, self.fp8, self.wgrad)
        if self.sequence_parallel:
            y = reduce_scatter_sequence(partial, self.tp_group)
        else:
            y = reduce_from_region(partial, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """E[ids] with E's vocab rows padded to ``padded`` and split: tp rank r holds rows [r*k, (r+1)*k)
    (k = padded / tp), looks up the ids in its block and zeros the rest; the partial results are summed over
    tp (all-reduce, or with sequence parallelism a reduce-scatter to sequence shards).

    ``logits`` is the tied LM head, X E^T, column-parallel by vocab: rank r computes the logits of its block."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        tp_group: dist.ProcessGroup | None = None,
        padded: int | None = None,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp_rank, tp_size = rank_and_size(tp_group)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.tp_size = tp_group, tp_size
        self.sequence_parallel = sequence_parallel and tp_size > 1
        placement = Placement((num_embeddings, embedding_dim), 0, tp_rank, tp_size, padded)
        self.weight = _parameter(placement)
        self.vocab_start = placement.offsets[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        block = self.weight.shape[0]
        foreign = (ids < self.vocab_start) | (ids >= self.vocab_start + block)
        local = (ids - self.vocab_start).masked_fill(foreign, 0)
        x = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_sequence(x, self.tp_group)
        return reduce_from_region(x, self.tp_group)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., vocab] at tp=1 (padding rows dropped); at tp>1 this rank's block of the padded
        vocab, [..., padded / tp], whose padding columns ``vocab_parallel_cross_entropy`` leaves out."""
        if self.tp_size == 1:
            # Slice only when there are padding rows: slicing the whole weight would still cost a zero-filled copy
            # of its gradient in backward.
            weight = self.weight if self.weight.shape[0] == self.num_embeddings else self.weight[: self.num_embeddings]
            return F.linear(x, weight)
        x = gather_sequence(x, self.tp_group) if self.sequence_parallel else copy_to_region(x, self.tp_group)
        return F.linear(x, self.weight)

    def loss_sum(self, x: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
        """The summed fp32 cross-entropy of ``logits(x)`` against ``targets``, the head's matmul and the loss fused
        ``chunk`` tokens at a time (``_LinearCrossEntropy``): never the whole logits. Computed in the autocast
        dtype when autocast is on, as ``logits`` would be, else in the weight's."""
        if self.tp_size > 1:
            x = gather_sequence(x, self.tp_group) if self.sequence_parallel else copy_to_region(x, self.tp_group)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else self.weight.dtype
        group = self.tp_group if self.tp_size > 1 else None
        x, t = x.reshape(-1, x.shape[-1]), targets.reshape(-1)
        return _LinearCrossEntropy.apply(x, self.weight, t, group, self.num_embeddings, chunk, dtype)


def _block_loss(
    z: torch.Tensor, t: torch.Tensor, group: dist.ProcessGroup | None, start: int, grad: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Megatron's cross-entropy over vocab-sharded logits: ``z`` fp32 [n, real], this rank's real vocabulary
    columns from ``start`` (overwritten), ``t`` [n] the token ids. With m the max over the whole vocab:
    loss = log(sum_v exp(z_v - m)) - (z_target - m), the max reduced with MAX and the two sums with one SUM over tp;
    the target logit is read on the rank whose block holds it (0 elsewhere). Returns the summed loss and, with
    ``grad``, its gradient softmax - onehot on this rank's columns, built in ``z``."""
    real = z.shape[-1]
    owned = (t >= start) & (t < start + real)
    local_t = (t - start).masked_fill(~owned, 0)
    m = z.amax(dim=-1) if real else z.new_full((z.shape[0],), float("-inf"))  # a block of padding adds nothing
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = z.sub_(m.unsqueeze(-1))
    target_z = z.new_zeros(z.shape[0])
    if real:
        target_z = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
    exp = z.exp_()
    sums = torch.stack([exp.sum(dim=-1), target_z])
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sums, group=group)
    loss = (sums[0].log() - sums[1]).sum()
    if not grad:
        return loss, None
    softmax = exp.div_(sums[0].unsqueeze(-1))
    if real:
        softmax[torch.arange(z.shape[0], device=z.device), local_t] -= owned.to(z.dtype)
    return loss, softmax


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``_block_loss`` over this rank's whole block of logits, its gradient kept for backward."""

    @staticmethod
    def forward(
        ctx, logits: torch.Tensor, targets: torch.Tensor, group: dist.ProcessGroup, vocab_size: int
    ) -> torch.Tensor:
        block = logits.shape[-1]
        start = rank_and_size(group)[0] * block
        # Only the first ``real`` columns of this block are vocabulary; the padding never enters the sums.
        real = max(0, min(block, vocab_size - start))
        t = targets.reshape(-1)
        z = logits.narrow(-1, 0, real).reshape(t.numel(), real).to(torch.float32, copy=True)  # built on in place
        loss, grad_z = _block_loss(z, t, group, start, True)
        ctx.save_for_backward(grad_z)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (grad_z,) = ctx.saved_tensors
        grad_z.mul_(grad)  # ours alone, and backward runs once: in place
        block = ctx.shape[-1]
        if grad_z.shape[-1] < block:
            grad_z = F.pad(grad_z, (0, block - grad_z.shape[-1]))  # padding columns: zero gradient
        return grad_z.view(ctx.shape).to(ctx.dtype), None, None, None


class _LinearCrossEntropy(torch.autograd.Function):
    """The LM head's matmul fused with the cross-entropy, ``chunk`` tokens at a time: x [n, d] (at tp > 1 every
    token, gathered), this rank's weight block [block, d], targets [n]. Per chunk the logits in ``dtype``, their
    fp32 copy and its softmax exist only while that chunk runs (``_block_loss``); no [n, vocab] tensor ever does.

    The gradients are computed in forward (as Liger's fused linear cross-entropy): per chunk grad_x[chunk] = g W
    and grad_W += g^T x (fp32), g the chunk's softmax - onehot in ``dtype``; backward only scales them by the loss's
    gradient. Kept from forward to backward: grad_x [n, d] and grad_W [block, d], d / (vocab / tp) of the fp32
    logits and softmax today's loss keeps, and the head's input is not kept at all. Recomputing the logits in
    backward instead would keep x (about grad_x's bytes) but cost one more head matmul, and under the zero-bubble
    schedules, whose input and weight passes each run this backward, two more; here a second backward is two
    scalings."""

    @staticmethod
    def forward(ctx, x, weight, targets, group, vocab_size: int, chunk: int, dtype: torch.dtype) -> torch.Tensor:
        block = weight.shape[0]
        start = rank_and_size(group)[0] * block
        real = max(0, min(block, vocab_size - start))
        w = weight[:real].to(dtype)
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        for lo in range(0, x.shape[0], chunk):
            h = x[lo : lo + chunk].to(dtype)
            loss, g = _block_loss((h @ w.T).float(), targets[lo : lo + chunk], group, start, need_x or need_w)
            total += loss
            if g is None:
                continue
            g = g.to(dtype)
            if need_x:
                grad_x[lo : lo + chunk] = g @ w
            if need_w and dtype == torch.float32:
                grad_w[:real].addmm_(g.T, h)
            elif need_w:
                grad_w[:real] += g.T @ h
        ctx.save_for_backward(grad_x, None if grad_w is None else grad_w.to(weight.dtype))
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        # Not in place: the zero-bubble schedules run this backward twice (their I and W passes).
        return *(None if g is None else g * grad for g in ctx.saved_tensors), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, tp_group: dist.ProcessGroup, vocab_size: int
) -> torch.Tensor:
    """Summed token cross-entropy (fp32) from vocab-sharded logits, never gathering the vocabulary.

    ``logits`` is this rank's block [..., padded / tp] (``VocabParallelEmbedding.logits``), ``targets`` the
    token ids [...], the same on every tp rank. Columns at or past ``vocab_size`` are padding: they get no
    probability and no gradient. Every tp rank returns the same loss.
    """
    return _VocabParallelCrossEntropy.apply(logits, targets, tp_group, vocab_size)
