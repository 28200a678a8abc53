"""The one mapping between our tensors and Hugging Face's, per architecture, that export and import both use; and
the translation of ``model.*`` to and from a Hugging Face ``config.json``.

Two Hugging Face classes hold our blocks:

    GPT2LMHeadModel   model.norm=layernorm, model.mlp=gelu, model.position=learned, multi-head attention
    LlamaForCausalLM  model.norm=rmsnorm, model.mlp=swiglu, model.position=rope, any n_kv_heads
                      (attention_bias = mlp_bias = model.bias)

and two the mixture-of-experts blocks (``model.moe``, models/moe.py) with Llama's:

    MixtralForCausalLM   every layer sparse, softmax router with the top-k weights renormalised, no shared experts
    Qwen3MoeForCausalLM  model.qk_norm=true, layers sparse every model.moe.every-th (decoder_sparse_step), softmax
                         router, renormalised or not (norm_topk_prob), no shared experts

Any other mix has no class and is refused with a line naming the key.

Each of our logical tensors (one-process, unpadded, canonical name) is a ``Source``: Hugging Face tensors stacked
along our dim 0, each transposed first when it is GPT-2's ``Conv1D`` (``[in, out]``), then its rows reordered:

    ours                     GPT-2 (transformer.*)                Llama (model.*)
    wte.weight               wte.weight                           embed_tokens.weight
    wpe.weight               wpe.weight                           -
    layers.i.ln_1.*          h.i.ln_1.*                           layers.i.input_layernorm.weight
    layers.i.ln_2.*          h.i.ln_2.*                           layers.i.post_attention_layernorm.weight
    layers.i.attn.qkv.*      h.i.attn.c_attn.* (T), (three h dh)  [q_proj; k_proj; v_proj], (three h dh)
    layers.i.attn.q.*        -                                    q_proj
    layers.i.attn.kv.*       -                                    [k_proj; v_proj], (two g dh)
    layers.i.attn.proj.*     h.i.attn.c_proj.* (T)                o_proj
    layers.i.mlp.fc.*        h.i.mlp.c_fc.* (T)                   -
    layers.i.mlp.gate.*      -                                    gate_proj
    layers.i.mlp.up.*        -                                    up_proj
    layers.i.mlp.proj.*      h.i.mlp.c_proj.* (T)                 down_proj
    ln_f.*                   ln_f.*                               norm.weight
    lm_head.weight (untied)  lm_head.weight                       lm_head.weight

(T): transposed, GPT-2's Conv1D. Llama's projections are under layers.i.self_attn. and layers.i.mlp.

A sparse layer's MLP (Mixtral: layers.i.block_sparse_moe.; Qwen3-MoE: layers.i.mlp.), expert e's tensors stacked
row-wise (Hugging Face's save_pretrained writes each expert's own, in either family):

    ours                     Mixtral                              Qwen3-MoE
    layers.i.mlp.router.weight   gate.weight                      gate.weight
    layers.i.mlp.experts.gate    [experts.e.w1.weight]            [experts.e.gate_proj.weight]
    layers.i.mlp.experts.up      [experts.e.w3.weight]            [experts.e.up_proj.weight]
    layers.i.mlp.experts.down    [experts.e.w2.weight (T)]        [experts.e.down_proj.weight (T)]
    layers.i.attn.q_norm.weight  -                                self_attn.q_norm.weight (and k_norm)

Our rows are laid out so that a tp block of rows holds whole heads: qkv ``(h three dh)``, kv ``(g two dh)``; the
stacked Hugging Face rows are regrouped to that. RoPE is Hugging
Face Llama's rotate-half convention (models/rope.py), so q_proj and k_proj need no permutation.

``read_box`` reads any box of one of our tensors from the Hugging Face tensors, touching only the rows and
columns it covers: what lets each rank of a run read only its own shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from einops import rearrange

from trident.config import ModelConfig, MoEConfig
from trident.errors import CheckpointError

GPT2, LLAMA = "GPT2LMHeadModel", "LlamaForCausalLM"
MIXTRAL, QWEN3_MOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM"

# What each class fixes, as (key, value) pairs of model.*; GPT-2's multi-head attention is checked apart.
_BLOCKS = {
    GPT2: (("norm", "layernorm"), ("mlp", "gelu"), ("position", "learned")),
    LLAMA: (("norm", "rmsnorm"), ("mlp", "swiglu"), ("position", "rope")),
}


@dataclass(frozen=True)
class Source:
    """Where one of our logical tensors lies: the Hugging Face tensors ``parts`` (``sizes[k]`` of our dim-0 rows
    each) stacked along our dim 0, each transposed first when ``transpose`` (2-D only); our row i is stacked row
    ``rows[i]`` (None: in order)."""

    parts: tuple[str, ...]
    sizes: tuple[int, ...]
    transpose: bool = False
    rows: torch.Tensor | None = None


def architecture(cfg: ModelConfig) -> str:
    """The Hugging Face class that holds a model of this block, or a CheckpointError naming the key that rules
    each class out."""
    have = {key: getattr(cfg, key) for key, _ in _BLOCKS[GPT2]}
    misses = {cls: [(k, v) for k, v in block if have[k] != v] for cls, block in _BLOCKS.items()}
    if not misses[GPT2]:
        if cfg.kv_heads != cfg.n_heads:
            raise CheckpointError(
                f"model.n_kv_heads={cfg.n_kv_heads} has no Hugging Face class: {GPT2} needs model.n_kv_heads="
                f"model.n_heads ({cfg.n_heads}); grouped-query attention exports as {LLAMA} "
                "(model.norm=rmsnorm, model.mlp=swiglu, model.position=rope)"
            )
        return GPT2
    if not misses[LLAMA]:
        return _moe_architecture(cfg)
    cls = min(misses, key=lambda c: len(misses[c]))
    key = misses[cls][0][0]
    rest = ", ".join(f"model.{k}={v}" for k, v in have.items() if k != key)
    wants = "; ".join(f"{c} needs " + ", ".join(f"model.{k}={v}" for k, v in _BLOCKS[c]) for c in _BLOCKS)
    raise CheckpointError(f"model.{key}={have[key]} with {rest} has no Hugging Face class: {wants}")


def _moe_architecture(cfg: ModelConfig) -> str:
    """Llama's block, dense (LlamaForCausalLM) or with experts (Mixtral, Qwen3-MoE), or a CheckpointError naming
    the key no class has."""
    moe = cfg.moe
    if not moe.enabled:
        if cfg.qk_norm:
            raise CheckpointError(f"model.qk_norm=true without experts has no Hugging Face class; {LLAMA} has none")
        return LLAMA
    cls = QWEN3_MOE if cfg.qk_norm else MIXTRAL
    rules = [
        ("model.moe.router", moe.router, "softmax"),
        ("model.moe.shared_experts", moe.shared_experts, 0),
        ("model.moe.first_dense", moe.first_dense, 0),
        ("model.bias", cfg.bias, False),
    ]
    if cls == MIXTRAL:
        rules += [("model.moe.every", moe.every, 1), ("model.moe.norm_topk", moe.norm_topk, True)]
    for key, value, want in rules:
        if value != want:
            raise CheckpointError(f"{key}={value} has no Hugging Face class: {cls} needs {key}={want}")
    return cls


# --- config.json -------------------------------------------------------------------------------------------


def hf_config(cfg: ModelConfig, bos_id: int | None = None, eos_ids: list[int] | None = None) -> dict:
    """The ``config.json`` of the class ``architecture(cfg)`` for a model of shape ``cfg``, with these token ids
    (one eos id is written as a number, several as a list, as Hugging Face writes them)."""
    eos: int | list[int] | None = list(eos_ids) if eos_ids else None
    if eos is not None and len(eos) == 1:
        eos = eos[0]
    ids = {"bos_token_id": bos_id, "eos_token_id": eos, "tie_word_embeddings": cfg.tie_embeddings}
    if architecture(cfg) == GPT2:
        return {
            "architectures": [GPT2],
            "model_type": "gpt2",
            "vocab_size": cfg.vocab_size,
            "n_positions": cfg.seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.ffn_dim,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": cfg.norm_eps,
            "initializer_range": cfg.init_std,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": cfg.dropout,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "use_cache": True,
            "torch_dtype": "float32",
            **ids,
        }
    cls = architecture(cfg)
    moe = cfg.moe
    extra: dict = {}
    if cls == MIXTRAL:
        extra = {"num_local_experts": moe.experts, "sliding_window": None, "router_jitter_noise": 0.0}
    elif cls == QWEN3_MOE:
        extra = {
            "num_experts": moe.experts,
            "moe_intermediate_size": cfg.expert_dim,
            "decoder_sparse_step": moe.every,
            "mlp_only_layers": [],
            "norm_topk_prob": moe.norm_topk,
            "use_sliding_window": False,
            "sliding_window": None,
        }
    if cls != LLAMA:
        extra.update(num_experts_per_tok=moe.top_k, router_aux_loss_coef=moe.aux_loss_coef, output_router_logits=False)
    return {
        "architectures": [cls],
        "model_type": {LLAMA: "llama", MIXTRAL: "mixtral", QWEN3_MOE: "qwen3_moe"}[cls],
        **extra,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_len,  # not the window it was trained on last
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.expert_dim if cls == MIXTRAL else cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "attention_bias": cfg.bias,
        "mlp_bias": cfg.bias,
        "attention_dropout": 0.0,
        "initializer_range": cfg.init_std,
        "use_cache": True,
        "torch_dtype": "float32",
        **ids,
    }


def _rope_scaling(cfg: ModelConfig) -> dict | None:
    """Hugging Face's ``rope_scaling`` for ``model.rope_scaling=llama3`` (Llama 3.1 / 3.2), else None."""
    if cfg.rope_scaling is None:
        return None
    return {
        "rope_type": cfg.rope_scaling,
        "factor": cfg.rope_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_seq_len,
    }


