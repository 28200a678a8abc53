"""The preparation's progress bar on stderr: documents, tokens, MB/s of input and the time left.

On a terminal it redraws one line a few times a second; elsewhere (a log file, a captured stream) it writes a line
every half minute, and a last one at the end.
"""

from __future__ import annotations

import time
from typing import TextIO


class Progress:
    def __init__(self, total_bytes: int, stream: TextIO, done_bytes: int = 0):
        self.stream = stream
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = 0.2 if self.tty else 30.0
        self.total, self.base = max(1, total_bytes), done_bytes
        self.start = self.last = time.perf_counter()
        self.drawn = False

    def show(self, documents: int, tokens: int, done_bytes: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < self.every:
            return
        self.last = now
        elapsed = max(now - self.start, 1e-9)
        rate = (done_bytes - self.base) / elapsed
        left = (self.total - done_bytes) / rate if rate > 0 else float("inf")
        frac = min(1.0, done_bytes / self.total)
        bar = "#" * int(frac * 20)
        eta = "done" if final else ("--:--" if left == float("inf") else _clock(left))
        line = (
            f"tokenizing {frac:4.0%} |{bar:<20}| {documents:,} doc{'' if documents == 1 else 's'}, {tokens:,} tokens, "
            f"{rate / 1e6:.1f} MB/s, {'in ' + _clock(elapsed) if final else 'ETA ' + eta}"
        )
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()
        self.drawn = True


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
