"""The restart rounds' keys (parallel/attempt.py), in one process: ranks as threads over one store, which holds
the keys of the rounds before, as torchrun's agent's store does after ``--max-restarts`` restarts."""

from __future__ import annotations

import threading
import time

import torch.distributed as dist

from trident.parallel.attempt import PREFIX, round_store


def _round(
    store: dist.Store, world: int, late: dict[int, float] | None = None, note: str = "hello-from"
) -> dict[int, int]:
    """Every rank's round number, each rank a thread started ``late[rank]`` seconds after the first; each rank
    writes ``{note}/{rank}`` in its round's keys."""
    numbers: dict[int, int] = {}

    def rank(r: int) -> None:
        time.sleep((late or {}).get(r, 0.0))
        round_keys, numbers[r] = round_store(store, r, world, timeout_s=30)
        round_keys.set(f"{note}/{r}", "1")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return numbers


def test_each_round_gets_a_fresh_number_even_when_rank_0_starts_last():
    store = dist.HashStore()
    assert _round(store, 3) == {0: 1, 1: 1, 2: 1}
    # The next round's ranks 1 and 2 start first and find round 1 still published: rank 0 of round 1 is gone
    # and never answers them there, so they wait for the new rank 0 and join its round.
    assert _round(store, 3, late={0: 1.0}, note="said-in-2") == {0: 2, 1: 2, 2: 2}
    assert _round(store, 3, late={0: 0.5, 2: 0.2}, note="said-in-3") == {0: 3, 1: 3, 2: 3}
    # Each round's keys are its own: what a rank writes in one round is not there in the next (both ran).
    round_2 = dist.PrefixStore(f"{PREFIX}/2/", store)
    round_3 = dist.PrefixStore(f"{PREFIX}/3/", store)
    assert round_2.check([f"said-in-2/{r}" for r in range(3)]) and round_3.check([f"said-in-3/{r}" for r in range(3)])
    assert not any(round_3.check([f"said-in-2/{r}"]) or round_2.check([f"said-in-3/{r}"]) for r in range(3))


def test_a_rank_left_without_rank_0_times_out_with_a_line_naming_it():
    store = dist.HashStore()
    _round(store, 2)
    started = time.monotonic()
    try:
        round_store(store, 1, 2, timeout_s=1)
    except TimeoutError as e:
        assert str(e) == "rank 0 did not admit rank 1 to a restart round within 1 s"
    else:
        raise AssertionError("rank 1 joined a round whose rank 0 is gone")
    assert time.monotonic() - started < 5
