"""Random layouts against one process: the layout fuzzer behind ``tools/fuzz_layouts.py``.

Each case draws a configuration from the whole space (world size, dp, tp, pp, vpp, schedule, ZeRO stage, CPU
offload, sequence parallelism, recomputation, micro-batch and bucket sizes, layer count, a vocabulary tp may not
divide, dropout, precision, and the block: norm, MLP, positions, kv heads, biases, a tied or untied head), valid or
not: the validator is under test as much as the training. Then:

- refused: the refusal is a one-line ``ConfigError`` naming a combination the README lists as unsupported
  (``REFUSALS`` is that list; anything else is a finding), and, for some cases, the real command
  (``python train.py`` or ``torchrun``) exits 2 with that line within seconds;
- accepted: the run gives the one-process curve (fp32: trident/curves.py's comparison, every step, every rank;
  bf16 / fp16: no skipped step and losses within 2% of fp32), and its mid-run checkpoint resumes under another
  random valid layout with the uninterrupted run's next losses; for a third of them a run started from that
  checkpoint's weights (``checkpoint.init_from``) under that layout gives one process's curve from the same
  weights. Every run has a time limit: nothing may hang.

Cases are deterministic per (seed, case index), so one failing case is reproduced alone. Training runs
in-process on warm rank pools (``trident.ranks``) through ``run(cfg, run_dir)`` of the checkout's ``train.py``,
and each one-process reference is computed once per sweep and shared by every case with the same model and batch.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re
import runpy
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trident.config import Config, DataConfig, compose_config, validate
from trident.curves import curve_mismatches
from trident.data.prepare import resolve_dataset
from trident.errors import ConfigError
from trident.layout import PLANNED_KEYS, Layout
from trident.parallel.zero.stage3 import GATHER_MODES
from trident.plan.auto import choose as choose_layout
from trident.ranks import run_distributed

STEPS = 6
SAVE_AT = 3  # the resumed run takes steps 4..6
MAX_WORLD = 8
LOW_PRECISION_REL = 2e-2  # bf16 / fp16 against the fp32 one-process losses

# The embedded test corpus: a few standard-library packages, tokenized to gpt-tiny's 512 pieces.
CORPUS_PACKAGES = ("json", "email", "logging")
CORPUS_VOCAB = 512
# What a resumed run keeps of the case (with the model.* knobs): the math of the run, not its layout.
KEPT_ON_RESUME = ("train.global_batch_size", "train.precision", "data.document_mask", "data.mix")


def launch_limit_s(world: int) -> float:
    """How long a refused launch may take: what starting ``world`` Python processes that import torch costs on a
    busy 2-core machine (torchrun at 8 ranks: 13 s median, 29 s at worst in a 200-case sweep under load 20), with
    room to spare; a refusal that came after a collective would hang for parallel.timeout_s (600 s) instead."""
    return 15.0 + 5.0 * world


# --- the space


def _weighted(rng: random.Random, choices: dict[Any, float]) -> Any:
    return rng.choices(list(choices), weights=list(choices.values()))[0]


# Each rule the validator enforces is broken on purpose in about this share of the cases that could break it:
# drawn fully at random, nearly every case would break several and few would train.
MISTAKE = 0.1


def _draw_knobs(rng: random.Random, mistake: float, fixed: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
    """A world size and train.py's knobs. ``fixed`` (a resumed case's model, batch and precision) is kept as is.

    Each knob is drawn among the values that suit the ones drawn before it, except with probability ``mistake``,
    when it is drawn from all of them: so every refusal happens, alone or with others, and about two thirds of the
    cases train. The model and batch knobs take few values, so that cases share their one-process references.
    """

    def wrong() -> bool:  # a fresh draw for each rule
        return rng.random() < mistake

    tp = _weighted(rng, {1: 0.4, 2: 0.4, 4: 0.15, 3: 0.05})  # 3 divides neither the 4 heads nor the sequence
    pp = _weighted(rng, {1: 0.4, 2: 0.4, 4: 0.15, 3: 0.05})
    dp = rng.randint(1, max(1, MAX_WORLD // (tp * pp)))
    world = dp * tp * pp
    if world > MAX_WORLD or wrong():  # a launch that does not fit the layout
        world = rng.randint(1, MAX_WORLD)
    knobs: dict[str, Any] = {"parallel.tp": tp, "parallel.pp": pp}
    if rng.random() < 0.3:  # otherwise dp is what the world leaves
        knobs["parallel.dp"] = dp
    vpp = _weighted(rng, {1: 0.6, 2: 0.35, 3: 0.05}) if pp > 1 or wrong() else 1
    knobs["parallel.vpp"] = vpp
    if rng.random() < 0.6:  # otherwise the default: 1f1b, or interleaved when vpp > 1
        fits = ["interleaved"] if vpp > 1 else ["gpipe", "1f1b", "zb-h1"]
        knobs["parallel.schedule"] = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1"] if wrong() else fits)
    knobs["parallel.zero"] = rng.randint(0, 3) if pp == 1 or wrong() else rng.randint(0, 2)
    if rng.random() < 0.3:
        if knobs["parallel.zero"] >= 1 or wrong():
            knobs["parallel.offload.optimizer"] = "cpu"
            knobs["parallel.offload.ratio"] = rng.choice([1.0, 0.5, round(rng.uniform(0.05, 1.0), 2)])
    knobs["parallel.sequence_parallel"] = rng.random() < 0.25 and (tp > 1 or wrong())
    knobs["train.activation_checkpointing"] = rng.choice(["none", "selective", "full"])
    # gpt-tiny's gradients are ~0.5 MB: the small sizes give tens to hundreds of buckets.
    knobs["parallel.bucket_mb"] = rng.choice([25.0, 1.0, 0.05, 0.001])

    model = dict(fixed or {})
    if not fixed:
        layers = [n for n in (2, 3, 4, 8) if n % (pp * vpp) == 0]
        model["model.n_layers"] = rng.choice(layers if layers and not wrong() else [2, 3, 4, 8])
        model["model.vocab_size"] = rng.choice([512, 515])  # 515: no tp divides it, the padded vocab is exercised
        model["model.dropout"] = _weighted(rng, {0.0: 0.75, 0.1: 0.25})
        batches = [b for b in (8, 16, 24) if b % dp == 0]
        model["train.global_batch_size"] = rng.choice(batches if batches and not wrong() else [8, 16, 24])
        model["train.precision"] = _weighted(rng, {"fp32": 0.6, "bf16": 0.2, "fp16": 0.2})
    batch = int(model["train.global_batch_size"])
    micro = [m for m in (1, 2, 4, 8) if batch % (m * dp) == 0]
    knobs["train.micro_batch_size"] = rng.choice(micro if micro and not wrong() else [1, 2, 4, 8])
    # ZeRO-3 with pipelines and its gather knobs (issue 21), drawn last so that every earlier knob of a case stays.
    if pp > 1 and knobs["parallel.zero"] == 2 and rng.random() < 0.5:
        knobs["parallel.zero"] = 3
    if knobs["parallel.zero"] == 3 and rng.random() < 0.6:
        knobs["parallel.zero3_gather"] = rng.choice(GATHER_MODES)
        knobs["parallel.zero3_prefetch"] = rng.choice([0, 1, 2])
    # The mid-run checkpoint and the resumed run's written in the background (drawn last: earlier draws keep theirs).
    knobs["checkpoint.async"] = rng.random() < 0.5
    return world, {**model, **knobs}


def _overrides(knobs: dict[str, Any]) -> tuple[str, ...]:
    return tuple(f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in knobs.items())


@dataclass(frozen=True)
class Case:
    """One drawn configuration: the overrides of train.py's command line and the world size it is launched on."""

    seed: int
    index: int
    world: int
    overrides: tuple[str, ...]

    @property
    def knobs(self) -> dict[str, str]:
        return dict(o.split("=", 1) for o in self.overrides)

    @property
    def precision(self) -> str:
        return self.knobs["train.precision"]

    def describe(self) -> str:
        return f"world {self.world}: {' '.join(self.overrides)}"