def _rope_scaling_keys(scaling: dict | None, where: str) -> dict:
    """Our ``model.rope_*`` scaling keys from Hugging Face's llama3 ``rope_scaling`` (None: plain RoPE)."""
    if scaling is None:
        return {"rope_scaling": None}
    try:
        return {
            "rope_scaling": "llama3",
            "rope_factor": float(scaling["factor"]),
            "rope_low_freq_factor": float(scaling["low_freq_factor"]),
            "rope_high_freq_factor": float(scaling["high_freq_factor"]),
            "rope_original_seq_len": int(scaling["original_max_position_embeddings"]),
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: rope_scaling={scaling} lacks a valid {e}") from None


def _get(config: dict, key: str, kind: type | tuple[type, ...], where: str, default: object = None) -> object:
    value = config.get(key, default)
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise CheckpointError(f"{where}: {key}={value!r} is not a valid value")
    return value


def _token_ids(config: dict, where: str) -> dict:
    """``model.bos_id`` and ``model.eos_ids`` from ``bos_token_id`` and ``eos_token_id`` (a number or a list)."""
    bos, eos = config.get("bos_token_id"), config.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) and not isinstance(eos, bool) else eos
    if bos is not None:
        _get(config, "bos_token_id", int, where)
    if eos is not None and not (isinstance(eos, list) and all(type(i) is int for i in eos)):
        raise CheckpointError(f"{where}: eos_token_id={config['eos_token_id']!r} is not a valid value")
    return {"bos_id": bos, "eos_ids": eos or None}


