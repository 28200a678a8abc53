"""Running a case: the validator's verdict (the resolved layout, or the refusal), the run on warm rank pools against
the one-process curve, its activation sets against the estimator, the resume under another layout, and the real
command's exit for refusals.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
import runpy
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trident.config import Config, DataConfig, compose_config, validate
from trident.data.prepare import resolve_dataset
from trident.errors import ConfigError
from trident.layout import Layout
from trident.models.compile import check_toolchain
from trident.plan.auto import choose as choose_layout
from trident_dev.curves import curve_mismatches
from trident_dev.fuzz.exits import Exits
from trident_dev.fuzz.refusals import refusal_problem
from trident_dev.fuzz.space import (
    CORPUS_PACKAGES,
    CORPUS_VOCAB,
    DATASET_TOKENIZER,
    LOW_PRECISION_REL,
    MIX_FIRST,
    MIX_SECOND,
    SAVE_AT,
    SECOND_PACKAGES,
    STEPS,
    Case,
    draw_resume_layout,
    launch_limit_s,
    starts_from_weights,
)
from trident_dev.ranks import run_distributed

# --- configs and runs


def resolve(cfg: Config, world: int, given: Sequence[str] = ()) -> Layout | BaseException:
    """The layout the validator resolves ``cfg`` into on ``world`` processes (with ``parallel.auto``, the one the
    planner chooses keeping the layout keys ``given`` sets, as train.py's ``run`` does), or its refusal."""
    try:
        if cfg.parallel.auto:
            cfg, _ = choose_layout(cfg, world, given)
        return validate(cfg, world)
    except Exception as e:  # anything but a ConfigError is itself a finding, reported by refusal_problem
        return e


def verdict(cfg: Config, world: int, given: Sequence[str] = ()) -> BaseException | None:
    """The validator's refusal of ``cfg`` on ``world`` processes, or None when it accepts it."""
    outcome = resolve(cfg, world, given)
    return outcome if isinstance(outcome, BaseException) else None


def activation_set_problems(run_dir: Path) -> list[str]:
    """memory.json's activation sets: on every rank the most its executor held in a step must be what the
    estimator's walk of the same schedule predicted."""
    rows = json.loads((run_dir / "memory.json").read_text())["ranks"]
    return [
        f"rank {r['rank']} (pp {r['pp']}) held {r['activation_sets']['measured']} activation sets at once, "
        f"the estimator predicted {r['activation_sets']['predicted']}"
        for r in rows
        if r["activation_sets"]["measured"] != r["activation_sets"]["predicted"]
    ]


def prepare_corpus(cache_dir: str = "~/.cache/trident") -> Path:
    """The small real dataset (tests/conftest.py's corpus), prepared once and cached under ``cache_dir``."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    data = DataConfig(text=[str(stdlib / p) for p in CORPUS_PACKAGES], suffixes=[".py"], cache_dir=cache_dir)
    return resolve_dataset(data, CORPUS_VOCAB, log=lambda _: None, progress=None)


def base_overrides(dataset: Path) -> tuple[str, ...]:
    """gpt-tiny on the small dataset, a short run that validates at its last step (the forward-only path)."""
    return (
        "model=gpt-tiny",
        f"data.dataset_dir={dataset}",
        "wandb.mode=disabled",
        f"train.steps={STEPS}",
        f"train.eval_every={STEPS}",
        "train.eval_batches=1",
        "optim.warmup_steps=2",
        "logging.peak_tflops=1",  # MFU against a fixed peak: no matmul probe on a machine the sweep keeps busy
    )


_RUN: dict[str, Callable[[Config, Path, Sequence[str]], list[dict]]] = {}


def _train_on_rank(
    rank: int, world: int, train_py: str, cfg: Config, run_dir: Path, given: Sequence[str]
) -> list[dict]:
    # train.py is a script, not part of the package: loaded by path once per rank process, then reused.
    run = _RUN.get(train_py)
    if run is None:
        run = _RUN[train_py] = runpy.run_path(train_py)["run"]
    with contextlib.redirect_stdout(io.StringIO()):  # the console lines of hundreds of runs are noise here
        return run(cfg, run_dir, given)


# --- comparisons


def curve_problems(expected: list[dict], got: list[dict], precision: str, what: str) -> list[str]:
    """How ``got`` departs from ``expected`` (rows of the same steps): in fp32 the project's one comparison
    (trident_dev/curves.py: loss, gradient norm and validation loss to reduction order); in bf16 / fp16 the losses
    within 2%. No step may be skipped. Empty when it does not depart."""
    if precision == "fp32":
        problems = curve_mismatches(expected, got)
    elif [r["step"] for r in got] != [r["step"] for r in expected]:
        problems = [f"steps differ: expected {[r['step'] for r in expected]}, got {[r['step'] for r in got]}"]
    else:
        problems = []
        for want, have in zip(expected, got, strict=True):
            for key in ("loss", "val_loss"):
                if (key in want) != (key in have):
                    problems.append(f"step {want['step']}: {key} in only one of the runs")
                elif key in want and not math.isclose(have[key], want[key], rel_tol=LOW_PRECISION_REL):
                    off = abs(have[key] - want[key]) / abs(want[key])
                    problems.append(
                        f"step {want['step']}: {key} {have[key]:.6g} vs fp32 {want[key]:.6g} (rel {off:.1e})"
                    )
    problems += [f"step {r['step']} skipped (non-finite gradients)" for r in got if r.get("skipped")]
    return [f"{what}: {p}" for p in problems]


# --- one case


@dataclass
class CaseResult:
    case: Case
    refused: bool
    layout: Layout | None = None  # the validator's, when it accepted the case
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    launch_seconds: float | None = None  # the real command's time, when it was checked

    @property
    def passed(self) -> bool:
        return not self.problems


def _first_line(error: BaseException) -> str:
    """The gist of a failed run: the last line of the earliest failing rank's traceback, and the first line."""
    text = str(error).strip()
    lines = text.splitlines()
    tail = next((line for line in reversed(lines) if line and not line.startswith(" ")), "")
    head = lines[0] if lines else type(error).__name__
    return head if tail in ("", head) else f"{head} ... {tail}"


def _has_compiler() -> bool:
    """Whether inductor finds the C++ compiler it needs on a CPU (models/compile.py's check)."""
    try:
        check_toolchain(torch.device("cpu"))
    except ConfigError:
        return False
    return True


class Fuzzer:
    """Runs cases on one dataset; keeps the one-process references of a sweep."""

    def __init__(
        self,
        repo: Path,
        dataset: Path,
        timeout_s: float = 180.0,
        work_dir: Path | None = None,
        exits_of: Callable[[Case], bool] = lambda case: True,
        resumes_of: Callable[[Case], bool] = lambda case: True,
    ) -> None:
        """``exits_of``: whether a trained case also checks its model's exits; ``resumes_of``: whether it also
        resumes its mid-run checkpoint under another layout (all of them do both by default)."""
        self.repo = repo
        self.exits_of = exits_of
        self.resumes_of = resumes_of
        self.train_py = str(repo / "train.py")
        self.dataset = dataset
        self.timeout_s = timeout_s
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="fuzz-")
        self.work_dir = work_dir or Path(self._tmp.name)
        self._references: dict[tuple[str, ...], list[dict]] = {}
        self._exits: Exits | None = None
        self._second: Path | None = None
        self._runs = 0
        self.compiles = _has_compiler()  # train.compile=true cases run eager without one

    def overrides(self, overrides: tuple[str, ...] | list[str]) -> list[str]:
        """train.py's command line for a case's overrides on this sweep's dataset."""
        paths = {DATASET_TOKENIZER: str(self.dataset / "tokenizer.model"), MIX_FIRST: str(self.dataset)}

        def fill(override: str) -> str:
            if override == "train.compile=true" and not self.compiles:
                return "train.compile=false"  # said once, when the sweep starts (tools/fuzz_layouts.py)
            if MIX_SECOND in override:
                override = override.replace(MIX_SECOND, str(self.second_dataset()))
            for placeholder, path in paths.items():
                override = override.replace(placeholder, path)
            return override

        return [*base_overrides(self.dataset), *(fill(o) for o in overrides)]

    def second_dataset(self) -> Path:
        """A mixture's second source, prepared once with the sweep's tokenizer and cached beside the first: the
        source files of other standard-library packages as a JSON Lines corpus (the text under ``content``, two
        malformed records among them), through the preparation keys ``data.text_field``, ``data.workers`` (2) and
        ``data.max_bad_fraction``."""
        if self._second is None:
            stdlib = Path(sysconfig.get_paths()["stdlib"])
            corpus = self.work_dir / "second.jsonl"
            with open(corpus, "w", encoding="utf-8") as f:
                for i, path in enumerate(
                    sorted(p for package in SECOND_PACKAGES for p in (stdlib / package).glob("*.py"))
                ):
                    f.write(json.dumps({"content": path.read_text(encoding="utf-8", errors="replace")}) + "\n")
                    if i in (3, 7):
                        f.write('{"content": "a record cut short\n' if i == 3 else '{"text": "the wrong field"}\n')
            data = DataConfig(
                text=[str(corpus)],
                text_field="content",
                workers=2,
                max_bad_fraction=0.1,
                cache_dir=str(self.work_dir / "cache"),
                tokenizer=str(self.dataset / "tokenizer.model"),
            )
            self._second = resolve_dataset(data, CORPUS_VOCAB, log=lambda _: None, progress=None)
        return self._second

    @property
    def exits(self) -> Exits:
        if self._exits is None:
            self._exits = Exits(self.repo, self.dataset, self.work_dir)
        return self._exits

    def config(self, overrides: tuple[str, ...] | list[str]) -> Config:
        return compose_config(self.repo / "conf", self.overrides(overrides))

    def accepts(self, world: int, overrides: tuple[str, ...]) -> bool:
        return verdict(self.config(overrides), world, self.overrides(overrides)) is None

    def train(self, world: int, overrides: tuple[str, ...] | list[str]) -> tuple[Path, list[list[dict]]]:
        """Every rank's history of one run, in a fresh run directory; raises what the run raised, or TimeoutError."""
        self._runs += 1
        run_dir = self.work_dir / f"run{self._runs:05d}"
        cfg, given = self.config(overrides), self.overrides(overrides)
        histories = run_distributed(_train_on_rank, world, self.train_py, cfg, run_dir, given, timeout_s=self.timeout_s)
        return run_dir, histories

    def reference(self, case: Case, *extra: str) -> list[dict]:
        """The fp32 one-process curve of the case's model, optimizer and batch (one micro-batch a step), with
        ``extra``."""
        knobs = case.knobs
        math = ("train.global_batch_size", "data.document_mask", "data.mix")
        key = tuple(f"{k}={v}" for k, v in knobs.items() if k.startswith(("model.", "optim.")) or k in math)
        key = (*key, *extra)
        if key not in self._references:
            batch = knobs["train.global_batch_size"]
            _, (history,) = self.train(1, (*key, f"train.micro_batch_size={batch}", "train.precision=fp32"))
            self._references[key] = history
        return self._references[key]

    def run_case(self, case: Case, check_launch: bool = False) -> CaseResult:
        start = time.monotonic()
        outcome = resolve(self.config(case.overrides), case.world, self.overrides(case.overrides))
        refusal = outcome if isinstance(outcome, BaseException) else None
        result = CaseResult(case, refused=refusal is not None, layout=None if refusal else outcome)
        try:
            if refusal is not None:
                problem = refusal_problem(refusal)
                result.problems += [problem] if problem else []
                if check_launch and problem is None:
                    problem, result.launch_seconds = self.check_launch(case, str(refusal))
                    result.problems += [problem] if problem else []
            else:
                result.problems += self._check_training(case)
        except TimeoutError as e:
            result.problems.append(f"hung: {e}")
        except Exception as e:
            result.problems.append(f"failed: {_first_line(e)}")
        result.seconds = time.monotonic() - start
        return result

    def _check_training(self, case: Case) -> list[str]:
        try:
            reference = self.reference(case)
        except TimeoutError:
            raise
        except Exception as e:
            return [f"the one-process reference failed: {_first_line(e)}"]
        save = (f"checkpoint.every={SAVE_AT}",)
        run_dir, histories = self.train(case.world, (*case.overrides, *save))
        problems = activation_set_problems(run_dir)
        for rank, history in enumerate(histories):  # every rank knows the loss and the global norm
            problems += curve_problems(reference, history, case.precision, f"rank {rank}")
        if problems:
            return problems
        # The trained model leaves by every exit it has (trident_dev/fuzz/exits.py); a failed one is the case's problem,
        # and the resume and the run from its weights are checked all the same.
        final = run_dir / "checkpoints" / f"step_{STEPS:08d}"
        exits = self.exits.problems(self.config(case.overrides), final) if self.exits_of(case) else []
        if not (self.resumes_of(case) or starts_from_weights(case)):
            return exits
        world, overrides = draw_resume_layout(case, self.accepts)
        checkpoint = run_dir / "checkpoints" / f"step_{SAVE_AT:08d}"
        resume = (f"checkpoint.resume={checkpoint}",)
        problems = []
        if self.resumes_of(case):
            problems = self._rerun(case, world, overrides, resume, lambda: histories[0][SAVE_AT:], "resumed")
        if problems or not starts_from_weights(case):
            return exits + problems
        # checkpoint.init_from: the saved weights, a fresh optimizer at step 0, under the other layout, against
        # one process started from the same weights.
        init = f"checkpoint.init_from={checkpoint}"
        started = self._rerun(case, world, overrides, (init,), lambda: self.reference(case, init), "started from it")
        return exits + started

    def _rerun(
        self,
        case: Case,
        world: int,
        overrides: tuple[str, ...],
        extra: tuple[str, ...],
        expected: Callable[[], list[dict]],
        what: str,
    ) -> list[str]:
        """A run of the step-``SAVE_AT`` checkpoint (``extra``) under another layout, against the curve ``expected``
        gives."""
        where = f"{what} at world {world} ({' '.join(overrides)})"
        try:
            want = expected()
            _, histories = self.train(world, (*overrides, *extra))
        except TimeoutError:
            raise
        except Exception as e:
            return [f"{where}: {_first_line(e)}"]
        problems = []
        for rank, history in enumerate(histories):
            problems += curve_problems(want, history, case.precision, f"{where}, rank {rank}")
        return problems

    def check_launch(self, case: Case, message: str) -> tuple[str | None, float]:
        """The real command on a refused case: exit 2 and the validator's line, within ``launch_limit_s``."""
        launcher = [sys.executable]
        if case.world > 1:  # --standalone: a free port of its own, beside other jobs on the machine
            launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={case.world}"]
        hydra = (f"hydra.run.dir={self.work_dir / 'launch'}", "hydra.output_subdir=null")
        cmd = [*launcher, self.train_py, *self.overrides(case.overrides), *hydra]
        limit = launch_limit_s(case.world)
        start = time.monotonic()
        try:
            done = subprocess.run(cmd, cwd=self.repo, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            return f"the refused launch did not end within {limit:g} s", limit
        seconds = time.monotonic() - start
        line = f"error: {message}"
        if case.world == 1:
            if done.returncode != 2 or done.stderr.strip() != line or done.stdout.strip():
                out = (done.stdout + done.stderr).strip().replace("\n", " | ")[-300:]
                return (
                    f"python train.py: exit {done.returncode}, expected 2 and one line {line!r}; got {out!r}",
                    seconds,
                )
            return None, seconds
        # torchrun: every rank that gets to print says the same line and exits with 2; torchrun stops the others
        # with SIGTERM: -15, or 143 (128 + SIGTERM) from a rank whose stop handler (trident/signals.py) was already
        # installed. torchrun itself exits 1 with its own report, which is the launcher's, not the run's. Which
        # failure the report calls the root cause depends on timing (a loaded machine may list a terminated rank
        # first), so every failure listed is read. The line is counted where it appears: torchrun's own log lines
        # share the stream and may cut into it.
        codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", done.stderr)]
        copies = done.stderr.count(line)
        others = sorted({x for x in done.stderr.splitlines() if x.startswith("error:") and x != line})
        if not copies or others or 2 not in codes or set(codes) - {2, -15, 128 + 15}:
            found = f"other error lines {others}" if others else f"{copies} copies of it"
            out = done.stderr.strip().replace("\n", " | ")[-600:]
            return (
                f"torchrun: expected {line!r} and ranks' exit codes 2 (or -15/143, stopped by torchrun); got {found}, "
                f"exit codes {codes or 'none reported'}; stderr ends {out!r}",
                seconds,
            )
        return None, seconds