def _draw_block(rng: random.Random, mistake: float) -> dict[str, Any]:
    """The transformer block's knobs (issue 18): GPT-2's (the defaults, no knob at all), Llama's, or each option
    drawn on its own, since every mix trains. With probability ``mistake`` a kv head count that does not divide the
    4 heads. From a stream of its own, so adding the block left every other knob of a case as it was."""
    family = _weighted(rng, {"gpt2": 0.35, "llama": 0.35, "mix": 0.3})
    if family == "gpt2":
        block: dict[str, Any] = {}
    elif family == "llama":
        block = {"model.norm": "rmsnorm", "model.mlp": "swiglu", "model.position": "rope", "model.bias": False}
        block |= {"model.tie_embeddings": False, "model.n_kv_heads": _weighted(rng, {2: 0.7, 1: 0.3})}
    else:
        block = {
            "model.norm": rng.choice(["layernorm", "rmsnorm"]),
            "model.norm_eps": rng.choice([1e-5, 1e-6]),
            "model.mlp": rng.choice(["gelu", "swiglu"]),
            "model.position": rng.choice(["learned", "rope"]),
            "model.rope_theta": rng.choice([10000.0, 500000.0]),
            "model.n_kv_heads": rng.choice([4, 2, 1]),
            "model.bias": rng.choice([True, False]),
            "model.tie_embeddings": rng.choice([True, False]),
        }
        # Llama 3's long-context frequencies, with an original context below the 64 tokens so that they matter.
        if block["model.position"] == "rope" and rng.random() < 0.5 or rng.random() < mistake:
            block["model.rope_scaling"] = "llama3"
            block["model.rope_factor"] = rng.choice([8.0, 32.0])
            block["model.rope_low_freq_factor"] = rng.choice([1.0, 2.0])
            block["model.rope_high_freq_factor"] = 4.0
            block["model.rope_original_seq_len"] = rng.choice([16, 32])
    if rng.random() < mistake:
        block["model.n_kv_heads"] = 3
    return block


