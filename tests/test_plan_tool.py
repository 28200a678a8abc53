"""tools/plan.py as a new user meets it: its first line says the batch, sequence and precision it plans for (bf16
on a GPU unless train.precision is given), stderr shows its progress (layouts examined, time spent and left), and
the table ends with the whole command that launches the best layout (datasheet profiles: no calibration)."""

from __future__ import annotations

import io
import runpy
import shlex

import pytest

from tests.helpers import REPO
from trident.config import compose_config, validate
from trident.plan.planner import plan
from trident.plan.profile import DATASHEETS

TOOL = runpy.run_path(str(REPO / "tools" / "plan.py"))
TINY = ["model=gpt-tiny", "train.global_batch_size=8"]


def run_tool(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[list[str], list[str]]:
    assert TOOL["main"]([*argv, "--top", "1"]) == 0
    out, err = capsys.readouterr()
    return out.splitlines(), err.splitlines()


def test_the_first_line_states_batch_sequence_and_precision_and_a_gpu_defaults_to_bf16(capsys) -> None:
    out, err = run_tool(capsys, *TINY, "--world", "2", "--device", "h100")
    assert out[0] == (
        "planning gpt-tiny on 2 ranks of h100: a global batch of 8 sequences x 64 tokens "
        "(train.global_batch_size, model.seq_len), bf16 (a GPU's default; set train.precision to change it)"
    )
    assert out[2].startswith("batch 8 x 64 tokens, bf16; ")
    out, _ = run_tool(capsys, *TINY, "train.precision=fp32", "--world", "2", "--device", "h100")
    assert out[0].endswith("(train.global_batch_size, model.seq_len), fp32")


def test_the_table_ends_with_the_command_that_launches_the_best(capsys) -> None:
    out, err = run_tool(capsys, *TINY, "--world", "2", "--device", "h100")
    assert out[-2] == "launch the best (#1):"
    command = shlex.split(out[-1])
    assert command[:6] == ["torchrun", "--nnodes", "1", "--nproc-per-node", "2", "train.py"]
    assert command[6:9] == [*TINY, "train.precision=bf16"]
    # What it launches is the best row's layout, which the planner ranked first.
    cfg = compose_config(REPO / "conf", [*TINY, "train.precision=bf16"])
    best = plan(cfg, 2, DATASHEETS["h100"]).best
    assert validate(compose_config(REPO / "conf", command[6:]), 2).keys() == best.layout.keys()
    # stderr: the progress, whose last line counts every candidate.
    assert err[-1].startswith("planning: ") and " layouts examined in " in err[-1]


def test_a_launch_over_nodes_names_them_and_a_given_layout_key_is_replaced_not_repeated() -> None:
    given = [*TINY, "parallel.zero=3"]
    cfg = compose_config(REPO / "conf", given)
    result = plan(cfg, 4, DATASHEETS["a100"], nodes=2)
    best = result.best
    command = shlex.split(TOOL["launch_command"](best, result, cfg, given))
    assert command[:5] == ["torchrun", "--nnodes", "2", "--nproc-per-node", "2"] and "--rdzv-endpoint" in command
    overrides = command[command.index("train.py") + 1 :]
    keys = [o.split("=")[0] for o in overrides]
    assert len(keys) == len(set(keys)), overrides
    assert validate(compose_config(REPO / "conf", overrides), 4).keys() == best.layout.keys()


def test_progress_counts_every_candidate_and_says_the_time_left() -> None:
    cfg = compose_config(REPO / "conf", TINY)
    calls: list[tuple[int, int, float]] = []
    result = plan(cfg, 2, DATASHEETS["h100"], progress=lambda *a: calls.append(a))
    total = result.examined + len(result.refused)
    assert calls[-1][:2] == (total, total) and {c[1] for c in calls} == {total}
    assert [c[0] for c in calls] == sorted(c[0] for c in calls)
    assert all(a[2] <= b[2] for a, b in zip(calls, calls[1:], strict=False))
    shown = io.StringIO()
    progress = TOOL["Progress"](shown, every=0.0)  # "planning" by default
    progress(10, 40, 5.0)
    progress(40, 40, 20.0)
    assert shown.getvalue().splitlines() == [
        "planning: 10 of 40 layouts examined, 5 s, about 15 s left",
        "planning: 40 layouts examined in 20.0 s",
    ]


def test_too_few_steps_to_measure_is_one_line_naming_the_flag_before_anything_runs(capsys) -> None:
    assert TOOL["main"]([*TINY, "--world", "2", "--device", "h100", "--measure", "1", "--steps", "3"]) == 2
    out, err = capsys.readouterr()
    assert err == "error: --steps must be above the 3 warm-up steps --measure leaves out; try --steps 8\n"
    assert out == ""
