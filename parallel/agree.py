"""Run a fallible step and make every rank agree on its outcome.

Work that only one rank does (writing a checkpoint, opening the metrics file, starting wandb), or that
every rank does but may fail on some (reading a checkpoint from a filesystem one node lacks), can fail
on a few ranks alone; the others would then wait in their next collective until the timeout. Here the
outcome is exchanged instead, and a failure is raised as the same one-line ``TridentError`` on every
rank, marked ``agreed`` so that one rank per node is enough to print it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from trident.parallel.errors import TridentError

T = TypeVar("T")
Failure = tuple[str, str] | None  # (error class name, message), or None for success


def _attempt(fn: Callable[[], T], what: str) -> tuple[T | None, Failure]:
    try:
        return fn(), None
    except TridentError as e:
        return None, (type(e).__name__, str(e))
    except OSError as e:
        return None, ("TridentError", f"cannot {what}: {e}")


def _raise_agreed(failure: tuple[str, str]) -> None:
    kind, msg = failure
    error = next((c for c in TridentError.__subclasses__() if c.__name__ == kind), TridentError)(msg)
    error.agreed = True
    raise error


def on_one_rank(fn: Callable[[], T], src: int, what: str, group: dist.ProcessGroup | None = None) -> T | None:
    """Call ``fn`` on global rank ``src``; return its result there (None elsewhere) or raise everywhere.

    ``what`` names the step for the message of an OS-level failure, e.g. "write checkpoint step_00000040".
    ``group``: the group the outcome is shared over (every rank's; default the world), e.g. a background one.
    """
    result, failure = _attempt(fn, what) if dist.get_rank() == src else (None, None)
    outcome = [failure]
    dist.broadcast_object_list(outcome, src=src, group=group)
    if outcome[0] is not None:
        _raise_agreed(outcome[0])
    return result


def on_every_rank(fn: Callable[[], T], what: str) -> T:
    """Call ``fn`` on every rank; if any rank fails, every rank raises the lowest failing rank's error."""
    result, failure = _attempt(fn, what)
    outcomes: list[Failure] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, failure)
    _raise_first(outcomes)
    return result


def gathered(fn: Callable[[], T], what: str, group: dist.ProcessGroup | None = None) -> list[T]:
    """Call ``fn`` on every rank of ``group``; return every rank's result (picklable), in rank order, on each, or
    raise the lowest failing rank's error on every rank."""
    outcomes: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, _attempt(fn, what), group=group)
    _raise_first([failure for _, failure in outcomes])
    return [result for result, _ in outcomes]


def _raise_first(failures: list[Failure]) -> None:
    failed = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if failed:
        rank, (kind, msg) = failed[0]
        _raise_agreed((kind, msg if len(failed) == len(failures) else f"rank {rank}: {msg}"))