def model_from_hf(config: dict, where: str) -> dict:
    """The ``model.*`` values a Hugging Face ``config.json`` fixes, and those it carries (its context, its token
    ids); refuses, in one line naming the key, what our blocks cannot compute the same way."""
    kind = config.get("model_type")
    if kind == "gpt2":
        act = config.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            raise CheckpointError(f"{where}: activation_function={act!r} is not supported; GPT-2 import needs gelu_new")
        for key, ok in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            if config.get(key, ok) != ok:
                raise CheckpointError(f"{where}: {key}={config[key]!r} is not supported; GPT-2 import needs {ok}")
        d = _get(config, "n_embd", int, where)
        inner = config.get("n_inner")
        return {
            "n_layers": _get(config, "n_layer", int, where),
            "d_model": d,
            "n_heads": _get(config, "n_head", int, where),
            "n_kv_heads": None,
            "seq_len": _get(config, "n_positions", int, where),
            "vocab_size": _get(config, "vocab_size", int, where),
            "d_ff": 4 * d if inner is None else _get(config, "n_inner", int, where),
            "bias": True,
            "norm": "layernorm",
            "norm_eps": float(_get(config, "layer_norm_epsilon", (int, float), where, 1e-5)),
            "mlp": "gelu",
            "position": "learned",
            "tie_embeddings": bool(config.get("tie_word_embeddings", True)),
            "qk_norm": False,
            "moe": MoEConfig(),
            **_token_ids(config, where),
        }
    if kind in ("llama", "mixtral", "qwen3_moe"):
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise CheckpointError(f"{where}: hidden_act={act!r} is not supported; Llama import needs silu")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or rope
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise CheckpointError(
                f"{where}: rope_scaling={scaling} is not supported; trident imports rope_type default and llama3"
            )
        if config["model_type"] != "llama" and config.get("attention_bias", False):
            raise CheckpointError(f"{where}: attention_bias=true is not supported for {config['model_type']}")
        if config.get("attention_bias", False) != config.get("mlp_bias", False):
            raise CheckpointError(
                f"{where}: attention_bias={config.get('attention_bias')} with mlp_bias={config.get('mlp_bias')} is "
                "not supported; model.bias sets both"
            )
        d, heads = _get(config, "hidden_size", int, where), _get(config, "num_attention_heads", int, where)
        head_dim = config.get("head_dim")
        if head_dim is not None and head_dim * heads != d:
            raise CheckpointError(
                f"{where}: head_dim={head_dim} is not hidden_size / num_attention_heads = {d // heads}; not supported"
            )
        kv = config.get("num_key_value_heads")
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        positions = _get(config, "max_position_embeddings", int, where)
        return {
            "n_layers": _get(config, "num_hidden_layers", int, where),
            "d_model": d,
            "n_heads": heads,
            "n_kv_heads": None if kv is None or kv == heads else _get(config, "num_key_value_heads", int, where),
            "seq_len": positions,
            "max_seq_len": positions,
            "vocab_size": _get(config, "vocab_size", int, where),
            "d_ff": _get(config, "intermediate_size", int, where),
            "bias": bool(config.get("attention_bias", False)),
            "norm": "rmsnorm",
            "norm_eps": float(_get(config, "rms_norm_eps", (int, float), where, 1e-6)),
            "mlp": "swiglu",
            "position": "rope",
            "rope_theta": float(theta),
            "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
            **_rope_scaling_keys(scaling if kind == "llama3" else None, where),
            **_token_ids(config, where),
            **_moe_from_hf(config, where),
        }
    raise CheckpointError(
        f"{where}: model_type={kind!r} is not supported; trident imports gpt2, llama, mixtral and qwen3_moe"
    )


