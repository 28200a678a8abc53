"""Attention of one (query block, key block) pair, returning (output, log-sum-exp), and its backward.

Every cp exchange is built from this one piece. With ``s = q k^T * scale`` masked by the spans (span.py)::

    lse = log sum_j exp(s_ij)          (fp32, or fp64 for fp64 inputs; -inf for a row that sees no key)
    out = sum_j exp(s_ij - lse_i) v_j  (0 for such a row)

and, given the final ``out``, ``lse`` and ``dout`` of a query row (which may have merged several key blocks: the
ring), the block's share of the gradients, flash-attention style (``P = exp(s - lse)``, ``D = rowsum(dout * out)``)::

    dv = P^T dout    dS = P * (dout v^T - D)    dq = dS k * scale    dk = dS^T q * scale

Grouped-query attention: k and v have G heads, q has H = G r; query head h reads kv head ``h // r`` (Hugging Face's
order), and the kv gradients sum over the r query heads of each group.

SDPA's kernels compute both directions where they can, the mask as an additive bias and the log-sum-exp returned
(grouped kv heads repeated to the query heads): on a CPU its flash kernel (any float dtype; the tests run it), on
CUDA in fp16/bf16 the memory-efficient one (not exercised by the CPU tests). Elsewhere (CUDA in fp32, other
devices) the same math in plain PyTorch, in the accumulation dtype (``_plain_forward``, ``_plain_backward``).
Either way a row that sees no key gets output 0 and log-sum-exp -inf.

A mask is a bool tensor, or a ``PlainMask`` where its form is known (``plain_form``): every key seen, or the lower
triangle of a square block. The ring reads its quarters' forms once per forward, on the host spans (ring.py
``RingPlan``), and the CPU kernel then takes no bias, nothing being built or read per call; a bool tensor is taken
as it is (a bias), its form never read on the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

_CUDA_DTYPES = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16- and 32-bit inputs, fp64 for fp64: the dtype partial outputs and log-sum-exps are merged in."""
    return torch.promote_types(dtype, torch.float32)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)


@dataclass(frozen=True)
class PlainMask:
    """A block mask ``[B or 1, T_q, T_k]`` known by its form: every key seen (``causal`` False) or, in a square
    block, the lower triangle (True). Every query row sees a key."""

    causal: bool
    shape: tuple[int, int, int]

    def dense(self, device: torch.device) -> torch.Tensor:
        seen = torch.ones(self.shape[-2:], dtype=torch.bool, device=device)
        return (seen.tril() if self.causal else seen).expand(self.shape)


Mask = torch.Tensor | PlainMask


def plain_form(mask: np.ndarray) -> PlainMask | None:
    """A host mask (numpy bool ``[B or 1, T_q, T_k]``, from span.py's host spans) as a ``PlainMask`` where it is
    one, else None (a dense mask, built from the device spans where it is used)."""
    if mask.all():
        return PlainMask(False, tuple(mask.shape))
    tq, tk = mask.shape[-2:]
    if tq == tk and np.array_equal(mask, np.broadcast_to(np.tri(tq, dtype=bool), mask.shape)):
        return PlainMask(True, tuple(mask.shape))
    return None


def _dense(mask: Mask, q: torch.Tensor) -> torch.Tensor:
    return mask.dense(q.device) if isinstance(mask, PlainMask) else mask


