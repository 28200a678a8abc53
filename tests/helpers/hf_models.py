"""Small Hugging Face models of the released families' shapes, written by transformers itself (built from a config,
randomly initialised, saved with save_pretrained; nothing downloaded), and the one-process trident model of a
``ModelWeights``.

The shapes are the ones the released models have and the tests used to miss: heads not d_model / n_heads wide
(Qwen3, Qwen3-MoE: 4 heads of 32 on a width of 64), grouped kv heads, four layers and more experts than k, so that
the balancing coefficient's conversion (L / k) is not 1. The vocabulary is the test dataset's (512), so a run can
start from any of them (``checkpoint.init_from``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from trident.config import model_config_from_dict
from trident.models.gpt import GPT
from trident.parallel.placement import placement_of
from trident_dev.consolidated import ModelWeights
from trident_dev.export import write_hf

VOCAB = 512
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=None,
    initializer_range=0.1,
)  # fmt: skip
MOE = dict(num_experts_per_tok=2, router_aux_loss_coef=0.02)

FAMILIES: dict[str, Callable[[], transformers.PreTrainedModel]] = {
    # Llama with per-head q/k norms and heads twice d_model / n_heads wide; tied, as the small Qwen3s are.
    "qwen3": lambda: transformers.Qwen3ForCausalLM(
        transformers.Qwen3Config(**{**SHAPE, "tie_word_embeddings": True}, intermediate_size=96, head_dim=32)
    ),
    # Qwen3-30B-A3B's kind: every layer sparse, the top-k weights renormalised, heads of head_dim.
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **SHAPE,
            **MOE,
            intermediate_size=96,
            moe_intermediate_size=32,
            num_experts=8,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            head_dim=32,
        )
    ),
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SHAPE, **MOE, intermediate_size=32, num_local_experts=8, rope_theta=500.0)
    ),
    # q and k normalised over the whole projection; the top-k weights not renormalised.
    "olmoe": lambda: transformers.OlmoeForCausalLM(
        transformers.OlmoeConfig(**SHAPE, **MOE, intermediate_size=32, num_experts=8, norm_topk_prob=False)
    ),
}
CLASSES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def saved(family: str, out: Path, seed: int = 0) -> Path:
    """A random model of ``family`` as transformers writes it, its gains and routers moved off their init (a
    misplaced gain shows in the logits; Qwen3's routers start at zero, where every expert ties)."""
    torch.manual_seed(seed)
    model = FAMILIES[family]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.rand(p.shape) * 0.5)
            elif name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


def ours(weights: ModelWeights) -> GPT:
    """The one-process trident model of ``weights`` (its logical tensors), in eval mode."""
    model = GPT(model_config_from_dict(weights.config["model"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(placement_of(p).shard(weights.tensors[name]))
    return model.eval()


def prompts(n: int = 3, length: int = 6, seed: int = 1) -> torch.Tensor:
    """``n`` random prompts of ``length`` tokens ([n, length]): a few, since one may settle on a repeated token."""
    return torch.randint(0, VOCAB, (n, length), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def greedy(model: GPT, prompt: torch.Tensor, n: int) -> list[list[int]]:
    """``n`` greedy tokens after each row of ``prompt``, each from a full forward of everything so far."""
    ids = prompt
    for _ in range(n):
        ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], 1)
    return ids[:, prompt.shape[1] :].tolist()


@torch.no_grad()
def hf_greedy(model: transformers.PreTrainedModel, prompt: torch.Tensor, n: int) -> list[list[int]]:
    """transformers' own greedy continuation (generate, with its KV cache) of each row of ``prompt``."""
    out = model.generate(prompt, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[:, prompt.shape[1] :].tolist()


def assert_export_matches(weights: ModelWeights, out: Path, hf_class: str, vocab_size: int) -> None:
    """Our model of ``weights``, moved off them (our own weights now, away from transformers' file), exported to
    ``out``: transformers loads every weight of it as ``hf_class`` and gives our logits."""
    model = ours(weights)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
    tensors = {name: placement_of(p).real_part(p.detach()) for name, p in model.named_parameters()}
    write_hf(dataclasses.replace(weights, tensors=tensors, tokenizer=None), out)
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # every weight came from the file
    assert type(hf).__name__ == hf_class
    ids = torch.randint(0, vocab_size, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (model(ids) - hf.eval()(ids).logits).abs().max() <= 1e-5
