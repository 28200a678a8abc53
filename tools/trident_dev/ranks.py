"""Run a function on ``world_size`` local processes that share one torch.distributed group.

The tests' multi-process tier and the tools that compare layouts (tools/fuzz_layouts.py) run on it. Usage (the
function must pickle by name: a module-level function of an importable module, which the ranks import)::

    from trident_dev.ranks import run_distributed

    def _check(rank, world_size, extra):  # module level, so it pickles by name
        ...
        return something_picklable

    def test_something():
        per_rank = run_distributed(_check, 2, "extra")

A process that imports torch takes ~2 s to start, so ranks are not started per call: each (world size,
backend) has a pool of ranks that join one default group once and then run one call after another, each
in the caller's working directory and environment. After a call a rank destroys the groups it created and
resets torch's global settings (threads, default dtype, grad mode, matmul precision, determinism). Seeds, and
module attributes a call patches, are the call's own business to set and restore.

If any rank raises, a ``RuntimeError`` carries every failed rank's traceback, the earliest failure (the
likely cause) first. A rank that dies without a traceback (a crash, ``os._exit``) is named with its exit
code. A call not done after ``timeout_s`` raises ``TimeoutError``. In each case the other ranks may be
stuck in a collective, so the pool is killed and the next call starts a fresh one.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import multiprocessing.forkserver
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _world

# After a failure, how long the other ranks get to report theirs: ranks that fail alike (an assertion every
# rank reaches) report close together, a loaded 2-core machine spreading them over some tenths of a second;
# the others are waiting in a collective for a failed rank and would never report.
_FAILURE_GRACE_S = 1.0
# A pool being closed gets this long to exit by itself before it is killed.
_CLOSE_GRACE_S = 5.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class _Done:
    value: Any
    healthy: bool  # False: the rank's default group or cleanup is not to be trusted for another task


@dataclass(frozen=True)
class _Failed:
    when: float  # time.monotonic(), which every process on the machine shares
    traceback: str


@dataclass(frozen=True)
class _TorchState:
    """torch's process-wide settings: a task may change them, and a later task would silently inherit them."""

    num_threads: int
    default_dtype: torch.dtype
    grad_enabled: bool
    matmul_precision: str  # "high" is TF32 on GPU
    deterministic: bool
    deterministic_warn_only: bool

    @classmethod
    def capture(cls) -> _TorchState:
        return cls(
            num_threads=torch.get_num_threads(),
            default_dtype=torch.get_default_dtype(),
            grad_enabled=torch.is_grad_enabled(),
            matmul_precision=torch.get_float32_matmul_precision(),
            deterministic=torch.are_deterministic_algorithms_enabled(),
            deterministic_warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        )

    def restore(self) -> None:
        # Only what changed: the first use_deterministic_algorithms call alone takes a second of imports.
        now = self.capture()
        if now.num_threads != self.num_threads:
            torch.set_num_threads(self.num_threads)
        if now.default_dtype != self.default_dtype:
            torch.set_default_dtype(self.default_dtype)
        if now.grad_enabled != self.grad_enabled:
            torch.set_grad_enabled(self.grad_enabled)
        if now.matmul_precision != self.matmul_precision:
            torch.set_float32_matmul_precision(self.matmul_precision)
        if (now.deterministic, now.deterministic_warn_only) != (self.deterministic, self.deterministic_warn_only):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.deterministic_warn_only)


@dataclass(frozen=True)
class _Task:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    # The caller's, as a process started for the call would have inherited them (monkeypatch.setenv/chdir).
    cwd: str
    environ: dict[str, str]

    def run(self, rank: int, world_size: int) -> Any:
        os.chdir(self.cwd)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        return self.fn(rank, world_size, *self.args)


def _exit(code: int) -> None:
    # Skip interpreter finalization: a gloo worker thread may still be releasing the last collective's
    # tensors, which needs the GIL and aborts a finalizing interpreter (see parallel/groups.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _exit_with_parent() -> None:
    # The pipe only tells an idle rank that the parent is gone; a rank inside a task (or stuck in a
    # collective) learns it here. The sentinel reads EOF once the parent process has exited.
    parent = mp.parent_process()
    assert parent is not None
    wait([parent.sentinel])
    _exit(1)


def _send(conn: Connection, reply: _Done | _Failed) -> None:
    # Plain pickle: torch's multiprocessing pickler would pass tensors through shared memory, which
    # needs this process alive until the parent has read them, and the parent may kill it right after.
    conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


