"""trident/metrics.py: metrics.jsonl, the console line and resume trimming."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trident import metrics
from trident.config import LoggingConfig, WandbConfig
from trident.metrics import MetricsLogger

# --- MetricsLogger, with wandb disabled so nothing leaves the run directory.


def make_row(step: int, **extra: object) -> dict:
    """A row with every key the console line reads; extra keys override or add."""
    row: dict = {
        "step": step,
        "loss": 3.5,
        "lr": 1e-3,
        "grad_norm": 0.75,
        "tokens_per_s": 12345.0,
        "mfu": 0.25,
        "peak_mem_mb": 512.0,
    }
    row.update(extra)
    return row


def make_logger(run_dir: Path, total_steps: int = 7, start_step: int = 0) -> MetricsLogger:
    return MetricsLogger(
        run_dir,
        total_steps=total_steps,
        logging_cfg=LoggingConfig(interval=2),
        wandb_cfg=WandbConfig(mode="disabled"),
        config={},
        start_step=start_step,
    )


def read_rows(path: Path) -> list[dict]:
    """Parse metrics.jsonl strictly: one JSON object per line, no Infinity/NaN tokens allowed."""

    def reject(token: str) -> None:
        raise ValueError(f"non-standard JSON token {token}")

    return [json.loads(line, parse_constant=reject) for line in path.read_text().splitlines()]


def test_every_row_is_one_json_line(tmp_path: Path) -> None:
    """Each logged row is written, in order, as one JSON object per line with its values intact."""
    logger = make_logger(tmp_path)
    logged = [make_row(step, loss=10.0 - step) for step in range(1, 8)]
    for row in logged:
        logger.log(row)
    logger.close()
    assert read_rows(tmp_path / "metrics.jsonl") == logged


def test_non_finite_and_missing_values_are_null(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """inf/nan become null (standard JSON); mfu=None is null in the file and "mfu n/a" on the console."""
    logger = make_logger(tmp_path)
    logger.log(make_row(1, grad_norm=float("inf"), loss=float("nan"), mfu=None))
    logger.close()
    (row,) = read_rows(tmp_path / "metrics.jsonl")
    assert row["grad_norm"] is None
    assert row["loss"] is None
    assert row["mfu"] is None
    assert row["step"] == 1  # finite values are untouched
    out = capsys.readouterr().out
    assert "mfu n/a" in out


def printed_steps(logger: MetricsLogger, steps: range, capsys: pytest.CaptureFixture[str]) -> list[int]:
    """Log a row for each step and return the steps that printed a console line."""
    printed = []
    for step in steps:
        logger.log(make_row(step))
        if capsys.readouterr().out.strip():
            printed.append(step)
    logger.close()
    return printed


def test_console_line_on_first_interval_and_last_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With interval 2 over 7 steps the console shows steps 1 (first), 2, 4, 6 (interval) and 7 (last) only."""
    assert printed_steps(make_logger(tmp_path, total_steps=7), range(1, 8), capsys) == [1, 2, 4, 6, 7]


def test_console_first_step_after_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """After resuming at step 4 the first step run (5, off the interval) is still shown."""
    assert printed_steps(make_logger(tmp_path, total_steps=7, start_step=4), range(5, 8), capsys) == [5, 6, 7]


