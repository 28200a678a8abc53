"""The one mapping between our tensors and Hugging Face's, per architecture, that export and import both use; and
the translation of a Hugging Face ``config.json`` to ``model.*`` (the other way, ``hf_config``, and the tensors'
way out, ``to_hf``, are the export's, which only tools run: tools/trident_dev/export.py).

Six Hugging Face classes hold our blocks, each both ways: GPT2LMHeadModel, LlamaForCausalLM and Qwen3ForCausalLM
the dense ones, MixtralForCausalLM, Qwen3MoeForCausalLM and OlmoeForCausalLM the mixture-of-experts ones (softmax
routers, no shared experts, no dense first layers, no biases). docs/models.md ("Hugging Face in both directions")
tables which ``model.*`` values each class fixes, and derives the balancing coefficient's conversion both ways
(``aux_coef_from_hf`` / the export's ``aux_coef_to_hf``: ``aux_loss_coef = router_aux_loss_coef * top_k / L``, L
the sparse layers). ``head_dim`` in config.json is ``model.head_dim`` (left None when it is hidden_size /
num_attention_heads). The router z-loss has no place in these configs: an import leaves ``z_loss_coef`` 0, an
export drops it. Export refuses the router state these dropless families have no place for: a nonzero loss-free
balancing bias and a capacity (tools/trident_dev/export.py).

Any other mix has no class and is refused with a line naming the key.

Each of our logical tensors (one-process, unpadded, canonical name) is a ``Source``: Hugging Face tensors stacked
along our dim 0, each transposed first when it is GPT-2's ``Conv1D`` (``[in, out]``), then its rows reordered. The
names each family gives ours are tabled in docs/models.md ("The tensors' names").

Our rows are laid out so that a tp block of rows holds whole heads: qkv ``(h three dh)``, kv ``(g two dh)``; the
stacked Hugging Face rows are regrouped to that. RoPE is Hugging
Face Llama's rotate-half convention (models/rope.py), so q_proj and k_proj need no permutation.

``read_box`` reads any box of one of our tensors from the Hugging Face tensors, touching only the rows and
columns it covers: what lets each rank of a run read only its own shard.

The mapping is one table both ways (every architecture's names, shapes and coefficients), so it stays whole past
~400 lines: the import and the table the export reads are read side by side.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from einops import rearrange

from trident.config import ModelConfig, MoEConfig
from trident.errors import CheckpointError

GPT2, LLAMA, QWEN3 = "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM"
MIXTRAL, QWEN3_MOE, OLMOE = "MixtralForCausalLM", "Qwen3MoeForCausalLM", "OlmoeForCausalLM"
MOE_CLASSES = (MIXTRAL, QWEN3_MOE, OLMOE)
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
        return _gpt2_architecture(cfg)
    if not misses[LLAMA]:
        return _llama_architecture(cfg)
    cls = min(misses, key=lambda c: len(misses[c]))
    key = misses[cls][0][0]
    rest = ", ".join(f"model.{k}={v}" for k, v in have.items() if k != key)
    wants = "; ".join(f"{c} needs " + ", ".join(f"model.{k}={v}" for k, v in _BLOCKS[c]) for c in _BLOCKS)
    raise CheckpointError(f"model.{key}={have[key]} with {rest} has no Hugging Face class: {wants}")


def _gpt2_architecture(cfg: ModelConfig) -> str:
    """GPT-2's block: GPT2LMHeadModel, which has multi-head attention of d_model / n_heads wide heads and nothing
    else; experts or q/k norms are refused naming the block keys the classes that have them need."""
    if cfg.moe.enabled or cfg.qk_norm:
        what, classes = ("experts", MOE_CLASSES) if cfg.moe.enabled else ("q/k norms", (QWEN3, QWEN3_MOE, OLMOE))
        block = ", ".join(f"model.{k}={getattr(cfg, k)}" for k, _ in _BLOCKS[GPT2])
        raise CheckpointError(
            f"{block} with {what} has no Hugging Face class: {GPT2} has no {what}, and {', '.join(classes)} need "
            + ", ".join(f"model.{k}={v}" for k, v in _BLOCKS[LLAMA])
        )
    if cfg.kv_heads != cfg.n_heads:
        raise CheckpointError(
            f"model.n_kv_heads={cfg.n_kv_heads} has no Hugging Face class: {GPT2} needs model.n_kv_heads="
            f"model.n_heads ({cfg.n_heads}); grouped-query attention exports as {LLAMA} "
            "(model.norm=rmsnorm, model.mlp=swiglu, model.position=rope)"
        )
    if cfg.head_size * cfg.n_heads != cfg.d_model:
        raise CheckpointError(
            f"model.head_dim={cfg.head_dim} has no Hugging Face class: {GPT2}'s heads are d_model / n_heads = "
            f"{cfg.d_model // cfg.n_heads} wide; another width exports as {LLAMA} (model.norm=rmsnorm, "
            "model.mlp=swiglu, model.position=rope)"
        )
    return GPT2


def _llama_architecture(cfg: ModelConfig) -> str:
    """Llama's block, dense (Llama, Qwen3) or with experts (Mixtral, Qwen3-MoE, OLMoE), or a CheckpointError
    naming the key no class has."""
    moe = cfg.moe
    projection = cfg.qk_norm and cfg.qk_norm_scope == "projection"
    if not moe.enabled:
        if not cfg.qk_norm:
            return LLAMA
        if projection:
            raise CheckpointError(
                f"model.qk_norm_scope=projection without experts has no Hugging Face class: {QWEN3} needs "
                "model.qk_norm_scope=head (OLMoE's norm over the whole projection exports with experts only)"
            )
        rules = [("model.bias", cfg.bias, False)]
        cls = QWEN3
    else:
        cls = OLMOE if projection else QWEN3_MOE if cfg.qk_norm else MIXTRAL
        rules = [
            ("model.moe.router", moe.router, "softmax"),
            ("model.moe.shared_experts", moe.shared_experts, 0),
            ("model.moe.first_dense", moe.first_dense, 0),
            ("model.bias", cfg.bias, False),
        ]
        if cls != QWEN3_MOE:
            rules.append(("model.moe.every", moe.every, 1))
        if cls == MIXTRAL:
            rules.append(("model.moe.norm_topk", moe.norm_topk, True))
    for key, value, want in rules:
        if value != want:
            raise CheckpointError(f"{key}={value} has no Hugging Face class: {cls} needs {key}={want}")
    if cls == OLMOE and cfg.head_size * cfg.n_heads != cfg.d_model:  # its q_norm is hidden_size wide
        raise CheckpointError(
            f"model.head_dim={cfg.head_dim} has no Hugging Face class: {OLMOE}'s heads are d_model / n_heads = "
            f"{cfg.d_model // cfg.n_heads} wide"
        )
    return cls


def sparse_layers(cfg: ModelConfig) -> int:
    """How many of the model's layers are sparse: the L of the balancing coefficient's conversion."""
    return sum(cfg.moe.is_sparse(i) for i in range(cfg.n_layers))


def _rounded(x: float) -> float:
    """``x`` to 12 significant digits: a coefficient converted there and back is the number it was."""
    return float(f"{x:.12g}")


def aux_coef_from_hf(coef: float, top_k: int, sparse: int) -> float:
    """Our ``model.moe.aux_loss_coef`` for Hugging Face's ``router_aux_loss_coef`` of a model of ``sparse`` sparse
    layers routing each token to ``top_k`` experts."""
    return _rounded(coef * top_k / max(sparse, 1))


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
            "head_dim": None,
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
            "qk_norm_scope": "head",
            "moe": MoEConfig(),
            **_token_ids(config, where),
        }
    if kind in LLAMA_TYPES:
        return _llama_from_hf(config, kind, where)
    raise CheckpointError(
        f"{where}: model_type={kind!r} is not supported; trident imports gpt2, {', '.join(LLAMA_TYPES)}"
    )


LLAMA_TYPES = ("llama", "qwen3", "mixtral", "qwen3_moe", "olmoe")  # Llama's block, with what each adds


def _llama_from_hf(config: dict, kind: str, where: str) -> dict:
    """The ``model.*`` of a Llama-family ``config.json`` (``model_type`` ``kind``, one of ``LLAMA_TYPES``)."""
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise CheckpointError(f"{where}: hidden_act={act!r} is not supported; Llama import needs silu")
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or rope
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(
            f"{where}: rope_scaling={scaling} is not supported; trident imports rope_type default and llama3"
        )
    if kind != "llama" and config.get("attention_bias", False):
        raise CheckpointError(
            f"{where}: attention_bias=true is not supported for {kind}: its MLPs have no biases, and model.bias "
            "sets both"
        )
    if config.get("attention_bias", False) != config.get("mlp_bias", False):
        raise CheckpointError(
            f"{where}: attention_bias={config.get('attention_bias')} with mlp_bias={config.get('mlp_bias')} is "
            "not supported; model.bias sets both"
        )
    # Sliding-window attention: Mixtral's is on whenever sliding_window is set, Qwen3's under use_sliding_window.
    if config.get("use_sliding_window", False):
        raise CheckpointError(
            f"{where}: use_sliding_window=true is not supported; trident's attention sees the whole causal context"
        )
    if kind in ("mixtral", "olmoe") and config.get("sliding_window") is not None:
        raise CheckpointError(f"{where}: sliding_window={config['sliding_window']} is not supported")
    if kind == "olmoe" and config.get("clip_qkv") is not None:
        raise CheckpointError(f"{where}: clip_qkv={config['clip_qkv']} is not supported; OLMoE import needs null")
    d, heads = _get(config, "hidden_size", int, where), _get(config, "num_attention_heads", int, where)
    # Qwen3Config's head_dim defaults to 128; every other class's to hidden_size / num_attention_heads.
    head_dim = _get(config, "head_dim", (int, type(None)), where, 128 if kind == "qwen3" else None)
    if head_dim is not None and head_dim * heads == d:
        head_dim = None
    if kind == "olmoe" and head_dim is not None:  # OlmoeAttention's q_norm is hidden_size wide
        raise CheckpointError(
            f"{where}: head_dim={head_dim} is not supported for olmoe; its heads are hidden_size / "
            f"num_attention_heads = {d // heads} wide"
        )
    kv = config.get("num_key_value_heads")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    positions = _get(config, "max_position_embeddings", int, where)
    n_layers = _get(config, "num_hidden_layers", int, where)
    return {
        "n_layers": n_layers,
        "d_model": d,
        "n_heads": heads,
        "n_kv_heads": None if kv is None or kv == heads else _get(config, "num_key_value_heads", int, where),
        "head_dim": head_dim,
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
        "qk_norm": kind in ("qwen3", "qwen3_moe", "olmoe"),
        "qk_norm_scope": "projection" if kind == "olmoe" else "head",
        **_rope_scaling_keys(scaling if rope_type == "llama3" else None, where),
        **_token_ids(config, where),
        "moe": _moe_from_hf(config, kind, n_layers, where),
    }


def _moe_from_hf(config: dict, kind: str, n_layers: int, where: str) -> MoEConfig:
    """``model.moe`` of a Mixtral, Qwen3-MoE or OLMoE ``config.json`` (a dense one's: none), the balancing
    coefficient converted to ours (the module docstring)."""
    if kind in ("llama", "qwen3"):
        return MoEConfig()
    top_k = _get(config, "num_experts_per_tok", int, where)
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts, and OLMoE's as num_experts
    experts = _get(config, "num_experts" if "num_experts" in config else "num_local_experts", int, where)
    if kind == "mixtral":
        every, d_expert, norm_topk = 1, _get(config, "intermediate_size", int, where), True
    elif kind == "olmoe":
        every, d_expert = 1, _get(config, "intermediate_size", int, where)
        norm_topk = bool(config.get("norm_topk_prob", False))
    else:
        if config.get("mlp_only_layers"):
            raise CheckpointError(f"{where}: mlp_only_layers={config['mlp_only_layers']} is not supported")
        every = _get(config, "decoder_sparse_step", int, where, 1)
        d_expert = _get(config, "moe_intermediate_size", int, where)
        norm_topk = bool(config.get("norm_topk_prob", False))
    moe = MoEConfig(experts=experts, top_k=top_k, d_expert=d_expert, every=every, norm_topk=norm_topk)
    coef = float(_get(config, "router_aux_loss_coef", (int, float), where, 0.0))
    sparse = sum(moe.is_sparse(i) for i in range(n_layers))
    return dataclasses.replace(moe, aux_loss_coef=aux_coef_from_hf(coef, top_k, sparse))


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
            parts = [attn + "q_proj", attn + "k_proj", attn + "v_proj"]
            add(ours + "attn.qkv", parts, [heads * dh] * 3, rows=qkv)
        else:
            add(ours + "attn.q", [attn + "q_proj"], [heads * dh])
            kv_rows = _rows("two g dh", "g two dh", two=2, g=kv, dh=dh)
            add(ours + "attn.kv", [attn + "k_proj", attn + "v_proj"], [kv * dh, kv * dh], rows=kv_rows)
        add(ours + "attn.proj", [attn + "o_proj"], [d])
        if cfg.qk_norm:  # per head: one gain of dh; over the projection (OLMoE): one per unit of q and of k
            widths = (heads * dh, kv * dh) if cfg.qk_norm_scope == "projection" else (dh, dh)
            for norm, width in zip(("q_norm", "k_norm"), widths, strict=True):
                out[f"{ours}attn.{norm}.weight"] = Source((f"{attn}{norm}.weight",), (width,))
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
