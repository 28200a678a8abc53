"""What a short sweep must exercise, and the cheapest sample of a sweep's first cases that does.

A trained case exercises facts (``parallel.zero=3``, ``pp>1``, ``model.n_kv_heads=1``, ...), read from the layout
the validator resolved and the config it composed; a refused case exercises the docs entry it was refused with.
``REQUIRED`` lists what a sample must exercise: every value of every knob that can train, a few pairs of them that
meet in the code (ZeRO under pipelines, replicated kv heads under tp, ...), and every refusal. ``cheapest_cover``
picks, by greedy weighted set cover over an estimate of each case's seconds, a sample of a sweep's first cases
that meets all of it (tools/fuzz_layouts.py --cover). tests/test_fuzz.py's CI sample began as one and is checked
against ``REQUIRED``; its comment says which cases measured time swapped.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from trident.checkpoint.hf import GPT2, LLAMA, MIXTRAL, OLMOE, QWEN3, QWEN3_MOE
from trident.config import Config, compose_config
from trident.layout import Layout, override_value
from trident.models.compile import compiles
from trident.parallel.zero.stage3 import GATHER_MODES
from trident_dev.fuzz.exits import export_class
from trident_dev.fuzz.refusals import REFUSALS, unsupported_entry
from trident_dev.fuzz.runner import base_overrides, resolve
from trident_dev.fuzz.space import (
    CAPACITIES,
    HEAD_DIMS,
    SAVE_AT,
    STEPS,
    Case,
    draw_case,
    draw_resume_layout,
    starts_from_weights,
)

# --- what a case exercises


def _is(key: str, value: object) -> str:
    return f"{key}={override_value(value)}"


def _words(key: str, values: Iterable[object]) -> list[str]:
    return [_is(key, v) for v in values]


HF_CLASSES = (GPT2, LLAMA, QWEN3, MIXTRAL, QWEN3_MOE, OLMOE)  # every class an export of the space can load as

SINGLES = (
    *_words("world", (1, 2, 3, 4, 6, 8)),  # 5 and 7: dp 5 or 7 divides no global batch of the space (8, 16, 24)
    *_words("parallel.tp", (1, 2, 4)),  # 3 divides neither the 4 heads nor the sequence: only ever refused
    *_words("parallel.pp", (1, 2, 3, 4)),
    *_words("parallel.vpp", (1, 2)),  # 3: no layer count of the space (2, 3, 4, 8) is a multiple of pp x 3, pp > 1
    *_words("parallel.schedule", ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-v")),
    *_words("parallel.zero", (0, 1, 2, 3)),
    *_words("parallel.zero3_gather", GATHER_MODES),
    *_words("parallel.zero3_prefetch", (0, 1, 2)),
    *_words("parallel.offload.optimizer", ("none", "cpu")),
    "parallel.offload.ratio=1",
    "parallel.offload.ratio<1",
    *_words("parallel.sequence_parallel", (True, False)),
    "parallel.dp given",
    "parallel.dp from the world",
    *_words("parallel.auto", (True, False)),
    *_words("parallel.bucket_mb", (25.0, 1.0, 0.05, 0.001)),
    *_words("train.activation_checkpointing", ("none", "selective", "attention", "full")),
    *_words("train.recompute_every", (1, 2)),
    *_words("train.recompute_modules", ("norm,mlp_act", "norm,mlp_act,attn_core,mlp", "attn_core", "mlp")),
    *_words("train.micro_batch_size", (1, 2, 4, 8)),
    "micro-batches=1",
    "micro-batches>1",
    *_words("train.global_batch_size", (8, 16, 24)),
    *_words("train.precision", ("fp32", "bf16", "fp16")),
    *_words("checkpoint.async", (True, False)),
    *_words("checkpoint.init_from", (True, False)),  # a third of the cases also start a run from the checkpoint
    *_words("model.vocab_size", (512, 515)),
    *_words("model.n_layers", (2, 3, 4, 8)),
    *_words("model.dropout", (0.0, 0.1)),
    *_words("model.norm", ("layernorm", "rmsnorm")),
    *_words("model.norm_eps", (1e-5, 1e-6)),
    *_words("model.mlp", ("gelu", "swiglu")),
    *_words("model.position", ("learned", "rope")),
    *_words("model.rope_theta", (10000.0, 500000.0)),  # with rotary positions: the theta of a learned table is unused
    *_words("model.n_kv_heads", (4, 2, 1)),
    *_words("model.bias", (True, False)),
    *_words("model.tie_embeddings", (True, False)),
    *_words("model.rope_scaling", (None, "llama3")),
    *_words("model.rope_factor", (8.0, 32.0)),  # these four with rope_scaling=llama3 only
    *_words("model.rope_low_freq_factor", (1.0, 2.0)),
    *_words("model.rope_high_freq_factor", (4.0,)),
    *_words("model.rope_original_seq_len", (16, 32)),
    *_words("data.tokenizer given", (True, False)),
    *_words("data.document_mask", (True, False)),
    *_words("data.mix", (None, 0.5, 0.7, 0.9)),  # the first source's weight
    *_words("parallel.cp", (1, 2, 4)),
    *_words("parallel.cp_comm", ("ring", "allgather", "ulysses")),  # with cp > 1
    *_words("model.moe.experts", (0, 2, 4)),
    *_words("model.moe.router", ("softmax", "sigmoid")),  # these with experts only
    *_words("model.moe.top_k", (1, 2)),
    *_words("model.moe.capacity_factor", (None, 1.0, *CAPACITIES)),
    "model.moe.bias_update_rate>0",
    "model.moe.bias_update_rate=0.01",
    "model.moe.every=2",
    *_words("parallel.ep", (1, 2, 4)),
    # The keys issue 48 added to the space (space.py's _draw_model_keys), and the exits' Hugging Face side: an
    # export that transformers loads, of each class the space can train, and one refused.
    *_words("model.d_ff", (None, 176)),
    *_words("model.head_dim", (None, *HEAD_DIMS)),
    *_words("model.qk_norm", (True, False)),
    *_words("model.qk_norm_scope", ("head", "projection")),  # with qk_norm
    *_words("model.max_seq_len", (None, 128)),  # with rotary positions
    "model.moe.shared_experts>0",  # 1 or 2 of them: one MLP either way, 2 only wider
    *_words("model.moe.norm_topk", (True, False)),  # with the softmax router
    *_words("model.moe.first_dense", (0, 1)),
    *_words("model.moe.d_expert", (32, 64)),
    *_words("model.moe.grouped_mm", (True, False)),
    "model.moe.aux_loss_coef>0",
    "model.moe.z_loss_coef>0",
    *_words("export", (*HF_CLASSES, None)),
    *_words("optim.name", ("adamw", "muon")),  # Muon (issue 52), its keys drawn with it
    # Issue 51's keys: FP8's recipes (with bf16), compiled blocks, the loss in chunks of tokens (one chunk of the
    # default 1024 here, unchunked, or a few tokens a chunk); and the replay check.
    *_words("train.fp8", ("off", "tensorwise", "rowwise", "rowwise_with_gw_hp")),
    *_words("train.compile", ("auto", True)),
    *_words("model.loss_chunk_tokens", (1024, 0, 7, 64)),
    *_words("train.replay_every", (0, 3)),
)

# Pairs that meet in the code: each must be exercised by one trained case.
PAIRS = (
    # Muon's matrices put together across tp shards, ZeRO shards and stages (parallel/zero/muon.py).
    *(("optim.name=muon", fact) for fact in ("tp>1", "sharded", "pp>1")),
    *((f"parallel.zero={z}", "pp>1") for z in range(4)),  # the optimizer over pipeline stages
    *((f"parallel.zero={z}", "dp>1") for z in (1, 2, 3)),  # sharded (over one rank, ZeRO shards nothing)
    ("parallel.zero=3", "tp>1"),
    # A steady phase (one forward, one backward) after the warm-up: more micro-batches than stages.
    *((f"parallel.schedule={s}", "micro-batches>pp") for s in ("1f1b", "interleaved", "zb-h1", "zb-v")),
    *((f"parallel.zero3_gather={g}", "pp>1") for g in GATHER_MODES),  # a stage's gathers per micro-batch or step
    ("parallel.offload.optimizer=cpu", "pp>1"),
    ("parallel.offload.optimizer=cpu", "dp>1"),
    *(("parallel.offload.optimizer=cpu", f"parallel.zero={z}") for z in (1, 2, 3)),
    ("parallel.sequence_parallel=true", "dp>1"),
    ("parallel.sequence_parallel=true", "pp>1"),
    ("parallel.vpp=2", "tp>1"),
    ("parallel.vpp=2", "dp>1"),
    *((f"train.precision={p}", "sharded") for p in ("fp32", "bf16", "fp16")),  # the sharded master weights
    *((f"train.precision={p}", "pp>1") for p in ("bf16", "fp16")),  # the loss scale over stages
    *((f"train.activation_checkpointing={a}", "pp>1") for a in ("selective", "attention", "full")),
    # Op-level selective recomputation with what its replay reruns: the sequence-parallel collectives, the redrawn
    # dropout masks, ZeRO-3's gathered blocks.
    ("train.activation_checkpointing=selective", "parallel.sequence_parallel=true"),
    ("train.activation_checkpointing=selective", "model.dropout=0.1"),
    ("train.activation_checkpointing=selective", "parallel.zero=3"),
    ("train.recompute_every=2", "pp>1"),
    *((_is("parallel.bucket_mb", b), "dp>1") for b in (25.0, 1.0, 0.05, 0.001)),  # buckets reduce over dp
    ("parallel.pp=1", "micro-batches>1", "dp>1"),  # gradient accumulation, synced on the last micro-batch
    ("model.dropout=0.1", "tp>1"),  # the tensor-parallel random streams
    ("model.dropout=0.1", "pp>1"),
    ("model.vocab_size=515", "tp>1"),  # a padded vocabulary split over tp
    ("model.n_kv_heads=2", "parallel.tp=2"),  # kv heads split over tp, or replicated when fewer than tp
    ("model.n_kv_heads=1", "parallel.tp=2"),
    ("model.n_kv_heads=1", "parallel.tp=4"),
    ("model.n_kv_heads=2", "parallel.tp=4"),
    ("model.tie_embeddings=true", "pp>1"),  # the tied copies on the first and last stage
    ("model.tie_embeddings=true", "parallel.schedule=zb-v"),  # both copies on one rank, in two chunks
    ("data.document_mask=true", "pp>1"),
    ("data.document_mask=true", "parallel.sequence_parallel=true"),
    ("checkpoint.async=true", "pp>1"),
    ("checkpoint.async=true", "parallel.zero=3"),
    ("parallel.auto=true", "world>1"),
    # Context parallelism with what meets its split: the other dimensions, documents' masks and positions, ZeRO.
    *(("cp>1", f"{axis}>1") for axis in ("dp", "tp", "pp")),
    ("cp>1", "data.document_mask=true"),
    ("cp>1", "parallel.sequence_parallel=true"),
    ("cp>1", "sharded"),
    ("cp>1", "model.n_kv_heads=1"),  # grouped-query heads gathered or spread
    ("cp>1", "model.dropout=0.1"),  # the masks' rows and columns at the tokens a rank holds
    # Experts over stages (a stage may have no sparse layer), beside tp, and sharded with their balancing state.
    *(("experts", f"{axis}>1") for axis in ("dp", "tp", "pp")),
    ("experts", "sharded"),
    ("experts", "train.activation_checkpointing=full"),  # routing counted once under recomputation
    # Experts on a sequence split over ranks: the balancing statistics and a capacity over the whole sequence.
    ("experts", "parallel.sequence_parallel=true"),
    ("experts", "cp>1"),
    # Experts over ep ranks: their own gradient group beside tp and pp, and their ZeRO shards.
    # ep with cp is drawn about once in 500 cases and trained by none of seed 0's first 1000: tests/test_moe_ep.py
    # holds it (cp 2 x dp 2 at ep 4).
    *(("ep>1", f"{axis}>1") for axis in ("tp", "pp")),
    *(("ep>1", f"parallel.zero={z}") for z in (1, 2, 3)),
    # q/k norms' gains replicated over tp, summed over it without SP and with it (issue 48's first finding), and
    # the projection's norm with its squares summed over tp; a head width of its own split over tp and cp.
    ("model.qk_norm=true", "tp>1", "parallel.sequence_parallel=false"),
    ("model.qk_norm=true", "parallel.sequence_parallel=true"),
    ("model.qk_norm=true", "pp>1"),
    ("model.qk_norm_scope=projection", "tp>1"),
    ("head_dim set", "tp>1"),
    ("head_dim set", "cp>1"),
    # Shared experts split over tp like the dense MLP; a capacity that drops, with the sequence split over ranks.
    ("model.moe.shared_experts>0", "tp>1"),
    ("model.moe.capacity_factor=0.5", "cp>1"),
    ("model.moe.capacity_factor=0.5", "tp>1"),
    # FP8's scales over the whole logical tensor: amaxes reduced over tp, and over ZeRO's weight shards.
    ("fp8", "tp>1"),
    ("fp8", "sharded"),
    ("model.loss_chunk_tokens=7", "tp>1"),  # the vocab-parallel head's loss in chunks
)

# What the trained cases whose exits a short sweep checks must exercise between them (tests/test_fuzz.py checks
# the exits of a few of its sample's cases, not all): an export of each class and a refused one, and the keys whose
# state or arithmetic an exit must carry (the balancing bias, a capacity, q/k norms, a head width, shared experts, a
# longer context).
EXIT_FACTS = (
    *_words("export", (*HF_CLASSES, None)),
    "model.moe.bias_update_rate>0",
    "model.moe.capacity_factor=0.5",
    *_words("model.qk_norm_scope", ("head", "projection")),
    "head_dim set",
    "model.moe.shared_experts>0",
    "model.max_seq_len=128",
    "model.moe.first_dense=1",
    "model.moe.every=2",
)

# What the trained cases whose resume a short sweep checks must exercise between them (tests/test_fuzz.py resumes
# a covering few of its sample's cases, not all): each layout dimension and ZeRO stage on the side that saves and
# on the side that resumes, and the state a checkpoint carries across them (the 16-bit runs' loss scale and fp32
# masters, the experts' balancing bias, Muon's momentum, FP8, a mixture's loader, dropout's random streams, the
# padded vocabulary split over tp, the tied head over stages, a background save). Resuming at cp > 1 or ep > 1 is
# not among them: no resume of the CI sample (all of its trained cases' resumes) draws either, and tests/
# test_cp_layouts.py (cp 2 to cp 4) and tests/test_moe_ep.py (ep 2 to ep 4 x pp 2) hold them.
_RESUME_SIDES = tuple(
    f"{side} {fact}"
    for side in ("saved", "resumed")
    for fact in (
        *(f"{axis}>1" for axis in ("dp", "tp", "pp", *(("cp", "ep") if side == "saved" else ()))),
        *(f"parallel.zero={z}" for z in range(4)),
        "sharded",
        "parallel.vpp=2",
        "parallel.offload.optimizer=cpu",
        "parallel.sequence_parallel=true",
        "model.vocab_size=515 tp>1",
        "model.tie_embeddings=true pp>1",
    )
)
RESUME_FACTS = (
    *_RESUME_SIDES,
    "saved checkpoint.async=true",
    *_words("train.precision", ("fp32", "bf16", "fp16")),
    "experts",
    "model.moe.bias_update_rate>0",
    "optim.name=muon",
    "fp8",
    "data.mix",
    "model.dropout=0.1",
)


def _layout_facts(layout: Layout, cfg: Config) -> set[str]:
    facts = {f"{axis}>1" for axis in ("dp", "tp", "pp", "cp", "ep") if getattr(layout, axis) > 1}
    facts |= {_is("parallel.zero", layout.zero), _is("parallel.vpp", layout.vpp)}
    facts |= {"sharded"} if layout.zero >= 1 and layout.dp > 1 else set()
    facts |= {"parallel.offload.optimizer=cpu"} if layout.offload != "none" else set()
    facts |= {"parallel.sequence_parallel=true"} if layout.sequence_parallel else set()
    facts |= {"model.vocab_size=515 tp>1"} if cfg.model.vocab_size == 515 and layout.tp > 1 else set()
    facts |= {"model.tie_embeddings=true pp>1"} if cfg.model.tie_embeddings and layout.pp > 1 else set()
    return facts


def resumed_facts(drawn: Drawn) -> frozenset[str]:
    """What a trained case's resume exercises (``draw_facts(..., with_resume=True)``): the saving layout's facts and
    the resuming one's (``RESUME_FACTS``), and the math a resume keeps."""
    layout, cfg = drawn.layout, drawn.cfg
    assert layout is not None and drawn.resume is not None, "a trained case, drawn with_resume=True"
    _, resumed = drawn.resume
    facts = {f"saved {f}" for f in _layout_facts(layout, cfg)} | {f"resumed {f}" for f in _layout_facts(resumed, cfg)}
    facts |= {"saved checkpoint.async=true"} if layout.async_checkpoint else set()
    facts.add(_is("train.precision", layout.precision))
    facts |= {"experts"} if cfg.model.moe.enabled else set()
    facts |= {"model.moe.bias_update_rate>0"} if cfg.model.moe.enabled and cfg.model.moe.bias_update_rate > 0 else set()
    facts |= {"optim.name=muon"} if cfg.optim.name == "muon" else set()
    facts |= {"fp8"} if cfg.train.fp8 != "off" else set()
    facts |= {"data.mix"} if cfg.data.mix else set()
    facts |= {"model.dropout=0.1"} if cfg.model.dropout > 0 else set()
    return frozenset(facts) & frozenset(RESUME_FACTS)


