"""Mixture-of-experts MLP (``model.moe.*``): a router picks ``top_k`` of ``experts`` MLPs for each token, their
outputs are summed with the router's weights, and ``shared_experts`` (if any) see every token.

    router      logits = x W_r^T (fp32); softmax over all experts (Mixtral, Qwen3-MoE, OLMoE) or sigmoid scores
                (DeepSeek-V3); the top k chosen on score + bias (the loss-free balancing bias, zero unless
                ``bias_update_rate``), weighted by the scores alone, renormalised to sum 1 (``norm_topk``, always
                with sigmoid)
    dispatch    the (token, expert) pairs sorted by expert, stable, so each expert's tokens are one contiguous run
                in token order; with a capacity the pairs past it are dropped, in token order (below)
    experts     every expert's MLP at once: ``torch._grouped_mm`` over the runs (the row offsets), or a loop of
                one matmul per expert where the build lacks it or the widths are not 16-byte aligned
    combine     each pair's output times its weight, added back into its token's row (``index_add_``, pairs of a
                token in expert order)

Capacity, the balancing bias and its exits, the experts' weight layout, the auxiliary losses, tensor, sequence and
context parallelism's token splits, expert parallelism's all-to-all and the estimator's traced routing: docs/models.md
("How the MoE layer computes").

The layer is one file read top to bottom (router, experts, dispatch, combine, balancing), as models/gpt.py is, so
it stays whole past ~400 lines.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trident.config.schema import ModelConfig, MoEConfig
from trident.models.kv_cache import KVCache
from trident.parallel.comm import (
    GroupShape,
    InFlight,
    all_to_all,
    gather_sequence,
    rank_and_size,
    reduce_from_region,
    start_all_to_all,
)
from trident.parallel.context.split import head_tail_order, rank_index
from trident.parallel.placement import Placement, replicated, set_placement


class AuxLoss(torch.autograd.Function):
    """Identity on ``x``; in backward, ``aux`` receives the gradient ``scale`` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale
        ctx.aux_meta = (aux.shape, aux.dtype)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        shape, dtype = ctx.aux_meta
        return grad, torch.full(shape, ctx.scale, dtype=dtype, device=grad.device), None


class Route(NamedTuple):
    """An expert exchange's sizes (``MoE._combine``, from the host's counts): the rows this rank sends each rank of
    ``group`` and receives from each. The rows an owner receives come in two orders:
    source-major (source by source, each source's expert-major, as an exact all-to-all delivers them) and
    expert-major (expert by expert, sources in order, as its experts take them); ``to_expert`` (each expert-major
    row's source-major place) and its inverse ``to_source`` map one to the other."""

    send: list[int]
    recv: list[int]
    group: dist.ProcessGroup


class ToExperts(torch.autograd.Function):
    """The rows ``rows`` this rank sent, as its experts receive them: ``received`` (the exchange's buffer, done)
    gathered expert-major by ``taken`` (each expert-major row's place in it), one gather for the received rows'
    selection and order. Backward puts the gradient source-major and returns it home, each pair's to its row."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, rows: torch.Tensor, received: torch.Tensor, taken: torch.Tensor, to_source: torch.Tensor, route: Route
    ) -> torch.Tensor:
        ctx.route = route
        ctx.save_for_backward(to_source)
        return received.index_select(0, taken)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None, None]:  # type: ignore[override]
        r, (to_source,) = ctx.route, ctx.saved_tensors
        return all_to_all(grad.index_select(0, to_source), r.recv, r.send, r.group), None, None, None, None


class FromExperts(torch.autograd.Function):
    """The experts' outputs ``y`` (expert-major rows) put source-major and returned home: each pair's output to the
    row its pair left from. Backward sends the gradient to the owners and puts it expert-major."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, y: torch.Tensor, to_source: torch.Tensor, to_expert: torch.Tensor, route: Route
    ) -> torch.Tensor:
        ctx.route = route
        ctx.save_for_backward(to_expert)
        return all_to_all(y.index_select(0, to_source), route.recv, route.send, route.group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        r, (to_expert,) = ctx.route, ctx.saved_tensors
        return all_to_all(grad, r.send, r.recv, r.group).index_select(0, to_expert), None, None, None


def _in_backward() -> bool:
    """True while autograd runs a backward: a forward now is a recomputation, whose routing is already counted."""
    return torch._C._current_graph_task_id() != -1


def grouped_mm_fits(dims: tuple[int, ...], dtype: torch.dtype, device: torch.device | None = None) -> bool:
    """``torch._grouped_mm`` exists in this build and takes rows of these widths (16-byte aligned strides) on this
    device: any CPU; a GPU from compute capability 8.0 (bf16 on 9.0 has the fast kernel, the rest a fallback)."""
    size = torch.empty((), dtype=dtype).element_size()
    if device is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 0):
        return False
    return hasattr(torch, "_grouped_mm") and all(d * size % 16 == 0 for d in dims)


