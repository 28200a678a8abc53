"""tools/plot_schedule.py decides the schedule as train.py does: left out, 1f1b, or interleaved when vpp > 1, and a
layout train.py's validator refuses is refused with the same line (named by this tool's flags)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from tests.conftest import REPO

TOOL = runpy.run_path(str(REPO / "tools" / "plot_schedule.py"))


def plot(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    out = tmp_path / "schedule.svg"
    TOOL["main"]([*argv, "--out", str(out)])
    assert out.read_text().startswith("<svg")
    return capsys.readouterr().out.splitlines()[0]


def test_vpp_above_one_picks_the_interleaved_schedule_as_train_py_does(tmp_path, capsys) -> None:
    title = plot(tmp_path, capsys, "--pp", "4", "--vpp", "2", "--micro", "8")
    assert title.startswith("interleaved, pp=4, vpp=2, 8 micro-batches (planned): bubble 0.188")
    assert TOOL["decide"](None, 4, 2, 8) == "interleaved"


def test_one_chunk_per_rank_picks_1f1b_and_an_explicit_schedule_is_kept(tmp_path, capsys) -> None:
    assert plot(tmp_path, capsys, "--pp", "4").startswith("1f1b, pp=4, vpp=1, 8 micro-batches")
    assert plot(tmp_path, capsys, "--pp", "2", "--schedule", "zb-h1", "--micro", "4").startswith("zb-h1, pp=2")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--pp", "4", "--vpp", "2", "--schedule", "1f1b"], "error: --vpp=2 needs --schedule=interleaved (got 1f1b)"),
        (["--pp", "2", "--schedule", "interleaved"], "error: --schedule=interleaved needs --vpp > 1 model chunks"),
        (["--pp", "1", "--vpp", "2"], "error: --vpp=2 needs pipeline parallelism (--pp > 1)"),
    ],
)
def test_a_layout_train_py_refuses_is_refused_with_its_line(tmp_path: Path, argv: list[str], line: str) -> None:
    with pytest.raises(SystemExit) as refused:
        TOOL["main"]([*argv, "--out", str(tmp_path / "x.svg")])
    assert str(refused.value.code).startswith(line)
    assert not (tmp_path / "x.svg").exists()
