"""Rank arithmetic of parallel/topology.py: golden layouts written out by hand, then properties."""

from __future__ import annotations

import itertools
import re

import pytest

from trident.errors import ConfigError
from trident.parallel.topology import Coord, Topology

# Each golden layout: Topology -> every group list and the logging rank, written out by hand.
# Ranks are arange(world).view(pp, dp, tp): tp fastest, then dp, pp slowest (Megatron's order).
GOLDEN = {
    # Megatron's documented example (also the docstring of parallel/topology.py).
    Topology(dp=2, pp=4, tp=2): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]],
        dp=[[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]],
        pp=[[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]],
        embedding=[[0, 12], [1, 13], [2, 14], [3, 15]],
        model_parallel=[[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]],
        logging_rank=12,
    ),
    Topology(dp=2, pp=2, tp=2): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        dp=[[0, 2], [1, 3], [4, 6], [5, 7]],
        pp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]],
        model_parallel=[[0, 1, 4, 5], [2, 3, 6, 7]],
        logging_rank=4,
    ),
    Topology(dp=8, pp=1, tp=1): dict(
        tp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        dp=[[0, 1, 2, 3, 4, 5, 6, 7]],
        pp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        embedding=[[0], [1], [2], [3], [4], [5], [6], [7]],
        model_parallel=[[0], [1], [2], [3], [4], [5], [6], [7]],
        logging_rank=0,
    ),
    Topology(dp=1, pp=8, tp=1): dict(
        tp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        dp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pp=[[0, 1, 2, 3, 4, 5, 6, 7]],
        embedding=[[0, 7]],
        model_parallel=[[0, 1, 2, 3, 4, 5, 6, 7]],
        logging_rank=7,
    ),
    Topology(dp=1, pp=2, tp=4): dict(
        tp=[[0, 1, 2, 3], [4, 5, 6, 7]],
        dp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        pp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        embedding=[[0, 4], [1, 5], [2, 6], [3, 7]],
        model_parallel=[[0, 1, 2, 3, 4, 5, 6, 7]],
        logging_rank=4,
    ),
}

GROUP_METHODS = {
    "tp": Topology.tp_groups,
    "dp": Topology.dp_groups,
    "pp": Topology.pp_groups,
    "embedding": Topology.embedding_groups,
    "model_parallel": Topology.model_parallel_groups,
}


@pytest.mark.parametrize("topo", GOLDEN, ids=str)
@pytest.mark.parametrize("kind", GROUP_METHODS)
def test_golden_groups(topo: Topology, kind: str) -> None:
    assert GROUP_METHODS[kind](topo) == GOLDEN[topo][kind]


@pytest.mark.parametrize("topo", GOLDEN, ids=str)
def test_golden_logging_rank(topo: Topology) -> None:
    assert topo.logging_rank == GOLDEN[topo]["logging_rank"]


def test_golden_coords_16_ranks() -> None:
    topo = Topology(dp=2, pp=4, tp=2)
    assert topo.world_size == 16
    assert topo.coord(0) == Coord(dp=0, pp=0, tp=0)
    assert topo.coord(1) == Coord(dp=0, pp=0, tp=1)
    assert topo.coord(2) == Coord(dp=1, pp=0, tp=0)
    assert topo.coord(5) == Coord(dp=0, pp=1, tp=1)
    assert topo.coord(14) == Coord(dp=1, pp=3, tp=0)
    assert topo.coord(15) == Coord(dp=1, pp=3, tp=1)
    assert topo.rank_of(dp=1, pp=2, tp=1) == 11
    assert [r for r in range(16) if topo.is_first_stage(r)] == [0, 1, 2, 3]
    assert [r for r in range(16) if topo.is_last_stage(r)] == [12, 13, 14, 15]


# With context parallelism: arange(world).view(pp, dp, cp, tp), cp between tp and dp.
GOLDEN_CP = {
    Topology(dp=2, pp=1, tp=2, cp=2): dict(
        tp=[[0, 1], [2, 3], [4, 5], [6, 7]],
        cp=[[0, 2], [1, 3], [4, 6], [5, 7]],
        dp=[[0, 4], [1, 5], [2, 6], [3, 7]],
        dp_cp=[[0, 2, 4, 6], [1, 3, 5, 7]],
        pp=[[0], [1], [2], [3], [4], [5], [6], [7]],
        model_parallel=[[0, 1], [2, 3], [4, 5], [6, 7]],
        logging_rank=0,
    ),
    Topology(dp=1, pp=2, tp=1, cp=2): dict(
        tp=[[0], [1], [2], [3]],
        cp=[[0, 1], [2, 3]],
        dp=[[0], [1], [2], [3]],
        dp_cp=[[0, 1], [2, 3]],
        pp=[[0, 2], [1, 3]],
        model_parallel=[[0, 2], [1, 3]],
        logging_rank=2,
    ),
}
CP_GROUP_METHODS = {
    "tp": Topology.tp_groups,
    "cp": Topology.cp_groups,
    "dp": Topology.dp_groups,
    "dp_cp": Topology.dp_cp_groups,
    "pp": Topology.pp_groups,
    "model_parallel": Topology.model_parallel_groups,
}


