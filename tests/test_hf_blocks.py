"""Hugging Face in both directions, one process: our GPT-2 and Llama blocks export to the transformers class that
gives our logits and greedy tokens; a transformers model read back gives its own; a round trip through a trident
checkpoint leaves every tensor equal; and what has no Hugging Face counterpart is refused in one line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from tokenizers import Tokenizer
from tokenizers.models import WordLevel

from tests.helpers.tools import run_tool
from trident.checkpoint.hf import read_box, sources
from trident.config import ModelConfig
from trident.errors import CheckpointError
from trident.models.gpt import GPT, init_weights
from trident.parallel.placement import Placement, placement_of
from trident_dev.consolidated import ModelWeights, load_weights, write_consolidated
from trident_dev.export import to_hf, write_hf

GPT2_SHAPE = dict(n_layers=2, d_model=32, n_heads=4, seq_len=24, vocab_size=70, d_ff=48, init_std=0.2)
LLAMA_BLOCK = dict(norm="rmsnorm", mlp="swiglu", position="rope", bias=False, norm_eps=1e-6, rope_theta=500.0)
BLOCKS = {
    "gpt2": ModelConfig(**GPT2_SHAPE),
    "gpt2-untied": ModelConfig(**GPT2_SHAPE, tie_embeddings=False),
    "llama-gqa-untied": ModelConfig(**GPT2_SHAPE, **LLAMA_BLOCK, n_kv_heads=2, tie_embeddings=False),
    "llama-mqa-tied": ModelConfig(**GPT2_SHAPE, **LLAMA_BLOCK, n_kv_heads=1),
    "llama-mha-bias": ModelConfig(**{**GPT2_SHAPE, **LLAMA_BLOCK, "bias": True}),
    # Llama 3.1 / 3.2's scaled RoPE, with an original context below seq_len so that the scaling changes the logits.
    "llama3-scaled-rope": ModelConfig(
        **GPT2_SHAPE, **LLAMA_BLOCK, n_kv_heads=2, rope_scaling="llama3", rope_factor=8.0, rope_original_seq_len=8
    ),
}
CLASSES = {"gpt2": transformers.GPT2LMHeadModel, "llama": transformers.LlamaForCausalLM}


def our_model(cfg: ModelConfig, seed: int = 3) -> tuple[GPT, dict[str, torch.Tensor]]:
    model = GPT(cfg)
    init_weights(model, cfg, seed)
    with torch.no_grad():  # biases and gains away from their 0 / 1 init, so a misplaced one shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)
    return model.eval(), {name: placement_of(p).real_part(p.detach()) for name, p in model.named_parameters()}


def greedy(step, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt
    for _ in range(n):
        ids = torch.cat([ids, step(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.shape[1] :].tolist()


@pytest.mark.parametrize("block", BLOCKS)
def test_export_loads_in_transformers_with_our_logits_and_greedy_tokens(block, tmp_path):
    cfg = BLOCKS[block]
    model, tensors = our_model(cfg)
    written = write_hf(ModelWeights(tensors, {"model": dataclasses.asdict(cfg)}, 5, None, tmp_path), tmp_path / "hf")
    assert written == ["config.json", "model.safetensors"]
    kind = "gpt2" if cfg.norm == "layernorm" else "llama"
    hf, info = CLASSES[kind].from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info  # every weight came from the file
    hf.eval()
    assert hf.config.tie_word_embeddings == cfg.tie_embeddings
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert ("lm_head.weight" in f.keys()) == (not cfg.tie_embeddings)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected, got = model(ids), hf(ids).logits
        assert got.shape == expected.shape == (2, cfg.seq_len, cfg.vocab_size)
        assert (got - expected).abs().max() < 1e-4
        ours = greedy(model, ids[:1, :4], 16)
        theirs = greedy(lambda x: hf(x).logits, ids[:1, :4], 16)
    assert ours == theirs and len(set(ours)) > 1


def _save(model: transformers.PreTrainedModel, out: Path, **kwargs) -> Path:
    model.save_pretrained(out, **kwargs)
    return out


def hf_gpt2(out: Path, **config) -> Path:
    cfg = transformers.GPT2Config(
        vocab_size=90, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=1, **config
    )
    torch.manual_seed(0)
    return _save(transformers.GPT2LMHeadModel(cfg), out)


def hf_llama(out: Path, **config) -> Path:
    defaults = dict(
        vocab_size=90, hidden_size=32, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    cfg = transformers.LlamaConfig(**{**defaults, **config})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # RMSNorm gains start at 1: move them so a misplaced one shows
                p.add_(torch.rand(p.shape) * 0.5)
    return _save(model, out)


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    with safe_open(directory / "model.safetensors", "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8,  # below the 32 positions: the scaling changes the logits
}
HF_MODELS = {
    "gpt2": lambda out: hf_gpt2(out),
    "llama-gqa": lambda out: hf_llama(out),
    "llama-mha-tied-bias": lambda out: hf_llama(
        out, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True
    ),
    "llama3-scaled-rope": lambda out: hf_llama(out, rope_scaling=LLAMA3_ROPE),
}


@pytest.mark.parametrize("name", HF_MODELS)
def test_a_transformers_model_reads_back_with_its_logits_and_round_trips_exactly(name, tmp_path, monkeypatch, capsys):
    source = HF_MODELS[name](tmp_path / "src")
    tokenizer = Tokenizer(WordLevel({"<|endoftext|>": 0, "a": 1, "b": 2}, unk_token="<|endoftext|>"))
    tokenizer.save(str(source / "tokenizer.json"))
    weights = load_weights(source)
    assert weights.load_tokenizer().eos_id == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    model = GPT(ModelConfig(**weights.config["model"]))
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            p.copy_(placement_of(p).shard(weights.tensors[param_name]))
        ids = torch.randint(0, 90, (2, 32), generator=torch.Generator().manual_seed(2))
        assert (model.eval()(ids) - hf(ids).logits).abs().max() < 1e-4

    # HF -> trident checkpoint -> HF, through the tool, as a user runs it.
    ck, out, io = tmp_path / "ck", tmp_path / "back", _io(monkeypatch, capsys)
    code, _, err = run_tool("convert_checkpoint", str(source), "--from", "hf", "--out", str(ck), **io)
    assert code == 0, err
    assert err == f"wrote {ck / 'step_00000000'}: {len(weights.tensors)} tensors from {source} (step 0)\n"
    code, _, err = run_tool("convert_checkpoint", str(ck), "--to", "hf", "--out", str(out), **io)
    assert code == 0, err
    before, after = hf_tensors(source), hf_tensors(out)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == hf.config.model_type and config["vocab_size"] == 90
    # The model's own eos id, not its tokenizer's (<|endoftext|>, 0): what transformers' generate stops at.
    assert config["eos_token_id"] == hf.config.eos_token_id != 0
    # The tokenizer travels under its own name, through the checkpoint and back.
    assert (ck / "step_00000000" / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()
    assert not (out / "tokenizer.model").exists()


@pytest.mark.parametrize(
    "name, ids",
    [("gpt2", {"bos_token_id": 0, "eos_token_id": 1}), ("llama", {"bos_token_id": 3, "eos_token_id": [4, 5]})],
)
def test_a_round_trip_without_a_tokenizer_keeps_the_token_ids_and_the_context(name, ids, tmp_path, monkeypatch, capsys):
    """No tokenizer file travels (a model saved alone): the bos / eos ids of its config.json (Llama 3.1 Instruct's
    several eos ids) and its positions come back from HF -> trident checkpoint -> HF all the same."""
    source = (
        hf_gpt2(tmp_path / "src") if name == "gpt2" else hf_llama(tmp_path / "src", max_position_embeddings=48, **ids)
    )
    ck, out, io = tmp_path / "ck", tmp_path / "back", _io(monkeypatch, capsys)
    for args in ([str(source), "--from", "hf", "--out", str(ck)], [str(ck), "--to", "hf", "--out", str(out)]):
        code, _, err = run_tool("convert_checkpoint", *args, **io)
        assert code == 0, err
    assert not any((out / file).exists() for file in ("tokenizer.json", "tokenizer.model"))
    before, after = (json.loads((d / "config.json").read_text()) for d in (source, out))
    positions = "n_positions" if name == "gpt2" else "max_position_embeddings"
    for key in (*ids, positions):
        assert after[key] == before[key] == {**ids, positions: 32 if name == "gpt2" else 48}[key], key
    hf = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert (hf.generation_config.bos_token_id, hf.generation_config.eos_token_id) == tuple(ids.values())


@pytest.mark.parametrize("block", ["gpt2-untied", "llama-gqa-untied", "llama-mha-bias"])
def test_each_tp_rank_reads_only_the_rows_and_columns_of_its_shard(block):
    """read_box of a tp block (rows for column-parallel weights, columns for row-parallel ones) touches exactly the
    elements of that block, and gives the block of the whole tensor."""
    cfg = BLOCKS[block]
    _, tensors = our_model(cfg)
    theirs = to_hf(tensors, cfg)
    read = []

    class Recording:
        def __init__(self, t: torch.Tensor) -> None:
            self.t, self.shape = t, t.shape

        def __getitem__(self, index: object) -> torch.Tensor:
            read.append(self.t[index].numel())
            return self.t[index]

    for name, source in sources(cfg).items():
        full = tensors[name]
        for dim in range(full.dim()):
            if full.shape[dim] % 2:
                continue
            for rank in range(2):
                placement = Placement(tuple(full.shape), split_dim=dim, tp_rank=rank, tp_size=2)
                read.clear()
                box = read_box(source, lambda n: Recording(theirs[n]), placement.offsets, placement.chunk_sizes)
                assert torch.equal(box, placement.shard(full)), (name, dim, rank)
                assert sum(read) == box.numel(), (name, dim, rank)


def _io(monkeypatch, capsys) -> dict:
    return {"monkeypatch": monkeypatch, "capsys": capsys}


def test_a_sharded_safetensors_model_reads_as_the_single_file_does(tmp_path):
    single = hf_llama(tmp_path / "one")
    model = transformers.LlamaForCausalLM.from_pretrained(single)
    sharded = _save(model, tmp_path / "many", max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file() and not (sharded / "model.safetensors").exists()
    a, b = load_weights(single), load_weights(sharded)
    assert a.tensors.keys() == b.tensors.keys()
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def test_a_pytorch_bin_reads_through_weights_only_and_a_pickle_is_refused(tmp_path):
    source = hf_gpt2(tmp_path / "st")
    reference = load_weights(source)
    binary = tmp_path / "bin"
    binary.mkdir()
    (binary / "config.json").write_text((source / "config.json").read_text())
    torch.save(hf_tensors(source), binary / "pytorch_model.bin")
    weights = load_weights(binary)
    assert all(torch.equal(weights.tensors[k], reference.tensors[k]) for k in reference.tensors)

    class Hostile:
        def __reduce__(self):
            return (print, ("pwned",))

    torch.save({"transformer.wte.weight": Hostile()}, binary / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as info:
        load_weights(binary)
    assert str(info.value) == (
        f"cannot read {binary / 'pytorch_model.bin'}: it holds objects other than tensors (damaged or hostile); refused"
    )


def _refused(monkeypatch, capsys, *args: str) -> str:
    code, out, err = run_tool("convert_checkpoint", *args, **_io(monkeypatch, capsys))
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (code, err)
    return err[len("error: ") : -1]


def test_what_has_no_hugging_face_counterpart_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    # A block mix no class holds: RMSNorm with GPT-2's GELU MLP and learned positions.
    cfg = ModelConfig(**GPT2_SHAPE, norm="rmsnorm")
    _, tensors = our_model(cfg)
    ck = tmp_path / "mix"
    weights = ModelWeights(tensors, {"model": dataclasses.asdict(cfg)}, 1, None, tmp_path)
    write_consolidated(weights, ck)
    assert _refused(monkeypatch, capsys, str(ck), "--to", "hf", "--out", str(tmp_path / "x")) == (
        "model.norm=rmsnorm with model.mlp=gelu, model.position=learned has no Hugging Face class: GPT2LMHeadModel "
        "needs model.norm=layernorm, model.mlp=gelu, model.position=learned; LlamaForCausalLM needs "
        "model.norm=rmsnorm, model.mlp=swiglu, model.position=rope"
    )
    gqa = ModelConfig(**GPT2_SHAPE, n_kv_heads=2)
    write_consolidated(ModelWeights(our_model(gqa)[1], {"model": dataclasses.asdict(gqa)}, 1, None, tmp_path), ck)
    assert _refused(monkeypatch, capsys, str(ck), "--to", "hf", "--out", str(tmp_path / "x")).startswith(
        "model.n_kv_heads=2 has no Hugging Face class: GPT2LMHeadModel needs model.n_kv_heads=model.n_heads (4)"
    )
    assert not (tmp_path / "x").exists()

    # A RoPE scaling we do not compute (YaRN), a llama3 one without its factors, an activation we do not compute, a
    # missing and a damaged weights file.
    scaled = hf_llama(tmp_path / "scaled")
    config = json.loads((scaled / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0}
    (scaled / "config.json").write_text(json.dumps(config))
    assert _refused(monkeypatch, capsys, str(scaled), "--from", "hf", "--out", str(tmp_path / "ck")) == (
        f"{scaled / 'config.json'}: rope_scaling={config['rope_parameters']} is not supported; trident imports "
        "rope_type default and llama3"
    )
    config["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}
    (scaled / "config.json").write_text(json.dumps(config))
    assert _refused(monkeypatch, capsys, str(scaled), "--from", "hf", "--out", str(tmp_path / "ck")) == (
        f"{scaled / 'config.json'}: rope_scaling={config['rope_parameters']} lacks a valid 'low_freq_factor'"
    )
    relu = hf_gpt2(tmp_path / "relu", activation_function="relu")
    assert _refused(monkeypatch, capsys, str(relu), "--from", "hf", "--out", str(tmp_path / "ck")) == (
        f"{relu / 'config.json'}: activation_function='relu' is not supported; GPT-2 import needs gelu_new"
    )
    source = hf_gpt2(tmp_path / "gpt2")
    weights_file = source / "model.safetensors"
    data = weights_file.read_bytes()
    weights_file.write_bytes(data[:100])
    assert _refused(monkeypatch, capsys, str(source), "--from", "hf", "--out", str(tmp_path / "ck")).startswith(
        f"cannot read {weights_file}: damaged ("
    )
    weights_file.unlink()
    assert _refused(monkeypatch, capsys, str(source), "--from", "hf", "--out", str(tmp_path / "ck")) == (
        f"{source} holds no model.safetensors, model.safetensors.index.json or pytorch_model.bin; the model's "
        "weights are missing"
    )
    assert not (tmp_path / "ck").exists()
