"""Export a model to Hugging Face: a directory that ``transformers.AutoModelForCausalLM.from_pretrained`` loads with
our logits as the class ``trident.checkpoint.hf.architecture`` names (GPT2LMHeadModel, LlamaForCausalLM,
Qwen3ForCausalLM, MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM), with the model's tokenizer file
beside it under its own name (``tokenizer.model`` or ``tokenizer.json``).

The input is the logical (one-process, unpadded) tensors under their canonical names, as
``trident.checkpoint.consolidated`` reads them from a checkpoint of any layout. Which class, the names and the
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
from trident.checkpoint.consolidated import ModelWeights
from trident.checkpoint.files import saved_model_config
from trident.config import ModelConfig
from trident.data.tokenizer import FILE_NAMES
from trident.errors import CheckpointError, TridentError

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


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
    return hf.hf_config(cfg, bos, eos)


def hf_state_dict(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face's tensors (fp32, contiguous) from ours; refuses a tensor set that is not this model's."""
    return hf.to_hf(tensors, cfg)


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
