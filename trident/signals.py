"""SIGTERM and SIGINT end a run cleanly: the step in flight finishes, the last completed step is saved, one line
says where, and the process exits with 128 + the signal number.

A signal only sets a flag here; ``agreed`` turns every rank's flag into one verdict per step (an all-reduce
MAX over the world group), because torchrun forwards SIGTERM to every worker at once but a Ctrl-C or a
``kill`` of one rank reaches the ranks at different moments, and every rank must stop after the same step.

Python runs a signal handler only when the main thread comes back to the interpreter, which it does not
do while it waits inside a collective. So the signal is also written to a wake-up pipe that a watcher
thread reads at once. It gives the stop ``grace_s`` to finish; a stop that cannot (a rank stopped answering
and the collective never completes) is abandoned with the last checkpoint named, instead of hanging until
the launcher kills the rank without a word. A second Ctrl-C, or any signal before training has started
(nothing to save yet), ends the process at once, still with one line and no traceback.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType

import torch
import torch.distributed as dist

from trident.error_file import record
from trident.parallel.groups import launch_rank

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# A launcher that forwards a signal its workers also got straight from the terminal (ranks left in the shell's
# process group, srun) delivers one key press twice within milliseconds: a repeat this soon is the same one.
SAME_KEY_PRESS_S = 1.0
_QUIT = b"\0"  # no signal has number 0: tells the watcher to end


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class Stopped(Exception):
    """Raised on every rank once the ranks agreed to stop after a signal (the checkpoint is written)."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None, history: list[dict]) -> None:
        super().__init__(f"stopped by {signal_name(signum)} at step {step}")
        self.signum, self.step, self.checkpoint, self.history = signum, step, checkpoint, history

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def stop_line(signum: int, step: int, checkpoint: Path | None, note: str = "") -> str:
    """The one line a stopped run leaves, e.g. ``stopped by SIGTERM at step 40; checkpoint runs/a/...``."""
    where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint yet"
    return f"stopped by {signal_name(signum)} at step {step}{note}; {where}; rerun the same command to resume"


class StopRequest:
    """Catches SIGTERM and SIGINT while the ``with`` block runs; restores the previous handlers after it.

    Until ``training`` is called a signal ends the process at once (there is nothing to save). From then on
    the loop reports its progress (``completed``) and asks ``agreed`` once per step.
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum = 0  # the first signal received, 0 for none; written by the watcher thread
        # The last completed step and the newest checkpoint, for a line printed on the way out.
        self.step = 0
        self.checkpoint: Path | None = None
        self._training = False
        self._prints = False
        self._first_at = 0.0
        self._installed = False

    # --- the loop's side

    def training(self, step: int, checkpoint: Path | None, prints: bool) -> None:
        """Training starts after ``step``: from now on a signal finishes the step and saves.
        ``prints``: this rank prints the line of a stop it cannot finish (one rank does)."""
        self.completed(step, checkpoint)
        self._prints = prints
        self._training = True

    def completed(self, step: int, checkpoint: Path | None) -> None:
        self.step, self.checkpoint = step, checkpoint

    def agreed(self, group: dist.ProcessGroup, device: torch.device) -> int:
        """The signal any rank received (the highest number if several), or 0: the same on every rank. One process
        reads its own flag: no collective (on gloo a hand-off to the group's thread and back, every step)."""
        if dist.get_world_size(group) == 1:
            return self.signum
        flag = torch.tensor([self.signum], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return int(flag.item())

    # --- installation

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is not threading.main_thread():
            return self  # only the main thread may set handlers; a run started elsewhere keeps the caller's
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
        for s in STOP_SIGNALS:
            # The handler itself does nothing: the C-level handler already wrote the signal to the pipe.
            signal.signal(s, _ignore)
        self._previous_wakeup = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="trident-stop-watcher", daemon=True)
        self._watcher.start()
        self._installed = True
        return self

    def __exit__(self, kind: type | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if not self._installed:
            return
        signal.set_wakeup_fd(self._previous_wakeup)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        os.write(self._write_fd, _QUIT)
        self._watcher.join()
        os.close(self._read_fd)
        os.close(self._write_fd)
        self._installed = False

    # --- the watcher thread

    def _watch(self) -> None:
        deadline = None
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self._read_fd], [], [], timeout)
            if not ready:
                self._abandon(f": it did not finish within train.stop_grace_s={self.grace_s:g}s")
            for byte in os.read(self._read_fd, 64):
                if byte == _QUIT[0]:
                    return
                if self._on_signal(byte):
                    deadline = time.monotonic() + self.grace_s

    def _on_signal(self, signum: int) -> bool:
        """Record one received signal; True if it is the first (the grace period starts)."""
        now = time.monotonic()
        if not self._training:
            # Silent on SIGTERM: during start-up that is most often the launcher ending this rank because another
            # failed, and that rank's error must stay the last word.
            line = f"stopped by {signal_name(signum)} before training started; rerun the same command to start"
            record(line)  # the agent's summary names it, not "To enable traceback see ..."
            self._exit(signum, line, signum == signal.SIGINT and _is_rank_zero())
        if not self.signum:
            self.signum, self._first_at = signum, now
            return True
        # A second Ctrl-C: from a terminal it is SIGINT again; torchrun, which keeps its workers out of the
        # terminal's reach, answers it by sending them SIGTERM. A repeated SIGTERM is only the launcher or
        # the scheduler saying again what it said.
        repeat = signum == signal.SIGTERM and self.signum == signal.SIGTERM
        if not repeat and now - self._first_at > SAME_KEY_PRESS_S:
            self._abandon(" on a second Ctrl-C" if self.signum == signal.SIGINT else " on a second signal")
        return False

    def _abandon(self, why: str) -> None:
        """End now, leaving the step in flight unfinished and unsaved."""
        line = stop_line(self.signum, self.step, self.checkpoint, f" (step {self.step + 1} abandoned{why})")
        self._exit(self.signum, line, self._prints)

    def _exit(self, signum: int, line: str, prints: bool) -> None:
        if prints:
            # os.write, not print: the main thread may be inside a print of its own.
            os.write(2, (line + "\n").encode())
        # No teardown: another rank may be gone, and a process group destroyed mid-collective can abort.
        os._exit(128 + signum)


def _ignore(signum: int, frame: FrameType | None) -> None:
    pass


def _is_rank_zero() -> bool:
    if dist.is_initialized():
        return dist.get_rank() == 0
    return launch_rank() == 0