def _uses_kernel(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in _CUDA_DTYPES


def _uses_cpu_kernel(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype.is_floating_point


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, T, D] -> [B, G, r, T, D]: the query heads of each kv head together."""
    b, h, t, d = q.shape
    return q.view(b, kv_heads, h // kv_heads, t, d)


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked scores [B, G, r, T_q, T_k] in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    s = (_grouped(q.to(acc), k.shape[1]) @ k.to(acc).unsqueeze(2).transpose(-2, -1)) * scale
    return s.masked_fill(~mask[:, None, None], float("-inf"))


def _probs(s: torch.Tensor, lse: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    # A row that sees no key has lse -inf and s -inf: its probabilities are 0, not nan.
    return torch.where(mask[:, None, None], (s - lse.unsqueeze(-1)).exp(), 0.0)


def block_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, T_q, D], lse [B, H, T_q]), both in the accumulation dtype. ``mask``: bool [B or 1, T_q, T_k], or
    a ``PlainMask``."""
    if _uses_kernel(q):
        return _kernel_forward(q, k, v, _dense(mask, q), scale)
    with _no_autocast(q):
        if _uses_cpu_kernel(q):
            return _cpu_forward(q, k, v, mask, scale)
        return _plain_forward(q, k, v, _dense(mask, q), scale)


def _no_autocast(q: torch.Tensor) -> torch.autocast:
    # Under 16-bit autocast the matmuls would run, and the log-sum-exp come out, in 16 bits: the plain path computes
    # in the accumulation dtype it casts to.
    return torch.autocast(q.device.type, enabled=False)


def _plain_forward(q, k, v, mask, scale):
    b, h, t, d = q.shape
    acc = accumulation_dtype(q.dtype)
    s = _scores(q, k, mask, scale)
    lse = s.logsumexp(dim=-1)
    out = _probs(s, lse, mask) @ v.to(acc).unsqueeze(2)
    return out.reshape(b, h, t, d), lse.reshape(b, h, t)


def block_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This block's (dq, dk, dv) in the accumulation dtype, given the query rows' final ``out``, ``lse`` and
    ``dout`` (over every key block they attended to)."""
    if _uses_kernel(q):
        return _kernel_backward(q, k, v, _dense(mask, q), out, lse, dout, scale)
    with _no_autocast(q):
        if _uses_cpu_kernel(q):
            return _cpu_backward(q, k, v, mask, out, lse, dout, scale)
        return _plain_backward(q, k, v, _dense(mask, q), out, lse, dout, scale)


def _plain_backward(q, k, v, mask, out, lse, dout, scale):
    b, h, t, d = q.shape
    g = k.shape[1]
    acc = accumulation_dtype(q.dtype)
    s = _scores(q, k, mask, scale)
    p = _probs(s, _grouped(lse.to(acc).unsqueeze(-1), g).squeeze(-1), mask)
    do, o = _grouped(dout.to(acc), g), _grouped(out.to(acc), g)
    dv = (p.transpose(-2, -1) @ do).sum(dim=2)
    dp = do @ v.to(acc).unsqueeze(2).transpose(-2, -1)
    ds = p * (dp - (do * o).sum(dim=-1, keepdim=True))
    dq = (ds @ k.to(acc).unsqueeze(2)) * scale
    dk = (ds.transpose(-2, -1) @ _grouped(q.to(acc), g)).sum(dim=2) * scale
    return dq.reshape(b, h, t, d), dk, dv


class BlockAttention(torch.autograd.Function):
    """One block as an autograd op: the output in q's dtype (differentiable) and the log-sum-exp (not)."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale):
        out, lse = block_forward(q, k, v, mask, scale)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        ctx.scale = scale
        ctx.mark_non_differentiable(lse)
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        dq, dk, dv = block_backward(q, k, v, mask, out, lse, dout, ctx.scale)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def block_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out in q's dtype, lse) of q against one key block, differentiable in q, k and v."""
    return BlockAttention.apply(q, k, v, mask, default_scale(q.shape[-1]) if scale is None else scale)


def merge(
    out: torch.Tensor | None, lse: torch.Tensor | None, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fold a block's partial (out, lse) into the running one, in the accumulation dtype: the log-sum-exp of the
    union and the outputs weighted by their share of it. ``out`` None: the first block."""
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    # Rows that have seen no key in either part stay -inf with output 0 (exp(-inf - -inf) would be nan).
    seen = new_lse > float("-inf")
    safe = torch.where(seen, new_lse, 0.0)
    a = torch.where(seen, (lse - safe).exp(), 0.0).unsqueeze(-1)
    b = torch.where(seen, (block_lse - safe).exp(), 0.0).unsqueeze(-1)
    return out * a + block_out * b, new_lse


# CPU: SDPA's flash kernel, which takes an additive bias and returns the log-sum-exp (0 for a row that sees no key).


def _grouped_sum(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, T, D] gradients of kv repeated to the query heads -> [B, G, T, D], summed over each group; as they are
    where each group is one head (no copy)."""
    b, h, t, d = x.shape
    return x if h == kv_heads else x.view(b, kv_heads, h // kv_heads, t, d).sum(dim=2)


def _cpu_forward(q, k, v, mask, scale):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    causal, bias = _cpu_mask(mask, q)
    out, lse = op(q, _expand_kv(q, k), _expand_kv(q, v), 0.0, causal, attn_mask=bias, scale=scale)
    acc = accumulation_dtype(q.dtype)
    if isinstance(mask, PlainMask):  # every row sees a key
        return out.to(acc), lse.to(acc)
    return out.to(acc), torch.where(mask.any(dim=-1)[:, None], lse.to(acc), float("-inf"))


def _cpu_backward(q, k, v, mask, out, lse, dout, scale):
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    acc, g = accumulation_dtype(q.dtype), k.shape[1]
    causal, bias = _cpu_mask(mask, q)
    dq, dk, dv = op(
        dout.to(q.dtype), q, _expand_kv(q, k), _expand_kv(q, v), out.to(q.dtype), lse.to(acc).nan_to_num(neginf=0.0),
        0.0, causal, attn_mask=bias, scale=scale,
    )  # fmt: skip
    return dq.to(acc), _grouped_sum(dk, g).to(acc), _grouped_sum(dv, g).to(acc)


def _cpu_mask(mask: Mask, q: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """The kernel's (is_causal, attn_mask) for ``mask``: no mask where every key is seen, its own causal mask for
    a lower triangle (``PlainMask``s: it then skips the blocks above the diagonal, a ring's block of a chunk with
    itself), else the bool mask as an additive bias [B or 1, 1, T_q, T_k] in q's dtype (it takes no boolean one)."""
    if isinstance(mask, PlainMask):
        return mask.causal, None
    return False, torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))[:, None]


# CUDA: the memory-efficient SDPA kernel, which takes an additive bias and returns the log-sum-exp.


def _bias(mask: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    b, h, tq, _ = q.shape
    tk = k.shape[-2]
    # The kernel wants the bias' rows 16-element aligned (as SDPA pads it): a padded buffer, viewed to the keys.
    bias = torch.zeros(*mask.shape[:-1], tk + (-tk % 16), dtype=q.dtype, device=q.device)[..., :tk]
    bias.masked_fill_(~mask, float("-inf"))
    return bias[:, None].expand(b, h, tq, tk)


def _expand_kv(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """k or v repeated to q's heads; as it is with as many heads (no copy)."""
    r = q.shape[1] // x.shape[1]
    return x if r == 1 else x.repeat_interleave(r, dim=1)


def _kernel_forward(q, k, v, mask, scale):
    t = q.shape[-2]
    op = torch.ops.aten._scaled_dot_product_efficient_attention
    out, lse, _, _ = op(q, _expand_kv(q, k), _expand_kv(q, v), _bias(mask, q, k), True, 0.0, False, scale=scale)
    acc = accumulation_dtype(q.dtype)
    # The kernel's output for a row that sees no key is not specified: make it the plain path's (0, -inf).
    seen = mask.any(dim=-1)[:, None].expand(q.shape[0], q.shape[1], t)
    lse = torch.where(seen, lse[..., :t].to(acc), float("-inf"))
    return torch.where(seen.unsqueeze(-1), out.to(acc), 0.0), lse


def _kernel_backward(q, k, v, mask, out, lse, dout, scale):
    b, h, t, _ = q.shape
    padded = torch.zeros(b, h, math.ceil(t / 32) * 32, dtype=torch.float32, device=q.device)
    # A row that sees no key: any finite lse gives it probabilities exp(-inf) = 0 (its -inf would give nan).
    padded[..., :t] = lse.float().nan_to_num(neginf=0.0)
    zero = torch.zeros((), dtype=torch.int64, device=q.device)
    op = torch.ops.aten._scaled_dot_product_efficient_attention_backward
    kx, vx = _expand_kv(q, k), _expand_kv(q, v)
    dq, dk, dv, _ = op(
        dout.to(q.dtype), q, kx, vx, _bias(mask, q, k), out.to(q.dtype), padded, zero, zero, 0.0,
        [True, True, True, False], False, scale=scale,
    )  # fmt: skip
    g, acc = k.shape[1], accumulation_dtype(q.dtype)
    return dq.to(acc), _grouped_sum(dk, g).to(acc), _grouped_sum(dv, g).to(acc)
