"""ZeRO's shards as checkpoint boxes: the same logical keys a plain run saves, so checkpoints stay layout-free.

    model/<name>                 the fp32 master weights (with 16-bit parameters too: a bf16 run resumes exactly,
                                 and a checkpoint's weights are fp32 whatever the precision that saved it)
    optim/<name>/exp_avg|exp_avg_sq   AdamW's moments, laid out like the parameter
    optim/<name>/step            the 0-d step counter

A rank's piece of a parameter is a contiguous range [start, stop) of the parameter's flattened local (tp) tensor.
A contiguous range of a row-major tensor is a few boxes (``range_boxes``): a partial row, whole rows, a partial
row, recursively in the trailing dims, each itself contiguous in memory, so each box is a view of the piece. Tensor
parallelism's padding rows (past ``placement.real`` on ``split_dim``) are cut off, and the boxes are shifted by
the tp block's offsets: what is saved is a set of boxes of the logical tensor, which DCP reassembles under any
layout (trident/checkpoint/dcp.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from trident.checkpoint.sharded import Sharded
from trident.parallel.layout import Piece
from trident.parallel.placement import Placement, placement_of
from trident.parallel.zero.optimizer import ZeroOptimizer

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Boxes covering elements [start, stop) of a row-major tensor of ``shape``, in order, each contiguous."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, lo = divmod(start, inner)
    last, hi = divmod(stop, inner)
    if first == last:  # inside one row
        return [((first, *o), (1, *s)) for o, s in range_boxes(shape[1:], lo, hi)]
    boxes = []
    if lo:
        boxes += [((first, *o), (1, *s)) for o, s in range_boxes(shape[1:], lo, inner)]
        first += 1
    if last > first:
        boxes.append(((first, *(0,) * (len(shape) - 1)), (last - first, *shape[1:])))
    if hi:
        boxes += [((last, *o), (1, *s)) for o, s in range_boxes(shape[1:], 0, hi)]
    return boxes


def piece_boxes(
    values: torch.Tensor, piece: Piece, placement: Placement
) -> Iterator[tuple[tuple[int, ...], torch.Tensor]]:
    """(logical offsets, view) of each real box of a piece; ``values`` is 1-D, element i at piece.start + i."""
    shape = placement.local_shape
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    for offsets, sizes in range_boxes(shape, piece.start, piece.stop):
        first = sum(o * s for o, s in zip(offsets, strides, strict=True)) - piece.start
        view = values[first : first + math.prod(sizes)].view(sizes)
        d = placement.split_dim
        if d is not None and offsets[d] + sizes[d] > placement.real:
            keep = placement.real - offsets[d]
            if keep <= 0:
                continue  # tp padding only: never saved
            view = view.narrow(d, 0, keep)
        yield tuple(o + g for o, g in zip(offsets, placement.offsets, strict=True)), view


def _source(name: str, param: nn.Parameter) -> str:
    return placement_of(param).tied_to or name


class MasterState:
    """``model/`` keys from the masters: saved from them, loaded into them, then published to the parameters."""

    def __init__(self, optimizer: ZeroOptimizer, params: Mapping[str, nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.names = {p: name for name, p in params.items()}

    def _boxes(self, keyed: Callable[[str, nn.Parameter], str | None]) -> dict[str, Sharded]:
        out: dict[str, Sharded] = {}
        for _, piece in self.optimizer.pieces():
            key = keyed(self.names[piece.param], piece.param)
            if key is None:
                continue
            placement = placement_of(piece.param)
            boxes = out.setdefault(key, Sharded(placement.shape)).boxes
            boxes.extend(piece_boxes(self.optimizer.master(piece), piece, placement))
        return out

    def sharded_state(self) -> dict[str, Sharded]:
        # A tied copy steps like its source, whose masters are saved.
        return self._boxes(lambda name, p: None if placement_of(p).tied_to else name)

    def load_destinations(self, saved: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Sharded], Callable[[], None]]:
        return self._boxes(_source), self.optimizer.publish_masters


class MomentState:
    """``optim/`` keys from AdamW's per-piece state (AdamW's keys: ``<name>/exp_avg``, ``exp_avg_sq``, ``step``)."""

    def __init__(self, optimizer: ZeroOptimizer, params: Mapping[str, nn.Parameter]) -> None:
        self.optimizer = optimizer
        self.names = {p: name for name, p in params.items()}

    def sharded_state(self) -> dict[str, Sharded]:
        out: dict[str, Sharded] = {}
        for seg, piece in self.optimizer.pieces():
            placement = placement_of(piece.param)
            if placement.tied_to is not None:
                continue
            name = self.names[piece.param]
            state = self.optimizer.optimizer_of(seg, piece).state.get(self.optimizer.master(piece), {})
            for kind, value in state.items():
                key = f"{name}/{kind}"
                if value.dim() == 0:
                    out.setdefault(key, Sharded.whole(value.detach()))  # the same on every piece
                else:
                    out.setdefault(key, Sharded(placement.shape)).boxes.extend(piece_boxes(value, piece, placement))
        return out

    def load_destinations(self, saved: Mapping[str, tuple[int, ...]]) -> tuple[dict[str, Sharded], Callable[[], None]]:
        out: dict[str, Sharded] = {}
        states: dict[torch.Tensor, dict[str, torch.Tensor]] = {}
        for _, piece in self.optimizer.pieces():
            placement = placement_of(piece.param)
            prefix = _source(self.names[piece.param], piece.param) + "/"
            view = self.optimizer.master(piece)
            for key in (k for k in saved if k.startswith(prefix)):
                if saved[key] == ():
                    value = torch.zeros((), dtype=torch.float32)
                    boxes = Sharded.whole(value).boxes
                else:
                    value = torch.zeros(piece.numel, dtype=torch.float32, device=view.device)
                    boxes = list(piece_boxes(value, piece, placement))
                states.setdefault(view, {})[key[len(prefix) :]] = value
                out.setdefault(key, Sharded(saved[key])).boxes.extend(boxes)
        return out, lambda: self._install(states)

    def _install(self, states: dict[torch.Tensor, dict[str, torch.Tensor]]) -> None:
        """Through each AdamW's ``load_state_dict`` (which puts ``step`` where its kernels want it)."""
        for opt in self.optimizer.optimizers:
            views = [v for g in opt.param_groups for v in g["params"]]
            index = {v: i for i, v in enumerate(views)}
            groups = [{**g, "params": [index[v] for v in g["params"]]} for g in opt.param_groups]
            mine = {index[v]: s for v, s in states.items() if v in index}
            opt.load_state_dict({"state": mine, "param_groups": groups})