def resume_seconds(drawn: Drawn) -> float:
    """What a trained case's resume costs by ``estimated_seconds``'s estimate (its steps after the save)."""
    assert drawn.resume is not None, "draw_facts(..., with_resume=True)"
    model = (drawn.cfg.model.n_layers, drawn.cfg.train.global_batch_size)
    return _run_seconds(drawn.resume[1], *model, STEPS - SAVE_AT)


REQUIRED: tuple[tuple[str, ...], ...] = (
    *((fact,) for fact in SINGLES),
    *PAIRS,
    *((f"refused: {u.readme}",) for u in REFUSALS),
)


@dataclass(frozen=True)
class Drawn:
    """A case as the validator sees it: its config and its layout or refusal, and, when asked for (the cost
    estimate reads it), the layout its checkpoint resumes under."""

    case: Case
    cfg: Config
    outcome: Layout | BaseException
    resume: tuple[int, Layout] | None = None

    @property
    def layout(self) -> Layout | None:
        return None if isinstance(self.outcome, BaseException) else self.outcome


def draw_facts(repo: Path, seed: int, index: int, with_resume: bool = False) -> Drawn:
    """Case ``index`` of sweep ``seed`` through the validator (no dataset needed: its paths are left as named)."""

    def config(overrides: tuple[str, ...]) -> Config:
        return compose_config(repo / "conf", [*base_overrides(Path("dataset")), *overrides])

    case = draw_case(seed, index)
    cfg = config(case.overrides)
    outcome = resolve(cfg, case.world, case.overrides)
    resume = None
    if with_resume and not isinstance(outcome, BaseException):
        world, overrides = draw_resume_layout(case, lambda w, o: not isinstance(resolve(config(o), w), BaseException))
        layout = resolve(config(overrides), world)
        assert isinstance(layout, Layout)
        resume = (world, layout)
    return Drawn(case, cfg, outcome, resume)