# data.tokenizer set to the tokenizer the sweep's dataset was prepared with (the path is the sweep's, filled in by
# ``Fuzzer.config``): the dataset must recognise it as its own and train exactly as without it.
DATASET_TOKENIZER = "DATASET_TOKENIZER"
# data.mix of the sweep's dataset and a second one prepared with its tokenizer (paths filled in likewise).
MIX_FIRST, MIX_SECOND = "MIX_FIRST", "MIX_SECOND"
SECOND_PACKAGES = ("unittest", "http")


def draw_case(seed: int, index: int) -> Case:
    """The case ``index`` of sweep ``seed``: the same on every machine and Python run (string seeds hash alike).
    The block and the data knobs come from streams of their own, so adding them changed no other knob."""
    world, knobs = _draw_knobs(random.Random(f"fuzz:{seed}:{index}"), MISTAKE)
    block = _draw_block(random.Random(f"fuzz-block:{seed}:{index}"), MISTAKE)
    data_rng = random.Random(f"fuzz-data:{seed}:{index}")
    data: dict[str, Any] = {"data.tokenizer": DATASET_TOKENIZER} if data_rng.random() < 0.2 else {}
    if data_rng.random() < 0.25:  # packed documents: it changes the math, so the reference and a resume keep it
        data["data.document_mask"] = True
    if data_rng.random() < 0.15:  # a two-source mixture instead of the one dataset (data.tokenizer is then unused)
        weight = data_rng.choice([0.5, 0.7, 0.9])
        data = {**data, "data.mix": f"[{MIX_FIRST}:{weight},{MIX_SECOND}:{round(1 - weight, 1)}]"}
        data.pop("data.tokenizer", None)
    # parallel.auto: the planner chooses the layout for the world drawn, so the layout knobs drawn are left out.
    if random.Random(f"fuzz-auto:{seed}:{index}").random() < 0.1:
        knobs = {k: v for k, v in knobs.items() if k not in PLANNED_KEYS} | {"parallel.auto": True}
    return Case(seed, index, world, _overrides({**block, **data, **knobs}))


