"""A ``tools/*.py`` script run in the test process, as ``python tools/<name>.py args`` would run it (torch is
imported already, so it takes no process start): its exit code and output."""

from __future__ import annotations

import runpy
import sys

import pytest

from tests.helpers import REPO


def run_tool(
    name: str, *args: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, str, str]:
    """``python tools/<name>.py args`` in this process: exit code, stdout, stderr."""
    path = REPO / "tools" / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    capsys.readouterr()
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
