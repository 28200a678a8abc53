"""Run a fallible step on one rank and make every rank agree on its outcome.

Work that only one rank does (writing a checkpoint, opening the metrics file, starting wandb) can fail
there alone; the others would then wait in their next collective until the timeout. Here the outcome is
broadcast instead, and a failure is raised as the same one-line ``TridentError`` on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist

from trident.errors import TridentError

T = TypeVar("T")


def on_one_rank(fn: Callable[[], T], src: int, what: str) -> T | None:
    """Call ``fn`` on global rank ``src``; return its result there (None elsewhere) or raise everywhere.

    ``what`` names the step for the message of an OS-level failure, e.g. "write checkpoint step_00000040".
    """
    result, outcome = None, [None]
    if dist.get_rank() == src:
        try:
            result = fn()
        except TridentError as e:
            outcome = [(type(e).__name__, str(e))]
        except OSError as e:
            outcome = [("TridentError", f"cannot {what}: {e}")]
    dist.broadcast_object_list(outcome, src=src)
    if outcome[0] is not None:
        kind, msg = outcome[0]
        raise next((c for c in TridentError.__subclasses__() if c.__name__ == kind), TridentError)(msg)
    return result
