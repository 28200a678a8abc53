"""Each torchrun restart round gets keys of its own in the agent's store, so restarted ranks find each other.

Under torchrun the workers do not host their store: the node-0 agent does, and it keeps that one store for the
whole job (torch's shared rendezvous store). torch names every key a process group writes the same way in every
round (gloo's rank addresses, the group counters), so after ``--max-restarts`` restarts the workers the new ranks
read the dead ones' addresses: ``Gloo connectFullMesh failed ... Connection refused``, or a hang. A prefix per
round fixes it, but no number the workers are given names the round: ``TORCHELASTIC_RESTART_COUNT`` counts each
node's own restarts, and a node restarted because another failed did not count one (torch issue #135712).

So the ranks agree on the round through the store itself, with rank 0 as the one that names it:

- rank 0 takes the next number from a counter (``add`` is atomic, so a number is never handed out twice) and
  publishes it as the current round;
- every other rank reads the current round, leaves a hello there under a nonce of its own, and waits for rank 0
  to answer that nonce. The round it reads first may be the last round's (this round's rank 0 has not published
  yet): no one answers there, because every process of an earlier round is gone before torchrun starts the next,
  so the rank reads the current round again until rank 0's answer comes.

Only a live rank 0 answers, and every live process belongs to the new round: a rank can never join a dead one.
"""

from __future__ import annotations

import datetime
import os
import time
import uuid

import torch.distributed as dist

PREFIX = "trident/round"
POLL_S = 0.2  # how long a rank waits for an answer in a round before reading the current round again


def round_store(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> tuple[dist.Store, int]:
    """A store whose keys belong to this restart round alone, and the round's number. Collective over the
    ``world_size`` ranks sharing ``store`` (rank 0 must take part); raises ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    if rank == 0:
        number = store.add(f"{PREFIX}/counter", 1)
        store.set(f"{PREFIX}/current", str(number))
        for peer in range(1, world_size):  # in any order: each hello waits in the store until it is read
            nonce = store.get(f"{PREFIX}/{number}/hello/{peer}").decode()
            store.set(f"{PREFIX}/{number}/answer/{nonce}", "1")
    else:
        nonce, hello_in = uuid.uuid4().hex, None
        while True:
            number = int(store.get(f"{PREFIX}/current"))
            if number != hello_in:
                store.set(f"{PREFIX}/{number}/hello/{rank}", nonce)
                hello_in = number
            if store.check([f"{PREFIX}/{number}/answer/{nonce}"]):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not admit rank {rank} to a restart round within {timeout_s:g} s")
            time.sleep(POLL_S)
    return dist.PrefixStore(f"{PREFIX}/{number}/", store), number


def agent_store(timeout_s: float) -> dist.Store:
    """A client of the store torchrun's agent hosts (``TORCHELASTIC_USE_AGENT_STORE``), from the launcher's
    ``MASTER_ADDR`` and ``MASTER_PORT``."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def agent_store_address() -> str:
    return f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"


def uses_agent_store() -> bool:
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
