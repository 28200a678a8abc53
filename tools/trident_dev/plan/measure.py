"""The planner checked against this machine: a plan's layouts run through train.py, predicted beside measured.

``pick`` takes the plan's K best layouts and K more spread evenly over the rest of its ranking; ``measure``
launches each as a user would (trident_dev/bench/runs.py: ``torchrun --standalone train.py`` with the layout's
overrides, one run at a time, a run directory each) and reads back what the run left:

- step time: the median ``step_time_s`` of metrics.jsonl after the first ``warmup`` steps (start-up, the
  allocator's growth), against the prediction's ``time.step``;
- model states: memory.json's max over ranks of the bytes a rank holds for parameters, gradients and optimizer
  states (trident/memory/measure.py, measured to the byte), device + host, against the same figure of the estimator: its
  max over pipeline stages (``expected_states``). The estimator counts these exactly, so the error is ~0 unless a
  layout's buffers changed without the estimator. (``prediction.states`` is not that figure: it is the states of
  the stage with the largest peak, which under pipelines need not be the stage with the most model states.)
- peak memory, on CUDA only: the largest ``peak_mem_mb`` of the rows (``torch.cuda.max_memory_allocated``: model
  states, activations and transient buffers) against the prediction's device peak (``prediction.peak``). On a CPU
  a run measures no activations (its ``peak_mem_mb`` is the process's resident set, the framework included), so
  there the model states are the only memory compared.

- the step split into what the model separates: each run profiles one more step after those it times
  (``logging.profile_step``, trident_dev/plan/breakdown.py), every rank's split into op classes, the framework's
  share, communication inside the passes, pipeline wait, dp + sync, optimizer and data; their mean over the ranks,
  scaled to the median step, is set beside the prediction's own split (``StepTime.split``) by ``breakdown``, so a
  miss is named by the parts it is in.

``summary`` is the one line ``tools/plan.py --measure`` ends with; ``table`` the rows above it. A run that fails
is reported with its error line and left out of the figures; it does not stop the others.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from trident.config import validate
from trident.errors import ConfigError
from trident.memory.estimate import estimate
from trident.plan.planner import Plan, Prediction
from trident_dev.bench.runs import Trial, run_trial
from trident_dev.plan.breakdown import CATEGORIES
from trident_dev.plan.splits import mean_split, read_splits
from trident_dev.tool_config import load_config

MIB = 2**20


def pick(plan: Plan, k: int) -> list[Prediction]:
    """The ``k`` best of ``plan.ranked``, then ``k`` more spread evenly over the rest of the ranking (all of it if
    it has ``k`` or fewer): the rest cut into ``k`` equal parts, the last layout of each taken, so the worst
    ranked layout is always among them. Best first, no layout twice."""
    if k <= 0:
        return []
    top, rest = plan.ranked[:k], plan.ranked[k:]
    if len(rest) <= k:
        return [*top, *rest]
    n = len(rest)  # > k: the parts are at least one long, their last layouts distinct
    return [*top, *(rest[(i + 1) * n // k - 1] for i in range(k))]


WARMUP = 3  # the first steps of a measured run, left out of its median (start-up, allocation)


@dataclass
class Measured:
    """One layout's prediction and what its run measured (None: not measured, the run failed or was refused)."""

    prediction: Prediction
    trial: Trial
    step_s: float | None = None  # median step time after the warm-up steps
    states: dict[str, int] | None = None  # memory.json's max over ranks of the model states, by place
    peak_mb: float | None = None  # CUDA: the largest peak_mem_mb (torch.cuda.max_memory_allocated) of the rows
    # The estimator's model states as memory.json's max counts them (``expected_states``); None: prediction.states.
    predicted: dict[str, int] | None = None
    split: dict[str, float] | None = None  # the profiled step's split (breakdown.py), scaled to ``step_s``

    @property
    def error(self) -> str | None:
        """Why nothing was measured: the validator's or the run's line."""
        return self.trial.refused or self.trial.error

    @property
    def predicted_step_s(self) -> float | None:
        t = self.prediction.time
        return t.step if t is not None else None

    @property
    def step_error(self) -> float | None:
        """measured / predicted step time - 1."""
        predicted = self.predicted_step_s
        if self.step_s is None or not predicted:
            return None
        return self.step_s / predicted - 1

    @property
    def predicted_states(self) -> int:
        states = self.predicted if self.predicted is not None else self.prediction.states
        return states["device"] + states["host"]

    @property
    def measured_states(self) -> int | None:
        return sum(self.states.values()) if self.states is not None else None

    @property
    def states_error(self) -> float | None:
        """measured / predicted model-state bytes (every place) - 1."""
        measured = self.measured_states
        if measured is None or not self.predicted_states:
            return None
        return measured / self.predicted_states - 1

    @property
    def peak_error(self) -> float | None:
        """CUDA: measured / predicted device peak - 1."""
        predicted = self.prediction.peak["device"]
        if self.peak_mb is None or not predicted:
            return None
        return self.peak_mb * MIB / predicted - 1

    @property
    def memory_error(self) -> float | None:
        """The model states' error, or on CUDA the peak's if that is larger in size."""
        errors = [e for e in (self.states_error, self.peak_error) if e is not None]
        return max(errors, key=abs) if errors else None


