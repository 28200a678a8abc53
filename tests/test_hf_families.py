"""The released Llama-family shapes both ways, one process: Qwen3 (dense), Qwen3-MoE, Mixtral and OLMoE models that
transformers itself wrote read back with its logits (fp32, within 1e-5) and its greedy tokens, our export of each
loads in transformers with our logits (and, trained at tp=2, with our greedy tokens: tests/test_hf_trained.py), and
HF -> trident -> HF gives back every tensor and the config. Heads are not d_model / n_heads wide where the family
allows it (head_dim 32 on a width of 64, 4 heads), as in every released Qwen3; what a family cannot compute is
refused in one line naming the key."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers
from einops import rearrange
from safetensors.torch import load_file
from transformers.models.olmoe.modeling_olmoe import OlmoeRMSNorm

from tests.helpers.hf_models import (
    CLASSES,
    FAMILIES,
    SHAPE,
    assert_export_matches,
    greedy,
    hf_greedy,
    ours,
    prompts,
    saved,
)
from tests.helpers.layouts import make_config
from tests.helpers.tools import run_tool
from trident.checkpoint.hf import architecture, model_from_hf
from trident.config import model_config_from_dict
from trident.errors import CheckpointError
from trident.models.gpt import ProjectionRMSNorm
from trident_dev.consolidated import load_weights
from trident_dev.export import write_hf

# What the import makes of each family's q/k norms and heads.
IMPORTED = {
    "qwen3": (True, "head", 32),
    "qwen3_moe": (True, "head", 32),
    "mixtral": (False, "head", None),
    "olmoe": (True, "projection", None),
}
# The config attributes an export must give back (read through transformers' own config classes, so that a key
# one class writes under another name, num_experts / num_local_experts, compares alike).
ATTRIBUTES = (
    "model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "max_position_embeddings",
    "num_local_experts", "num_experts_per_tok", "router_aux_loss_coef", "norm_topk_prob", "moe_intermediate_size",
    "decoder_sparse_step", "clip_qkv", "use_sliding_window", "sliding_window", "attention_bias",
)  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_model_reads_back_with_its_logits_and_greedy_tokens(family, tmp_path):
    source = saved(family, tmp_path / "src")
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    weights = load_weights(source)
    cfg = model_config_from_dict(weights.config["model"])
    assert (cfg.qk_norm, cfg.qk_norm_scope, cfg.head_dim) == IMPORTED[family]
    assert architecture(cfg) == CLASSES[family] == type(hf).__name__
    model = ours(weights)
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-5
    tokens = greedy(model, prompts(), 8)
    assert tokens == hf_greedy(hf, prompts(), 8) and len({t for row in tokens for t in row}) > 3


@pytest.mark.parametrize("family", FAMILIES)
def test_an_export_loads_in_transformers_with_our_logits(family, tmp_path):
    assert_export_matches(
        load_weights(saved(family, tmp_path / "src")), tmp_path / "hf", CLASSES[family], SHAPE["vocab_size"]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_to_trident_to_hf_gives_back_every_tensor_and_the_config(family, tmp_path, monkeypatch, capsys):
    source = saved(family, tmp_path / "src")
    ck, out = tmp_path / "ck", tmp_path / "back"
    for args in ([str(source), "--from", "hf", "--out", str(ck)], [str(ck), "--to", "hf", "--out", str(out)]):
        code, _, err = run_tool("convert_checkpoint", *args, monkeypatch=monkeypatch, capsys=capsys)
        assert code == 0, err
    before, after = (load_file(d / "model.safetensors") for d in (source, out))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    theirs, back = (transformers.AutoConfig.from_pretrained(d) for d in (source, out))
    for name in ATTRIBUTES:
        assert _effective(back, name) == _effective(theirs, name), name
    assert back.rope_parameters["rope_theta"] == theirs.rope_parameters["rope_theta"]


def _effective(config: transformers.PretrainedConfig, name: str) -> object:
    """A config attribute as the model reads it: head_dim None is hidden / heads, attention_bias absent false."""
    value = getattr(config, name, None)
    if name == "head_dim" and value is None:
        return config.hidden_size // config.num_attention_heads
    return bool(value) if name == "attention_bias" else value


@pytest.mark.parametrize(
    "build",
    [
        lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**SHAPE, intermediate_size=96, head_dim=32)),
        lambda: transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**SHAPE, intermediate_size=32, num_local_experts=4, head_dim=32)
        ),
    ],
    ids=["llama", "mixtral"],
)
def test_a_llama_or_mixtral_head_dim_reads_back_and_exports_back(build, tmp_path, monkeypatch, capsys):
    torch.manual_seed(0)
    hf = build().eval()
    hf.save_pretrained(tmp_path / "src")
    weights = load_weights(tmp_path / "src")
    assert weights.config["model"]["head_dim"] == 32
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(weights)(ids) - hf(ids).logits).abs().max() <= 1e-5
    write_hf(weights, tmp_path / "back")
    before, after = (load_file(d / "model.safetensors") for d in (tmp_path / "src", tmp_path / "back"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def _config(family: str, **changes: object) -> dict:
    return {**FAMILIES[family]().config.to_dict(), **changes}


@pytest.mark.parametrize(
    "family, changes, line",
    [
        ("qwen3", {"use_sliding_window": True}, "use_sliding_window=true is not supported; trident's attention"),
        ("qwen3_moe", {"use_sliding_window": True}, "use_sliding_window=true is not supported"),
        ("olmoe", {"clip_qkv": 8.0}, "clip_qkv=8.0 is not supported; OLMoE import needs null"),
        ("olmoe", {"head_dim": 32}, "head_dim=32 is not supported for olmoe; its heads are hidden_size / "),
        ("qwen3", {"attention_bias": True}, "attention_bias=true is not supported for qwen3: its MLPs have no"),
    ],
)
def test_what_a_family_computes_otherwise_is_refused_on_import_in_one_line(family, changes, line):
    with pytest.raises(CheckpointError, match=line) as e:
        model_from_hf(_config(family, **changes), "src/config.json")
    assert str(e.value).startswith("src/config.json: ") and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "preset, changes, line",
    [
        (
            "llama-tiny",
            {"qk_norm": True, "qk_norm_scope": "projection"},
            "model.qk_norm_scope=projection without experts has no Hugging Face class: Qwen3ForCausalLM needs "
            "model.qk_norm_scope=head",
        ),
        ("llama-tiny", {"qk_norm": True, "bias": True}, "model.bias=True has no Hugging Face class: Qwen3ForCausalLM"),
        ("gpt-tiny", {"head_dim": 32}, "model.head_dim=32 has no Hugging Face class: GPT2LMHeadModel's heads are"),
        ("gpt-tiny", {"qk_norm": True}, "model.norm=layernorm, model.mlp=gelu, model.position=learned with q/k norms"),
    ],
)
def test_a_dense_block_no_class_holds_is_refused_naming_the_key(preset, changes, line):
    cfg = dataclasses.replace(make_config(f"model={preset}").model, **changes)
    with pytest.raises(CheckpointError, match=line):
        architecture(cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_projection_norm_is_olmoes_to_the_bit(dtype):
    """OLMoE's q/k norm over the whole projection: fp32 variance, cast back, then the gain."""
    heads, dh = 4, 16
    gain = torch.rand(heads * dh) + 0.5
    mine, theirs = ProjectionRMSNorm(heads, dh, 1e-5, None), OlmoeRMSNorm(heads * dh, eps=1e-5)
    with torch.no_grad():
        mine.weight.copy_(gain)
        theirs.weight.copy_(gain)
    x = torch.randn(2, 7, heads * dh, generator=torch.Generator().manual_seed(0)).to(dtype) * 3
    got = mine.to(dtype)(rearrange(x, "b t (h d) -> b h t d", h=heads))
    assert torch.equal(got, rearrange(theirs.to(dtype)(x), "b t (h d) -> b h t d", h=heads))