def _failed() -> _Failed:
    return _Failed(time.monotonic(), traceback.format_exc())


def _clean_up(groups_before: set[dist.ProcessGroup], world: dist.ProcessGroup, pristine: _TorchState) -> bool:
    """Undo what a successful task left behind; True if this rank can run another task."""
    try:
        # Each gloo group holds sockets to every peer: hundreds of tests' groups would exhaust the fds.
        for group in set(_world.pg_map) - groups_before:
            dist.destroy_process_group(group)
        # Reference cycles (e.g. through gradient hooks) can hold a destroyed group, and a task's model, alive.
        gc.collect()
        # What survives is modules and caches: frozen, the next collection only looks at the next task's objects.
        gc.freeze()
        pristine.restore()
        return dist.is_initialized() and dist.group.WORLD is world
    except Exception:
        traceback.print_exc()
        return False


def start_fork_server(preload: Sequence[str] = ()) -> tuple[Any, bytes | None]:
    """Start the fork server that pool ranks are forked from, with this module and ``preload`` imported once (a
    server already running is kept, with what it imported); return what a rank needs to ask
    it for processes of its own: its address (and, from Python 3.12, its authentication key)."""
    mp.get_context("forkserver").set_forkserver_preload([__name__, *preload])
    multiprocessing.forkserver.ensure_running()
    server = multiprocessing.forkserver._forkserver
    return server._forkserver_address, getattr(server, "_forkserver_authkey", None)


def _use_the_pools_server(address: Any, authkey: bytes | None) -> None:
    """In a rank: processes it starts with the forkserver context (the background checkpoint writer) are forked
    from the pool's fork server, which imported torch and trident once, instead of from a server of the rank's own
    (a fresh interpreter importing torch: seconds of a core per rank of every pool, eight at world 8). The rank
    was forked from that server too, so it holds the server's liveness pipe (``_forkserver_alive_fd``, set by
    the server for its children) and the resource tracker's; the server outlives every pool rank."""
    server = multiprocessing.forkserver._forkserver
    if address is None or server._forkserver_alive_fd is None:
        return
    server._forkserver_address = address
    if authkey is not None:
        server._forkserver_authkey = authkey
    server.ensure_running = resource_tracker.ensure_running  # running already: never start a second one


def _serve(rank: int, world_size: int, port: int, backend: str, conn: Connection, server: tuple[Any, ...]) -> None:
    """A pool rank: join the default group, then run each task the parent sends until the pipe closes."""
    _use_the_pools_server(*server)
    # Ctrl-C reaches every process of the terminal's group; the parent alone decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Everything inherited from the fork server stays: a collection that looked at it would copy every page.
    gc.freeze()
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    try:
        torch.set_num_threads(1)
        # torch's default group timeout stays: the parent enforces each task's own deadline.
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        world = dist.group.WORLD
        groups = set(_world.pg_map)
        pristine = _TorchState.capture()
    except BaseException:
        _send(conn, _failed())  # answers the first task: that call reports it and kills the pool
        _exit(1)
    while True:
        try:
            task = conn.recv_bytes()
        except EOFError:  # the pool is closing, or the parent died
            _exit(0)
        try:
            value = pickle.loads(task).run(rank, world_size)
        except BaseException:
            # Sent before any cleanup: the other ranks may be blocked on this one, and the pool dies anyway.
            _send(conn, _failed())
            continue
        healthy = _clean_up(groups, world, pristine)
        try:
            _send(conn, _Done(value, healthy))
        except Exception:  # the return value does not pickle
            _send(conn, _failed())


