"""Warm processes: ``python train.py`` (or a tool) as a process of its own that starts in milliseconds.

A fresh Python that imports torch, Hydra and trident takes seconds on a busy 2-core machine, and the command-line
tests start dozens. Instead, multiprocessing's fork server (the one trident_dev/ranks.py forks its ranks from) imports
them once (``start_fork_server``), and each command is a fork of it that then runs the script as ``python script
args`` would: ``sys.argv``, the script's directory first on ``sys.path``, the environment, the working directory
and, optionally, a session of its own are the command's; stdout and stderr are pipes to the test (unbuffered when
``PYTHONUNBUFFERED`` says so); ``atexit`` handlers run on a normal exit, and the exit code is the script's (a
signal's: minus its number). What a warm process does not do is start an interpreter: the tests of that (a
launcher's children, an installed wheel), and everything under ``torchrun``, start real ones.

``WarmProcess`` answers as ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` does: ``pid``,
``returncode``, ``poll``, ``wait``, ``communicate``, ``send_signal``, ``terminate``, ``kill``.
"""

from __future__ import annotations

import atexit
import io
import multiprocessing as mp
import os
import runpy
import signal
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import trident_dev.ranks

_CTX = mp.get_context("forkserver")
# What the fork server imports once beside the rank pools' module (trident_dev.ranks): train.py and these helpers (the
# ranks run functions of tests.helpers.layouts, warm processes this module's _run_script); and what importing
# train.py leaves to the run that needs it, which nearly every test's run does: dynamo (torch.optim's optimizers
# import it) and DCP (a checkpoint's save or load).
PRELOAD = [
    "train",
    "tests.helpers.layouts",
    "tests.helpers.warm",
    "torch._dynamo",
    "trident.checkpoint.dcp",
]


def start_fork_server() -> None:
    """Start the fork server with ``PRELOAD`` imported, before any rank pool starts it with trident_dev.ranks alone.
    Ranks and warm processes forked from it then import nothing; a server already running is left as it is."""
    trident_dev.ranks.start_fork_server(PRELOAD)


def _stdio(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    """A text stream on ``fd`` as Python makes sys.stdout for a pipe: block-buffered, or with ``-u`` /
    PYTHONUNBUFFERED written through to the pipe at once."""
    raw = io.FileIO(fd, "w", closefd=False)
    if unbuffered:
        return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True)
    return io.TextIOWrapper(io.BufferedWriter(raw), encoding="utf-8", errors="backslashreplace")


def _run_script(
    script: str,
    args: list[str],
    env: dict[str, str],
    cwd: str,
    stdout: Connection,
    stderr: Connection,
    new_session: bool,
    before: tuple[Callable[..., Any], tuple[Any, ...]] | None,
) -> None:
    """In the forked child: become ``python script args`` and never return (``os._exit`` with its exit code)."""
    if new_session:
        os.setsid()
    # multiprocessing's resource tracker of its own, as a fresh interpreter has, not the test process's (the
    # fork server's children share it): what a killed command leaks is its tracker's to clean up and report.
    tracker = resource_tracker._resource_tracker
    if tracker._fd is not None:
        os.close(tracker._fd)
    tracker._fd, tracker._pid = None, None
    os.dup2(stdout.fileno(), 1)
    os.dup2(stderr.fileno(), 2)
    stdout.close()
    stderr.close()
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdout, sys.stderr = _stdio(1, unbuffered), _stdio(2, unbuffered)
    if "OMP_NUM_THREADS" in env:  # read by the OpenMP runtime when torch loaded it: in the server, not here
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [script, *args]
    sys.path.insert(0, str(Path(script).parent))
    code = 0
    try:
        if before is not None:
            fn, fn_args = before
            fn(*fn_args)
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


class WarmProcess:
    """A running warm process, as ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` would be."""

    def __init__(
        self,
        script: Path,
        args: Sequence[str],
        env: dict[str, str] | None = None,
        cwd: Path | str | None = None,
        new_session: bool = False,
        before: tuple[Callable[..., Any], tuple[Any, ...]] | None = None,
    ) -> None:
        self.args = [sys.executable, str(script), *args]
        out_r, out_w = _CTX.Pipe(duplex=False)
        err_r, err_w = _CTX.Pipe(duplex=False)
        env = dict(os.environ if env is None else env)
        cwd = str(cwd if cwd is not None else os.getcwd())
        self._process = _CTX.Process(
            target=_run_script,
            args=(str(script), list(args), env, cwd, out_w, err_w, new_session, before),
            name=f"warm {Path(script).name}",
        )
        try:
            self._process.start()
        finally:
            out_w.close()  # only the child holds the write ends now: the pipes read EOF when it (and its children) exit
            err_w.close()
        self.pid: int = self._process.pid
        self._readers = [_Reader(out_r), _Reader(err_r)]

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Wait for the process to exit and its output to end; its stdout and stderr."""
        self.wait(timeout)
        out, err = (reader.text(timeout) for reader in self._readers)
        if out is None or err is None:  # a child of the process still holds the pipes
            raise subprocess.TimeoutExpired(self.args, timeout)
        return out, err

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Reader:
    """Reads one pipe to its end in a thread, so that a process writing much to both never blocks."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._chunks: list[bytes] = []
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        fd = self._conn.fileno()
        while chunk := os.read(fd, 65536):
            self._chunks.append(chunk)
        self._conn.close()

    def text(self, timeout: float | None) -> str | None:
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        return b"".join(self._chunks).decode("utf-8", errors="replace")


def run(
    script: Path,
    args: Sequence[str],
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run([python, script, *args], capture_output=True, text=True, ...)``, warm."""
    proc = WarmProcess(script, args, env, cwd)
    try:
        out, err = proc.communicate(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