def _moe_from_hf(config: dict, where: str) -> dict:
    """``model.qk_norm`` and ``model.moe`` of a Mixtral or Qwen3-MoE ``config.json`` (a Llama's: none)."""
    kind = config["model_type"]
    if kind == "llama":
        return {"qk_norm": False, "moe": MoEConfig()}
    if config.get("sliding_window") is not None and config.get("use_sliding_window", kind == "mixtral"):
        raise CheckpointError(f"{where}: sliding_window={config['sliding_window']} is not supported")
    common = {
        "top_k": _get(config, "num_experts_per_tok", int, where),
        "aux_loss_coef": float(_get(config, "router_aux_loss_coef", (int, float), where, 0.0)),
    }
    if kind == "mixtral":
        experts = _get(config, "num_local_experts", int, where)
        d_expert = _get(config, "intermediate_size", int, where)
        return {"qk_norm": False, "moe": MoEConfig(experts=experts, d_expert=d_expert, norm_topk=True, **common)}
    if config.get("mlp_only_layers"):
        raise CheckpointError(f"{where}: mlp_only_layers={config['mlp_only_layers']} is not supported")
    moe = MoEConfig(
        # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts
        experts=_get(config, "num_experts" if "num_experts" in config else "num_local_experts", int, where),
        d_expert=_get(config, "moe_intermediate_size", int, where),
        every=_get(config, "decoder_sparse_step", int, where, 1),
        norm_topk=bool(config.get("norm_topk_prob", False)),
        **common,
    )
    return {"qk_norm": True, "moe": moe}