def starts_from_weights(case: Case) -> bool:
    """Whether an accepted case also checks ``checkpoint.init_from`` (about a third of them: two more runs each)."""
    return random.Random(f"fuzz-init:{case.seed}:{case.index}").random() < 1 / 3


def draw_resume_layout(case: Case, accepts: Callable[[int, tuple[str, ...]], bool]) -> tuple[int, tuple[str, ...]]:
    """Another layout for resuming ``case``'s checkpoint: same model, batch and precision, drawn until ``accepts``
    (the validator) takes it. Deterministic per case, like the case itself."""
    rng = random.Random(f"fuzz-resume:{case.seed}:{case.index}")
    kept = {k: v for k, v in case.knobs.items() if k.startswith("model.") or k in KEPT_ON_RESUME}
    for _ in range(100):
        world, knobs = _draw_knobs(rng, 0.0, kept)
        overrides = _overrides(knobs)
        # A parallel.auto case names no layout: any resume layout moves it (the planner's may be the same).
        moved = (world, knobs["parallel.tp"], knobs["parallel.pp"], knobs["parallel.zero"]) != (
            case.world,
            int(case.knobs.get("parallel.tp", 0)),
            int(case.knobs.get("parallel.pp", 0)),
            int(case.knobs.get("parallel.zero", 0)),
        )
        if world <= MAX_WORLD and moved and accepts(world, overrides):
            return world, overrides
    raise RuntimeError(f"no valid resume layout in 100 draws for case {case.index}")


# --- what the README lists as unsupported


@dataclass(frozen=True)
class Unsupported:
    """One combination the README's "Unsupported combinations" section lists, and how its refusal reads."""

    readme: str  # the README's wording, verbatim (a test keeps the two in step)
    pattern: str  # a regular expression the validator's message matches from its start


REFUSALS: tuple[Unsupported, ...] = (
    Unsupported(
        "CPU offload without a ZeRO stage (`parallel.offload.optimizer=cpu` with `parallel.zero=0`)",
        r"parallel\.offload\.optimizer=cpu needs a ZeRO stage",
    ),
    Unsupported(
        "sequence parallelism without tensor parallelism (`parallel.sequence_parallel=true` with `parallel.tp=1`)",
        r"parallel\.sequence_parallel=true needs parallel\.tp > 1",
    ),
    Unsupported(
        "virtual stages without pipeline parallelism (`parallel.vpp` > 1 with `parallel.pp=1`)",
        r"parallel\.vpp=\d+ needs pipeline parallelism",
    ),
    Unsupported(
        "virtual stages under a schedule other than `interleaved`, and `interleaved` without virtual stages",
        r"parallel\.vpp=\d+ needs parallel\.schedule=interleaved|parallel\.schedule=interleaved needs parallel\.vpp",
    ),
    Unsupported(
        "a layer count that `pp` x `vpp` does not divide",
        r"model\.n_layers=\d+ is not divisible by pp \d+ x vpp \d+",
    ),
    Unsupported(
        "heads, FFN width or (with sequence parallelism) sequence length that `tp` does not divide",
        r"model\.(n_heads|d_ff|seq_len)=\d+ is not divisible by parallel\.tp=\d+",
    ),
    Unsupported(
        "key/value heads that do not divide `n_heads`, or that `tp` neither divides nor is a multiple of",
        r"model\.n_kv_heads=\d+ (must divide model\.n_heads|neither splits over nor replicates)",
    ),
    Unsupported(
        "RoPE frequency scaling without rotary positions (`model.rope_scaling` with `model.position=learned`)",
        r"model\.rope_scaling=\w+ needs model\.position=rope",
    ),
    Unsupported(
        "a global batch that is not a multiple of `micro_batch_size` x `dp`",
        r"train\.global_batch_size=\d+ is not divisible by micro_batch_size \d+ x dp \d+",
    ),
    Unsupported(
        "a world size other than `dp` x `tp` x `pp` (with `dp` left out: not a multiple of `tp` x `pp`)",
        r"world size \d+ (!= dp|is not divisible by tp)",
    ),
    Unsupported(
        "`parallel.auto=true` on a world size no layout of the model and batch can use",
        r"parallel\.auto=true: no layout of \d+ ranks",
    ),
)