class _Pool:
    """``world_size`` ranks of one backend, started once, killed after any failure."""

    def __init__(self, world_size: int, backend: str) -> None:
        self.world_size = world_size
        # Ranks are forked from a server process that imported torch once, so starting a pool (again, after
        # a failure) costs a fork per rank, not a torch import per rank on a machine with fewer cores than ranks.
        ctx = mp.get_context("forkserver")
        server = start_fork_server()
        port = free_port()
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        try:
            for rank in range(world_size):
                parent_end, child_end = ctx.Pipe()
                proc = ctx.Process(
                    target=_serve,
                    args=(rank, world_size, port, backend, child_end, server),
                    name=f"dist-{backend}-{world_size}-rank{rank}",
                )
                proc.start()
                # Only the child holds its end now, so the parent's end reads EOF when the child dies.
                child_end.close()
                self.procs.append(proc)
                self.conns.append(parent_end)
        except BaseException:
            self.kill()
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, task: bytes, timeout_s: float, deadline: float) -> tuple[list[Any], bool]:
        """Run one pickled ``_Task`` on every rank; return the values in rank order, and whether every
        rank can take another task. Kills the pool before raising, whatever the reason."""
        replies: dict[int, _Done | _Failed] = {}
        dead: dict[int, int | None] = {}  # rank -> exit code, for ranks that died without a reply
        try:
            for conn in self.conns:
                try:
                    conn.send_bytes(task)
                except OSError:  # that rank is dead (the pipe is a socket pair); the wait below finds out
                    pass
            give_up = deadline
            while len(replies) + len(dead) < self.world_size:
                waiting = [r for r in range(self.world_size) if r not in replies and r not in dead]
                handles = {self.conns[r]: r for r in waiting} | {self.procs[r].sentinel: r for r in waiting}
                ready = wait(list(handles), timeout=max(0.0, give_up - time.monotonic()))
                if not ready:
                    break
                for rank in sorted({handles[h] for h in ready}):
                    reply = self._receive(rank)
                    if reply is None:
                        dead[rank] = self.procs[rank].exitcode
                    else:
                        replies[rank] = reply
                if dead or any(isinstance(r, _Failed) for r in replies.values()):
                    give_up = min(give_up, time.monotonic() + _FAILURE_GRACE_S)
        except BaseException:
            self.kill()
            raise
        failures = sorted((r.when, rank, r.traceback) for rank, r in replies.items() if isinstance(r, _Failed))
        unfinished = [r for r in range(self.world_size) if r not in replies and r not in dead]
        if failures or dead or unfinished:
            self.kill()
        report = "".join(f"\n--- rank {rank}:\n{tb}" for _, rank, tb in failures)
        if dead:
            # The cause: the others' tracebacks (a peer's connection reset) are what the death did to them.
            codes = [dead.get(rank) for rank in range(self.world_size)]
            raise RuntimeError(f"a rank died without a Python traceback; exit codes by rank: {codes}{report}")
        if failures:
            raise RuntimeError(f"rank {failures[0][1]} of {self.world_size} failed first{report}")
        if unfinished:
            raise TimeoutError(f"ranks {unfinished} of {self.world_size} still running after {timeout_s} s")
        done = [replies[rank] for rank in range(self.world_size)]
        assert all(isinstance(r, _Done) for r in done)
        return [r.value for r in done], all(r.healthy for r in done)

    def _receive(self, rank: int) -> _Done | _Failed | None:
        """The rank's reply, or None if it died without one."""
        conn, proc = self.conns[rank], self.procs[rank]
        try:
            # A rank that exited wakes the wait through its sentinel; a reply it sent first is still in the pipe.
            if conn.poll():
                return pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # closed, or reset because it died with our task unread
            pass
        proc.join(timeout=1.0)  # the pipe can close a moment before the exit code is known
        return None

    def close(self) -> None:
        """Let idle ranks exit by themselves (they read EOF), then kill what is left."""
        for conn in self.conns:
            conn.close()
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.pid is not None:
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()


_pools: dict[tuple[int, str], _Pool] = {}


def _pool(world_size: int, backend: str) -> _Pool:
    key = (world_size, backend)
    pool = _pools.get(key)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.kill()  # a pool with one dead rank still has live ones
        pool = _pools[key] = _Pool(world_size, backend)
    return pool


@atexit.register
def shutdown_pools() -> None:
    """Stop every pool's ranks. Runs at interpreter exit; the next ``run_distributed`` starts a fresh pool."""
    while _pools:
        _, pool = _pools.popitem()
        pool.close()


def run_distributed(
    fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo", timeout_s: float = 120
) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return each rank's result, rank 0 first."""
    deadline = time.monotonic() + timeout_s  # a pool's start counts, as a fresh process's start always did
    # Pickled here, before any rank gets it: a function that does not pickle leaves the pool untouched.
    task = pickle.dumps(_Task(fn, args, os.getcwd(), dict(os.environ)), protocol=pickle.HIGHEST_PROTOCOL)
    pool = _pool(world_size, backend)
    values, healthy = pool.run(task, timeout_s, deadline)
    if not healthy:
        pool.close()  # the next call finds it dead and starts another
    return values
