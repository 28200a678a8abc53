"""The global gradient norm on real process groups: each logical element counted once, whatever the layout."""

from __future__ import annotations

import math

import pytest
import torch

from trident.parallel.groups import build_process_groups
from trident.parallel.norms import GlobalGradNorm, global_grad_norm
from trident.parallel.placement import Placement
from trident.parallel.topology import Topology
from trident_dev.ranks import run_distributed

pytestmark = pytest.mark.multiprocess

# One logical model: per pipeline stage a column-split matrix, a tp-replicated vector and an embedding whose
# vocab is padded (first stage) with its tied copy as LM head (last stage).
VOCAB, PADDED = 10, 12


def _logical(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    return torch.randn(shape, generator=gen)


def _stage_params(stage: int, n_stages: int) -> list[tuple[str, tuple[int, ...], int | None]]:
    params = [(f"{stage}.w", (8, 4), 0), (f"{stage}.b", (5,), None)]
    if stage == 0:
        params.append(("wte", (VOCAB, 4), 0))
    if stage == n_stages - 1:
        params.append(("head", (VOCAB, 4), 0))
    return params


def expected_norm(pp: int) -> float:
    total = 0.0
    for stage in range(pp):
        for name, shape, _ in _stage_params(stage, pp):
            if name != "head":  # the tied copy is the embedding itself
                total += _logical(name, shape).square().sum().item()
    return math.sqrt(total)


def _pieces(groups, dp_sharded: bool, poison: bool) -> list[tuple[torch.Tensor, Placement]]:
    pieces = []
    for name, shape, split in _stage_params(groups.pp_rank, groups.pp_size):
        padded = PADDED if name in ("wte", "head") else None
        placement = Placement(
            shape, split_dim=split, tp_rank=groups.tp_rank, tp_size=groups.tp_size, padded=padded,
            tied_to="wte" if name == "head" else None,
        )  # fmt: skip
        local = placement.shard(_logical("wte" if name == "head" else name, shape))
        if dp_sharded:  # ZeRO-2 style: each dp rank holds a disjoint slice of the flat gradient
            local = local.flatten().tensor_split(groups.dp_size)[groups.dp_rank]
        pieces.append((local, placement))
    if poison and groups.dp_rank == groups.dp_size - 1 and groups.tp_rank == groups.tp_size - 1:
        # A piece this rank does not count (replicated over dp or tp, or a tied copy): it must still poison.
        for local, placement in pieces:
            if placement.tied_to or placement.split_dim is None or not dp_sharded:
                local.view(-1)[0] = float("nan")
                break
    return pieces


def _check_norm(rank: int, world: int, dp: int, pp: int, tp: int, dp_sharded: bool) -> None:
    groups = build_process_groups(Topology(dp=dp, pp=pp, tp=tp))
    norm = global_grad_norm(_pieces(groups, dp_sharded, poison=False), groups, dp_sharded)
    assert norm.item() == pytest.approx(expected_norm(pp), rel=1e-6)
    bad = global_grad_norm(_pieces(groups, dp_sharded, poison=True), groups, dp_sharded)
    assert not torch.isfinite(bad)


LAYOUTS = [(4, 1, 1), (2, 1, 2), (1, 2, 2), (2, 2, 1), (1, 4, 1), (1, 1, 4)]


@pytest.mark.parametrize("dp_sharded", [False, True], ids=["dp-replicated", "dp-sharded"])
def test_global_norm_counts_every_logical_element_once(dp_sharded):
    for dp, pp, tp in LAYOUTS:
        run_distributed(_check_norm, 4, dp, pp, tp, dp_sharded)


def test_one_process_norm_is_the_plain_norm():
    run_distributed(_check_norm, 1, 1, 1, 1, False)
    run_distributed(_check_norm, 1, 1, 1, 1, True)


def _one_process(rank: int, world: int) -> tuple[float, list[str]]:
    groups = build_process_groups(Topology(dp=1, pp=1, tp=1))
    with torch.profiler.profile() as prof:
        norm = global_grad_norm(_pieces(groups, dp_sharded=False, poison=False), groups)
    return norm.item(), [e.name for e in prof.events() if e.name.startswith("c10d::")]


def test_one_process_norm_takes_no_collective():
    """Its sum is its own: no all-reduce (on gloo a hand-off to the group's thread and back, every step)."""
    ((norm, collectives),) = run_distributed(_one_process, 1)
    assert norm == pytest.approx(expected_norm(1), rel=1e-6) and collectives == []


def _replicated_norm(rank: int, world: int) -> dict:
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    out = {}
    for poison in (None, float("inf"), float("nan")):
        pieces = _pieces(groups, dp_sharded=False, poison=False)  # the same on every dp rank, as after the all-reduce
        if poison is not None:
            pieces[0][0].view(-1)[0] = poison  # on every replica alike
        with torch.profiler.profile() as prof:
            mine = GlobalGradNorm(pieces, groups, replicated=True)()
        collectives = [e.name for e in prof.events() if e.name.startswith("c10d::")]
        out[str(poison)] = (mine, global_grad_norm(pieces, groups), collectives)
    return out


def test_replicated_gradients_give_the_all_reduced_norm_bit_for_bit_without_a_collective():
    """dp replicas after the all-reduce (tp = pp = 1) each take the norm themselves: the collective's result, NaN
    (not inf) where a gradient overflowed, as the other replicas' zeros make it."""
    for world in (1, 2):
        for got in run_distributed(_replicated_norm, world):
            for poison, (mine, reduced, collectives) in got.items():
                assert collectives == [], poison
                assert torch.equal(mine, reduced) or (mine.isnan() and reduced.isnan()), (poison, mine, reduced)
            assert got["None"][0].item() == pytest.approx(expected_norm(1), rel=1e-6)
            assert got["nan"][0].isnan() and got["inf"][0].isnan() == (world > 1)
