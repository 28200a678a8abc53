"""torchrun's per-worker error file: where its agent looks for why a worker ended.

``record`` leaves a line (and a bug's traceback) in the JSON file ``TORCHELASTIC_ERROR_FILE`` names, as
torch.distributed.elastic's ``record`` writes it. The agent's closing summary then names the cause instead of "To
enable traceback see ...", even of a rank it ended itself (trident/signals.py: a rank stopped during start-up)."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time


def record(line: str, callstack: str | None = None) -> None:
    """Under torchrun, leave ``line`` where its agent reads a worker's cause; elsewhere nothing."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    extra = {"timestamp": str(int(time.time())), **({"py_callstack": callstack} if callstack else {})}
    # Written whole or not at all: a rank the agent ends mid-write (SIGTERM after another rank's refusal) must not
    # leave an empty file, which the agent's summary fails to parse (JSONDecodeError) instead of naming the cause.
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
    with contextlib.suppress(OSError):
        with open(tmp, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": extra}}, f)
        os.replace(tmp, path)
