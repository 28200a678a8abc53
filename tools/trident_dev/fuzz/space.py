"""The fuzzer's space: each case a world size and train.py's knobs, drawn from the whole layout space, valid or
not (each rule broken on purpose in a share of the cases), deterministic per (seed, case index).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trident.layout import PLANNED_KEYS
from trident.parallel.pipeline.schedules import SCHEDULES
from trident.parallel.zero.stage3 import GATHER_MODES

# 4 steps, saved at 2: the resumed run takes steps 3..4, after the 2 warm-up steps. (6 and 3 cost a fifth more
# CPU a case: 62 against 50 CPU-s for one 8-rank case.)
STEPS = 4
SAVE_AT = 2
MAX_WORLD = 8
LOW_PRECISION_REL = 2e-2  # bf16 / fp16 against the fp32 one-process losses

# The embedded test corpus: a few standard-library packages, tokenized to gpt-tiny's 512 pieces.
CORPUS_PACKAGES = ("json", "email", "logging")
CORPUS_VOCAB = 512
# What a resumed run keeps of the case (with the model.* knobs): the math of the run, not its layout.
KEPT_ON_RESUME = ("train.global_batch_size", "train.precision", "train.fp8", "data.document_mask", "data.mix")
KEPT_PREFIXES = ("model.", "optim.")  # the optimizer's keys with the model's: a resume keeps its math


def launch_limit_s(world: int) -> float:
    """How long a refused launch may take: what starting ``world`` Python processes that import torch costs on a
    busy 2-core machine (torchrun at 8 ranks: 13 s median, 29 s at worst in a 200-case sweep under load 20; torchrun
    at 2 ranks took over 25 s once in CI, beside the other test worker's ranks), with room to spare; a refusal that
    came after a collective would hang for parallel.timeout_s (600 s) instead."""
    return 30.0 + 5.0 * world


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
        fits = ["gpipe", "1f1b", "zb-h1"] if vpp == 1 else ["interleaved", "zb-v"] if vpp == 2 else ["interleaved"]
        knobs["parallel.schedule"] = rng.choice(list(SCHEDULES) if wrong() else fits)
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
    # Recomputation's attention-core policy, selective's module lists and every N-th block (issue 32), drawn last.
    if knobs["train.activation_checkpointing"] == "selective":
        kind = _weighted(rng, {"default": 0.4, "attention": 0.3, "modules": 0.3})
        if kind == "attention":
            knobs["train.activation_checkpointing"] = "attention"
        elif kind == "modules":
            knobs["train.recompute_modules"] = rng.choice(RECOMPUTE_MODULES)
    if knobs["train.activation_checkpointing"] != "none" and rng.random() < 0.3:
        knobs["train.recompute_every"] = 2
    return world, {**model, **knobs}


# Selective's module lists beside its default [norm,mlp_act]: the core and the whole MLP too, and each kept alone.
RECOMPUTE_MODULES = ["[norm,mlp_act,attn_core,mlp]", "[attn_core]", "[mlp]"]


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


CP_COMMS = ("ring", "allgather", "ulysses")


def _draw_context(rng: random.Random, mistake: float, world: int) -> tuple[int, dict[str, Any]]:
    """Context parallelism (issue 30) for about a quarter of the cases: cp ranks more for the same layout (within
    the machine's 8), each exchange. With probability ``mistake`` a cp of 3 (64 tokens do not split into 6 chunks)
    or a world left as drawn (a cp that does not fit it)."""
    if rng.random() >= 0.25:
        return world, {}
    cp = _weighted(rng, {2: 0.75, 4: 0.25}) if rng.random() >= mistake else 3
    knobs = {"parallel.cp": cp, "parallel.cp_comm": _weighted(rng, {"ring": 0.35, "allgather": 0.3, "ulysses": 0.35})}
    if rng.random() < mistake:
        return world, knobs
    return (world * cp, knobs) if world * cp <= MAX_WORLD else (world, {})


def _draw_experts(rng: random.Random, mistake: float) -> dict[str, Any]:
    """A mixture-of-experts MLP (issue 31) in about a fifth of the cases: each router, top-k, the balancing
    losses, the loss-free bias, a capacity, every or every second layer sparse. With probability ``mistake`` a
    top-k above the expert count."""
    if rng.random() >= 0.2:
        return {}
    experts = rng.choice([2, 4])
    return {
        "model.moe.experts": experts,
        "model.moe.top_k": rng.choice([1, 2]) if rng.random() >= mistake else experts + 1,
        "model.moe.d_expert": rng.choice([32, 64]),
        "model.moe.router": rng.choice(["softmax", "sigmoid"]),
        "model.moe.aux_loss_coef": rng.choice([0.0, 0.01]),
        "model.moe.z_loss_coef": rng.choice([0.0, 0.001]),
        "model.moe.bias_update_rate": rng.choice([0.0, 0.001]),
        "model.moe.capacity_factor": rng.choice(["null", 1.0]),
        "model.moe.every": rng.choice([1, 2]),
    }


# The model keys of trident/config/schema.py and where each is drawn. ModelConfig: n_layers, vocab_size, dropout
# (``_draw_knobs``); norm, norm_eps, mlp, position, rope_theta, rope_scaling and its four factors, n_kv_heads, bias,
# tie_embeddings (``_draw_block``); d_ff, head_dim, qk_norm, qk_norm_scope, max_seq_len (``_draw_model_keys``);
# moe (below). Not drawn: name (a label); d_model, n_heads and seq_len (gpt-tiny's 64, 4 and 64: the rules on them
# are met through tp 3, cp 3 and head_dim, and another width would only split the references); init_std (a scale
# of the same initialisation); vocab_multiple (the padding is met by the vocabulary 515 at every tp); bos_id and
# eos_ids (token ids an export's config.json carries, no part of the function). MoEConfig: experts, top_k,
# d_expert, router, aux_loss_coef, z_loss_coef, bias_update_rate, capacity_factor, every (``_draw_experts``);
# shared_experts, norm_topk, first_dense, grouped_mm and the rates and capacities beyond those
# (``_draw_model_keys``): every key.
SHARED_EXPERTS = {0: 0.6, 1: 0.25, 2: 0.15}
HEAD_DIMS = (32, 8)  # gpt-tiny's heads are 64 / 4 = 16 wide: wider and narrower (Qwen3's head_dim decoupled)
CAPACITIES = (0.5, 1.25)  # 0.5 drops about half the pairs; 1.25 a few when the routing is uneven


def _draw_model_keys(
    rng: random.Random, mistake: float, tp: int, block: dict[str, Any], experts: dict[str, Any]
) -> dict[str, Any]:
    """The model keys the block and the experts leave (issue 48): the FFN width, a head width other than d_model /
    n_heads, q/k norms per head or over the whole projection, a longer context with RoPE; and of the experts, shared
    experts, the top-k renormalisation, a first dense layer, the loop kernel, a capacity that drops and a faster
    balancing bias. Drawn among the values the case's tp and block allow, except with probability ``mistake``: an
    odd head width (refused with RoPE), a projection norm tp cannot split, an FFN or shared-expert width tp does not
    divide, ``norm_topk`` or the sigmoid router with one expert a token. From a stream of its own, so that every
    earlier knob stays.

    Where ``_draw_experts`` drew top_k=1 with the softmax router, ``norm_topk`` is false (but as a mistake): true
    would make every routing weight 1, which the validator refuses; with the sigmoid router (which always
    renormalises) top_k=1 becomes 2 likewise."""

    def wrong() -> bool:
        return rng.random() < mistake

    keys: dict[str, Any] = {}
    if rng.random() < 0.25:
        keys["model.d_ff"] = 90 if wrong() else 176  # 90: tp 4 does not divide it
    if rng.random() < 0.2:
        keys["model.head_dim"] = 7 if wrong() else rng.choice(HEAD_DIMS)  # 7: odd, refused with RoPE only
    rope = block.get("model.position") == "rope"
    if rope and rng.random() < 0.2:  # the context an export and generation read, beyond the training windows
        keys["model.max_seq_len"] = 128
    if rng.random() < 0.25:
        keys["model.qk_norm"] = True
        scope = rng.choice(["head", "projection"])
        kv_heads = int(block.get("model.n_kv_heads", 4))
        # The projection's norm spans every kv head: tp must divide them. Broken in half the cases that could break
        # it (not MISTAKE's tenth): few cases can, and a tenth of them met the refusal in none of 1000 cases.
        if scope == "projection" and kv_heads % tp != 0 and rng.random() >= 0.5:
            scope = "head"
        keys["model.qk_norm_scope"] = scope
    if not experts:
        return keys
    shared = _weighted(rng, SHARED_EXPERTS)
    if shared:
        keys["model.moe.shared_experts"] = shared
        if tp > 1 and wrong():  # one shared expert of a width tp does not divide
            keys["model.moe.shared_experts"] = 1
            keys["model.moe.d_expert"] = {2: 33, 3: 32, 4: 30}.get(tp, 33)
    top_k = experts["model.moe.top_k"]
    if experts["model.moe.router"] == "softmax":
        keys["model.moe.norm_topk"] = rng.choice([True, False]) if top_k != 1 else wrong()
    if rng.random() < 0.25:
        keys["model.moe.first_dense"] = 1
    if rng.random() < 0.35:
        keys["model.moe.capacity_factor"] = rng.choice(CAPACITIES)
    if rng.random() < 0.25:
        keys["model.moe.bias_update_rate"] = 0.01
    if rng.random() < 0.2:
        keys["model.moe.grouped_mm"] = False
    if rng.random() < 0.25:  # drawn freely, hardly a sparse case would have a Hugging Face class to export to
        keys |= _moe_family(rng.choice(MOE_FAMILIES), tp, block, experts)
    # The sigmoid router's one chosen score is renormalised to 1 (refused): drawn last, so no other key moves.
    if keys.get("model.moe.router", experts["model.moe.router"]) == "sigmoid" and top_k == 1 and not wrong():
        keys["model.moe.top_k"] = 2
    return keys


MOE_FAMILIES = ("mixtral", "qwen3_moe", "olmoe")


def _moe_family(family: str, tp: int, block: dict[str, Any], experts: dict[str, Any]) -> dict[str, Any]:
    """The keys that make a sparse case one of Hugging Face's MoE classes (trident/checkpoint/hf.py): Llama's
    block without biases, the softmax router, no shared experts, no first dense layer, dropless routing and no
    balancing bias (the classes have no place for either); Mixtral renormalises the top k (so k is 2) and has no q/k
    norm, Qwen3-MoE norms each head and may skip layers, OLMoE norms the whole projections (kv heads tp divides,
    heads d_model / n_heads wide)."""
    keys: dict[str, Any] = {"model.norm": "rmsnorm", "model.mlp": "swiglu", "model.position": "rope"}
    keys |= {"model.bias": False, "model.moe.router": "softmax", "model.moe.shared_experts": 0}
    keys |= {"model.moe.first_dense": 0, "model.moe.capacity_factor": "null", "model.moe.bias_update_rate": 0.0}
    if family == "mixtral":
        return keys | {"model.moe.every": 1, "model.moe.top_k": 2, "model.moe.norm_topk": True, "model.qk_norm": False}
    keys |= {"model.qk_norm": True, "model.moe.norm_topk": False}
    if family == "qwen3_moe":
        return keys | {"model.qk_norm_scope": "head"}
    kv_heads = int(block.get("model.n_kv_heads", 4))
    keys |= {"model.qk_norm_scope": "projection", "model.moe.every": 1, "model.head_dim": "null"}
    return keys | ({"model.n_kv_heads": 4} if kv_heads % tp else {})


def draw_case(seed: int, index: int) -> Case:
    """The case ``index`` of sweep ``seed``: the same on every machine and Python run (string seeds hash alike).
    The block, the data, context parallelism and the experts, and the model keys beyond them, come from streams of
    their own, so adding them changed no other knob (except what a new one rules out, below)."""
    world, knobs = _draw_knobs(random.Random(f"fuzz:{seed}:{index}"), MISTAKE)
    block = _draw_block(random.Random(f"fuzz-block:{seed}:{index}"), MISTAKE)
    extra_rng = random.Random(f"fuzz-cp-moe:{seed}:{index}")
    experts = _draw_experts(extra_rng, MISTAKE)
    world, context = _draw_context(extra_rng, MISTAKE, world)
    # Expert parallelism over the data-parallel (x cp) ranks (drawn last from this stream, so nothing above
    # changed): an ep dividing dp x cp and the experts for about half of the expert cases; as a mistake one that
    # does not, or an ep without experts.
    cp = int(context.get("parallel.cp", 1)) or 1
    dp = int(knobs.get("parallel.dp", 0)) * cp or world // (int(knobs["parallel.tp"]) * int(knobs["parallel.pp"]))
    if experts and extra_rng.random() < 0.5:
        fits = [ep for ep in (2, 4) if dp % ep == 0 and experts["model.moe.experts"] % ep == 0]
        if extra_rng.random() < MISTAKE:
            context["parallel.ep"] = extra_rng.choice([2, 3, 4])
        elif fits:
            context["parallel.ep"] = extra_rng.choice(fits)
    elif not experts and extra_rng.random() < MISTAKE / 4:
        context["parallel.ep"] = 2
    knobs = {**knobs, **context}
    keys = _draw_model_keys(
        random.Random(f"fuzz-keys:{seed}:{index}"), MISTAKE, int(knobs["parallel.tp"]), block, experts
    )
    block = {**block, **experts, **keys}
    data_rng = random.Random(f"fuzz-data:{seed}:{index}")
    data: dict[str, Any] = {"data.tokenizer": DATASET_TOKENIZER} if data_rng.random() < 0.2 else {}
    if data_rng.random() < 0.25:  # packed documents: it changes the math, so the reference and a resume keep it
        data["data.document_mask"] = True
    if data_rng.random() < 0.15:  # a two-source mixture instead of the one dataset (data.tokenizer is then unused)
        weight = data_rng.choice([0.5, 0.7, 0.9])
        data = {**data, "data.mix": f"[{MIX_FIRST}:{weight},{MIX_SECOND}:{round(1 - weight, 1)}]"}
        data.pop("data.tokenizer", None)
    # The replay check (trident/replay.py), from a stream of its own: with STEPS 4, step 3 is computed twice and
    # compared bitwise on every rank (any difference fails the run), and the curve must still be the reference's.
    replay_rng = random.Random(f"fuzz-replay:{seed}:{index}")
    if replay_rng.random() < 0.15:
        knobs["train.replay_every"] = 3
        # What a mismatch does (a healthy run has none either way), and the bound on skipped non-finite steps, which
        # a healthy run never meets.
        knobs["train.replay_action"] = replay_rng.choice(["stop", "warn"])
        knobs["train.max_skipped_steps"] = replay_rng.choice([STEPS + 1, 10])
    # FP8 matmuls (train.fp8, issue 51) in half of the bf16 cases, from a stream of their own: held, as bf16 is, to
    # the fp32 reference's losses within LOW_PRECISION_REL.
    fp8_rng = random.Random(f"fuzz-fp8:{seed}:{index}")
    if knobs.get("train.precision") == "bf16" and fp8_rng.random() < 0.5:
        knobs["train.fp8"] = fp8_rng.choice(["tensorwise", "rowwise", "rowwise_with_gw_hp"])
    # Compiled blocks (train.compile=true, issue 51) in a twentieth of the cases, from a stream of their own: the
    # eager reference's curve at the layouts' tolerance, and the compiled run's checkpoint resumed eagerly (the resume
    # layout does not keep the key). Where no C++ compiler is found the runner runs the case eager (runner.py).
    if random.Random(f"fuzz-compile:{seed}:{index}").random() < 0.05:
        knobs["train.compile"] = True
    knobs.update(_draw_optimizer(random.Random(f"fuzz-muon:{seed}:{index}"), knobs.get("train.precision", "fp32")))
    # The fused head and loss in chunks of tokens (model.loss_chunk_tokens, default 1024: one chunk here): unchunked
    # or a chunk of a few tokens, from a stream of its own.
    chunk_rng = random.Random(f"fuzz-loss-chunk:{seed}:{index}")
    if chunk_rng.random() < 0.3:
        knobs["model.loss_chunk_tokens"] = chunk_rng.choice([0, 7, 64])
    # parallel.auto: the planner chooses the layout for the world drawn, so the layout knobs drawn are left out,
    # but context parallelism: the planner keeps a given cp and cp_comm and chooses the rest around them.
    if random.Random(f"fuzz-auto:{seed}:{index}").random() < 0.1:
        kept = {k: v for k, v in knobs.items() if k not in PLANNED_KEYS or k.startswith("parallel.cp")}
        knobs = kept | {"parallel.auto": True}
    return Case(seed, index, world, _overrides({**block, **data, **knobs}))


def _draw_optimizer(rng: random.Random, precision: str) -> dict[str, Any]:
    """Muon (optim.name=muon, issue 52) in a fifth of the cases with its keys drawn, from a stream of its own; at fp32
    with fp32 Newton-Schulz, which holds the one-process curve to REL (bf16's moves with the sums' order: 5e-4 in
    the gradient norm, tests/test_muon_layouts.py), at 16 bits either."""
    if rng.random() >= 0.2:
        return {}
    return {
        "optim.name": "muon",
        "optim.muon_lr": rng.choice([0.01, 0.02]),
        "optim.muon_nesterov": rng.choice([True, False]),
        "optim.muon_ns_steps": rng.choice([3, 5]),
        "optim.muon_adjust_lr": rng.choice(["original", "match_rms_adamw"]),
        "optim.muon_ns_dtype": "fp32" if precision == "fp32" else rng.choice(["bf16", "fp32"]),
    }


def starts_from_weights(case: Case) -> bool:
    """Whether an accepted case also checks ``checkpoint.init_from`` (about a third of them: two more runs each)."""
    return random.Random(f"fuzz-init:{case.seed}:{case.index}").random() < 1 / 3


def draw_resume_layout(case: Case, accepts: Callable[[int, tuple[str, ...]], bool]) -> tuple[int, tuple[str, ...]]:
    """Another layout for resuming ``case``'s checkpoint: same model, batch and precision, drawn until ``accepts``
    (the validator) takes it. Deterministic per case, like the case itself."""
    rng = random.Random(f"fuzz-resume:{case.seed}:{case.index}")
    kept = {k: v for k, v in case.knobs.items() if k.startswith(KEPT_PREFIXES) or k in KEPT_ON_RESUME}
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