# --- tensors -------------------------------------------------------------------------------------------------


def _rows(stacked: str, ours: str, **sizes: int) -> torch.Tensor:
    """For each of our rows (laid out ``ours``), its index among the stacked rows (laid out ``stacked``)."""
    n = 1
    for size in sizes.values():
        n *= size
    return rearrange(torch.arange(n), f"({stacked}) -> ({ours})", **sizes)


def sources(cfg: ModelConfig) -> dict[str, Source]:
    """Our canonical name -> its Source, for every tensor a model of ``cfg`` has; GPT-2 also lists the biases a
    model without them lacks (exported as zeros)."""
    d, f, heads, kv, dh = cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.kv_heads, cfg.head_size
    out: dict[str, Source] = {}
    gpt2 = architecture(cfg) == GPT2
    top, layer = ("transformer.", "transformer.h.") if gpt2 else ("model.", "model.layers.")

    def add(ours: str, parts: list[str], sizes: list[int], conv1d: bool = False, rows: torch.Tensor | None = None):
        kinds = ("weight", "bias") if gpt2 or cfg.bias else ("weight",)
        for kind in kinds:
            out[f"{ours}.{kind}"] = Source(tuple(f"{p}.{kind}" for p in parts), tuple(sizes), conv1d, rows)

    out["wte.weight"] = Source((top + ("wte.weight" if gpt2 else "embed_tokens.weight"),), (cfg.vocab_size,))
    if gpt2:
        out["wpe.weight"] = Source((top + "wpe.weight",), (cfg.seq_len,))
    qkv = _rows("three h dh", "h three dh", three=3, h=heads, dh=dh)
    for i in range(cfg.n_layers):
        ours, theirs = f"layers.{i}.", f"{layer}{i}."
        if gpt2:
            for norm in ("ln_1", "ln_2"):
                add(ours + norm, [theirs + norm], [d])
            add(ours + "attn.qkv", [theirs + "attn.c_attn"], [3 * d], True, qkv)
            add(ours + "attn.proj", [theirs + "attn.c_proj"], [d], True)
            add(ours + "mlp.fc", [theirs + "mlp.c_fc"], [f], True)
            add(ours + "mlp.proj", [theirs + "mlp.c_proj"], [d], True)
            continue
        out[ours + "ln_1.weight"] = Source((theirs + "input_layernorm.weight",), (d,))
        out[ours + "ln_2.weight"] = Source((theirs + "post_attention_layernorm.weight",), (d,))
        attn = theirs + "self_attn."
        if kv == heads:
            add(ours + "attn.qkv", [attn + "q_proj", attn + "k_proj", attn + "v_proj"], [d, d, d], rows=qkv)
        else:
            add(ours + "attn.q", [attn + "q_proj"], [heads * dh])
            kv_rows = _rows("two g dh", "g two dh", two=2, g=kv, dh=dh)
            add(ours + "attn.kv", [attn + "k_proj", attn + "v_proj"], [kv * dh, kv * dh], rows=kv_rows)
        add(ours + "attn.proj", [attn + "o_proj"], [d])
        if cfg.qk_norm:
            for norm in ("q_norm", "k_norm"):
                out[f"{ours}attn.{norm}.weight"] = Source((f"{attn}{norm}.weight",), (dh,))
        if cfg.moe.is_sparse(i):
            out.update(_expert_sources(cfg, ours + "mlp.", theirs))
            continue
        mlp = theirs + "mlp."
        add(ours + "mlp.gate", [mlp + "gate_proj"], [f])
        add(ours + "mlp.up", [mlp + "up_proj"], [f])
        add(ours + "mlp.proj", [mlp + "down_proj"], [d])
    if gpt2:
        add("ln_f", [top + "ln_f"], [d])
    else:
        out["ln_f.weight"] = Source((top + "norm.weight",), (d,))
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = Source(("lm_head.weight",), (cfg.vocab_size,))
    return out


