"""Random layouts against one process: the layout fuzzer behind ``tools/fuzz_layouts.py``.

Each case draws a configuration from the whole space (world size, dp, tp, pp, vpp, schedule, ZeRO stage, CPU
offload, sequence parallelism, context and expert parallelism, recomputation, micro-batch and bucket sizes, layer
count, a vocabulary tp may not divide, dropout, precision, the block: norm, MLP, positions, kv heads, biases, a tied
or untied head, and the other model keys: FFN and head widths, q/k norms, the context, every key of the experts;
space.py says which keys are left out and why), valid or not: the validator is under test as much as the training.
Then:

- refused: the refusal is a one-line ``ConfigError`` naming a combination docs/configuration.md lists as unsupported
  (``REFUSALS`` is that list; anything else is a finding), and, for some cases, the real command
  (``python train.py`` or ``torchrun``) exits 2 with that line within seconds;
- accepted: the run gives the one-process curve (fp32: trident_dev/curves.py's comparison, every step, every rank;
  bf16 / fp16: no skipped step and losses within 2% of fp32), and its mid-run checkpoint resumes under another
  random valid layout with the uninterrupted run's next losses; for a third of them a run started from that
  checkpoint's weights (``checkpoint.init_from``) under that layout gives one process's curve from the same
  weights. The trained model also leaves by every exit it has (``exits.py``): its final checkpoint resumed in one
  process is the truth, and the consolidated file, generation (a KV-cache decode against the full forward),
  ``checkpoint.init_from`` and the Hugging Face export loaded by transformers (or its one-line refusal naming a key)
  must compute it. Every run has a time limit: nothing may hang.

Cases are deterministic per (seed, case index), so one failing case is reproduced alone. Training runs
in-process on warm rank pools (``trident_dev.ranks``) through ``run(cfg, run_dir)`` of the checkout's ``train.py``,
and each one-process reference is computed once per sweep and shared by every case with the same model and batch.

The package: ``space.py`` draws the cases, ``refusals.py`` lists what may be refused, ``runner.py`` runs a case,
``exits.py`` checks a trained model's exits, ``cover.py`` says what a short sweep must exercise and picks the
cheapest of a sweep's cases that do (the CI sample).
"""

from trident_dev.fuzz.cover import (
    REQUIRED,
    Drawn,
    cheapest_cover,
    draw_facts,
    estimated_seconds,
    exercised,
    greedy_cover,
    missing,
)
from trident_dev.fuzz.refusals import REFUSALS, Unsupported, refusal_problem, unsupported_entry
from trident_dev.fuzz.runner import (
    CaseResult,
    Fuzzer,
    activation_set_problems,
    base_overrides,
    curve_problems,
    prepare_corpus,
    resolve,
    verdict,
)
from trident_dev.fuzz.space import (
    LOW_PRECISION_REL,
    MAX_WORLD,
    SAVE_AT,
    STEPS,
    Case,
    draw_case,
    draw_resume_layout,
    launch_limit_s,
    starts_from_weights,
)

__all__ = [
    "LOW_PRECISION_REL",
    "MAX_WORLD",
    "REFUSALS",
    "REQUIRED",
    "SAVE_AT",
    "STEPS",
    "Case",
    "CaseResult",
    "Drawn",
    "Fuzzer",
    "Unsupported",
    "activation_set_problems",
    "base_overrides",
    "cheapest_cover",
    "curve_problems",
    "draw_facts",
    "draw_case",
    "draw_resume_layout",
    "estimated_seconds",
    "exercised",
    "greedy_cover",
    "launch_limit_s",
    "missing",
    "prepare_corpus",
    "refusal_problem",
    "resolve",
    "starts_from_weights",
    "unsupported_entry",
    "verdict",
]
