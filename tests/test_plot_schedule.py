"""tools/plot_schedule.py decides the schedule as train.py does: left out, 1f1b, or interleaved when vpp > 1, and a
layout train.py's validator refuses is refused with the same line (named by this tool's flags). ``--plan`` draws the
layout planner's per-action costs (a hand-built CPU profile here: no calibration), one box per action of each
rank, and beside a real run's recorded timings on one time scale."""

from __future__ import annotations

import re
import runpy
from pathlib import Path
from xml.sax.saxutils import escape

import pytest

from tests.helpers import REPO
from tests.helpers.layouts import make_config, tiny, train_in_process
from tests.helpers.plan_profiles import hand_built_cpu

TOOL = runpy.run_path(str(REPO / "tools" / "plot_schedule.py"))


def plot(tmp_path: Path, capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    out = tmp_path / "schedule.svg"
    TOOL["main"]([*argv, "--out", str(out)])
    assert out.read_text().startswith("<svg")
    return capsys.readouterr().out.splitlines()[0]


def test_vpp_above_one_picks_the_interleaved_schedule_as_train_py_does(tmp_path, capsys) -> None:
    title = plot(tmp_path, capsys, "--pp", "4", "--vpp", "2", "--micro", "8")
    assert title.startswith("interleaved, pp=4, vpp=2, 8 micro-batches (planned): bubble 0.188")
    assert TOOL["decide"](None, 4, 2, 8) == ("interleaved", 2)


def test_one_chunk_per_rank_picks_1f1b_and_an_explicit_schedule_is_kept(tmp_path, capsys) -> None:
    assert plot(tmp_path, capsys, "--pp", "4").startswith("1f1b, pp=4, vpp=1, 8 micro-batches")
    assert plot(tmp_path, capsys, "--pp", "2", "--schedule", "zb-h1", "--micro", "4").startswith("zb-h1, pp=2")


def test_zb_v_is_drawn_in_its_v_with_its_bubble(tmp_path, capsys) -> None:
    # (P - 1) / (6 M) at M >= 2P - 1: half of zb-h1's; below that no formula, the simulated bubble alone.
    title = plot(tmp_path, capsys, "--pp", "4", "--vpp", "2", "--schedule", "zb-v", "--micro", "8")
    assert title.startswith("zb-v, pp=4, vpp=2, 8 micro-batches (planned): bubble 0.062 of busy time, formula 0.062")
    title = plot(tmp_path, capsys, "--pp", "4", "--vpp", "2", "--schedule", "zb-v", "--micro", "4")
    assert title.endswith("bubble 0.250 of busy time")
    # zb-v always runs two chunks a rank: --vpp left out draws the same V, as train.py runs it.
    title = plot(tmp_path, capsys, "--pp", "4", "--schedule", "zb-v", "--micro", "8")
    assert title.startswith("zb-v, pp=4, vpp=2, 8 micro-batches (planned): bubble 0.062 of busy time, formula 0.062")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--pp", "4", "--vpp", "2", "--schedule", "1f1b"], "error: --vpp=2 needs --schedule=interleaved (or zb-v"),
        (["--pp", "4", "--vpp", "3", "--schedule", "zb-v"], "error: --vpp=3 with --schedule=zb-v, which runs two"),
        (["--pp", "2", "--schedule", "interleaved"], "error: --schedule=interleaved needs --vpp > 1 model chunks"),
        (["--pp", "1", "--vpp", "2"], "error: --vpp=2 needs pipeline parallelism (--pp > 1)"),
    ],
)
def test_a_layout_train_py_refuses_is_refused_with_its_line(tmp_path: Path, argv: list[str], line: str) -> None:
    with pytest.raises(SystemExit) as refused:
        TOOL["main"]([*argv, "--out", str(tmp_path / "x.svg")])
    assert str(refused.value.code).startswith(line)
    assert not (tmp_path / "x.svg").exists()