@pytest.mark.parametrize("topo", GOLDEN_CP, ids=str)
def test_golden_groups_with_context_parallelism(topo: Topology) -> None:
    for kind, groups_of in CP_GROUP_METHODS.items():
        assert groups_of(topo) == GOLDEN_CP[topo][kind], kind
    assert topo.logging_rank == GOLDEN_CP[topo]["logging_rank"]
    for rank in range(topo.world_size):
        assert topo.rank_of(*topo.coord(rank)[:3], cp=topo.coord(rank).cp) == rank


# Every layout with each axis in 1..4, plus a few with odd or larger sizes.
LAYOUTS = [Topology(dp=d, pp=p, tp=t) for d, p, t in itertools.product(range(1, 5), repeat=3)] + [
    Topology(dp=3, pp=2, tp=5),
    Topology(dp=1, pp=8, tp=2),
    Topology(dp=6, pp=1, tp=1),
    Topology(dp=2, pp=3, tp=1),
]
AXES = ("dp", "pp", "tp")


def _check_partition(topo: Topology, groups: list[list[int]], varying: tuple[str, ...]) -> None:
    """The groups partition the world; inside a group only the ``varying`` axes change, in rank order."""
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(topo.world_size))
    size = 1
    for axis in varying:
        size *= getattr(topo, axis)
    assert len(groups) == topo.world_size // size
    for group in groups:
        assert len(group) == size
        assert group == sorted(group)
        coords = [topo.coord(r) for r in group]
        for axis in AXES:
            values = {getattr(c, axis) for c in coords}
            if axis in varying:
                assert values == set(range(getattr(topo, axis))), (axis, group)
            else:
                assert len(values) == 1, (axis, group)


@pytest.mark.parametrize("topo", LAYOUTS, ids=str)
def test_layout_properties(topo: Topology) -> None:
    world = topo.world_size
    assert world == topo.dp * topo.pp * topo.tp

    # coord / rank_of round trip, both ways.
    seen = set()
    for rank in range(world):
        c = topo.coord(rank)
        assert 0 <= c.dp < topo.dp and 0 <= c.pp < topo.pp and 0 <= c.tp < topo.tp
        assert topo.rank_of(*c) == rank
        assert topo.rank_of(dp=c.dp, pp=c.pp, tp=c.tp) == rank
        seen.add(c)
        assert topo.is_first_stage(rank) == (c.pp == 0)
        assert topo.is_last_stage(rank) == (c.pp == topo.pp - 1)
    assert len(seen) == world

    # tp is the fastest-varying axis: a tp group is a run of neighbouring ranks.
    for group in topo.tp_groups():
        assert group == list(range(group[0], group[0] + topo.tp))

    _check_partition(topo, topo.dp_groups(), ("dp",))
    _check_partition(topo, topo.tp_groups(), ("tp",))
    _check_partition(topo, topo.pp_groups(), ("pp",))
    _check_partition(topo, topo.model_parallel_groups(), ("pp", "tp"))

    # Embedding groups: first and last stage of each pipeline (one rank when pp == 1).
    pp_groups = topo.pp_groups()
    emb_groups = topo.embedding_groups()
    assert len(emb_groups) == len(pp_groups)
    for emb, pipe in zip(emb_groups, pp_groups, strict=True):
        assert emb == sorted({pipe[0], pipe[-1]})
        assert len(emb) == (1 if topo.pp == 1 else 2)
        assert topo.is_first_stage(emb[0]) and topo.is_last_stage(emb[-1])

    # The logging rank holds the loss: last stage, dp replica 0, tp rank 0.
    assert topo.coord(topo.logging_rank) == Coord(dp=0, pp=topo.pp - 1, tp=0)
    assert topo.is_last_stage(topo.logging_rank)

    topo.check_world_size(world)  # the matching size is accepted


@pytest.mark.parametrize("topo", [Topology(dp=2, pp=4, tp=2), Topology(dp=1, pp=1, tp=1)], ids=str)
def test_out_of_range_coordinates(topo: Topology) -> None:
    for rank in (-1, topo.world_size):
        with pytest.raises(ValueError, match="outside"):
            topo.coord(rank)
    for dp, pp, tp in ((topo.dp, 0, 0), (0, topo.pp, 0), (0, 0, topo.tp), (-1, 0, 0)):
        with pytest.raises(ValueError, match="outside"):
            topo.rank_of(dp=dp, pp=pp, tp=tp)


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("value", [0, -1])
def test_axis_below_one_is_config_error(axis: str, value: int) -> None:
    sizes = dict(dp=2, pp=2, tp=2)
    sizes[axis] = value
    with pytest.raises(ConfigError, match=rf"parallel\.{axis}={value}\b"):
        Topology(**sizes)


@pytest.mark.parametrize("world", [1, 6, 7, 32])
def test_check_world_size_mismatch(world: int) -> None:
    topo = Topology(dp=2, pp=2, tp=2)
    with pytest.raises(ConfigError) as excinfo:
        topo.check_world_size(world)
    numbers = re.findall(r"\d+", str(excinfo.value))
    assert str(world) in numbers and "8" in numbers, str(excinfo.value)