def exercised(drawn: Drawn) -> frozenset[str]:
    """The facts a case exercises. A ``parallel.auto`` case's layout is the planner's, which depends on the machine
    it plans for (a GPU's datasheet, a calibrated CPU): only what it keeps from its draw counts."""
    layout = drawn.layout
    if layout is None:
        entry = unsupported_entry(str(drawn.outcome))
        return frozenset([f"refused: {entry.readme}"] if entry else [])
    cfg, case, model = drawn.cfg, drawn.case, drawn.cfg.model
    facts = {
        _is("world", case.world),
        _is("parallel.auto", cfg.parallel.auto),
        _is("parallel.bucket_mb", layout.bucket_mb),
        _is("train.global_batch_size", cfg.train.global_batch_size),
        _is("train.precision", layout.precision),
        _is("checkpoint.async", layout.async_checkpoint),
        _is("checkpoint.init_from", starts_from_weights(case)),
        _is("data.tokenizer given", cfg.data.tokenizer is not None),
        _is("data.document_mask", layout.document_mask),
        _is("data.mix", cfg.data.mix[0].rsplit(":", 1)[1] if cfg.data.mix else None),
        _is("model.n_kv_heads", model.kv_heads),
        _is("optim.name", cfg.optim.name),
        _is("train.fp8", cfg.train.fp8),
        _is("train.compile", str(cfg.train.compile).lower()),
        _is("model.loss_chunk_tokens", model.loss_chunk_tokens),
        _is("train.replay_every", cfg.train.replay_every),
        *(["fp8"] if cfg.train.fp8 != "off" else []),
        *(["world>1"] if case.world > 1 else []),
    }
    keys = ["vocab_size", "n_layers", "dropout", "norm", "norm_eps", "mlp", "position", "bias", "tie_embeddings"]
    keys += ["rope_scaling", "d_ff", "head_dim", "qk_norm"]
    keys += ["rope_theta", "max_seq_len"] if model.position == "rope" else []
    keys += ["qk_norm_scope"] if model.qk_norm else []
    facts |= {"head_dim set"} if model.head_dim is not None else set()
    facts.add(_is("export", export_class(drawn.cfg)))
    if model.rope_scaling is not None:
        keys += ["rope_factor", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_seq_len"]
    facts |= {_is(f"model.{key}", getattr(model, key)) for key in keys}
    moe = model.moe
    facts.add(_is("model.moe.experts", moe.experts))
    if moe.enabled:
        facts |= {"experts", _is("model.moe.router", moe.router), _is("model.moe.top_k", moe.top_k)}
        facts.add(_is("model.moe.capacity_factor", moe.capacity_factor))
        facts |= {"model.moe.bias_update_rate>0"} if moe.bias_update_rate > 0 else set()
        facts |= {"model.moe.every=2"} if moe.every == 2 else set()
        facts |= {_is(f"model.moe.{key}", getattr(moe, key)) for key in ("bias_update_rate", "shared_experts")}
        facts |= {_is(f"model.moe.{key}", getattr(moe, key)) for key in ("first_dense", "d_expert", "grouped_mm")}
        facts |= {"model.moe.shared_experts>0"} if moe.shared_experts > 0 else set()
        facts |= {_is("model.moe.norm_topk", moe.norm_topk)} if moe.router == "softmax" else set()
        facts |= {"model.moe.aux_loss_coef>0"} if moe.aux_loss_coef > 0 else set()
        facts |= {"model.moe.z_loss_coef>0"} if moe.z_loss_coef > 0 else set()
    if cfg.parallel.auto:
        return frozenset(facts)
    facts |= {_is(f"parallel.{key}", getattr(layout, key)) for key in ("tp", "pp", "vpp", "zero", "sequence_parallel")}
    facts |= {_is(f"train.{key}", getattr(layout, key)) for key in ("activation_checkpointing", "micro_batch_size")}
    if layout.activation_checkpointing != "none":
        facts.add(_is("train.recompute_every", layout.recompute_every))
    if layout.activation_checkpointing == "selective":
        facts.add(_is("train.recompute_modules", ",".join(layout.recompute_modules)))
    facts.add(_is("parallel.offload.optimizer", layout.offload))
    facts.add("parallel.dp given" if cfg.parallel.dp is not None else "parallel.dp from the world")
    facts.add("micro-batches>1" if layout.micro_batches > 1 else "micro-batches=1")
    facts |= {f"{axis}>1" for axis in ("dp", "tp", "pp", "cp") if getattr(layout, axis) > 1}
    facts.add(_is("parallel.cp", layout.cp))
    facts |= {_is("parallel.ep", layout.ep)} | ({"ep>1"} if layout.ep > 1 else set())
    if layout.cp > 1:
        facts.add(_is("parallel.cp_comm", layout.cp_comm))
    facts |= {"sharded"} if layout.zero >= 1 and layout.dp > 1 else set()
    if layout.schedule is not None:
        facts.add(_is("parallel.schedule", layout.schedule))
        facts |= {"micro-batches>pp"} if layout.micro_batches > layout.pp else set()
    if layout.zero == 3:  # the ZeRO-3 knobs mean nothing below it (the layout resets them)
        facts |= {
            _is("parallel.zero3_gather", layout.zero3_gather),
            _is("parallel.zero3_prefetch", layout.zero3_prefetch),
        }
    if layout.offload != "none":
        facts.add("parallel.offload.ratio=1" if layout.offload_ratio == 1 else "parallel.offload.ratio<1")
    return frozenset(facts)


def missing(drawn: Iterable[Drawn]) -> list[tuple[str, ...]]:
    """The requirements no case of ``drawn`` meets."""
    facts = [exercised(d) for d in drawn]
    return [r for r in REQUIRED if not any(set(r) <= f for f in facts)]


# --- what a case costs


def _run_seconds(layout: Layout, layers: int, batch: int, steps: int) -> float:
    """One run's seconds on an idle 2-core machine, roughly (fitted to the old CI sample's measured cases): a second
    a run, half a second a rank (8 ranks on 2 cores: each rank's Python and collectives wait their turn; the 8-rank
    cases of the sample measured two to five times their estimate without it), a writer interpreter per rank with
    ``checkpoint.async`` (each imports torch), and the arithmetic, which grows with the tokens times the layers
    (recomputation adds forwards)."""
    recomputed = {"none": 0.0, "selective": 0.2, "attention": 0.2, "full": 0.4}[layout.activation_checkpointing]
    recompute = 1.0 + recomputed / layout.recompute_every
    ranks = 0.5 * layout.world + 1.6 * layout.world * layout.async_checkpoint
    return 0.8 + ranks + 0.0032 * steps * batch * (layers * recompute + 2)


# A compiled run's C++ (tests/test_compile.py's tp=2 runs: about 10 s more than eager), plus a second a rank.
COMPILE_SECONDS = 10.0


def estimated_seconds(drawn: Drawn) -> float:
    """What running the case costs (the runner's order: the one-process reference, the run, the resume, and for a
    third of the cases a run from the checkpoint's weights with its own reference); a refusal costs nothing."""
    if drawn.layout is None:
        return 0.0
    assert drawn.resume is not None, "draw_facts(..., with_resume=True)"
    model = (drawn.cfg.model.n_layers, drawn.cfg.train.global_batch_size)
    reference = _run_seconds(Layout(), *model, STEPS)
    _, resumed = drawn.resume
    seconds = reference + _run_seconds(drawn.layout, *model, STEPS) + _run_seconds(resumed, *model, STEPS - SAVE_AT)
    if compiles(drawn.cfg.train.compile, torch.device("cpu")):  # the run's C++ compilation (its resume runs eager)
        seconds += COMPILE_SECONDS + drawn.case.world
    if starts_from_weights(drawn.case):
        seconds += reference + _run_seconds(resumed, *model, STEPS)
    return seconds + _exit_seconds(drawn.cfg)


def _exit_seconds(cfg: Config) -> float:
    """The exits' checks in the sweep's process (trident_dev/fuzz/exits.py), roughly: 0.7 to 2.6 s measured for tiny
    models, a sparse model's decode the dearest, and a loaded export about half a second (transformers' import, once
    a sweep, about 9 s, is left out)."""
    decode = 0.1 * cfg.model.n_layers * (3 if cfg.model.moe.enabled else 1)
    return 0.6 + decode + (0.5 if export_class(cfg) is not None else 0.0)


def greedy_cover(meets: dict[int, frozenset], cost: dict[int, float]) -> list[int]:
    """The keys of a cover of everything ``meets`` holds: greedy weighted set cover (the key meeting the most unmet
    requirements per unit of ``cost`` next), then each key the others make redundant dropped, the dearest first."""
    todo = set().union(*meets.values())
    chosen: list[int] = []
    while todo:
        best = max(meets, key=lambda i: (len(meets[i] & todo) / cost[i], -i))
        chosen.append(best)
        todo -= meets[best]
    for i in sorted(chosen, key=lambda i: -cost[i]):
        if meets[i] <= set().union(*(meets[j] for j in chosen if j != i)):
            chosen.remove(i)
    return sorted(chosen)


def cheapest_cover(drawn: Sequence[Drawn], tries: int = 200) -> list[Drawn]:
    """A sample of ``drawn`` that meets every requirement any of them meets, cheap by the estimate: the cheapest of
    ``tries`` greedy covers, all but the first on costs shaken by up to 30% (deterministic: a seeded stream)."""
    meets = {d.case.index: frozenset(r for r in REQUIRED if set(r) <= exercised(d)) for d in drawn}
    cost = {d.case.index: estimated_seconds(d) + 0.1 for d in drawn}  # + 0.1: a refusal costs a little too
    rng = random.Random(0)
    best = greedy_cover(meets, cost)
    for _ in range(tries - 1):
        shaken = {i: c * rng.uniform(0.7, 1.3) for i, c in cost.items()}
        sample = greedy_cover(meets, shaken)
        if sum(cost[i] for i in sample) < sum(cost[i] for i in best):
            best = sample
    by_index = {d.case.index: d for d in drawn}
    return [by_index[i] for i in best]