def expert_matmul(x: torch.Tensor, w: torch.Tensor, counts: list[int], grouped: bool) -> torch.Tensor:
    """``x`` [sum(counts), k] rows grouped by expert (``counts[e]`` rows each) times each expert's ``w[e]``
    [k, n]: [sum(counts), n]. ``grouped``: one ``torch._grouped_mm``; else one matmul per expert."""
    if grouped:
        offs = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, w, offs=offs)
    return torch.cat([part @ w[e] for e, part in enumerate(x.split(counts))])


class Experts(nn.Module):
    """``experts`` MLPs of hidden size ``f``, their weights stacked row-wise (the module docstring's layout); under
    expert parallelism the ``experts / ep_size`` of ep rank ``ep_rank``."""

    def __init__(self, cfg: ModelConfig, ep_rank: int = 0, ep_size: int = 1) -> None:
        super().__init__()
        e, d, f = cfg.moe.experts, cfg.d_model, cfg.expert_dim
        self.n, self.d, self.f = e // ep_size, d, f

        def stacked() -> nn.Parameter:
            placement = Placement((e * f, d), ep_rank=ep_rank, ep_size=ep_size)
            return set_placement(nn.Parameter(torch.empty(placement.local_shape)), placement)

        self.swiglu = cfg.mlp == "swiglu"
        if self.swiglu:
            self.gate = stacked()
        self.up = stacked()
        self.down = stacked()
        self.grouped = cfg.moe.grouped_mm

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``x`` [sum(counts), d]: each expert's rows in one run, ``counts[e]`` of them, expert by expert."""
        dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
        x = x.to(dtype)
        grouped = self.grouped and grouped_mm_fits((self.d, self.f), dtype, x.device)

        def weight(p: torch.Tensor, transpose: bool) -> torch.Tensor:  # [E, in, out] for x @ w[e]
            w = p.to(dtype).view(self.n, self.f, self.d)
            return w.transpose(-2, -1) if transpose else w

        up = expert_matmul(x, weight(self.up, True), counts, grouped)
        if self.swiglu:
            h = F.silu(expert_matmul(x, weight(self.gate, True), counts, grouped)) * up
        else:
            h = F.gelu(up, approximate="tanh")
        return expert_matmul(h, weight(self.down, False), counts, grouped)


