"""Export a model to the Hugging Face GPT-2 layout: a directory that ``transformers.GPT2LMHeadModel.from_pretrained``
loads with our logits, and the run's sentencepiece ``tokenizer.model`` beside it.

The input is the logical (one-process, unpadded) tensors under their canonical names, as
``trident.checkpoint.consolidated`` reads them from a checkpoint of any layout. The mapping, ours -> HF
(``d`` = model.d_model, ``h`` heads of ``dh`` = d / h, ``f`` = the MLP width, ``V`` = model.vocab_size):

    wte.weight               [V, d]        transformer.wte.weight           the same; lm_head is tied to it
    wpe.weight               [T, d]        transformer.wpe.weight           n_positions = model.seq_len
    layers.i.ln_{1,2}.*      [d]           transformer.h.i.ln_{1,2}.*
    layers.i.attn.qkv.weight [3d, d]       transformer.h.i.attn.c_attn.weight [d, 3d]
    layers.i.attn.qkv.bias   [3d]          transformer.h.i.attn.c_attn.bias   [3d]
    layers.i.attn.proj.*     [d, d]        transformer.h.i.attn.c_proj.*      (weight transposed)
    layers.i.mlp.fc.*        [f, d]        transformer.h.i.mlp.c_fc.*         (weight transposed, [d, f])
    layers.i.mlp.proj.*      [d, f]        transformer.h.i.mlp.c_proj.*       (weight transposed, [f, d])
    ln_f.*                   [d]           transformer.ln_f.*

- HF's ``Conv1D`` computes ``y = x W + b`` with ``W`` stored ``[in, out]``: every linear weight is transposed.
- Our fused qkv rows are laid out head by head, ``(h three dh)`` (so a tp block of rows holds whole heads);
  HF's ``c_attn`` columns are ``[q | k | v]``, ``(three h dh)``. The rows are regrouped before the transpose.
- ``activation_function = gelu_new``: the tanh approximation of GELU, which is what our MLP computes.
- ``layer_norm_epsilon = model.norm_eps``; ``model.bias=false`` exports zero biases (HF's GPT-2 always has them;
  a zero bias is the same function). Attention is scaled by 1/sqrt(dh) (``scale_attn_weights``), as
  ``scaled_dot_product_attention`` does.
- ``vocab_size`` is the real vocabulary: the padding rows of the embedding never reach a checkpoint.
- The three dropouts are ``model.dropout`` (0 by default); our dropout sits where GPT-2's does (embeddings,
  attention probabilities, each residual branch).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import sentencepiece as spm
import torch
from einops import rearrange
from safetensors import SafetensorError
from safetensors.torch import save_file

from trident.checkpoint.consolidated import ModelWeights
from trident.config import ModelConfig, model_config_from_dict
from trident.errors import CheckpointError, TridentError

CONFIG_FILE, WEIGHTS_FILE, TOKENIZER_FILE = "config.json", "model.safetensors", "tokenizer.model"


def model_config(weights: ModelWeights) -> ModelConfig:
    try:
        return model_config_from_dict(weights.config["model"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"the saved config does not describe a trident model: {type(e).__name__} {e}") from None


def _token_ids(tokenizer: bytes | None) -> dict[str, int | None]:
    """bos/eos of the run's tokenizer (trident's has an end-of-text id and no begin id); None without one."""
    if tokenizer is None:
        return {"bos_token_id": None, "eos_token_id": None}
    sp = spm.SentencePieceProcessor(model_proto=tokenizer)
    return {key: (i if i >= 0 else None) for key, i in (("bos_token_id", sp.bos_id()), ("eos_token_id", sp.eos_id()))}


def hf_config(cfg: ModelConfig, tokenizer: bytes | None = None) -> dict:
    """GPT-2's config.json for a model of shape ``cfg``."""
    return {
        "architectures": ["GPT2LMHeadModel"],
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
        "tie_word_embeddings": True,
        "use_cache": True,
        "torch_dtype": "float32",
        **_token_ids(tokenizer),
    }


def _names(cfg: ModelConfig) -> dict[str, str]:
    """Our canonical name -> HF's, for every tensor of the model."""
    pairs = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight"}
    sub = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj"}
    sub |= {"mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    for i in range(cfg.n_layers):
        for ours, theirs in sub.items():
            for kind in ("weight", "bias"):
                pairs[f"layers.{i}.{ours}.{kind}"] = f"transformer.h.{i}.{theirs}.{kind}"
    pairs |= {"ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias"}
    return pairs


def _bias_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    width = {"attn.qkv": 3 * cfg.d_model, "mlp.fc": cfg.ffn_dim}
    return (next((n for key, n in width.items() if f".{key}." in name), cfg.d_model),)


def hf_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF GPT-2's tensors (fp32, contiguous) from ours; refuses a tensor set that is not this model's."""
    names = _names(cfg)
    unknown = sorted(set(tensors) - set(names))
    if unknown:
        raise CheckpointError(
            f"the checkpoint holds {unknown[0]}, which GPT-2 has no place for; it is not a trident GPT"
        )
    out = {}
    for ours, theirs in names.items():
        if ours in tensors:
            t = tensors[ours].float()
        elif ours.endswith(".bias") and not cfg.bias:
            t = torch.zeros(_bias_shape(cfg, ours))
        else:
            raise CheckpointError(f"the checkpoint holds no tensor {ours}; it is not this model's")
        if ".attn.qkv." in ours:
            # Rows (h three dh) -> (three h dh): q of every head, then k, then v.
            t = rearrange(t, "(h three dh) ... -> (three h dh) ...", three=3, h=cfg.n_heads)
        if ours.endswith(".weight") and ours.startswith("layers.") and t.dim() == 2:
            t = t.t()  # nn.Linear [out, in] -> Conv1D [in, out]
        out[theirs] = t.contiguous()
    return out


def check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise TridentError(f"--out {out} is a file; --to hf writes a directory (config.json, model.safetensors)")


def write_hf(weights: ModelWeights, out: Path) -> list[str]:
    """Write config.json, model.safetensors and (if the run had one) tokenizer.model into ``out``.

    The files are made in a temporary sibling directory, then each is moved into ``out`` by rename: a failed
    export leaves no half-written file there. Returns the names written."""
    check_out_dir(out)
    cfg = model_config(weights)
    state = hf_state_dict(weights.tensors, cfg)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        try:
            save_file(state, tmp / WEIGHTS_FILE, metadata={"format": "pt"})  # HF reads only "pt"-tagged files
        except SafetensorError as e:  # its I/O errors are not OSErrors
            raise OSError(" ".join(str(e).split())) from None
        (tmp / CONFIG_FILE).write_text(json.dumps(hf_config(cfg, weights.tokenizer), indent=2) + "\n")
        if weights.tokenizer is not None:
            (tmp / TOKENIZER_FILE).write_bytes(weights.tokenizer)
        written = sorted(p.name for p in tmp.iterdir())
        out.mkdir(exist_ok=True)
        for name in written:
            os.replace(tmp / name, out / name)
        if TOKENIZER_FILE not in written:
            (out / TOKENIZER_FILE).unlink(missing_ok=True)  # an older export's tokenizer must not outlive its model
        return written
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
