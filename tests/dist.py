"""Run a function on ``world_size`` local processes that share one torch.distributed group.

Usage from a test module (``tests/`` is a package, so pytest puts the repository root on sys.path, and
spawned children inherit it)::

    from tests.dist import run_distributed

    def _check(rank, world_size, extra):  # module level, so the spawn context can pickle it
        ...

    def test_something():
        run_distributed(_check, 2, "extra")

If any rank raises, the remaining ranks are killed and a ``RuntimeError`` carries every failed rank's
traceback, the earliest failure (the likely cause) first. A run not done after ``timeout_s`` is killed
and raises ``TimeoutError``, so a hung collective never hangs pytest.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import torch
import torch.distributed as dist

from trident.parallel.groups import shutdown_distributed


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, fn, world_size, port, backend, timeout_s, args, err_dir) -> None:
    try:
        torch.set_num_threads(1)
        url = f"tcp://127.0.0.1:{port}"
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, init_method=url, rank=rank, world_size=world_size, timeout=timeout)
        fn(rank, world_size, *args)
        shutdown_distributed()
    except BaseException:
        # Written before we exit: our exit is what makes the other ranks' collectives fail next.
        with open(os.path.join(err_dir, f"{rank}.tmp"), "w") as f:
            f.write(f"{time.monotonic()}\n{traceback.format_exc()}")
        os.replace(os.path.join(err_dir, f"{rank}.tmp"), os.path.join(err_dir, str(rank)))
        code = 1
    else:
        code = 0
    # Skip interpreter finalization: a gloo worker thread may still be releasing the last collective's
    # tensors, which needs the GIL and aborts a finalizing interpreter (see parallel/groups.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_distributed(fn: Callable, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; return when all succeed."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as err_dir:
        procs = [
            ctx.Process(target=_worker, args=(rank, fn, world_size, port, backend, timeout_s, args, err_dir))
            for rank in range(world_size)
        ]
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.start()
            while True:
                codes = [p.exitcode for p in procs]  # one snapshot: a rank may exit while we look
                if any(codes) or all(c == 0 for c in codes):
                    break
                running = [p for p, c in zip(procs, codes, strict=True) if c is None]
                if time.monotonic() >= deadline:
                    alive = [procs.index(p) for p in running]
                    raise TimeoutError(f"ranks {alive} of {world_size} still running after {timeout_s} s")
                wait([p.sentinel for p in running], timeout=max(0.0, deadline - time.monotonic()))
        finally:
            for p in procs:
                if p.pid is not None:
                    p.kill()
                    p.join()
        failures = []
        for rank in range(world_size):
            if os.path.exists(path := os.path.join(err_dir, str(rank))):
                with open(path) as f:
                    when, tb = f.read().split("\n", 1)
                failures.append((float(when), rank, tb))
    if failures:
        report = "".join(f"\n--- rank {rank}:\n{tb}" for _, rank, tb in sorted(failures))
        raise RuntimeError(f"rank {min(failures)[1]} of {world_size} failed first{report}")
    codes = [p.exitcode for p in procs]
    if any(codes):
        raise RuntimeError(f"a rank died without a Python traceback; exit codes by rank: {codes}")
