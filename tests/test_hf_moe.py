"""Hugging Face mixture-of-experts models both ways, one process: Mixtral and Qwen3-MoE models that transformers
itself wrote with save_pretrained read back with its logits (fp32, within 1e-5) and its greedy tokens, and our
models export to the class that loads them with ours; the balancing coefficient is converted so that an import
trains on transformers' own balancing term, and the presets hold our number of the released one; an export refuses
the router state Hugging Face's dropless experts have no place for (tests/test_hf_families.py: the released
shapes, OLMoE and Qwen3 among them)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from tests.helpers.hf_models import assert_export_matches, ours
from tests.helpers.layouts import make_config, train_rank
from tests.helpers.tools import run_tool
from tests.test_init_from import adopted, first_batch, run_args
from trident.checkpoint.hf import MIXTRAL, OLMOE, QWEN3_MOE, architecture, model_from_hf
from trident.config import model_config_from_dict
from trident.errors import CheckpointError
from trident.models.gpt import GPT
from trident.models.moe import MoE, set_loss_multiplier
from trident.parallel.placement import placement_of
from trident_dev.consolidated import ModelWeights, load_weights, write_checkpoint
from trident_dev.export import hf_config, write_hf
from trident_dev.ranks import run_distributed

SHAPE = dict(
    vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=32, num_experts_per_tok=2, tie_word_embeddings=False,
)  # fmt: skip
FAMILIES = {
    # Every layer sparse, the top-2 weights renormalised.
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**SHAPE, intermediate_size=16, num_local_experts=4, rope_theta=500.0)
    ),
    # Layer 0 dense (decoder_sparse_step 2), layer 1 sparse; the top-k weights not renormalised; q/k norms.
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **SHAPE,
            intermediate_size=40,
            moe_intermediate_size=16,
            num_experts=4,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            head_dim=8,
        )  # fmt: skip
    ),
}


def saved(family: str, out: Path) -> Path:
    """A random model of ``family`` as transformers writes it, gains and routers moved off their init."""
    torch.manual_seed(0)
    model = FAMILIES[family]()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.rand(p.shape) * 0.5)
            elif "gate.weight" in name and "experts" not in name:  # Qwen3's router starts at zero: ties
                p.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_moe_model_reads_back_with_its_logits_and_greedy_tokens(family, tmp_path):
    source = saved(family, tmp_path / "src")
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    model = ours(load_weights(source))
    assert any(isinstance(m, MoE) for m in model.modules())
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max() <= 1e-5
        prompt, tokens = ids[:1, :4], []
        for _ in range(12):
            tokens.append(int(model(torch.cat([prompt, torch.tensor([tokens], dtype=torch.long)], 1))[0, -1].argmax()))
        theirs = hf.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == theirs[0, 4:].tolist() and len(set(tokens)) > 1


@pytest.mark.parametrize("family", FAMILIES)
def test_an_export_loads_in_transformers_with_our_logits(family, tmp_path):
    hf_class = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}[family]
    assert_export_matches(load_weights(saved(family, tmp_path / "src")), tmp_path / "hf", hf_class, 96)


def test_hf_to_trident_to_hf_leaves_every_tensor_equal(tmp_path, monkeypatch, capsys):
    source = saved("qwen3_moe", tmp_path / "src")
    ck, out = tmp_path / "ck", tmp_path / "back"
    for args in ([str(source), "--from", "hf", "--out", str(ck)], [str(ck), "--to", "hf", "--out", str(out)]):
        code, _, err = run_tool("convert_checkpoint", *args, monkeypatch=monkeypatch, capsys=capsys)
        assert code == 0, err
    before, after = (load_file(d / "model.safetensors") for d in (source, out))
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    config = json.loads((out / "config.json").read_text())
    assert (config["num_experts"], config["decoder_sparse_step"], config["norm_topk_prob"]) == (4, 2, False)


@pytest.mark.multiprocess
def test_a_qwen3_moe_model_starts_a_tp2_pp2_run_at_its_own_loss_and_trains(tiny_dataset, tmp_path):
    """Each rank reads its experts and router from the Hugging Face files; the first stage holds no sparse layer."""
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=512, hidden_size=64, intermediate_size=176, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=False,
        initializer_range=0.1,
    )  # fmt: skip
    model = transformers.Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(tmp_path / "src")
    overrides = run_args(tiny_dataset, "parallel.tp=2", "parallel.pp=2", "train.steps=4")
    cfg = adopted(tmp_path / "run", [*overrides, f"checkpoint.init_from={tmp_path / 'src'}"])
    assert cfg.model.qk_norm and cfg.model.moe.experts == 4 and not cfg.model.moe.is_sparse(0)
    histories = run_distributed(train_rank, 4, cfg, tmp_path / "run", timeout_s=300)
    losses = [row["loss"] for row in histories[0]]
    x, y = first_batch(cfg)
    with torch.no_grad():
        expected = F.cross_entropy(model.eval()(x).logits.flatten(0, 1).double(), y.flatten()).item()
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
    assert losses[-1] < losses[0] - 0.05, losses
    assert set(histories[0][0]) >= {"moe/aux_loss", "moe/load/1"}


@pytest.mark.parametrize(
    "moe, line",
    [
        ({"router": "sigmoid"}, "model.moe.router=sigmoid has no Hugging Face class: MixtralForCausalLM needs"),
        ({"shared_experts": 1}, "model.moe.shared_experts=1 has no Hugging Face class"),
        ({"norm_topk": False}, "model.moe.norm_topk=False has no Hugging Face class: MixtralForCausalLM needs"),
        ({"every": 2}, "model.moe.every=2 has no Hugging Face class: MixtralForCausalLM needs model.moe.every=1"),
    ],
)
def test_an_expert_block_no_class_holds_is_refused_naming_the_key(moe, line):
    cfg = make_config("model=moe-tiny").model
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))
    with pytest.raises(CheckpointError, match=line):
        architecture(cfg)
    if "norm_topk" in moe or "every" in moe:  # what Qwen3-MoE has (decoder_sparse_step, norm_topk_prob)
        assert architecture(dataclasses.replace(cfg, qk_norm=True)) == "Qwen3MoeForCausalLM"


def test_the_balancing_term_an_import_trains_on_is_transformers_own(tmp_path):
    """transformers adds router_aux_loss_coef x E sum_e f_e P_e once, pooled over the sparse layers (k when
    balanced); we add aux_loss_coef x aux per layer (1 when balanced). Imported as it was, ours was L / k = 4 times
    theirs; converted, the two agree where the routing is balanced, and near balance (transformers' own init,
    probabilities close to uniform) within 5%: they differ by how the layers' and sequences' loads vary about
    their mean (ours averages a product over them, theirs multiplies the averages)."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02,
        max_position_embeddings=64,
    )  # fmt: skip
    hf = transformers.MixtralForCausalLM(config)
    hf.save_pretrained(tmp_path)
    weights = load_weights(tmp_path)
    cfg = model_config_from_dict(weights.config["model"])
    assert cfg.moe.aux_loss_coef == 0.02 * 2 / 8
    ids = torch.randint(0, 96, (4, 64), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        theirs = float(hf.eval()(ids, output_router_logits=True).aux_loss) * config.router_aux_loss_coef
        model = ours(weights).train()  # train mode: each sparse layer adds up its aux term (step_sums)
        set_loss_multiplier(model, 0.0)
        model(ids)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    assert len(layers) == 8
    mine = cfg.moe.aux_loss_coef * sum(float(m.step_sums[2] / m.step_sums[1]) for m in layers)
    assert abs(mine / theirs - 1) <= 0.05, (mine, theirs)


@pytest.mark.parametrize(
    "preset, cls, released",
    [("mixtral-8x7b", MIXTRAL, 0.02), ("qwen3-30b-a3b", QWEN3_MOE, 0.001), ("olmoe-1b-7b", OLMOE, 0.01)],
)
def test_a_moe_preset_holds_our_coefficient_of_the_released_models_own(preset, cls, released):
    cfg = make_config(f"model={preset}").model
    config = hf_config(cfg)
    assert architecture(cfg) == cls and config["router_aux_loss_coef"] == released
    assert cfg.moe.aux_loss_coef == pytest.approx(released * cfg.moe.top_k / cfg.n_layers, rel=1e-9)  # ours
    assert model_from_hf(config, preset)["moe"] == dataclasses.replace(cfg.moe, z_loss_coef=0.0)  # none in HF's
    if preset == "qwen3-30b-a3b":  # the released heads: 32 of 128 on a 2048-wide stream, top-8 renormalised
        assert (cfg.head_size, cfg.n_heads, cfg.d_model, cfg.moe.norm_topk) == (128, 32, 2048, True)


def _checkpoint(tmp_path: Path, moe: dict, buffers: dict[str, torch.Tensor]) -> Path:
    """A trident checkpoint (written in this process) of a transformers Mixtral with these model.moe keys and
    buffers."""
    weights = load_weights(saved("mixtral", tmp_path / "src"))
    config = json.loads(json.dumps(weights.config))
    config["model"]["moe"].update(moe)
    return write_checkpoint(dataclasses.replace(weights, config=config, buffers=buffers), tmp_path / "ck")


@pytest.mark.parametrize(
    "moe, bias, line",
    [
        (
            {"capacity_factor": 0.5},
            0.0,
            "error: model.moe.capacity_factor=0.5 has no place in MixtralForCausalLM: its experts are dropless",
        ),
        (
            {"bias_update_rate": 0.01},
            0.03,
            "error: model.moe.bias_update_rate=0.01 moved the loss-free balancing bias "
            "(layers.1.mlp.router.expert_bias, max |bias| 0.03), which MixtralForCausalLM has no place for",
        ),
        ({"bias_update_rate": 0.01}, 0.0, None),  # a bias that never moved changes no choice: exported
    ],
    ids=["capacity", "moved-bias", "zero-bias"],
)
def test_an_export_refuses_router_state_hf_has_no_place_for_in_one_line(moe, bias, line, tmp_path, monkeypatch, capsys):
    buffers = {f"layers.{i}.mlp.router.expert_bias": torch.zeros(4) for i in range(2)}
    buffers["layers.1.mlp.router.expert_bias"][2] = bias
    ck = _checkpoint(tmp_path, moe, buffers)
    out = tmp_path / "hf"
    args = [str(ck), "--to", "hf", "--out", str(out)]
    code, _, err = run_tool("convert_checkpoint", *args, monkeypatch=monkeypatch, capsys=capsys)
    if line is None:
        assert code == 0 and (out / "model.safetensors").is_file(), err
        return
    assert code == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert not out.exists()  # refused before anything was written


def test_a_gpt2_block_with_experts_is_refused_naming_its_block_keys(tmp_path):
    cfg = make_config("model=moe-tiny", "model.norm=layernorm", "model.mlp=gelu", "model.position=learned").model
    model = GPT(cfg)
    tensors = {name: placement_of(p).real_part(p.detach()) for name, p in model.named_parameters()}
    weights = ModelWeights(tensors, {"model": dataclasses.asdict(cfg)}, 0, None, tmp_path)
    with pytest.raises(CheckpointError) as e:
        write_hf(weights, tmp_path / "hf")
    assert str(e.value) == (
        "model.norm=layernorm, model.mlp=gelu, model.position=learned with experts has no Hugging Face class: "
        "GPT2LMHeadModel has no experts, and MixtralForCausalLM, Qwen3MoeForCausalLM, OlmoeForCausalLM need "
        "model.norm=rmsnorm, model.mlp=swiglu, model.position=rope"
    )
