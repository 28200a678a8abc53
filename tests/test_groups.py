"""parallel/groups.py on real gloo process groups (the harness's pooled local ranks), plus the harness's
failure reporting. One call checks every layout of its world size."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.ranks import run_distributed

pytestmark = pytest.mark.multiprocess

LAYOUTS_BY_WORLD = {
    4: [
        Topology(dp=1, pp=2, tp=2),
        Topology(dp=2, pp=1, tp=2),
        Topology(dp=2, pp=2, tp=1),
        Topology(dp=4, pp=1, tp=1),
        Topology(dp=1, pp=1, tp=4),
    ],
    2: [
        Topology(dp=2, pp=1, tp=1),
        Topology(dp=1, pp=2, tp=1),
        Topology(dp=1, pp=1, tp=2),
    ],
}


def _mine(groups: list[list[int]], rank: int) -> list[int] | None:
    mine = [g for g in groups if rank in g]
    assert len(mine) <= 1, (rank, groups)
    return mine[0] if mine else None


def _check_layouts(rank: int, world_size: int, layouts: list[Topology]) -> None:
    for topo in layouts:
        pg = build_process_groups(topo, timeout_s=60)
        assert pg.rank == rank and pg.topology == topo
        c = topo.coord(rank)
        assert (pg.dp_rank, pg.pp_rank, pg.tp_rank) == (c.dp, c.pp, c.tp), topo
        assert (pg.dp_size, pg.pp_size, pg.tp_size) == (topo.dp, topo.pp, topo.tp)
        assert pg.is_first_stage == (c.pp == 0)
        assert pg.is_last_stage == (c.pp == topo.pp - 1)
        assert pg.is_logging_rank == (rank == topo.logging_rank)
        assert pg.pp_ranks == tuple(_mine(topo.pp_groups(), rank))
        assert pg.pp_ranks[pg.pp_rank] == rank

        expected = {
            "dp": (pg.dp_group, _mine(topo.dp_groups(), rank)),
            "tp": (pg.tp_group, _mine(topo.tp_groups(), rank)),
            "pp": (pg.pp_group, _mine(topo.pp_groups(), rank)),
            "model_parallel": (pg.model_parallel_group, _mine(topo.model_parallel_groups(), rank)),
            "embedding": (pg.embedding_group, _mine(topo.embedding_groups(), rank)),
        }
        for name, (group, members) in expected.items():
            if members is None:  # only a middle pipeline stage is in no group (of the embedding kind)
                assert name == "embedding" and 0 < c.pp < topo.pp - 1, (topo, name)
                assert group is None, (topo, name)
                continue
            assert dist.get_world_size(group) == len(members), (topo, name)
            assert dist.get_process_group_ranks(group) == members, (topo, name)
            # 1 + rank, so that rank 0 also shows up in the sum.
            t = torch.tensor([1.0 + rank])
            dist.all_reduce(t, group=group)
            assert t.item() == sum(1 + r for r in members), (topo, name, t.item(), members)


@pytest.mark.parametrize("world_size", sorted(LAYOUTS_BY_WORLD))
def test_build_process_groups(world_size: int) -> None:
    run_distributed(_check_layouts, world_size, LAYOUTS_BY_WORLD[world_size], timeout_s=90)


def test_build_process_groups_with_middle_pipeline_stages() -> None:
    """Middle pipeline stages hold no embedding: their embedding_group is None, not a crash."""
    run_distributed(_check_layouts, 4, [Topology(dp=1, pp=4, tp=1)], timeout_s=90)


# --- the spawn helper: a failing rank and a hung rank must fail the test, not pass or hang it.


def _rank_one_raises(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError(f"boom from rank {rank} of {world_size}")
    dist.barrier()  # rank 0 waits here for a rank that never comes: it must be terminated


def _sleeps(rank: int, world_size: int) -> None:
    time.sleep(600)


def test_run_distributed_reports_the_failing_rank() -> None:
    with pytest.raises(RuntimeError, match="^rank 1 of 2 failed first") as excinfo:
        run_distributed(_rank_one_raises, 2, timeout_s=60)
    message = str(excinfo.value)
    assert "Traceback" in message and "in _rank_one_raises" in message
    assert "ValueError: boom from rank 1 of 2" in message


def test_run_distributed_kills_a_hung_run() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 1 still running after 3 s"):
        run_distributed(_sleeps, 1, timeout_s=3)
    assert time.monotonic() - start < 15