def test_help_is_whole_with_its_examples_and_ends_in_a_sentence(capsys) -> None:
    with pytest.raises(SystemExit) as done:
        TOOL["main"](["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert (
        "a box per action (F, B, I, W) labelled micro-batch and chunk, the gaps between boxes the bubble."
        in " ".join(text.split())
    )
    assert "python tools/plot_schedule.py --pp 4 --vpp 2 --out interleaved.png" in text
    assert "--plan model=gpt-small parallel.pp=4" in text and "--measured outputs/<run>/pipeline_timings" in text
    assert text.rstrip().endswith("this is its command line.")


@pytest.mark.parametrize("argv", [["--pp", "4"], ["--pp", "4", "--vpp", "2"], ["--pp", "4", "--micro", "16"]])
def test_every_box_is_labelled_where_its_label_fits(tmp_path, capsys, argv: list[str]) -> None:
    """Forward boxes too: an interleaved schedule's narrow ones carry theirs upright."""
    plot(tmp_path, capsys, *argv)
    svg = (tmp_path / "schedule.svg").read_text()
    labels = re.findall(r'class="label"[^>]*>([FBIW][0-9.]+)</text>', svg)
    assert len(labels) == svg.count('class="action"')
    assert sum(t.startswith("F") for t in labels) == sum(t.startswith("B") for t in labels)


@pytest.mark.multiprocess  # matplotlib's first import on a machine runs fc-list to build its font cache
def test_a_png_is_written_by_what_the_install_brings(tmp_path, capsys) -> None:
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), re.M | re.S)
    assert re.search(r'^\s*"matplotlib\b', dependencies.group(1), re.M)  # pip install -e . brings it
    out = tmp_path / "schedule.png"
    TOOL["main"](["--pp", "4", "--vpp", "2", "--out", str(out)])
    assert out.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and out.stat().st_size > 10_000
    assert capsys.readouterr().out.splitlines()[-1] == f"wrote {out}"


# --- --plan: the layout planner's per-action costs, alone and beside a run's timings ------------------------------

PROFILE = hand_built_cpu()


def boxes(svg: str, panel: int, rank: int) -> int:
    """Action boxes drawn in ``panel``'s lane of ``rank``."""
    return svg.count(f'class="action" data-panel="{panel}" data-rank="{rank}" ')


def pipeline(*extra: str) -> list[str]:
    """gpt-tiny in 2 pipeline stages, 4 micro-batches of 4 sequences."""
    return ["model=gpt-tiny", "parallel.pp=2", "train.global_batch_size=16", "train.micro_batch_size=4", *extra]


@pytest.mark.parametrize(
    "extra, world, per_rank, hatched",
    [
        ((), 2, 8, False),  # 1f1b: F and B of each micro-batch
        (("parallel.schedule=zb-h1",), 2, 12, False),  # F, I and W of each
        (("parallel.tp=2", "parallel.sequence_parallel=true"), 4, 8, True),  # tp collectives inside each action
    ],
)
def test_plan_mode_draws_one_box_per_action_of_each_rank_in_seconds(
    extra: tuple[str, ...], world: int, per_rank: int, hatched: bool
) -> None:
    cfg = make_config(*pipeline(*extra))
    prediction, panel, title = TOOL["plan_panel"](cfg, world, PROFILE)
    assert len(panel.boxes) == len(prediction.time.spans) == 2 * per_rank
    assert all(b.start <= b.compute_end <= b.end <= prediction.time.pipeline for b in panel.boxes)
    svg = TOOL["draw"]([panel], title, "s")
    assert [boxes(svg, 0, r) for r in range(3)] == [per_rank, per_rank, 0]
    assert ('class="comm"' in svg) == hatched and ("hatched: tp communication" in svg) == hatched
    assert "time (s)" in svg
    assert title.startswith(f"gpt-tiny {prediction.label} on {world} ranks of test cpu: ")
    assert f"planned pipeline {prediction.time.pipeline:.4g} s (step {prediction.time.step:.4g} s)" in title