def unsupported_entry(message: str) -> Unsupported | None:
    """The README entry a refusal's message names, or None when it names none."""
    return next((u for u in REFUSALS if re.match(u.pattern, message)), None)


def refusal_problem(error: BaseException) -> str | None:
    """Why a refusal is itself a finding (not a one-line ConfigError, or not a listed combination), or None."""
    if not isinstance(error, ConfigError):
        return f"refused with {type(error).__name__}, not a ConfigError: {error}"
    message = str(error)
    if not message or "\n" in message:
        return f"the refusal is not one line: {message!r}"
    if unsupported_entry(message) is None:
        return f"refused a combination the README does not list as unsupported: {message}"
    return None


# --- configs and runs


def resolve(cfg: Config, world: int) -> Layout | BaseException:
    """The layout the validator resolves ``cfg`` into on ``world`` processes (with ``parallel.auto``, the one the
    planner chooses, as train.py's ``run`` does), or its refusal."""
    try:
        if cfg.parallel.auto:
            cfg, _ = choose_layout(cfg, world)
        return validate(cfg, world)
    except Exception as e:  # anything but a ConfigError is itself a finding, reported by refusal_problem
        return e


def verdict(cfg: Config, world: int) -> BaseException | None:
    """The validator's refusal of ``cfg`` on ``world`` processes, or None when it accepts it."""
    outcome = resolve(cfg, world)
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


_RUN: dict[str, Callable[[Config, Path], list[dict]]] = {}


def _train_on_rank(rank: int, world: int, train_py: str, cfg: Config, run_dir: Path) -> list[dict]:
    # train.py is a script, not part of the package: loaded by path once per rank process, then reused.
    run = _RUN.get(train_py)
    if run is None:
        run = _RUN[train_py] = runpy.run_path(train_py)["run"]
    with contextlib.redirect_stdout(io.StringIO()):  # the console lines of hundreds of runs are noise here
        return run(cfg, run_dir)


# --- comparisons