def _expert_sources(cfg: ModelConfig, ours: str, theirs: str) -> dict[str, Source]:
    """A sparse layer's router and experts (the module docstring's table), ``ours`` its ``layers.i.mlp.``."""
    e, f = cfg.moe.experts, cfg.expert_dim
    mixtral = architecture(cfg) == MIXTRAL
    block = theirs + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    out = {ours + "router.weight": Source((block + "gate.weight",), (e,))}
    for mine, name in zip(("gate", "up", "down"), names, strict=True):
        parts = tuple(f"{block}experts.{k}.{name}.weight" for k in range(e))
        out[f"{ours}experts.{mine}"] = Source(parts, (f,) * e, transpose=mine == "down")
    return out


def part_shape(source: Source, k: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The Hugging Face shape of part ``k`` of a tensor of our logical ``shape``."""
    rows = source.sizes[k]
    if len(shape) == 1:
        return (rows,)
    return (shape[1], rows) if source.transpose else (rows, shape[1])


def to_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's tensors (fp32, contiguous) from our logical ones; refuses a tensor set not this model's."""
    table = sources(cfg)
    unknown = sorted(set(tensors) - set(table))
    if unknown:
        raise CheckpointError(
            f"the checkpoint holds {unknown[0]}, which {architecture(cfg)} has no place for; it is not this model's"
        )
    out = {}
    for ours, source in table.items():
        if ours in tensors:
            t = tensors[ours].float()
        elif ours.endswith(".bias") and not cfg.bias:  # GPT-2 always has biases: zero ones are the same function
            t = torch.zeros(sum(source.sizes))
        else:
            raise CheckpointError(f"the checkpoint holds no tensor {ours}; it is not this model's")
        if source.rows is not None:
            stacked = torch.empty_like(t)
            stacked[source.rows] = t
            t = stacked
        for name, part in zip(source.parts, t.split(list(source.sizes)), strict=True):
            out[name] = (part.t() if source.transpose and part.dim() == 2 else part).contiguous()
    return out


Slicer = Callable[[str], object]  # a Hugging Face name -> something indexable with slices (a safetensors slice)


def check_parts(source: Source, slicer: Slicer, shape: tuple[int, ...], where: str) -> None:
    """Each Hugging Face part has the shape a tensor of our logical ``shape`` needs (the config's)."""
    for k, name in enumerate(source.parts):
        got, want = tuple(slicer(name).shape), part_shape(source, k, shape)
        if got != want:
            raise CheckpointError(f"{where}: {name} has shape {list(got)}, its config.json gives {list(want)}")


def read_box(source: Source, slicer: Slicer, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The box ``[offsets, offsets + sizes)`` of one of our logical tensors, read from the Hugging Face tensors
    through ``slicer``: only the rows (and columns) the box covers."""
    start, n = offsets[0], sizes[0]
    wanted = source.rows[start : start + n].tolist() if source.rows is not None else range(start, start + n)
    cols = slice(offsets[1], offsets[1] + sizes[1]) if len(sizes) == 2 else None
    bounds = [0]
    for size in source.sizes:
        bounds.append(bounds[-1] + size)
    pieces: list[torch.Tensor] = []
    i = 0
    while i < len(wanted):
        part = next(k for k in range(len(source.sizes)) if wanted[i] < bounds[k + 1])
        first = j = wanted[i]
        while i + 1 < len(wanted) and wanted[i + 1] == j + 1 and j + 1 < bounds[part + 1]:
            i, j = i + 1, j + 1
        i += 1
        rows = slice(first - bounds[part], j + 1 - bounds[part])
        view = slicer(source.parts[part])
        if cols is None:
            pieces.append(view[rows])
        elif source.transpose:
            pieces.append(view[cols, rows].t())
        else:
            pieces.append(view[rows, cols])
    if not pieces:
        return torch.empty(sizes)
    return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
