"""The multi-process test harness itself: pooled ranks, isolation between calls, failures, timeouts, exits."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

from tests.helpers import REPO
from trident_dev.ranks import run_distributed

pytestmark = pytest.mark.multiprocess


def _whoami(rank: int, world_size: int) -> tuple[int, int, int]:
    return rank, world_size, os.getpid()


def _pids(world_size: int) -> list[int]:
    return [pid for _, _, pid in run_distributed(_whoami, world_size)]


def _gone(pid: int, within_s: float = 0.0) -> bool:
    """Exited (by ``within_s`` from now): no such process, or a zombie that no parent has reaped yet."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def test_values_come_back_in_rank_order_from_one_reused_pool() -> None:
    first = run_distributed(_whoami, 2)
    assert [(rank, world) for rank, world, _ in first] == [(0, 2), (1, 2)]
    assert len({pid for _, _, pid in first} | {os.getpid()}) == 3
    assert run_distributed(_whoami, 2) == first


def _parent_pid(conn) -> None:
    conn.send(os.getppid())


def _writers_parent(rank: int, world_size: int) -> tuple[int, int]:
    """A process the rank starts as the background checkpoint writer does (trident/checkpoint/background.py): from
    the forkserver context. Its parent, and the rank's own (the server the pool forked the rank from)."""
    ctx = multiprocessing.get_context("forkserver")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=_parent_pid, args=(theirs,), daemon=True)
    proc.start()
    parent = ours.recv()
    proc.join(timeout=30)
    return parent, os.getppid()


def test_a_ranks_own_processes_are_forked_from_the_pools_server() -> None:
    """Not from a fork server of the rank's own, a fresh interpreter that imports torch (seconds of a core for
    each rank of each pool whose runs save in the background)."""
    for writer, server in run_distributed(_writers_parent, 2):
        assert writer == server


def test_world_sizes_keep_their_own_pools() -> None:
    pids = {world_size: _pids(world_size) for world_size in (1, 2, 4)}
    assert len({pid for ranks in pids.values() for pid in ranks}) == 7
    assert {world_size: _pids(world_size) for world_size in (4, 2, 1)} == pids


def test_a_function_that_does_not_pickle_leaves_the_pool_alone() -> None:
    before = _pids(1)
    with pytest.raises(AttributeError, match="local object"):
        run_distributed(lambda rank, world_size: None, 1)
    assert _pids(1) == before


def _open_groups(rank: int, world_size: int, n: int) -> int:
    fds = len(os.listdir("/proc/self/fd"))
    groups = [dist.new_group(ranks) for ranks in ([0, 1], [0], [1]) * n]
    for group in groups:
        if rank in dist.get_process_group_ranks(group):
            dist.all_reduce(torch.ones(1), group=group)
    # A reference cycle, as gradient hooks make: only a collection frees it.
    cycle: list = [groups]
    cycle.append(cycle)
    return fds


def _groups_and_fds(rank: int, world_size: int) -> tuple[int, int]:
    return len(_world.pg_map), len(os.listdir("/proc/self/fd"))


def test_groups_a_task_creates_are_destroyed_after_it() -> None:
    fds = run_distributed(_open_groups, 2, 10)
    # Only the default group is left, and every socket of the task's groups is closed.
    assert run_distributed(_groups_and_fds, 2) == [(1, fds[0]), (1, fds[1])]


def _changes_global_state(rank: int, world_size: int) -> None:
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("medium")
    os.environ["TRIDENT_TEST_DIST"] = "left behind"
    os.chdir("/")


def _global_state(rank: int, world_size: int) -> tuple[torch.dtype, bool, int, str, str | None, str]:
    return (
        torch.get_default_dtype(),
        torch.is_grad_enabled(),
        torch.get_num_threads(),
        torch.get_float32_matmul_precision(),
        os.environ.get("TRIDENT_TEST_DIST"),
        os.getcwd(),
    )


