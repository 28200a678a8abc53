"""Every rank agrees on the outcome of a step that can fail on some ranks only (two gloo ranks)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from trident.errors import CheckpointError, ConfigError, DataError, TridentError
from trident.parallel.agree import on_every_rank, on_one_rank
from trident_dev.ranks import run_distributed


def _raise_on(ranks: set[int], error: Exception):
    def step() -> int:
        if dist.get_rank() in ranks:
            raise error
        return 10 + dist.get_rank()

    return step


def _agreement(rank: int, world_size: int) -> None:
    # Success: each rank keeps its own result.
    assert on_every_rank(_raise_on(set(), DataError("x")), "work") == 10 + rank
    # One rank fails: every rank raises its error, named with the rank, of the same class, marked agreed.
    with pytest.raises(CheckpointError, match=r"^rank 1: no file here$") as info:
        on_every_rank(_raise_on({1}, CheckpointError("no file here")), "read")
    assert info.value.agreed
    # An OS error becomes a TridentError that says which step could not be done.
    with pytest.raises(TridentError, match=r"^rank 0: cannot read checkpoint x: \[Errno 13\] denied$"):
        on_every_rank(_raise_on({0}, PermissionError(13, "denied")), "read checkpoint x")
    # Every rank fails alike: no rank prefix, the message is the same everywhere.
    with pytest.raises(DataError, match=r"^bad data$"):
        on_every_rank(_raise_on({0, 1}, DataError("bad data")), "read")

    # on_one_rank: only the source runs the step; a failure there is raised everywhere.
    assert on_one_rank(_raise_on(set(), DataError("x")), 1, "work") == (11 if rank == 1 else None)
    with pytest.raises(DataError, match=r"^disk full$") as info:
        on_one_rank(_raise_on({1}, DataError("disk full")), 1, "work")
    assert info.value.agreed
    # A failure on a rank that is not the source is not this step's business: it never ran there.
    assert on_one_rank(_raise_on({0}, DataError("x")), 1, "work") == (11 if rank == 1 else None)
    dist.barrier()  # nobody is left inside a collective


@pytest.mark.multiprocess
def test_every_rank_agrees_on_failures() -> None:
    run_distributed(_agreement, 2)


def test_errors_are_not_agreed_unless_marked() -> None:
    """Only errors every rank reaches alike may be printed by one rank per node."""
    assert not DataError("x").agreed and not CheckpointError("x").agreed
    assert ConfigError("x").agreed