def test_console_line_shows_loss_scale(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An fp16 row carries loss_scale and the console shows it; a row without it shows no scale."""
    logger = make_logger(tmp_path)
    logger.log(make_row(1, loss_scale=65536.0))
    with_scale = capsys.readouterr().out
    logger.log(make_row(2))
    without_scale = capsys.readouterr().out
    logger.close()
    assert "scale 65536" in with_scale
    assert without_scale.strip() and "scale" not in without_scale


def test_mixture_and_loader_keys_reach_the_file_and_the_console(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Per-source tokens and validation losses and the loader's figures are written as they are; the console shows
    the sources' validation losses after the weighted mean, and the loader's share of the step."""
    logger = make_logger(tmp_path)
    extra = {"tokens/web": 4480, "tokens/code": 1920, "data_ms": 0.25, "data_read_ms": 1.5, "data_share": 0.0123}
    validation = {"val_loss": 3.37, "val_loss/web": 3.5, "val_loss/code": 3.07}
    logged = [make_row(1, **extra), make_row(2, **extra, **validation)]
    logger.log(logged[0])
    first = capsys.readouterr().out
    logger.log(logged[1])
    second = capsys.readouterr().out
    logger.close()
    assert read_rows(tmp_path / "metrics.jsonl") == logged
    assert "data 1.2%" in first and "val" not in first
    assert "val 3.3700 (web 3.5000, code 3.0700)" in second


# --- resume: rows past the checkpoint step are dropped, with a backup of the original file.


def test_resume_trims_rows_past_checkpoint(tmp_path: Path) -> None:
    """Rows <= start_step stay, later rows and a half-written last line go, and a .bak keeps the original."""
    path = tmp_path / "metrics.jsonl"
    kept = [make_row(step) for step in (1, 2, 3)]
    dropped = [make_row(step) for step in (4, 5)]
    original = "".join(json.dumps(row) + "\n" for row in kept + dropped) + '{"step": 6, "loss": 3.'
    path.write_text(original)

    logger = make_logger(tmp_path, total_steps=7, start_step=3)
    assert read_rows(path) == kept
    # The resumed run appends after the kept rows, so the file reads as one clean history.
    logger.log(make_row(4, loss=1.0))
    logger.close()
    assert [row["step"] for row in read_rows(path)] == [1, 2, 3, 4]
    assert read_rows(path)[-1]["loss"] == 1.0

    backups = list(tmp_path.glob("metrics.jsonl.*.bak"))
    assert len(backups) == 1
    assert backups[0].read_text() == original


def test_resume_with_nothing_to_trim_keeps_file(tmp_path: Path) -> None:
    """If no row lies past start_step the file is left alone and no backup is made."""
    path = tmp_path / "metrics.jsonl"
    rows = [make_row(step) for step in (1, 2, 3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    make_logger(tmp_path, start_step=3).close()
    assert read_rows(path) == rows
    assert not list(tmp_path.glob("*.bak"))


def test_trim_without_file_is_a_no_op(tmp_path: Path) -> None:
    """A fresh run (no metrics.jsonl yet) trims nothing and creates nothing."""
    metrics.trim_metrics(tmp_path / "metrics.jsonl", 5)
    assert list(tmp_path.iterdir()) == []


# --- the end of a run: one summary line; a resumed run continues the same wandb run.


def test_summary_line_names_steps_time_speed_losses_and_checkpoint() -> None:
    checkpoint = Path("runs/a/checkpoints/step_00000200")
    line = metrics.summary_line(0, 200, 125.0, 1_000_000, 3.21, 3.4567, checkpoint)
    assert line == f"done: 200 steps in 2m05s | 8,000 tok/s | loss 3.2100 | val 3.4567 | checkpoint {checkpoint}"
    resumed = metrics.summary_line(100, 200, 10.0, 1000, float("nan"), None, None)
    assert resumed == "done: steps 101-200 in 0m10s | 100 tok/s | loss nan | val n/a | no checkpoint"


def test_wandb_run_id_is_kept_for_a_resumed_run(tmp_path: Path) -> None:
    assert metrics.wandb_run_id(tmp_path, resuming=False, new_id="first") == "first"
    assert metrics.wandb_run_id(tmp_path, resuming=True, new_id="second") == "first"
    # A run that starts from step 0 again (nothing was saved) is a new wandb run.
    assert metrics.wandb_run_id(tmp_path, resuming=False, new_id="third") == "third"
    assert (tmp_path / metrics.WANDB_ID_FILE).read_text().strip() == "third"
