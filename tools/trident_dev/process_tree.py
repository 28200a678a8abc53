"""A launched command and every process it starts, ended together: what ``tools/plan.py --measure``, a calibration's
held-out runs and the bench's layouts launch (``torchrun ... train.py``) never outlives the tool that launched it.

``subprocess.run(..., timeout=...)`` kills only its child: torchrun's agent. torchrun starts each worker in a
session of its own, so the workers are neither in the agent's process group nor told when it dies by SIGKILL; a
worker in a collective then runs on, orphaned (``--measure``'s cp8 ring ZeRO-3 layout left six ranks of 3.4 GB each
running for minutes after the tool had exited). So every process of a launch carries one mark in its environment
(``TRIDENT_PROCESS_TREE``, inherited through torchrun by every worker) and, however the launch ends (it exits, it
runs past its time, the tool is interrupted or sent SIGTERM), the agent is first asked to stop its workers (SIGTERM:
torchrun passes it on), given a few seconds, and then every process still carrying the mark is killed.

Finding the marked processes reads ``/proc/<pid>/environ`` (Linux). Elsewhere only the agent's own process group is
reached.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

MARK = "TRIDENT_PROCESS_TREE"
# How long the agent has to stop its workers after SIGTERM before every marked process is killed.
GRACE_S = 10.0


class Terminated(SystemExit):
    """SIGTERM arrived while a launch ran: the launch is ended, then the tool exits as SIGTERM asks (143)."""

    def __init__(self) -> None:
        super().__init__(128 + signal.SIGTERM)


def marked(mark: str, name: str = MARK) -> list[int]:
    """The pids of the live processes whose environment carries ``name=mark`` (none where /proc is missing)."""
    needle = f"\0{name}={mark}\0".encode()
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        if needle in b"\0" + environ + b"\0":
            found.append(int(entry.name))
    return [pid for pid in found if pid != os.getpid()]


def _kill(pids: list[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def end_tree(proc: subprocess.Popen, mark: str, grace_s: float = GRACE_S) -> None:
    """Stop ``proc`` and everything marked ``mark``: SIGTERM to the agent (which stops its workers), then after
    ``grace_s`` (or as soon as none is left) SIGKILL to every marked process still alive, and reap the agent."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and (proc.poll() is None or marked(mark)):
        time.sleep(0.1)
    for _ in range(3):  # a worker may be forking as it is killed: look again until none is left
        left = marked(mark)
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        if not left:
            break
        _kill(left, signal.SIGKILL)
        time.sleep(0.1)
    proc.wait()


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """While a launch runs on the main thread, SIGTERM raises ``Terminated`` there, so that the launch is ended
    before the tool exits (Python's default for SIGTERM exits at once, past every ``finally``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_terminated(signum: int, frame: object) -> None:
        raise Terminated()

    before = signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def run_tree(
    cmd: list[str], timeout_s: float, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)``, except that when it returns or
    raises (``subprocess.TimeoutExpired``, ``KeyboardInterrupt``, ``Terminated``) no process the command started
    is left running."""
    mark = uuid.uuid4().hex
    env = dict(os.environ if env is None else env, **{MARK: mark})
    with _sigterm_raises():
        proc = subprocess.Popen(
            cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except BaseException:
            end_tree(proc, mark)
            proc.communicate()  # what it printed before the end, so the pipes are closed
            raise
        end_tree(proc, mark)  # it exited: any worker it left behind is ended too
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
