"""torchrun's per-worker error file: where its agent looks for why a worker ended.

``record`` leaves a line (and a bug's traceback) in the JSON file ``TORCHELASTIC_ERROR_FILE`` names, as
torch.distributed.elastic's ``record`` writes it. The agent's closing summary then names the cause instead of "To
enable traceback see ...", even of a rank it ended itself (trident/signals.py: a rank stopped during start-up)."""

from __future__ import annotations

import contextlib
import json
import os
import time


def record(line: str, callstack: str | None = None) -> None:
    """Under torchrun, leave ``line`` where its agent reads a worker's cause; elsewhere nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"timestamp": str(int(time.time())), **({"py_callstack": callstack} if callstack else {})}
    with contextlib.suppress(OSError):
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": extra}}, f)
