"""ZeRO's sharding arithmetic, with no process group: bucket padding, shard ranges, pieces, the offload cut, and
the boxes a contiguous range of a parameter becomes in a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trident.checkpoint.zero_state import piece_boxes, range_boxes
from trident.parallel.layout import FlatLayout, padded_numel
from trident.parallel.placement import Placement, set_placement
from trident.parallel.zero.optimizer import shard_segments


def _params(*shapes: tuple[int, ...]) -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(s)) for s in shapes]


def test_buckets_are_padded_to_dp_and_shards_tile_them():
    a, b, c = _params((5,), (3, 4), (7,))  # registration order; the layout is reversed: c, b, a
    layout = FlatLayout.by_size([a, b, c], bucket_numel=17, dp_size=4)
    assert [span.params for span in layout.spans] == [[c], [b, a]]
    assert [(s.offset, s.numel) for s in layout.spans] == [(0, 8), (8, 20)]  # 7 -> 8, 12 + 5 = 17 -> 20
    assert layout.numel == 28 and padded_numel(17, 4) == 20
    assert [layout.offset[p] for p in (c, b, a)] == [0, 8, 20]
    for span in layout.spans:
        ranges = [span.shard(r, 4) for r in range(4)]
        assert ranges[0][0] == span.offset and ranges[-1][1] == span.offset + span.numel
        assert all(ranges[r][1] == ranges[r + 1][0] for r in range(3))
        assert len({stop - start for start, stop in ranges}) == 1
    with pytest.raises(ValueError):
        layout.spans[1].shard(0, 3)
    # A parameter larger than a bucket is a bucket of its own, and the greedy run goes on after it.
    d, e, f = _params((3,), (50,), (4,))
    big = FlatLayout.by_size([a, b, c, d, e, f], bucket_numel=17, dp_size=4)
    assert [span.params for span in big.spans] == [[f], [e], [d, c], [b, a]]
    assert [s.numel for s in big.spans] == [4, 52, 12, 20]


def test_parameters_apart_fill_buckets_of_their_own_and_cut_no_other_run():
    # A dense model with two sparse layers between dense parameters (the expert weights x1, x2 and y1, y2): their
    # gradients reduce over another group, so they share no bucket with the dense ones, which stay in one bucket
    # as without them (splitting the dense run would add a dense reduction per cut).
    d1, x1, x2, d2, y1, y2, d3 = _params((4,), (6,), (6,), (4,), (6,), (6,), (4,))
    params = [d1, x1, x2, d2, y1, y2, d3]
    layout = FlatLayout.by_size(params, bucket_numel=100, dp_size=2, apart=[x1, x2, y1, y2])
    assert [span.params for span in layout.spans] == [[y2, y1, x2, x1], [d3, d2, d1]]  # the earlier filled first
    assert [span.params for span in FlatLayout.by_size(params, 100, 2, isolate=[x1, x2, y1, y2]).spans] == [
        [d3],
        [y2],
        [y1],
        [d2],
        [x2],
        [x1],
        [d1],
    ]  # isolated instead: four dense buckets' cuts
    # Greedy by size within each kind, each bucket listed when it is full; chunk boundaries cut both kinds.
    small = FlatLayout.by_size(params, bucket_numel=12, dp_size=2, apart=[x1, x2, y1, y2])
    assert [span.params for span in small.spans] == [[y2, y1], [x2, x1], [d3, d2, d1]]
    chunks = [[d1, x1, x2], [d2, y1, y2, d3]]
    chunked = FlatLayout.by_size(params, bucket_numel=100, dp_size=2, chunks=chunks, apart=[x1, x2, y1, y2])
    assert [span.params for span in chunked.spans] == [[y2, y1], [d3, d2], [x2, x1], [d1]]


def test_pieces_cut_parameters_at_shard_edges_and_skip_padding():
    a, b, c = _params((5,), (3, 4), (7,))
    layout = FlatLayout.by_size([a, b, c], bucket_numel=17, dp_size=4)
    span = layout.spans[1]  # b at [8, 20), a at [20, 25), padding [25, 28)
    got = [[(p.param is b, p.start, p.stop, p.flat) for p in layout.pieces(span, *span.shard(r, 4))] for r in range(4)]
    assert got == [
        [(True, 0, 5, 8)],
        [(True, 5, 10, 13)],
        [(True, 10, 12, 18), (False, 0, 3, 20)],
        [(False, 3, 5, 23)],  # then two padding elements: no piece
    ]
    # Every element of every parameter is in exactly one piece over the ranks.
    for p in (a, b, c):
        covered = sorted(
            (pc.start, pc.stop)
            for s in layout.spans
            for r in range(4)
            for pc in layout.pieces(s, *s.shard(r, 4))
            if pc.param is p
        )
        assert covered[0][0] == 0 and covered[-1][1] == p.numel()
        assert all(x[1] == y[0] for x, y in zip(covered[:-1], covered[1:], strict=True))


def test_offload_takes_the_first_ratio_of_the_shard_cutting_one_bucket():
    a, b, c = _params((5,), (3, 4), (7,))
    layout = FlatLayout.by_size([a, b, c], bucket_numel=17, dp_size=4)
    # rank 1 owns [2, 4) of bucket 0 and [13, 18) of bucket 1: 7 elements; 4 of them on the host.
    runs = shard_segments(layout, rank=1, shards=4, host_numel=4)
    assert [(s.index, start, stop, host) for s, start, stop, host in runs] == [
        (0, 2, 4, True),
        (1, 13, 15, True),
        (1, 15, 18, False),
    ]
    assert all(not host for *_, host in shard_segments(layout, 1, 4, 0))
    assert all(host for *_, host in shard_segments(layout, 1, 4, 7))
    # Stage 0: one "shard" of everything.
    assert [(start, stop) for _, start, stop, _ in shard_segments(layout, 0, 1, 0)] == [(0, 8), (8, 28)]


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3)])
def test_range_boxes_cover_a_range_exactly_with_contiguous_boxes(shape):
    n = math.prod(shape)
    full = torch.arange(n).view(shape)
    for start in range(n):
        for stop in range(start + 1, n + 1):
            boxes = range_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            got = []
            for offsets, sizes in boxes:
                box = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))]
                values = box.reshape(-1).tolist()
                assert values == list(range(values[0], values[0] + len(values)))  # contiguous in memory
                got += values
            assert got == list(range(start, stop))


def test_piece_boxes_place_a_tp_block_in_the_logical_tensor_without_padding():
    # wte-like: logical [10, 3] split on rows over tp 2, padded to 12: rank 1 holds rows 6..11, rows 10, 11 padding.
    placement = Placement((10, 3), split_dim=0, tp_rank=1, tp_size=2, padded=12)
    param = set_placement(nn.Parameter(torch.zeros(6, 3)), placement)
    logical = torch.arange(30.0).view(10, 3)
    local = placement.shard(logical).reshape(-1)  # padding rows are zero
    layout = FlatLayout([[param]], dp_size=1)
    (piece,) = layout.pieces(layout.spans[0], 4, 17)  # elements 4..16 of the local block: rows 1..5, partly
    rebuilt = torch.full((10, 3), -1.0)
    for offsets, view in piece_boxes(local[piece.start : piece.stop], piece, placement):
        rebuilt[tuple(slice(o, o + s) for o, s in zip(offsets, view.shape, strict=True))] = view
    expected = torch.full((10, 3), -1.0).view(-1)
    expected[22:30] = logical.view(-1)[22:30]  # local 4..12 are logical rows 7..9 from column 1; 12..17 padding
    assert torch.equal(rebuilt.view(-1), expected)


def test_an_isolated_parameter_has_the_same_shards_in_different_layouts():
    """A pipeline's first stage holds the embedding among other parameters, its last stage the tied copy among
    others: isolated, each dp rank's shard covers the same elements of it in both layouts."""
    first = _params((10, 4), (6,), (3, 3))  # embedding first, as registered
    last = _params((5,), (10, 4), (7,), (2,))
    shards = []
    for params, tied in ((first, first[0]), (last, last[1])):
        layout = FlatLayout.by_size(params, bucket_numel=12, dp_size=3, isolate=[tied])
        span = layout.span_of[tied]
        assert len(span.params) == 1 and span.params[0] is tied
        shards.append([[(pc.start, pc.stop) for pc in layout.pieces(span, *span.shard(r, 3))] for r in range(3)])
    assert shards[0] == shards[1] == [[(0, 14)], [(14, 28)], [(28, 40)]]
