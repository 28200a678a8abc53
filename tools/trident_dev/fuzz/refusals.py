"""What docs/configuration.md lists as unsupported: a refused case must be refused with one of these lines, anything
else is a finding.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trident.errors import ConfigError

# --- what docs/configuration.md lists as unsupported


@dataclass(frozen=True)
class Unsupported:
    """One combination docs/configuration.md lists under "Unsupported combinations", and how its refusal reads."""

    readme: str  # the docs' wording, verbatim (a test keeps the two in step)
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
        "virtual stages under a schedule other than `interleaved` or `zb-v`, `interleaved` without virtual stages, "
        "and `zb-v` with other than two (`parallel.vpp=2`)",
        r"parallel\.vpp=\d+ needs parallel\.schedule=interleaved|parallel\.schedule=interleaved needs parallel\.vpp"
        r"|parallel\.vpp=\d+ with parallel\.schedule=zb-v",
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
        "a world size other than `dp` x `cp` x `tp` x `pp` (with `dp` left out: not a multiple of `cp` x `tp` x `pp`)",
        r"world size \d+ (!= dp|is not divisible by tp)",
    ),
    Unsupported(
        "context parallelism with a sequence length that 2 x `cp` (x `tp` with sequence parallelism) does not divide",
        r"model\.seq_len=\d+ does not split into 2 x parallel\.cp",
    ),
    Unsupported(
        "`parallel.cp_comm=ulysses` with heads or key/value heads that `tp` x `cp` ranks cannot spread",
        r"parallel\.cp_comm=ulysses (spreads|cannot spread)",
    ),
    Unsupported(
        "expert parallelism without experts, or with an `ep` that does not divide the experts or the data-parallel "
        "(x `cp`) ranks (`parallel.ep`)",
        r"parallel\.ep=\d+ (needs a model with experts|does not divide)",
    ),
    Unsupported(
        "a top-k outside 1 to the expert count (`model.moe.top_k`)",
        r"model\.moe\.top_k=\d+ must be between 1 and",
    ),
    Unsupported(
        "`parallel.auto=true` on a world size no layout of the model and batch can use",
        r"parallel\.auto=true: no layout of \d+ ranks",
    ),
    Unsupported(
        "rotary positions with an odd head width (`model.position=rope` with an odd `model.head_dim`, or d_model / "
        "n_heads)",
        r"model\.position=rope needs an even head size",
    ),
    Unsupported(
        "q/k norms over the whole projection with key/value heads that `tp` does not divide "
        "(`model.qk_norm_scope=projection`)",
        r"model\.qk_norm_scope=projection normalises all \d+ kv heads together",
    ),
    Unsupported(
        "shared experts whose width (`model.moe.shared_experts` x `model.moe.d_expert`) `tp` does not divide",
        r"the shared experts' width model\.moe\.shared_experts=\d+ x model\.moe\.d_expert=\d+ = \d+ is not "
        r"divisible by parallel\.tp=\d+",
    ),
    Unsupported(
        "`model.moe.norm_topk=true` with `model.moe.top_k=1` (every routing weight would be 1)",
        r"model\.moe\.norm_topk=true with model\.moe\.top_k=1",
    ),
    Unsupported(
        "the sigmoid router with `model.moe.top_k=1` (its chosen score is renormalised to a weight of 1)",
        r"model\.moe\.router=sigmoid renormalises the chosen scores to sum 1",
    ),
)


def unsupported_entry(message: str) -> Unsupported | None:
    """The docs entry a refusal's message names, or None when it names none."""
    return next((u for u in REFUSALS if re.match(u.pattern, message)), None)


def refusal_problem(error: BaseException) -> str | None:
    """Why a refusal is itself a finding (not a one-line ConfigError, or not a listed combination), or None."""
    if not isinstance(error, ConfigError):
        return f"refused with {type(error).__name__}, not a ConfigError: {error}"
    message = str(error)
    if not message or "\n" in message:
        return f"the refusal is not one line: {message!r}"
    if unsupported_entry(message) is None:
        return f"refused a combination docs/configuration.md does not list as unsupported: {message}"
    return None