def _trial(repo: Path, label: str, overrides: list[str], world: int) -> Trial:
    """A trial of ``overrides`` on ``world`` ranks, checked by train.py's validator as a launch of that world
    (the planner's overrides name dp; runs.checked_trial would take the world from it)."""
    trial = Trial(label, overrides, world)
    try:
        trial.config = load_config(repo / "conf", overrides)
        validate(trial.config, world)
    except ConfigError as e:
        trial.refused = str(e)
    return trial


def _slug(label: str) -> str:
    return re.sub(r"[^A-Za-z0-9.]+", "-", label).strip("-")


def expected_states(prediction: Prediction) -> dict[str, int]:
    """The estimator's model-state bytes by place, each place's max over the layout's pipeline stages: what
    memory.json's ``max`` holds (trident/memory/measure.py ``max_over_ranks``)."""
    stages = estimate(prediction.config.model, prediction.layout).stages
    return {place: max(s.model_states["total"][place] for s in stages) for place in ("device", "host")}


def read(
    prediction: Prediction, trial: Trial, warmup: int, steps: int | None = None, profiled: Path | None = None
) -> Measured:
    """What ``trial``'s run measured of ``prediction``: the median of its steps after ``warmup`` up to ``steps``
    (None: all; a profiled step after them is not timed), and the split of the step profiled into ``profiled``."""
    out = Measured(prediction, trial, predicted=expected_states(prediction))
    if trial.refused is None and trial.error is not None and steps is not None and len(trial.rows) >= steps:
        trial.error = None  # every timed step is there: only the profiled one after them did not finish
    if trial.ok:
        times = [r["step_time_s"] for r in trial.rows[warmup:steps] if r.get("step_time_s") is not None]
        out.step_s = statistics.median(times) if times else None
        if out.step_s is None:
            trial.error = f"no step after the {warmup} warm-up steps in metrics.jsonl"
        elif profiled is not None:
            out.split = mean_split(read_splits(profiled), out.step_s)
    try:
        out.states = {place: int(n) for place, n in trial.memory["max"]["total"].items()}
    except (TypeError, KeyError, AttributeError, ValueError):
        out.states = None
    if prediction.layout.device == "cuda":
        peaks = [r["peak_mem_mb"] for r in trial.rows if r.get("peak_mem_mb") is not None]
        out.peak_mb = max(peaks) if peaks else None
    return out


def measure(
    predictions: Sequence[Prediction],
    base_overrides: list[str],
    world: int,
    repo: Path,
    run_root: Path,
    steps: int = 8,
    warmup: int = WARMUP,
    timeout_s: float = 600,
    log: Callable[[str], None] = print,
    profiled: bool = True,
) -> list[Measured]:
    """Run each prediction's layout through train.py on ``world`` ranks, one at a time, for ``steps`` steps, in a
    run directory of its own under ``run_root``, and compare. ``base_overrides``: what every run shares (the
    model, the data, the batch: the overrides the plan was made from). ``profiled``: and one step more, profiled,
    to split the measured step (``Measured.split``)."""
    if not 0 <= warmup < steps:
        raise ValueError(f"warmup ({warmup}) must be below steps ({steps})")
    run_root.mkdir(parents=True, exist_ok=True)
    out = []
    # The steps timed, and with ``profiled`` one more after them, profiled.
    length = [f"train.steps={steps + 1}", f"logging.profile_step={steps + 1}"] if profiled else [f"train.steps={steps}"]
    for i, p in enumerate(predictions):
        run_dir = run_root / f"{i:02d}-{_slug(p.label)}"
        overrides = [
            *base_overrides,
            *p.layout.overrides(),
            *length,
            "train.eval_every=0",
            "wandb.mode=disabled",
            "logging.interval=1",
            f"checkpoint.dir={run_dir / 'ck'}",
        ]
        trial = _trial(repo, p.label, overrides, world)
        if trial.refused is None:
            log(f"measure [{i + 1}/{len(predictions)}] {p.label}: {steps} steps on {world} ranks in {run_dir} ...")
            run_trial(repo, trial, run_dir, timeout_s)
        m = read(p, trial, warmup, steps, run_dir / "step_profile" if profiled else None)
        out.append(m)
        log(f"measure [{i + 1}/{len(predictions)}] {line(m)}")
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:+.1f}%"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / MIB:.3f}"


def line(m: Measured) -> str:
    """One layout's figures in a sentence, as measure() logs it."""
    if m.step_s is None and m.states is None:
        return f"{m.prediction.label}: failed: {m.error or 'nothing measured'}"
    text = (
        f"{m.prediction.label}: step {_s(m.predicted_step_s)} s predicted, {_s(m.step_s)} s measured "
        f"({_pct(m.step_error)}); model states {_mib(m.predicted_states)} MiB predicted, "
        f"{_mib(m.measured_states)} MiB measured ({_pct(m.states_error)})"
    )
    if m.peak_mb is not None:
        text += (
            f"; peak {_mib(m.prediction.peak['device'])} MiB predicted, {m.peak_mb:.3f} MiB measured "
            f"({_pct(m.peak_error)})"
        )
    if m.error:
        text += f"; failed: {m.error}"
    return text