def test_plan_mode_from_the_command_line_on_a_datasheet(tmp_path: Path, capsys) -> None:
    title = plot(tmp_path, capsys, "--plan", *pipeline(), "--device", "a100")
    assert title.startswith("gpt-tiny dp1 tp1 pp2 1f1b zero0 mbs4 on 2 ranks of a100: 1f1b, pp=2, vpp=1, 4 micro")
    svg = (tmp_path / "schedule.svg").read_text()
    assert boxes(svg, 0, 0) == boxes(svg, 0, 1) == 8
    # The world defaults to dp x tp x pp; a wider one gives dp ranks, the same pipeline lanes.
    assert "dp2 tp1 pp2" in plot(tmp_path, capsys, "--plan", "--world", "4", *pipeline(), "--device", "h100")


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--plan", "model=gpt-tiny", "parallel.pp=3", "--device", "h100"], "error: model.n_layers=2 is not divisible"),
        (
            ["--plan", "model=gpt-tiny", "parallel.ppp=3"],
            "error: unknown config key parallel.ppp; did you mean parallel.pp?",
        ),
        (["--plan", "model=gpt-tiny", "--pp", "2"], "error: --plan takes the layout as train.py overrides"),
        (["model=gpt-tiny"], "error: train.py overrides and --world go with --plan"),
    ],
)
def test_plan_mode_refuses_what_train_py_refuses(tmp_path: Path, argv: list[str], line: str) -> None:
    with pytest.raises(SystemExit) as refused:
        TOOL["main"]([*argv, "--out", str(tmp_path / "x.svg")])
    assert str(refused.value.code).startswith(line)
    assert not (tmp_path / "x.svg").exists()


@pytest.mark.multiprocess
def test_plan_beside_a_runs_measured_timings_on_one_time_scale(tmp_path: Path, tiny_dataset: Path, capsys) -> None:
    overrides = pipeline("logging.pipeline_timings=true", "train.eval_every=0")
    train_in_process(tmp_path / "run", tiny(tiny_dataset, "train.steps=2", *overrides), world=2)
    timings = tmp_path / "run" / "pipeline_timings"

    prediction, panel, _ = TOOL["plan_panel"](make_config(*overrides), 2, PROFILE)
    recorded = TOOL["read_timings"](timings, None)
    panels, title = TOOL["plan_and_measured"](prediction, panel, recorded, timings)
    svg = TOOL["draw"](panels, title, "s")
    assert [[boxes(svg, p, r) for r in range(2)] for p in range(2)] == [[8, 8], [8, 8]]
    found = re.search(r"pipeline (\S+) s planned, (\S+) s measured \(([+-]\d+\.\d)%\)", title)
    assert found and float(found[1]) == pytest.approx(prediction.time.pipeline, rel=1e-3)
    assert float(found[2]) == pytest.approx(recorded.pipeline_s, rel=1e-3) and 0 < recorded.pipeline_s < 10
    assert title.startswith(f"gpt-tiny {prediction.label}, 1f1b, pp=2, vpp=1, 4 micro-batches: ")
    assert "planned: test cpu, hand-built" in svg and f"measured: {escape(str(timings))}" in svg

    # Another pipeline's plan is refused beside these timings.
    other, other_panel, _ = TOOL["plan_panel"](make_config(*pipeline("train.micro_batch_size=8")), 2, PROFILE)
    with pytest.raises(ValueError, match=r"another pipeline: micro-batches 4 \(planned 2\)"):
        TOOL["plan_and_measured"](other, other_panel, recorded, timings)
    # The measured timings alone, as before (ms).
    assert plot(tmp_path, capsys, "--measured", str(timings)).startswith("1f1b, pp=2, vpp=1, 4 micro-batches (measured")
