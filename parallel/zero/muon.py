"""Muon over ZeRO's pieces, the same update in every layout (``optim.name=muon``; docs/parallelism.md#muon).

torch's ``torch.optim.Muon`` per logical matrix G (models/matrices.py: q, k, v, each expert's matrices apart):

    B <- B.lerp(g, 1 - mu)                        momentum, element by element
    U <- g.lerp(B, mu) if nesterov else B         element by element
    O <- NS(U)                                    Newton-Schulz on the whole matrix (bf16, torch's own function)
    W <- W (1 - lr wd) - adjust(lr, out x in) O   element by element

Only NS needs the whole matrix. Each rank runs the element-wise parts on the pieces it steps (ZeRO's shards of the
flat layout, parallel/zero/optimizer.py), where the momentum lives (1-D, the piece's shape: it saves, resumes and
reshards as AdamW's moments do). U of a parameter is then put together on one rank, its owner: every rank writes
its pieces into its local (tp / ep) tensor and that, tp padding cut off, at its block of a zero logical tensor,
and a sum reduces them to the owner over tp and then over dp x cp (the ranks holding a pipeline stage's
parameters: experts split over ep are among them). Each element is written by exactly one rank, so
the sum is exact: which one (of the replicas: dp at ZeRO 0, tp for a weight every tp rank holds) is agreed once, at
start, by a max over the ranks' ids (``_coverage``). The owner orthogonalises every matrix of the parameter with
``torch.optim._muon._zeropower_via_newtonschulz`` and broadcasts O back; each rank takes its pieces' elements of it
(``Placement.shard``). Owners are balanced by Newton-Schulz's cost (rows x cols x min(rows, cols) per matrix).
So the update is the one-process update bit for bit wherever the same kernels run: no mode whose result depends on
the tp degree, and padding never reaches NS.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from trident.parallel.layout import Piece
from trident.parallel.placement import Placement, placement_of


@dataclass(frozen=True)
class Matrices:
    """A logical tensor ``(groups * parts * rows, cols)`` as ``parts`` matrices of ``(groups * rows, cols)``; which
    parameter holds which is the model's knowledge (models/matrices.py ``matrices_of``)."""

    groups: int = 1
    parts: int = 1
    transposed: bool = False
    names: tuple[str, ...] = ()  # what each part is, for the start-up summary

    def split(self, t: torch.Tensor) -> list[torch.Tensor]:
        """The logical tensor's matrices, each (out, in), contiguous copies."""
        four = t.reshape(self.groups, self.parts, -1, t.shape[-1])
        mats = [four[:, i].reshape(-1, t.shape[-1]) for i in range(self.parts)]
        return [m.T.contiguous() if self.transposed else m.contiguous() for m in mats]

    def join(self, mats: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write ``mats`` (as ``split`` returns them) back into the logical tensor ``out``."""
        four = out.view(self.groups, self.parts, -1, out.shape[-1])
        for i, m in enumerate(mats):
            four[:, i] = (m.T if self.transposed else m).reshape(self.groups, -1, out.shape[-1])
        return out

    def shape(self, logical: tuple[int, ...]) -> tuple[int, int]:
        """One matrix's (out, in)."""
        rows, cols = logical[0] // self.parts, logical[-1]
        return (cols, rows) if self.transposed else (rows, cols)

    def describe(self, logical: tuple[int, ...]) -> str:
        out, inp = self.shape(logical)
        what = ", ".join(self.names) if self.names else f"{self.parts} matrices"
        return f"{what} of {out}x{inp}" if self.parts > 1 else f"{out}x{inp}"


@dataclass(frozen=True)
class MuonSettings:
    """Muon's hyperparameters; ``lr_ratio``: Muon's learning rate over AdamW's (the schedule scales both)."""

    lr_ratio: float
    weight_decay: float
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    adjust_lr: str = "original"
    ns_dtype: torch.dtype = torch.bfloat16  # torch's; float32: the same iteration in fp32


@dataclass(frozen=True)
class MuonPlan:
    """What a ZeRO optimizer steps with Muon: each matrix parameter of this rank's chunks with its matrices, in the
    same order on every rank of the stage, and the groups over which a parameter's pieces lie."""

    settings: MuonSettings
    params: list[tuple[nn.Parameter, Matrices]]
    tp_group: dist.ProcessGroup | None
    grad_group: dist.ProcessGroup | None


@dataclass(eq=False)
class _Entry:
    piece: Piece
    master: torch.Tensor  # 1-D view of the fp32 master of the piece
    grad: torch.Tensor  # its reduced gradient (the host copy for offloaded pieces)
    writes: bool = False  # this rank's copy of the elements is the one summed into U


@dataclass(eq=False)
class _Param:
    param: nn.Parameter
    placement: Placement
    matrices: Matrices
    owner: int  # index among the stage's ranks: grad rank * tp + tp rank
    entries: list[_Entry]


def muon_entry(piece: Piece, master: torch.Tensor, grad: torch.Tensor) -> _Entry:
    return _Entry(piece, master, grad)


def _embed(p: _Param, values: list[tuple[_Entry, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """A zero logical tensor holding ``values`` (a 1-D tensor per entry) where their pieces lie; ``Placement.shard``
    inverted."""
    pl = p.placement
    local = torch.zeros(pl.local_shape, dtype=dtype, device=p.param.device)
    for e, v in values:
        local.view(-1)[e.piece.start : e.piece.stop] = v.to(local.device)
    full = torch.zeros(pl.shape, dtype=dtype, device=p.param.device)
    full[tuple(slice(o, o + n) for o, n in zip(pl.offsets, pl.chunk_sizes, strict=True))] = pl.real_part(local)
    return full


class MuonPieces(torch.optim.Optimizer):
    """The pieces of Muon's matrices this rank steps, their momentum (``state[master view]["momentum_buffer"]``),
    and ``update``. Every rank of a pipeline stage builds it over the same parameters, in the same order."""

    def __init__(self, plan: MuonPlan, entries: list[_Entry]) -> None:
        views = [e.master for e in entries]
        super().__init__(views or [torch.zeros(0)], {"lr": 0.0})
        if not views:
            self.param_groups[0]["params"] = []
        self.settings, params = plan.settings, plan.params
        self.tp, self.grad = plan.tp_group, plan.grad_group
        tp_size, tp_rank = _size_rank(self.tp)
        grad_size, grad_rank = _size_rank(self.grad)
        self.tp_size, self.grad_size = tp_size, grad_size
        self.me = grad_rank * tp_size + tp_rank
        by_param: dict[nn.Parameter, list[_Entry]] = {}
        for e in entries:
            by_param.setdefault(e.piece.param, []).append(e)
        owners = _balance([_cost(placement_of(p).shape, m) for p, m in params], tp_size * grad_size)
        self.params = [
            _Param(p, placement_of(p), m, owner, by_param.get(p, []))
            for (p, m), owner in zip(params, owners, strict=True)
        ]
        for e in entries:
            self.state[e.master]["momentum_buffer"] = torch.zeros_like(e.master)
        for p in self.params:
            self._coverage(p)

    def step(self, closure=None):  # noqa: ANN001, ANN201  (torch's signature; ``update`` is the step)
        raise NotImplementedError("MuonPieces steps through update(lr)")

    def update(self, lr: float) -> None:
        """One Muon step of every matrix at AdamW's ``lr`` scaled by ``lr_ratio``."""
        s = self.settings
        lr = lr * s.lr_ratio
        for p in self.params:
            written = []
            for e in p.entries:
                buf = self.state[e.master]["momentum_buffer"]
                buf.lerp_(e.grad, 1 - s.momentum)
                if e.writes:
                    written.append((e, e.grad.lerp(buf, s.momentum) if s.nesterov else buf))
            full = _embed(p, written, torch.float32)
            ortho = self._orthogonalise(p, full)
            adjusted = _adjust_lr(lr, s.adjust_lr, torch.Size(p.matrices.shape(p.placement.shape)))
            local = p.placement.shard(ortho).reshape(-1) if p.entries else None
            for e in p.entries:
                e.master.mul_(1 - lr * s.weight_decay)
                e.master.add_(local[e.piece.start : e.piece.stop].to(e.master.device), alpha=-adjusted)

    def _orthogonalise(self, p: _Param, full: torch.Tensor) -> torch.Tensor:
        """U summed on the owner, NS of each matrix there, the result (bf16) broadcast to every rank of the stage."""
        s = self.settings
        tp_owner, grad_owner = p.owner % self.tp_size, p.owner // self.tp_size
        on_owner_tp = self.me % self.tp_size == tp_owner
        if self.tp_size > 1:
            dist.reduce(full, group_dst=tp_owner, group=self.tp)
        if self.grad_size > 1 and on_owner_tp:
            dist.reduce(full, group_dst=grad_owner, group=self.grad)
        out = torch.empty(p.placement.shape, dtype=s.ns_dtype, device=full.device)
        if self.me == p.owner:
            mats = [newton_schulz(g, s) for g in p.matrices.split(full)]
            p.matrices.join(mats, out)
        if self.grad_size > 1 and on_owner_tp:
            dist.broadcast(out, group_src=grad_owner, group=self.grad)
        if self.tp_size > 1:
            dist.broadcast(out, group_src=tp_owner, group=self.tp)
        return out

    def _coverage(self, p: _Param) -> None:
        """Which of the replicas of each element writes it into U (the highest stage index holding it), checked to
        cover the whole parameter once."""
        mark = torch.full((), self.me + 1, dtype=torch.int32)
        ids = _embed(p, [(e, mark.expand(e.piece.numel)) for e in p.entries], torch.int32)
        if self.tp_size > 1:
            dist.all_reduce(ids, op=dist.ReduceOp.MAX, group=self.tp)
        if self.grad_size > 1:
            dist.all_reduce(ids, op=dist.ReduceOp.MAX, group=self.grad)
        if bool((ids == 0).any()):
            raise RuntimeError(f"Muon: no rank steps part of a {tuple(p.placement.shape)} parameter")
        local = p.placement.shard(ids).view(-1)
        for e in p.entries:
            held = local[e.piece.start : e.piece.stop]
            real = held[held != 0]  # tp padding: no rank holds it
            mine = real == self.me + 1
            if bool(mine.any()) != bool(mine.all()):
                raise RuntimeError("Muon: a piece is written partly by another replica")
            e.writes = bool(mine.all()) and real.numel() > 0


def newton_schulz(g: torch.Tensor, s: MuonSettings) -> torch.Tensor:
    """Orthogonalise the matrix ``g``: torch's ``_zeropower_via_newtonschulz`` (bf16), or the same iteration in fp32
    (``ns_dtype``), whose result moves with its input's last bits as little as fp32 does."""
    if s.ns_dtype == torch.bfloat16:
        return _zeropower_via_newtonschulz(g, s.coefficients, s.ns_steps, s.eps)
    a, b, c = s.coefficients
    x = g.to(s.ns_dtype, copy=True)
    wide = g.size(0) > g.size(1)
    if wide:
        x = x.T
    x.div_(x.norm().clamp(min=s.eps))
    for _ in range(s.ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


def _size_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _cost(shape: tuple[int, ...], m: Matrices) -> int:
    out, inp = m.shape(shape)
    return m.parts * out * inp * min(out, inp)


def _balance(costs: list[int], slots: int) -> list[int]:
    """Each job's slot, the largest first to the least loaded (ties: the lowest slot): the same on every rank."""
    heap = [(0, s) for s in range(slots)]
    owner = [0] * len(costs)
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, slot = heapq.heappop(heap)
        owner[i] = slot
        heapq.heappush(heap, (load + costs[i], slot))
    return owner