def curve_problems(expected: list[dict], got: list[dict], precision: str, what: str) -> list[str]:
    """How ``got`` departs from ``expected`` (rows of the same steps): in fp32 the project's one comparison
    (trident/curves.py: loss, gradient norm and validation loss to reduction order); in bf16 / fp16 the losses
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


class Fuzzer:
    """Runs cases on one dataset; keeps the one-process references of a sweep."""

    def __init__(self, repo: Path, dataset: Path, timeout_s: float = 180.0, work_dir: Path | None = None) -> None:
        self.repo = repo
        self.train_py = str(repo / "train.py")
        self.dataset = dataset
        self.timeout_s = timeout_s
        self._tmp = None if work_dir else tempfile.TemporaryDirectory(prefix="fuzz-")
        self.work_dir = work_dir or Path(self._tmp.name)
        self._references: dict[tuple[str, ...], list[dict]] = {}
        self._second: Path | None = None
        self._runs = 0

    def overrides(self, overrides: tuple[str, ...] | list[str]) -> list[str]:
        """train.py's command line for a case's overrides on this sweep's dataset."""
        paths = {DATASET_TOKENIZER: str(self.dataset / "tokenizer.model"), MIX_FIRST: str(self.dataset)}

        def fill(override: str) -> str:
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

    def config(self, overrides: tuple[str, ...] | list[str]) -> Config:
        return compose_config(self.repo / "conf", self.overrides(overrides))

    def accepts(self, world: int, overrides: tuple[str, ...]) -> bool:
        return verdict(self.config(overrides), world) is None

    def train(self, world: int, overrides: tuple[str, ...] | list[str]) -> tuple[Path, list[list[dict]]]:
        """Every rank's history of one run, in a fresh run directory; raises what the run raised, or TimeoutError."""
        self._runs += 1
        run_dir = self.work_dir / f"run{self._runs:05d}"
        cfg = self.config(overrides)
        return run_dir, run_distributed(_train_on_rank, world, self.train_py, cfg, run_dir, timeout_s=self.timeout_s)

    def reference(self, case: Case, *extra: str) -> list[dict]:
        """The fp32 one-process curve of the case's model and batch (one micro-batch a step), with ``extra``."""
        knobs = case.knobs
        math = ("train.global_batch_size", "data.document_mask", "data.mix")
        key = tuple(f"{k}={v}" for k, v in knobs.items() if k.startswith("model.") or k in math)
        key = (*key, *extra)
        if key not in self._references:
            batch = knobs["train.global_batch_size"]
            _, (history,) = self.train(1, (*key, f"train.micro_batch_size={batch}", "train.precision=fp32"))
            self._references[key] = history
        return self._references[key]

    def run_case(self, case: Case, check_launch: bool = False) -> CaseResult:
        start = time.monotonic()
        outcome = resolve(self.config(case.overrides), case.world)
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
        world, overrides = draw_resume_layout(case, self.accepts)
        checkpoint = run_dir / "checkpoints" / f"step_{SAVE_AT:08d}"
        resume = (f"checkpoint.resume={checkpoint}",)
        problems = self._rerun(case, world, overrides, resume, lambda: histories[0][SAVE_AT:], "resumed")
        if problems or not starts_from_weights(case):
            return problems
        # checkpoint.init_from: the saved weights, a fresh optimizer at step 0, under the other layout, against
        # one process started from the same weights.
        init = f"checkpoint.init_from={checkpoint}"
        return self._rerun(case, world, overrides, (init,), lambda: self.reference(case, init), "started from it")

    def _rerun(
        self,
        case: Case,
        world: int,
        overrides: tuple[str, ...],
        extra: tuple[str, ...],
        expected: Callable[[], list[dict]],
        what: str,
    ) -> list[str]:
        """A run of the step-3 checkpoint (``extra``) under another layout, against the curve ``expected`` gives."""
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
        # torchrun: every rank that gets to print says the same line; the one torchrun saw first exited with 2
        # (torchrun itself then exits 1 with its own report, which is the launcher's, not the run's).
        # The line is counted where it appears: torchrun's own log lines share the stream and may cut into it.
        root = re.search(r"Root Cause.*?exitcode\s*:\s*(-?\d+)", done.stderr, re.DOTALL)
        copies = done.stderr.count(line)
        others = sorted({x for x in done.stderr.splitlines() if x.startswith("error:") and x != line})
        if not copies or others or root is None or root.group(1) != "2":
            found = f"other error lines {others}" if others else f"{copies} copies of it"
            code = root.group(1) if root else "none reported"
            out = done.stderr.strip().replace("\n", " | ")[-600:]
            return (
                f"torchrun: expected {line!r}; got {found}, first rank's exit code {code}; stderr ends {out!r}",
                seconds,
            )
        return None, seconds
