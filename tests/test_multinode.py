"""Several nodes, tested on one machine: two torchrun agents joined by the c10d rendezvous, as on two nodes (the
docs/nodes.md's "Several nodes" commands). What is per node is per node: each agent numbers its own local ranks, and the
dataset a run prepares (``data.text``) is prepared once where the nodes share the cache (here, one file system).
A node that dies, agent and workers at once, ends the other node's ranks within 60 s, each with a line naming
what was lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import SMALL_CORPUS
from tests.helpers.layouts import assert_same_curve, tiny, train_in_process
from tests.helpers.processes import (
    child_env,
    is_alive,
    output_lines,
    read_metrics,
    torchrun,
    train_command,
    wait_for_rows,
    worker_pids,
)
from trident_dev.ranks import free_port

pytestmark = pytest.mark.multiprocess


def _agent(
    port: int, node: int, nproc: int, run_dir: Path, overrides: list[str], restarts: int = 0
) -> subprocess.Popen:
    """One node's torchrun agent, in a process group of its own (a node's processes, to kill at once)."""
    agent = ["--nnodes=2", f"--node-rank={node}", *([f"--max-restarts={restarts}"] if restarts else [])]
    agent += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=test"]
    cmd = train_command(run_dir, overrides, launcher=torchrun(nproc, *agent, standalone=False))
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=child_env(), start_new_session=True
    )


def _two_nodes(nproc: int, run_dir: Path, overrides: list[str], restarts: int = 0) -> list[subprocess.Popen]:
    port = free_port()
    first = _agent(port, 0, nproc, run_dir, overrides, restarts)
    # The first agent hosts the rendezvous (both would try, on one machine): let it bind the port first.
    deadline = time.monotonic() + 30
    while not _listening(port):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    return [first, _agent(port, 1, nproc, run_dir, overrides, restarts)]


def _listening(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _end(agents: list[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    try:
        return [agent.communicate(timeout=timeout) for agent in agents]
    finally:
        for agent in agents:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(agent.pid, signal.SIGKILL)


def test_two_agents_train_a_tp_pp_layout_with_the_one_process_curve_and_prepare_the_data_once(tmp_path):
    steps, cache = 6, tmp_path / "cache"
    data = [f"data.text=[{','.join(SMALL_CORPUS)}]", "data.suffixes=[.py]", f"data.cache_dir={cache}"]
    # gpt-tiny on the text the test dataset is prepared from, prepared by the run itself (no data.dataset_dir).
    tiny_run = tiny(Path("unused"), f"train.steps={steps}", "train.eval_every=3")
    common = [*(o for o in tiny_run if not o.startswith("data.dataset_dir=")), *data]
    # tp inside a node, the pipeline's sends between the nodes (two ranks a node: ten processes at world 8 cost
    # this 2-core CI a minute more, and dp across nodes is tested below)
    layout = ["parallel.tp=2", "parallel.pp=2", "train.micro_batch_size=2"]
    run_dir = tmp_path / "run"
    agents = _two_nodes(2, run_dir, [*common, *layout])
    (out0, err0), (out1, err1) = _end(agents, timeout=240)
    assert [a.returncode for a in agents] == [0, 0], err0 + err1
    # Every rank of both nodes asked for the dataset; the first prepared it, the rest waited on its lock.
    prepared = [line for line in output_lines(out0 + out1) if line.startswith("preparing dataset")]
    assert len(prepared) == 1, out0 + out1
    assert "world 4 (dp 1 x tp 2 x pp 2)" in out0 + out1

    (reference,) = train_in_process(tmp_path / "reference", common)
    assert_same_curve(reference, read_metrics(run_dir, partial=True))


def _node_of_rank_0(agents: list[subprocess.Popen]) -> int:
    for node, agent in enumerate(agents):
        if 0 in worker_pids(agent.pid):
            return node
    raise AssertionError("no agent runs rank 0")


@pytest.mark.parametrize("lost", ["the other node", "the node of rank 0"])
def test_a_node_killed_mid_run_ends_the_other_nodes_ranks_within_60_s_naming_what_was_lost(
    tiny_dataset, tmp_path, lost
):
    overrides = tiny(tiny_dataset, "train.steps=100000", "parallel.tp=2", "train.eval_every=0", "logging.interval=1000")
    run_dir = tmp_path / "run"
    agents = _two_nodes(2, run_dir, overrides)
    workers: dict[int, int] = {}
    try:
        wait_for_rows(run_dir, 3, agents[0])
        rank0_node = _node_of_rank_0(agents)
        dead = rank0_node if lost == "the node of rank 0" else 1 - rank0_node
        survivor = agents[1 - dead]
        workers = worker_pids(survivor.pid)
        dead_workers = worker_pids(agents[dead].pid)
        # The node's agent and its workers at once (torchrun starts each worker in a session of its own).
        for pid in [agents[dead].pid, *dead_workers.values()]:
            os.kill(pid, signal.SIGKILL)
        dead_ranks = sorted(dead_workers)
        killed = time.monotonic()
        while any(is_alive(pid) for pid in workers.values()) and time.monotonic() - killed < 90:
            time.sleep(0.05)
        took = time.monotonic() - killed
        # Where the surviving agent saw the lost store first and stopped its workers itself, its own line on the
        # lost store comes after they are gone: it gets a little time to write it (and usually exits meanwhile).
        if lost == "the node of rank 0":
            with contextlib.suppress(subprocess.TimeoutExpired):
                survivor.wait(timeout=15)
    finally:
        # What is asserted is written by now: the surviving ranks' lines, or before them its agent's own line on
        # the lost store. The agent itself may wait a store timeout more before it exits: not what is tested.
        for pid in [agent.pid for agent in agents] + list(workers.values()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        results = _end(agents, timeout=60)
    assert took < 60, took
    # Each surviving rank whose collective failed first names what was lost; one that its agent's SIGTERM reached
    # first (sent when the first survivor exited) leaves nothing or the stop line.
    err = results[1 - dead][1]
    lines = [line for line in output_lines(err) if line.startswith(("error:", "stopped by"))]
    if lost == "the other node":
        ranks = ", ".join(map(str, dead_ranks))
        named = f"error: lost contact with ranks {ranks} (silent for 3 s: dead or stuck; all of node "
    else:  # rank 0's node hosted the job's store (its agent's): the survivors cannot see beats, only that it is gone
        named = "error: lost contact with another rank and with the job's store (torchrun's agent at "
    assert all(line.startswith((named, "stopped by SIGTERM")) for line in lines), err
    if lost == "the node of rank 0" and not any(line.startswith(named) for line in lines):
        # The surviving agent lost the same store, and may see it first and stop its workers before their 3 s of
        # silence: then torch's own line names what was lost (seen on a loaded machine).
        assert "RendezvousConnectionError: The connection to the C10d store has failed" in err, err
    else:
        assert any(line.startswith(named) for line in lines), err


def test_a_rank_killed_on_one_node_under_max_restarts_resumes_on_both_with_the_unbroken_losses(tiny_dataset, tmp_path):
    """The node whose rank died counts a restart; the other is restarted without counting one (torch's agents count
    their own), so the restart count cannot name the round: the ranks still meet in the new one."""
    steps = 12
    overrides = tiny(tiny_dataset, f"train.steps={steps}", "train.micro_batch_size=2", "train.eval_every=0")
    overrides += ["logging.interval=1000", "checkpoint.every=2"]
    run_dir = tmp_path / "run"
    agents = _two_nodes(2, run_dir, [*overrides, "parallel.tp=2"], restarts=1)  # dp=2 x tp=2
    try:
        wait_for_rows(run_dir, 5, agents[0])
        node = 1 - _node_of_rank_0(agents)  # the node of ranks 2 and 3
        workers = {**worker_pids(agents[0].pid), **worker_pids(agents[1].pid)}
        os.kill(workers[3], signal.SIGKILL)
        killed_at = read_metrics(run_dir, partial=True)[-1]["step"]
    finally:
        results = _end(agents, timeout=240)
    assert killed_at < steps, "the run ended before the kill: make its steps longer"
    # The killed node's agent saw its local rank 1 die and restarted; both agents' new workers resumed by themselves.
    assert [a.returncode for a in agents] == [0, 0], results
    assert "local_rank: 1" in results[node][1] and "exitcode: -9" in results[node][1], results[node][1]
    assert not any(is_alive(pid) for pid in workers.values())
    out = output_lines(results[0][0] + results[1][0])
    resumed = [line for line in out if line.startswith("resumed from ")]
    assert len(resumed) == 1, out  # rank 0 says it
    start = int(resumed[0].rsplit(" ", 1)[1])  # its newest complete checkpoint: a multiple of checkpoint.every
    assert start % 2 == 0 and 0 < start <= killed_at, (resumed, killed_at)
    assert any(line.startswith(f"done: steps {start + 1}-{steps} ") for line in out), out
    (reference,) = train_in_process(tmp_path / "reference", overrides)
    assert_same_curve(reference, read_metrics(run_dir, partial=True))