def measured_table(measured: Sequence[Measured]) -> str:
    """One row per layout: predicted and measured step time and model-state memory with their errors (and on CUDA
    the device peak), then the launch overrides, or the error line of a run that failed."""
    cuda = any(m.peak_mb is not None for m in measured)
    header = ["layout", "step pred (s)", "step meas (s)", "error", "states pred (MiB)", "states meas (MiB)", "error"]
    if cuda:
        header += ["peak pred (MiB)", "peak meas (MiB)", "error"]
    header.append("overrides / error")
    rows = []
    for m in measured:
        row = [
            m.prediction.label,
            _s(m.predicted_step_s),
            _s(m.step_s),
            _pct(m.step_error),
            _mib(m.predicted_states),
            _mib(m.measured_states),
            _pct(m.states_error),
        ]
        if cuda:
            peak = None if m.peak_mb is None else m.peak_mb * MIB
            row += [_mib(m.prediction.peak["device"]), _mib(peak), _pct(m.peak_error)]
        row.append(f"failed: {m.error}" if m.error else " ".join(m.prediction.layout.overrides()))
        rows.append(row)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip()
        for r in [header, *rows]
    )


def breakdown(m: Measured) -> str:
    """``m``'s step, predicted and measured, in what the model separates (breakdown.CATEGORIES), in seconds, and
    the measured less the predicted: which parts a miss is in (empty if nothing was measured)."""
    predicted = m.prediction.time.split if m.prediction.time is not None else None
    if m.step_s is None or not predicted:
        return ""
    cols = [c for c in CATEGORIES if predicted.get(c, 0.0) > 0.0005 or (m.split or {}).get(c, 0.0) > 0.0005]
    width = max(9, *(len(c) for c in cols))
    rows = [("", [c.rjust(width) for c in cols])]
    rows.append(("predicted", [f"{predicted.get(c, 0.0):{width}.3f}" for c in cols]))
    lines = [f"{m.prediction.label}: step {_s(m.predicted_step_s)} s predicted, {_s(m.step_s)} s measured "
             f"({_pct(m.step_error)})"]  # fmt: skip
    if m.split is None:
        lines.append("  (no profiled step to split the measured one)")
    else:
        rows.append(("measured", [f"{m.split.get(c, 0.0):{width}.3f}" for c in cols]))
        misses = {c: m.split.get(c, 0.0) - predicted.get(c, 0.0) for c in cols}
        rows.append(("miss", [f"{misses[c]:+{width}.3f}" for c in cols]))
    lines += [f"  {name:<9} {' '.join(cells)}" for name, cells in rows]
    if m.split is not None:
        worst = max(misses, key=lambda c: abs(misses[c]))
        lines.append(
            f"  largest miss: {worst} {misses[worst]:+.3f} s of the step's "
            f"{m.step_s - (m.predicted_step_s or 0.0):+.3f} s"
        )
    return "\n".join(lines)


def summary(measured: Sequence[Measured]) -> str:
    """``plan: N layouts measured; step time error median X%, max Y%; memory error max Z%; predicted best is
    measured rank R of N, its step W% above the measured best's``.

    N: the runs that gave a step time, which every figure is over (a failed run's memory,
    if it got as far as measuring it, is in ``table`` only); errors in absolute percent, one decimal. R: where the
    layout the plan ranked first among those N (the highest predicted tokens/s, ties in the order given, which is
    the plan's) comes by measured step time, the fastest 1; W: how much longer its measured step is than the
    fastest measured one (0.0% at rank 1)."""
    timed = [(i, m) for i, m in enumerate(measured) if m.step_s is not None]
    n = len(timed)
    step_errors = [abs(m.step_error) for _, m in timed if m.step_error is not None]
    memory_errors = [abs(m.memory_error) for _, m in timed if m.memory_error is not None]

    def pct(x: float | None) -> str:
        return "n/a" if x is None else f"{100 * x:.1f}%"

    median = statistics.median(step_errors) if step_errors else None
    worst = max(step_errors) if step_errors else None
    memory = max(memory_errors) if memory_errors else None
    if timed:
        _, best = min(timed, key=lambda im: (-im[1].prediction.tokens_per_s, im[0]))
        rank = str(1 + sum(1 for _, m in timed if m.step_s < best.step_s))
        fastest = min(m.step_s for _, m in timed)
        behind = f", its step {100 * (best.step_s / fastest - 1):.1f}% above the measured best's"
    else:
        rank, behind = "n/a", ""
    return (
        f"plan: {n} layouts measured; step time error median {pct(median)}, max {pct(worst)}; "
        f"memory error max {pct(memory)}; predicted best is measured rank {rank} of {n}{behind}"
    )
