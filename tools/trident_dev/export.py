"""Export a model to Hugging Face: a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads with
our logits as the class ``trident.checkpoint.hf.architecture`` names (GPT2LMHeadModel, LlamaForCausalLM,
Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM), with the model's tokenizer file
beside it under its own name (``tokenizer.model`` or ``tokenizer.json``).

The input is the logical (one-process, unpadded) tensors under their canonical names, as
``trident_dev.consolidated`` reads them from a checkpoint of any layout. Which class, the names and the
row layouts are ``trident.checkpoint.hf``'s table, the one import reads through too. Notes:

- GPT-2: ``activation_function = gelu_new`` (the tanh GELU our MLP computes); ``model.bias=false`` exports zero
  biases (HF's GPT-2 always has them; a zero bias is the same function); the three dropouts are
  ``model.dropout``. Attention is scaled by 1/sqrt(dh), as ``scaled_dot_product_attention`` does.
- Llama: ``attention_bias = mlp_bias = model.bias``, ``rope_theta = model.rope_theta``, ``rope_scaling`` from
  ``model.rope_scaling`` (llama3) or none, ``max_position_embeddings = model.max_seq_len`` (the context the model
  was made for, kept from the model a run started from; ``model.seq_len`` when unset).
- ``bos_token_id`` / ``eos_token_id``: ``model.bos_id`` / ``model.eos_ids`` (an imported model's own, carried
  through training), else the tokenizer's.
- ``vocab_size`` is the real vocabulary: the padding rows of the embedding never reach a checkpoint.
- ``tie_word_embeddings = model.tie_embeddings``: a tied model writes no ``lm_head.weight``.
- Mixture of experts: ``router_aux_loss_coef`` is ``model.moe.aux_loss_coef`` converted to Hugging Face's form
  (trident/checkpoint/hf.py). These families are dropless and route on the router's scores alone, so a model that
  computes otherwise is refused in one line before anything is written: one with ``model.moe.capacity_factor``
  set, or with a loss-free balancing bias that has moved off zero (``model.moe.bias_update_rate``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from trident.checkpoint import hf
from trident.checkpoint.files import saved_model_config
from trident.checkpoint.hf import (
    GPT2,
    LLAMA,
    MIXTRAL,
    MOE_CLASSES,
    OLMOE,
    QWEN3,
    QWEN3_MOE,
    _rounded,
    architecture,
    sources,
    sparse_layers,
)
from trident.config import ModelConfig
from trident.data.tokenizer import FILE_NAMES
from trident.errors import CheckpointError, TridentError
from trident_dev.consolidated import ModelWeights

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


MODEL_TYPES = {
    GPT2: "gpt2",
    LLAMA: "llama",
    QWEN3: "qwen3",
    MIXTRAL: "mixtral",
    QWEN3_MOE: "qwen3_moe",
    OLMOE: "olmoe",
}


def aux_coef_to_hf(cfg: ModelConfig) -> float:
    """Hugging Face's ``router_aux_loss_coef`` for our ``model.moe.aux_loss_coef`` (the module docstring)."""
    return _rounded(cfg.moe.aux_loss_coef * max(sparse_layers(cfg), 1) / cfg.moe.top_k)


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
    if cls == QWEN3:
        extra = {"use_sliding_window": False, "sliding_window": None}
    elif cls == MIXTRAL:
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
    elif cls == OLMOE:  # its own defaults would pad with token 1 and clip nothing: written, not left to them
        extra = {"num_experts": moe.experts, "norm_topk_prob": moe.norm_topk, "clip_qkv": None, "pad_token_id": None}
    if cls in MOE_CLASSES:
        extra.update(
            num_experts_per_tok=moe.top_k, router_aux_loss_coef=aux_coef_to_hf(cfg), output_router_logits=False
        )
    return {
        "architectures": [cls],
        "model_type": MODEL_TYPES[cls],
        **extra,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_len,  # not the window it was trained on last
        "hidden_size": cfg.d_model,
        # Mixtral's and OLMoE's experts are intermediate_size wide (every layer sparse); Qwen3-MoE's dense layers are
        "intermediate_size": cfg.expert_dim if cls in (MIXTRAL, OLMOE) else cfg.ffn_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        **({} if cls == OLMOE else {"head_dim": cfg.head_size}),  # OLMoE's is always hidden / heads
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": _rope_scaling(cfg),
        "attention_bias": cfg.bias,
        **({"mlp_bias": cfg.bias} if cls == LLAMA else {}),
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


def model_config(weights: ModelWeights) -> ModelConfig:
    return saved_model_config(weights.config, weights.source)


def config_json(cfg: ModelConfig, weights: ModelWeights | None = None) -> dict:
    """The config.json for a model of shape ``cfg``, with the bos/eos ids the model carries (``model.bos_id``,
    ``model.eos_ids``: an imported model's own), else those of the weights' tokenizer, if any."""
    bos, eos = cfg.bos_id, cfg.eos_ids
    if weights is not None and weights.tokenizer is not None:
        tokenizer = weights.load_tokenizer()
        if bos is None:
            bos = tokenizer.bos_id
        if eos is None and tokenizer.eos_id is not None:
            eos = [tokenizer.eos_id]
    return hf_config(cfg, bos, eos)


def hf_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's tensors (fp32, contiguous) from ours; refuses a tensor set that is not this model's."""
    return to_hf(tensors, cfg)


def check_exportable(cfg: ModelConfig, buffers: dict[str, torch.Tensor]) -> str:
    """The class a model of ``cfg`` with these buffers (``ModelWeights.buffers``) exports as, or a CheckpointError
    naming the key whose state that class has no place for: a capacity, which drops pairs Hugging Face's dropless
    experts compute, or a balancing bias that changes which experts a token meets."""
    cls = hf.architecture(cfg)
    if cls not in hf.MOE_CLASSES:
        return cls
    moe = cfg.moe
    if moe.capacity_factor is not None:
        raise CheckpointError(
            f"model.moe.capacity_factor={moe.capacity_factor} has no place in {cls}: its experts are dropless, so "
            "the export would compute another function; export a model trained with model.moe.capacity_factor=null"
        )
    moved = {name: float(b.abs().max()) for name, b in buffers.items() if name.endswith("expert_bias") and b.any()}
    if moved:
        name = max(moved, key=moved.get)
        raise CheckpointError(
            f"model.moe.bias_update_rate={moe.bias_update_rate} moved the loss-free balancing bias ({name}, "
            f"max |bias| {moved[name]:.3g}), which {cls} has no place for: it routes on the scores alone, so the "
            "export would send tokens to other experts; keep it with --to consolidated, or train with "
            "model.moe.bias_update_rate=0"
        )
    return cls


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise TridentError(f"--out {out} is a file; --to hf writes a directory (config.json, model.safetensors)")


def write_hf(weights: ModelWeights, out: Path) -> list[str]:
    """Write config.json, model.safetensors and (if the model has one) its tokenizer file into ``out``.

    The files are made in a temporary sibling directory, then each is moved into ``out`` by rename: a failed
    export leaves no half-written file there. Returns the names written."""
    check_out_dir(out)
    cfg = model_config(weights)
    check_exportable(cfg, weights.buffers)  # a model no Hugging Face class computes is refused before any write
    state = hf_state_dict(weights.tensors, cfg)
    config = config_json(cfg, weights)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        try:
            save_file(state, tmp / WEIGHTS_FILE, metadata={"format": "pt"})  # HF reads only "pt"-tagged files
        except SafetensorError as e:  # its I/O errors are not OSErrors
            raise OSError(" ".join(str(e).split())) from None
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        if weights.tokenizer is not None:
            (tmp / weights.tokenizer_file).write_bytes(weights.tokenizer)
        written = sorted(p.name for p in tmp.iterdir())
        out.mkdir(exist_ok=True)
        for name in written:
            os.replace(tmp / name, out / name)
        for name in FILE_NAMES:  # an older export's tokenizer must not outlive its model
            if name not in written:
                (out / name).unlink(missing_ok=True)
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
