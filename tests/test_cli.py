"""The error line reaches the shared stderr in one piece, as torchrun's unbuffered workers write it."""

from __future__ import annotations

import io
import sys

import pytest

from trident import cli


class Unbuffered(io.StringIO):
    """A stderr as ``python -u`` has it (torchrun's workers): every ``write`` call goes to the pipe at once."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_print_would_write_a_line_and_its_newline_apart() -> None:
    """Why ``say`` exists: two ranks printing at once could glue their lines (fuzz seed 7, case 152)."""
    err = Unbuffered()
    print("error: x", file=err, flush=True)
    assert err.writes == ["error: x", "\n"]


def test_the_error_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    err = Unbuffered()
    monkeypatch.setattr(sys, "stderr", err)
    cli.say("error: parallel.vpp=2 needs parallel.schedule=interleaved (got 1f1b)")
    assert err.writes == ["error: parallel.vpp=2 needs parallel.schedule=interleaved (got 1f1b)\n"]
