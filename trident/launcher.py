"""Who launched this process: whether torchrun did (``launcher_pid``, the one test of it) and the launcher's
pid and start time (``launcher``), which name the default run directory (``launch_id``). And a worker whose
torchrun agent is gone stops: nothing would restart it, end it, or report its exit.

When a node's agent dies (killed, its node's job step cancelled) and its workers do not, they would train on
orphaned, holding the run directory and the devices. A worker sees its launcher go when its parent pid changes
(the kernel hands an orphan to init or a subreaper): a thread looks twice a second and then sends this process
SIGTERM, which stops the run cleanly after the step in flight, with a checkpoint, as any SIGTERM does
(trident/signals.py), within ``train.stop_grace_s`` when the other ranks no longer answer.

Not ``prctl(PR_SET_PDEATHSIG)``: the kernel sends that signal when the parent *thread* exits, and a killed
multi-threaded agent's threads exit one by one, so it comes while the worker still sees the agent as its parent.
"""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time

INTERVAL_S = 0.5


def launcher_pid() -> int | None:
    """The pid of this rank's torchrun agent, or None when no torchrun agent started this process.

    The one test of "under torchrun" (the run directory's name and the orphan watch both read it):
    ``TORCHELASTIC_RUN_ID``, which torchrun's agent alone sets. ``LOCAL_WORLD_SIZE``, ``RANK`` and the rest are
    also set by other launchers and by tests that start ranks by hand, whose parent is no torchrun agent.
    """
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    return os.getppid()  # torchrun starts its workers itself


def launcher() -> tuple[int, float]:
    """The pid and start time (seconds since the epoch) of the process that launched this job: torchrun's agent
    for its workers (every local rank is its child), else this process."""
    pid = launcher_pid()
    if pid is not None:
        try:
            return pid, _start_time(pid)
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return os.getpid(), time.time()


def launch_id() -> str:
    """The default run directory's name, ``YYYY-MM-DD/HH-MM-SS-<launcher pid>``.

    Every local rank of one torchrun job computes the same name (the same launcher), and train.py hands rank 0's
    to the other nodes. Two jobs started in the same second have different launchers, so different names.
    """
    pid, stamp = launcher()
    return datetime.datetime.fromtimestamp(stamp).strftime(f"%Y-%m-%d/%H-%M-%S-{pid}")


def _start_time(pid: int) -> float:
    """When process ``pid`` started, from /proc (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + start_ticks / os.sysconf("SC_CLK_TCK")


def gone_line(launcher: int, rank: int) -> str:
    return (
        f"error: rank {rank}'s launcher (torchrun agent, pid {launcher}) is gone: stopping, since nothing would "
        "restart or end this rank; start the job again to resume from its last checkpoint"
    )


def stop_when_orphaned(launcher: int, rank: int, interval_s: float = INTERVAL_S) -> threading.Event:
    """Watch, from a daemon thread, for ``launcher`` to stop being this process's parent; then print one line and
    send this process SIGTERM. Setting the returned event ends the watch."""
    done = threading.Event()

    def watch() -> None:
        while not done.wait(interval_s):
            if os.getppid() != launcher:
                os.write(2, (gone_line(launcher, rank) + "\n").encode())
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="trident-launcher-watch", daemon=True).start()
    return done