class Router(nn.Module):
    """Scores tokens against experts and picks each token's top k (the module docstring's rules). The loss-free
    balancing bias is a buffer: it moves outside the gradient, after each optimizer step (``step_stats``)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.moe = cfg.moe
        self.weight = replicated(nn.Parameter(torch.empty(cfg.moe.experts, cfg.d_model)))
        self.register_buffer("expert_bias", torch.zeros(cfg.moe.experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``x`` [N, d] -> (logits [N, E] fp32, scores [N, E] fp32, top-k experts [N, k], their weights [N, k])."""
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32 whatever the compute dtype
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.moe.router == "softmax" else logits.sigmoid()
        # The bias is part of the function whatever the rate (which only moves it): a model started from a trained
        # one with another rate, or exported, chooses as it was trained to. Zero, it changes no choice.
        chosen = (scores + self.expert_bias).topk(self.moe.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.moe.router == "sigmoid" or self.moe.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, scores, chosen, weights


class TokenSplit:
    """The ranks one sequence's tokens are spread over: cp (head-tail chunks, parallel/context/split.py), then under
    sequence parallelism tp (each cp rank's part cut in tp contiguous shards). None for a group not split over."""

    def __init__(self, cp_group: dist.ProcessGroup | None, tp_group: dist.ProcessGroup | None) -> None:
        self.cp_group, self.tp_group = cp_group, tp_group
        self.cp_rank, self.cp = rank_and_size(cp_group)
        self.tp_rank, self.tp = rank_and_size(tp_group)
        self.parts = self.cp * self.tp

    def groups(self) -> list[dist.ProcessGroup]:
        return [g for g, size in ((self.tp_group, self.tp), (self.cp_group, self.cp)) if g is not None and size > 1]

    def total(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the ranks of the split (identity backward: each rank's part has slope 1)."""
        for group in self.groups():
            x = reduce_from_region(x, group)
        return x

    def index(self, tokens: int, device: torch.device, window: torch.Tensor | None = None) -> torch.Tensor:
        """The places in the whole sequence of this rank's ``tokens`` tokens, in its order: ``[B or 1, tokens]``.
        ``window`` ``[B or 1, tokens x tp]``: this cp rank's places as its batch split them (with packed documents
        each sample's own, parallel/context/split.py); None: head-tail."""
        if window is None:
            whole = tokens * self.parts
            window = (
                rank_index(whole, self.cp, self.cp_rank, device) if self.cp > 1 else torch.arange(whole, device=device)
            )
        window = window.view(-1, window.shape[-1])
        return window[:, self.tp_rank * tokens : (self.tp_rank + 1) * tokens]

    def whole(self, x: torch.Tensor, window: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``x`` [b, tokens, ...] (no gradient) together: [b, tokens * parts, ...] in sequence order
        (``window`` as ``index`` takes it)."""
        for group in self.groups():  # tp's shards make each cp rank's part, the parts the sequence in rank order
            x = gather_sequence(x, group)
        if self.cp == 1:
            return x
        if window is None:
            out = torch.empty_like(x)
            out[:, head_tail_order(x.shape[1], self.cp, x.device)] = x
            return out
        window = window.reshape(-1, window.shape[-1])
        places = gather_sequence(window.contiguous(), self.cp_group).expand(x.shape[0], -1)  # every rank's, in order
        places = places.reshape(*places.shape, *([1] * (x.dim() - 2))).expand_as(x)
        return torch.empty_like(x).scatter_(1, places, x)


def _places(chosen: torch.Tensor, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``chosen`` [b, t, k]: the experts of b sequences' tokens. Each pair's place among its sequence's pairs of the
    same expert, in token order [b, t, k], and the pairs per (expert, sequence) [experts * b]."""
    b, t, k = chosen.shape
    flat = chosen.reshape(-1)
    order = flat.argsort(stable=True)
    run = flat[order] * b + order // k // t  # (expert, sequence) of each sorted pair: contiguous runs
    per_seq = torch.bincount(run, minlength=experts * b)
    starts = per_seq.cumsum(0) - per_seq
    place = torch.empty_like(flat)
    place[order] = torch.arange(flat.numel(), device=flat.device) - starts[run]
    return place.view(b, t, k), per_seq


# A dispatch whose padded exchange is at most this many bytes a rank goes in one all-to-all, its counts ahead of its
# rows (``MoE._dispatch``): below it a collective's latency costs more than the padding's bytes (gloo on loopback:
# about half a millisecond, the time to move a megabyte).
PADDED_DISPATCH_BYTES = 1 << 20


class TracedRouting(NamedTuple):
    """What a sparse layer reads of its routing on the host, given instead (``MoE.traced``): for a forward on fake
    tensors, whose values none can read (the memory estimator's trace, trident/memory/trace.py). ``kept``: this
    rank's pairs kept per expert; ``received`` (ep > 1): the rows each rank of the ep group sends each of this rank's
    experts, ``[source][local expert]``. The tensors' values are left as the data makes them; only the sizes the host
    would read come from here."""

    kept: list[int]
    received: list[list[int]] | None = None


class Dispatch(NamedTuple):
    """Rows on their way to the experts' owners (``MoE._dispatch``): the rows sent (in pair order), the exchange in
    flight, and either (padded) ``sent`` (the rows sent to each rank, on the device), ``block`` (the rows of each
    rank's block) and ``head`` (its first rows, that hold its counts), or (counts first) ``sizes``: the rows sent to
    each rank, those received from each and the counts received [source][local expert]."""

    rows: torch.Tensor
    started: InFlight
    sent: torch.Tensor | None
    head: int
    block: int | None
    sizes: tuple[list[int], list[int], list[list[int]]] | None


class MoE(nn.Module):
    """The sparse MLP of one layer: router, routed experts and, with ``shared_experts``, a dense MLP beside them."""

    def __init__(
        self,
        cfg: ModelConfig,
        shared: nn.Module | None = None,
        ep_group: dist.ProcessGroup | GroupShape | None = None,
        split: TokenSplit | None = None,
    ) -> None:
        super().__init__()
        self.moe = cfg.moe
        # The window a capacity is taken over: the model's training sequence (tools/generate.py, which builds the
        # model over a longer context, keeps it at the trained one).
        self.seq_len = cfg.seq_len
        self.split = split if split is not None and split.parts > 1 else None  # a sequence split over ranks
        self.router = Router(cfg)
        self.ep_rank, self.ep_size = rank_and_size(ep_group)
        self.ep_group = ep_group
        self.experts = Experts(cfg, self.ep_rank, self.ep_size)
        self.shared = shared
        self.traced: TracedRouting | None = None  # the memory trace's routing; None: read from the data (a run)
        # The gradient the auxiliary losses get per token of a micro-batch: set by the runner (set_loss_multiplier).
        self.loss_multiplier = 0.0
        # A step's sums (training forwards only, each counted once): tokens per expert (before any drop), dropped
        # pairs, tokens, and token-weighted aux and z losses.
        self.register_buffer("step_counts", torch.zeros(cfg.moe.experts, dtype=torch.float64), persistent=False)
        self.register_buffer("step_sums", torch.zeros(4, dtype=torch.float64), persistent=False)

    def capacity(self, tokens: int) -> int | None:
        """The most (token, expert) pairs an expert takes from a sequence, for a window of ``tokens`` tokens (the
        forward passes ``seq_len``, whatever the length of the call); None: dropless."""
        if self.moe.capacity_factor is None:
            return None
        return math.ceil(self.moe.capacity_factor * tokens * self.moe.top_k / self.moe.experts)

    def forward(
        self, x: torch.Tensor, window: torch.Tensor | None = None, cache: KVCache | None = None
    ) -> torch.Tensor:
        """``x`` [b, t, d] (or [n, d]). ``window``: under context parallelism the places of this cp rank's tokens in
        their sequences, as its batch split them (``TokenSplit.index``); a capacity keeps pairs by them. ``cache``
        (generation, one process): ``x`` continues the sequences it holds; a capacity counts their pairs so far."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        n, k, e = x.shape[0], self.moe.top_k, self.moe.experts
        t = shape[-2] if len(shape) > 2 else n  # this rank's tokens per sequence
        b = n // t
        split = self.split
        parts = 1 if split is None else split.parts  # the ranks each sequence is split over
        logits, scores, chosen, weights = self.router(x)

        # Dispatch: the pairs sorted by expert (stable: each expert's tokens in token order, so sequence by
        # sequence). Per sequence: which pairs a capacity keeps and the balancing statistics, so that neither
        # depends on how sequences are grouped into micro-batches and ranks (every layout gives one curve).
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=e)
        cap = self.capacity(self.seq_len)
        if cap is None:
            run = flat[order] * b + order // k // t  # (expert, sequence) of each sorted pair: contiguous runs
            per_seq = torch.bincount(run, minlength=e * b)
            kept = counts
        else:  # a pair's place in its (expert, sequence) run, in the whole sequence, decides whether it is kept
            whole = chosen.view(b, t, k) if split is None else split.whole(chosen.view(b, t, k), window)
            place, per_seq = _places(whole, e)
            if split is not None:
                mine = split.index(t, x.device, window).expand(b, -1)
                place = place.gather(1, mine.unsqueeze(-1).expand(-1, -1, k))
            if cache is not None:  # after the pairs of the tokens the cache holds
                held = cache.routed(self, b, e, x.device)
                place = place + held.gather(1, chosen.view(b, t * k)).view(b, t, k)
                held += per_seq.view(e, b).t()
            if self.traced is None:
                order = order[place.reshape(-1)[order] < cap]
            else:  # as many pairs as the traced routing keeps, in a tensor of their own as the selection makes
                order = order[: sum(self.traced.kept)].clone()
            kept = torch.bincount(flat[order], minlength=e)
        token = order // k
        if self.ep_size == 1:
            y = self.experts(x[token], kept.tolist() if self.traced is None else self.traced.kept)
        else:  # on the wire to their experts' owners while the balancing statistics and the shared experts compute
            dispatch = self._dispatch(x, token, kept)

        # Load balancing (Switch / GShard, per sequence as DeepSeek-V3's sequence-wise loss): E * sum_i f_i P_i,
        # f_i the share of a sequence's pairs expert i was chosen for, P_i its mean (normalised) score over the
        # sequence, averaged over the sequences; and the router z-loss. A split sequence's sums are the split's.
        probs = scores if self.moe.router == "softmax" else scores / scores.sum(-1, keepdim=True)
        if split is None:
            mean = probs.view(b, t, e).mean(1)
        else:
            sums = probs.view(b, t, e).sum(1).flatten()
            if cap is None:  # the counts travel with the scores, in one all-reduce
                per_seq, sums = split.total(torch.cat([per_seq.to(sums.dtype), sums])).split([e * b, b * e])
            else:
                sums = split.total(sums)
            mean, per_seq = sums.view(b, e) / (t * parts), per_seq.detach()
        share = per_seq.view(e, b).t().float() / (t * parts * k)  # [b, e]
        aux = e * (share * mean).sum(-1).mean()
        z = logits.logsumexp(-1).square().mean()
        if self.training and not _in_backward():
            with torch.no_grad():
                self.step_counts += counts.double()
                dropped = (counts - kept).sum().double()
                self.step_sums += torch.stack([dropped, dropped.new_tensor(float(n)), n * aux.double(), n * z.double()])
        shared = self.shared(x.reshape(shape)) if self.shared is not None else None
        if self.ep_size > 1:
            y = self._combine(dispatch)
        y = y.float() * weights.reshape(-1)[order].unsqueeze(-1)
        out = torch.zeros(n, shape[-1], dtype=y.dtype, device=x.device).index_add_(0, token, y).to(x.dtype)
        # The gradient is the runner's multiplier times this rank's tokens: the z-loss is theirs alone, the aux loss
        # the whole sequence's (every rank of a split holds it whole and passes each its own tokens' share).
        extra = self.moe.aux_loss_coef * parts * aux + self.moe.z_loss_coef * z
        if self.training and torch.is_grad_enabled() and self.loss_multiplier and extra.requires_grad:
            out = AuxLoss.apply(out, extra, self.loss_multiplier * n)
        out = out.reshape(shape)
        return out + shared if shared is not None else out

    def _dispatch(self, x: torch.Tensor, token: torch.Tensor, kept: torch.Tensor) -> Dispatch:
        """The rows ``x[token]``, sorted by expert (``kept[e]`` of expert e), started towards their experts' owners.
        A rank sends each owner at most ``bound`` rows (every token's experts are distinct, and each rank of the
        group routes as many tokens); where every rank's ``bound`` rows a block come to at most
        ``PADDED_DISPATCH_BYTES``, each block holds its counts (int64 bytes, in whole rows) and its rows, each put in
        its place by one copy, the padding left as it is (never read), in one all-to-all of equal blocks; else the
        counts go first in a small all-to-all of their own (the rows gathered meanwhile) and then the rows, each
        block as long as it is."""
        ep, local, pairs = self.ep_size, self.n_local, token.shape[0]
        send_counts = kept.view(ep, local)
        head, block = _padded_block(local, x.shape[0] * min(self.moe.top_k, local), x.shape[1] * x.element_size())
        if ep * block * x.shape[1] * x.element_size() <= PADDED_DISPATCH_BYTES:
            rows = x.index_select(0, token)
            sent = send_counts.sum(1)
            # rank r's pairs, from its first (pair ``first[r]``): pair i to row i - first[r] of r's block, past the head
            shift = torch.arange(head, ep * block, block, device=x.device) - sent.cumsum(0) + sent
            place = torch.arange(pairs, device=x.device) + shift.repeat_interleave(sent, output_size=pairs)
            blocks = x.new_empty(ep * block, x.shape[1])
            blocks.view(ep, -1).view(torch.uint8)[:, : local * 8] = send_counts.view(torch.uint8)
            blocks.index_copy_(0, place, rows.detach())
            started = start_all_to_all(blocks, [block] * ep, [block] * ep, self.ep_group)
            return Dispatch(rows, started, sent, head, block, None)
        started = start_all_to_all(send_counts, [1] * ep, [1] * ep, self.ep_group)
        rows = x.index_select(0, token)
        counts = started.wait()  # [source, local expert]
        table = self._table(counts, send_counts.sum(1))
        sizes = [row[local] for row in table], [sum(row[:local]) for row in table], [row[:local] for row in table]
        started = start_all_to_all(rows, sizes[0], sizes[1], self.ep_group)
        return Dispatch(rows, started, None, 0, None, sizes)

    def _combine(self, d: Dispatch) -> torch.Tensor:
        """``_dispatch``'s rows through the experts and back: the received rows gathered expert-major (out of the
        padded blocks too, in the same gather), computed, put back source-major and sent home (module docstring)."""
        ep, local = self.ep_size, self.n_local
        received = d.started.wait()
        if d.block is None:
            (send, recv, table), starts = d.sizes, None
        else:  # each source's block: its counts, then its rows and the padding
            counts = received.view(ep, -1).view(torch.uint8)[:, : local * 8].view(torch.int64)
            header = self._table(counts, d.sent)
            send, table = [row[local] for row in header], [row[:local] for row in header]
            recv = [sum(row) for row in table]
            starts = [r * d.block + d.head for r in range(ep)]
        taken, to_expert, to_source = _expert_major(table, received.device, starts)
        route = Route(send, recv, self.ep_group)
        xe = ToExperts.apply(d.rows, received, taken, to_source, route)
        y = self.experts(xe, [sum(column) for column in zip(*table, strict=True)])
        return FromExperts.apply(y, to_source, to_expert, route)

    def _table(self, counts: torch.Tensor, sent: torch.Tensor) -> list[list[int]]:
        """The exchange's one read on the host: per source, the rows it sends each local expert (``counts``
        [source, local expert]) and last the rows this rank sends it (``sent`` [ep]); a traced routing's instead."""
        if self.traced is None:
            return torch.cat([counts, sent.unsqueeze(1)], 1).tolist()
        kept, local = self.traced.kept, self.n_local
        return [[*rows, sum(kept[r * local : (r + 1) * local])] for r, rows in enumerate(self.traced.received)]

    @property
    def n_local(self) -> int:
        """The experts this rank holds."""
        return self.moe.experts // self.ep_size


def _padded_block(local: int, bound: int, row_bytes: int) -> tuple[int, int]:
    """A padded dispatch's block (``MoE._dispatch``): the rows that hold its ``local`` int64 counts, and all its
    rows, ``bound`` more, rounded up so that every block starts 8-byte aligned (the counts are read in place)."""
    head = -(-local * 8 // row_bytes)
    align = 8 // math.gcd(row_bytes, 8)
    return head, -(-(head + bound) // align) * align


def _expert_major(
    table: list[list[int]], device: torch.device, starts: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows received source-major (source r's run of local expert e: ``table[r][e]`` rows) put expert-major, sources
    in order within each expert (what a stable sort by expert gives): ``taken``, each expert-major row's place in the
    received buffer (source r's rows from ``starts[r]``; None: packed, source after source), ``to_expert``, its
    place among the received rows packed, and ``to_source``, the inverse of ``to_expert``. Each run keeps its rows
    in order and moves by one offset, so each is a range plus that offset repeated over the run: from the host's
    counts, with no sort."""
    ep, local = len(table), len(table[0])
    source_major = [(r, e) for r in range(ep) for e in range(local)]
    expert_major = [(r, e) for e in range(local) for r in range(ep)]
    received, placed = {}, {}  # each run's first row: its place among the received rows, its expert-major place
    for first, order in ((received, source_major), (placed, expert_major)):
        at = 0
        for r, e in order:
            first[r, e], at = at, at + table[r][e]
    moves = [
        [table[r][e] for r, e in expert_major],
        [received[run] - placed[run] for run in expert_major],
        [table[r][e] for r, e in source_major],
        [placed[run] - received[run] for run in source_major],
    ]
    if starts is not None:
        moves.append([received[r, e] - placed[r, e] + starts[r] - received[r, 0] for r, e in expert_major])
    rows = torch.arange(at, device=device)
    expert_runs, to_expert_move, source_runs, to_source_move, *taken_move = torch.tensor(moves, device=device).unbind()
    to_expert = rows + to_expert_move.repeat_interleave(expert_runs, output_size=at)
    to_source = rows + to_source_move.repeat_interleave(source_runs, output_size=at)
    if starts is None:
        return to_expert, to_expert, to_source
    return rows + taken_move[0].repeat_interleave(expert_runs, output_size=at), to_expert, to_source


def moe_layers(modules: list[nn.Module]) -> dict[int, MoE]:
    """The sparse MLPs in these model chunks by global layer index."""
    out = {}
    for chunk in modules:
        for name, module in chunk.named_modules():
            if isinstance(module, MoE):
                out[int(name.split(".")[1])] = module  # layers.<i>.mlp
    return out


def balancing_state(modules: list[nn.Module]) -> dict[str, torch.Tensor]:
    """The loss-free balancing biases of the sparse layers in these model chunks, by name: state a checkpoint
    keeps beside the parameters (``buffers/<name>``), the same on every dp and tp rank."""
    return {f"layers.{i}.mlp.router.expert_bias": m.router.expert_bias for i, m in moe_layers(modules).items()}


def set_loss_multiplier(model: nn.Module, multiplier: float) -> None:
    """What a runner multiplies the summed token loss by before backward: the auxiliary losses' gradient per
    token (``MoE.loss_multiplier``). A dense model has nothing to set."""
    for module in model.modules():
        if isinstance(module, MoE):
            module.loss_multiplier = multiplier


@torch.no_grad()
def step_stats(
    modules: list[nn.Module],
    moe: MoEConfig,
    dp_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
    tp_group: dist.ProcessGroup | None = None,
    skipped: bool = False,
) -> dict[str, float]:
    """After the optimizer step: the step's routing summed over dp (one all-reduce; ``dp_group`` is dp x cp under
    context parallelism, and under sequence parallelism a second over ``tp_group``: every rank routed its own tokens),
    the loss-free bias moved by it, and the metrics of every sparse layer (gathered over the pipeline stages,
    ``pp_group``): ``moe/aux_loss`` (mean over the sparse layers, token-weighted over the step), ``moe/z_loss``,
    ``moe/load/<layer>`` (max over mean tokens per expert) and, with a capacity, ``moe/dropped`` (the share of (token,
    expert) pairs dropped). The sums start again from zero. A ``skipped`` step (fp16's loss scaler found its gradients
    not finite) changed no weight, so the bias does not move either: it stays with the weights it balances, and the
    step's routing is reported but dropped, not carried into the next step's update. Every rank calls it; a dense
    model returns an empty row (no collective)."""
    if not moe.enabled:
        return {}
    layers = moe_layers(modules)
    per_layer: dict[int, tuple[float, float, float, float, float]] = {}  # aux, z, dropped, pairs, load
    if layers:
        stacked = torch.cat([torch.cat([m.step_sums, m.step_counts]) for m in layers.values()])
        for group in (dp_group, tp_group):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(stacked, group=group)
        offset = 0
        for layer, m in sorted(layers.items()):
            sums, counts = stacked[offset : offset + 4], stacked[offset + 4 : offset + 4 + m.moe.experts]
            offset += 4 + m.moe.experts
            tokens, mean = max(float(sums[1]), 1.0), counts.mean()
            load = float(counts.max() / mean) if mean > 0 else 0.0
            per_layer[layer] = (
                float(sums[2]) / tokens,
                float(sums[3]) / tokens,
                float(sums[0]),
                tokens * m.moe.top_k,
                load,
            )
            if m.moe.bias_update_rate > 0 and not skipped:  # DeepSeek-V3: under-loaded experts up, over-loaded down
                m.router.expert_bias += m.moe.bias_update_rate * torch.sign(mean - counts).float()
            m.step_counts.zero_()
            m.step_sums.zero_()
    if pp_group is not None and dist.get_world_size(pp_group) > 1:  # a stage may hold no sparse layer
        gathered: list[dict] = [{} for _ in range(dist.get_world_size(pp_group))]
        dist.all_gather_object(gathered, per_layer, group=pp_group)
        per_layer = {layer: v for stage in gathered for layer, v in stage.items()}
    if not per_layer:
        return {}
    row = {f"moe/load/{layer}": v[4] for layer, v in sorted(per_layer.items())}
    row["moe/aux_loss"] = sum(v[0] for v in per_layer.values()) / len(per_layer)
    if moe.z_loss_coef > 0:
        row["moe/z_loss"] = sum(v[1] for v in per_layer.values()) / len(per_layer)
    if moe.capacity_factor is not None:
        dropped, pairs = sum(v[2] for v in per_layer.values()), sum(v[3] for v in per_layer.values())
        row["moe/dropped"] = dropped / max(pairs, 1.0)
    return row
