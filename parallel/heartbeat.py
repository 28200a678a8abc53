"""Which ranks are alive, for the error a rank leaves when a collective fails.

A failed collective does not say which rank caused it: gloo reports "Connection reset by peer" or a timeout,
and a rank blocked on a live rank that failed first sees the same error as the dead rank's own peers. So every
rank beats in the job's key-value store (the rendezvous store every rank already holds), from a background
thread: it increments ``trident/heartbeat/<rank>`` every ``interval_s``. The thread beats while the main thread
computes or waits in a collective (both release the GIL), and stops only with the process: killed, crashed,
exited, or frozen (SIGSTOP, a hung node: every thread of it stops).

When a collective fails because a peer is gone or silent (``is_lost_peer``), the rank reads every counter,
waits ``window_s``, and reads them again: the ranks whose counters did not move are dead or stuck, and the
error names them (``LostPeerError``, exit code 1). A rank that leaves on its own (an error, a stop, the launcher's
SIGTERM after another rank died) first says so in the store, so it is not named as the silent one.

The store must outlive the failed rank. Under torchrun the agent hosts it in its own process
(``TORCHELASTIC_USE_AGENT_STORE``), so it does whichever worker fails; should the store itself be gone (its
node died) the error names the store's address and the node hosting it as lost. Each rank also records its
node (torchrun's ``GROUP_RANK`` and the host name), so that a node lost whole is named as one. Without the
agent (ranks started by hand, ``srun python``) rank 0 hosts the store and takes it along when it exits, even
after an error of its own, while the other ranks still need it: there are no heartbeats then, and a lost peer is
reported without a name.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import threading
import time
from types import TracebackType

import torch.distributed as dist

from trident.parallel.attempt import agent_store_address, uses_agent_store
from trident.parallel.errors import TridentError, gist, is_lost_peer


class LostPeerError(TridentError):
    """A collective failed because another rank is gone; names the ranks that stopped beating when it can."""

    exit_code = 1


class Heartbeat:
    """``with Heartbeat(store, rank, world_size):`` beats while the block runs, and turns a lost-peer error
    raised inside it into a ``LostPeerError`` naming the silent ranks."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        interval_s: float = 0.5,
        window_s: float = 3.0,
        prefix: str = "trident/heartbeat/",
        store_host: str = "its host",
    ) -> None:
        self.store, self.rank, self.world_size, self.prefix = store, rank, world_size, prefix
        self.store_host = store_host
        self.interval_s, self.window_s = interval_s, window_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="trident-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(f"{self.prefix}{self.rank}", 1)
            except Exception:  # the store's host is gone: nothing left to tell
                return
            self._stop.wait(self.interval_s)

    def _counters(self) -> list[int]:
        # add(key, 0) reads a counter without blocking on a rank that never beat (it reads 0).
        return [self.store.add(f"{self.prefix}{r}", 0) for r in range(self.world_size)]

    def silent_ranks(self) -> list[int] | None:
        """The ranks (this one aside) whose counters stood still for ``window_s`` and that did not say they were
        leaving; None if the store is gone."""
        try:
            self.store.set_timeout(datetime.timedelta(seconds=self.window_s))
            before = self._counters()
            time.sleep(self.window_s)
            after = self._counters()
            still = [r for r in range(self.world_size) if r != self.rank and after[r] == before[r]]
            return [r for r in still if not self.store.check([f"{self.prefix}left/{r}"])]
        except Exception:  # the store is gone with its host
            return None

    def __enter__(self) -> Heartbeat:
        # Which node this rank runs on, so that a node lost whole is named as one (torchrun's GROUP_RANK).
        self.store.set(
            f"{self.prefix}node/{self.rank}", f"node {os.environ.get('GROUP_RANK', '0')} ({socket.gethostname()})"
        )
        self._thread.start()
        return self

    def __exit__(self, kind: type | None, error: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if error is None:
                return
            self._say_leaving()
            if is_lost_peer(error):
                why = "the first error above, if any, says why it stopped"
                raise LostPeerError(f"lost contact with {self._who()} ({gist(error)}); {why}") from None
        finally:
            self._stop.set()
            # Bounded: a beat caught in a store whose host has vanished must not hold up the exit.
            self._thread.join(timeout=2 * self.interval_s)

    def _say_leaving(self) -> None:
        try:
            self.store.set(f"{self.prefix}left/{self.rank}", "1")
        except Exception:  # the store is gone with its host
            pass

    def _who(self) -> str:
        silent = self.silent_ranks()
        if silent is None:
            return f"another rank and with the job's store ({self.store_host}), so with the node that hosts it"
        if not silent:
            return "another rank"
        ranks = ", ".join(map(str, silent))
        nodes = self._whole_nodes(silent)
        where = f"; all of {' and '.join(nodes)}" if nodes else ""
        return f"rank{'s' if len(silent) > 1 else ''} {ranks} (silent for {self.window_s:g} s: dead or stuck{where})"

    def _whole_nodes(self, silent: list[int]) -> list[str]:
        """The nodes every rank of which is silent: a node lost whole (killed, crashed, cut off)."""
        try:
            node = [self.store.get(f"{self.prefix}node/{r}").decode() for r in range(self.world_size)]
        except Exception:  # a rank that died before it said where it runs
            return []
        lost = {node[r] for r in silent}
        return sorted(n for n in lost if all(r in silent for r in range(self.world_size) if node[r] == n))


def watch_peers() -> contextlib.AbstractContextManager:
    """A ``Heartbeat`` of this rank in the default group's store, under torchrun; nothing without its agent's store
    or in a one-process run."""
    if dist.get_world_size() == 1 or not uses_agent_store():
        return contextlib.nullcontext()
    # The default group's store holds this restart round's keys alone (parallel/attempt.py).
    store, host = dist.distributed_c10d._get_default_store(), f"torchrun's agent at {agent_store_address()}"
    return Heartbeat(store, dist.get_rank(), dist.get_world_size(), store_host=host)