def test_a_call_sees_the_callers_directory_and_environment_and_torch_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_distributed(_changes_global_state, 1)
    fresh = (torch.float32, True, 1, "highest")
    assert run_distributed(_global_state, 1) == [(*fresh, None, os.getcwd())]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TRIDENT_TEST_DIST", "set by the test")
    assert run_distributed(_global_state, 1) == [(*fresh, "set by the test", str(tmp_path))]


def _destroys_the_default_group(rank: int, world_size: int) -> str:
    dist.destroy_process_group()
    return "done"


def _default_group_works(rank: int, world_size: int) -> int:
    t = torch.tensor([1.0])
    dist.all_reduce(t)
    return os.getpid()


def test_a_task_that_destroys_the_default_group_gets_its_result_and_a_fresh_pool() -> None:
    before = _pids(1)
    assert run_distributed(_destroys_the_default_group, 1) == ["done"]
    assert all(_gone(pid) for pid in before)
    after = run_distributed(_default_group_works, 1)
    assert after != before


def _both_fail(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(0.2)
    raise ValueError(f"rank {rank} gives up")


def test_every_failure_is_reported_earliest_first_then_a_fresh_pool_runs() -> None:
    before = _pids(2)
    with pytest.raises(RuntimeError, match="^rank 1 of 2 failed first") as excinfo:
        run_distributed(_both_fail, 2)
    message = str(excinfo.value)
    assert message.index("--- rank 1:") < message.index("ValueError: rank 1 gives up") < message.index("--- rank 0:")
    assert message.rstrip().endswith("ValueError: rank 0 gives up")
    assert all(_gone(pid) for pid in before)
    assert set(_pids(2)).isdisjoint(before)


def _rank_one_exits(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()  # rank 0 waits for a rank that is gone


def test_a_rank_that_dies_without_a_traceback_is_reported_with_its_exit_code() -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^a rank died without a Python traceback; exit codes by rank: \[None, 3\]"):
        run_distributed(_rank_one_exits, 2, timeout_s=60)
    assert time.monotonic() - start < 30  # rank 0 was not waited for until the timeout
    assert len(_pids(2)) == 2


def _rank_zero_sleeps(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(60)


def test_a_timeout_names_the_ranks_still_running_then_a_fresh_pool_runs() -> None:
    before = _pids(2)  # warm, so that the timeout is all the task's
    with pytest.raises(TimeoutError, match=r"^ranks \[0\] of 2 still running after 1 s$"):
        run_distributed(_rank_zero_sleeps, 2, timeout_s=1)
    assert all(_gone(pid) for pid in before)
    assert set(_pids(2)).isdisjoint(before)


def _kills_the_test_process(rank: int, world_size: int) -> None:
    print(os.getpid(), flush=True)
    parent = multiprocessing.parent_process()
    assert parent is not None and parent.pid is not None
    os.kill(parent.pid, signal.SIGKILL)
    time.sleep(60)


# Run with -c from the repository root, so that tests/ imports as it does under pytest.
_OWNER = """
import sys
from trident_dev.ranks import run_distributed
from tests.test_dist import _kills_the_test_process, _whoami

if sys.argv[1] == "exit":
    print(run_distributed(_whoami, 1)[0][2])
else:
    run_distributed(_kills_the_test_process, 1)
"""


@pytest.mark.parametrize("ending", ["exit", "sigkill"])
def test_ranks_end_with_the_process_that_started_them(ending: str) -> None:
    """A normal exit closes the pools; a rank whose parent is killed in the middle of a call exits by itself."""
    # The rank's stdout is this pipe too: run() returns only once the rank has let go of it, or times out.
    done = subprocess.run([sys.executable, "-c", _OWNER, ending], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert done.returncode == (-signal.SIGKILL if ending == "sigkill" else 0), done.stderr
    # An orphan closes its pipes a moment before it is gone; after a normal exit the pool was closed already.
    assert _gone(int(done.stdout), within_s=5 if ending == "sigkill" else 0)
