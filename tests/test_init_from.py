"""``checkpoint.init_from``: a run starts from a Hugging Face GPT-2 or Llama (transformers' own loss on the first
batch, at tp=2 x pp=2, then trains) or from a trident checkpoint saved under another layout; the shape comes from
the source, and a config that contradicts it stops in one line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.helpers import REPO
from tests.helpers.layouts import make_config, train_in_process, train_rank
from tests.helpers.processes import run_train
from trident.checkpoint.init_from import adopt_init_from, check_init_from, load_init_weights, open_source
from trident.config import Config, ModelConfig
from trident.data.dataset import open_dataset
from trident.data.sampler import GlobalBatchSampler
from trident.errors import ConfigError
from trident.layout import Layout
from trident.memory.estimate import estimate
from trident.models.gpt import GPT, init_weights, lm_loss_sum
from trident.parallel.placement import placement_of
from trident_dev.consolidated import load_weights, read_model_tensors, write_checkpoint
from trident_dev.export import write_hf
from trident_dev.ranks import run_distributed

CONF = REPO / "conf"
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def hf_model(kind: str, out: Path) -> Path:
    """A small random transformers model of vocabulary 512 (the test dataset's) and 64 positions, saved locally."""
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4, n_inner=160, initializer_range=0.1
        )
        model = transformers.GPT2LMHeadModel(cfg)
    else:  # one kv head: at tp=2 each rank holds it whole
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, rms_norm_eps=1e-5,
            initializer_range=0.1,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # gains and biases away from 1 / 0, so a misplaced one shows in the loss
                p.add_(torch.rand(p.shape) * 0.2)
    model.save_pretrained(out)
    return out


def run_args(dataset: Path, *extra: str) -> list[str]:
    return [
        f"data.dataset_dir={dataset}",
        "wandb.mode=disabled",
        "train.global_batch_size=16",
        "train.micro_batch_size=4",
        "train.eval_every=0",
        "optim.warmup_steps=1",
        "optim.lr=3e-3",
        "logging.peak_tflops=1",
        *extra,
    ]


def adopted(run_dir: Path, overrides: list[str]) -> Config:
    """The config train.py's main runs: composed from the command line, the model taken from init_from."""
    return adopt_init_from(make_config(*overrides), overrides, CONF, run_dir)


def first_batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs and targets of a run's first global batch, as its trainer draws them."""
    train, _ = open_dataset(cfg.data, cfg.model.vocab_size).split(
        cfg.model.seq_len, cfg.data.val_fraction, cfg.train.global_batch_size
    )
    return train.batch(GlobalBatchSampler(len(train), cfg.train.global_batch_size, cfg.train.seed).global_batch(0))


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "kind,world,layout",
    [
        ("gpt2", 4, ["parallel.tp=2", "parallel.pp=2"]),
        ("llama", 4, ["parallel.tp=2", "parallel.pp=2"]),
        ("llama", 2, ["parallel.cp=2"]),  # RoPE positions and the head-tail split of the window
    ],
    ids=["gpt2-tp2-pp2", "llama-tp2-pp2", "llama-cp2"],
)
def test_a_hugging_face_model_starts_a_run_at_its_own_loss_and_trains(kind, world, layout, tiny_dataset, tmp_path):
    source = hf_model(kind, tmp_path / kind)
    overrides = run_args(tiny_dataset, *layout, "train.steps=4", f"checkpoint.init_from={source}")
    cfg = adopted(tmp_path / "run", overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    m = cfg.model
    assert (m.n_layers, m.d_model, m.n_heads, m.kv_heads, m.ffn_dim, m.vocab_size, m.seq_len) == (
        2, 64, 4, 4 if kind == "gpt2" else 1, 160 if kind == "gpt2" else 176, 512, 64,
    )  # fmt: skip
    assert m.tie_embeddings == (kind == "gpt2") and m.norm == ("layernorm" if kind == "gpt2" else "rmsnorm")

    histories = run_distributed(train_rank, world, cfg, tmp_path / "run", timeout_s=300)
    losses = [row["loss"] for row in histories[0]]
    assert [row["step"] for row in histories[0]] == [1, 2, 3, 4]  # step 0: a fresh start
    x, y = first_batch(cfg)
    with torch.no_grad():
        expected = F.cross_entropy(hf(x).logits.flatten(0, 1).double(), y.flatten()).item()
    assert abs(losses[0] - expected) <= 1e-5 * expected, (losses[0], expected)
    assert losses[-1] < losses[0] - 0.05, losses


@pytest.mark.multiprocess
def test_a_checkpoint_saved_at_tp2_starts_a_pp2_run_at_its_weights_and_a_restart_resumes(tiny_dataset, tmp_path):
    saved = tmp_path / "a" / "checkpoints"
    (first,) = train_in_process(
        tmp_path / "a", run_args(tiny_dataset, "model=llama-tiny", "parallel.tp=2", "train.steps=2"), world=2
    )[:1]
    overrides = run_args(tiny_dataset, "parallel.pp=2", "train.steps=1", f"checkpoint.init_from={saved}")
    cfg = adopted(tmp_path / "b", overrides)
    assert cfg.model.name == "llama-tiny" and cfg.model.kv_heads == 2 and not cfg.model.tie_embeddings
    (history, _) = run_distributed(train_rank, 2, cfg, tmp_path / "b", timeout_s=300)
    assert [row["step"] for row in history] == [1]

    # The one-process model of the saved weights, on the same first batch.
    model = GPT(cfg.model)
    tensors = read_model_tensors(saved / "step_00000002")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(placement_of(p).shard(tensors[name]))
        x, y = first_batch(cfg)
        expected = (lm_loss_sum(model(x), y) / y.numel()).item()
    assert abs(history[0]["loss"] - expected) <= 1e-5 * expected, (history[0]["loss"], expected)
    assert abs(first[0]["loss"] - expected) > 1e-2  # the fresh initialisation's loss on that batch is another

    # Rerun the same command for more steps: it resumes from its own checkpoint, even with the source gone.
    shutil.move(saved, tmp_path / "moved")
    overrides = [*overrides[:-2], "train.steps=2", overrides[-1]]
    (history, _) = run_distributed(train_rank, 2, adopted(tmp_path / "b", overrides), tmp_path / "b", timeout_s=300)
    assert [row["step"] for row in history] == [2]


def test_a_model_key_that_contradicts_the_source_is_refused_in_one_line(tmp_path):
    source = hf_model("llama", tmp_path / "src")
    base = ["wandb.mode=disabled", f"checkpoint.init_from={source}"]
    with pytest.raises(ConfigError) as info:
        adopted(tmp_path / "run", [*base, "model.n_layers=3", "model.d_ff=200"])
    assert str(info.value) == (
        f"checkpoint.init_from={source} is a Hugging Face model with model.n_layers=2, model.d_ff=176; the command "
        "line sets model.n_layers=3, model.d_ff=200: leave them out to take its shape, or start from another model"
    )
    # A preset sets its keys: llama-tiny's d_ff (176), norm, heads agree, its kv heads (2) do not.
    with pytest.raises(ConfigError, match=r"with model\.n_kv_heads=1; the command line sets model\.n_kv_heads=2:"):
        adopted(tmp_path / "run", [*base, "model=llama-tiny"])
    # Keys that agree, and a shorter RoPE window, are kept; the rest is the source's.
    cfg = adopted(tmp_path / "run", [*base, "model.n_layers=2", "model.seq_len=32"])
    assert cfg.model.seq_len == 32 and cfg.model.n_kv_heads == 1 and cfg.model.name == "src"
    assert check_init_from(cfg, tmp_path / "run").path == source
    # run() itself refuses a config that was not made to agree (tests and tools call it directly).
    with pytest.raises(ConfigError) as info:
        check_init_from(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=600)), tmp_path)
    assert str(info.value) == (
        f"checkpoint.init_from={source} is a Hugging Face model with model.vocab_size=512; this run's config has "
        "model.vocab_size=600: leave it out to take its shape, or start from another model"
    )


def test_a_run_on_shorter_windows_exports_the_context_scaling_and_token_ids_of_its_source(tmp_path):
    """A Llama 3.2-like source (512 positions, llama3 RoPE scaling, bos / eos ids) started at model.seq_len=32: the
    run's config, which its checkpoints hold, keeps the source's context and ids, and so does a run started from
    that checkpoint at 16; their export says 512 positions, the scaling and the ids again, not 32."""
    hf_cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=512, bos_token_id=3, eos_token_id=[4, 5], rope_scaling=dict(LLAMA3_SCALING),
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(hf_cfg).save_pretrained(tmp_path / "src")
    base = ["wandb.mode=disabled", "model.seq_len=32"]
    cfg = adopted(tmp_path / "run", [*base, f"checkpoint.init_from={tmp_path / 'src'}"])
    assert (cfg.model.seq_len, cfg.model.context_len, cfg.model.bos_id, cfg.model.eos_ids) == (32, 512, 3, [4, 5])
    assert estimate(cfg.model, Layout()).total_params > 0  # the estimator the run calls keys its caches by the config
    # What the run saves: the source's weights under the run's config (training changes the weights, not the config).
    weights = dataclasses.replace(load_weights(tmp_path / "src"), config=dataclasses.asdict(cfg))
    checkpoint = write_checkpoint(weights, tmp_path / "run" / "checkpoints")
    again = adopted(tmp_path / "again", [*base[:1], "model.seq_len=16", f"checkpoint.init_from={checkpoint}"])
    assert (again.model.seq_len, again.model.context_len, again.model.eos_ids) == (16, 512, [4, 5])
    for config in (cfg, again):
        write_hf(dataclasses.replace(weights, config=dataclasses.asdict(config)), tmp_path / "hf")
        exported = json.loads((tmp_path / "hf" / "config.json").read_text())
        assert (exported["max_position_embeddings"], exported["bos_token_id"], exported["eos_token_id"]) == (
            512, 3, [4, 5],
        )  # fmt: skip
        assert exported["rope_scaling"] == LLAMA3_SCALING
        loaded = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
        assert loaded.max_position_embeddings == 512 and loaded.rope_parameters["factor"] == 32.0


@pytest.mark.multiprocess
def test_train_py_exits_2_with_one_line_on_a_contradicting_key(tmp_path):
    source = hf_model("gpt2", tmp_path / "src")
    args = [f"checkpoint.init_from={source}", "model=gpt-tiny", "model.n_layers=4", "wandb.mode=disabled"]
    done = run_train(tmp_path / "run", args, env=dict(os.environ), timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr == (
        f"error: checkpoint.init_from={source} is a Hugging Face model with model.n_layers=2; the command line sets "
        "model.n_layers=4: leave it out to take its shape, or start from another model\n"
    )


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_converted_checkpoint_and_the_directory_load_the_same_weights(kind, tmp_path):
    """init_from reads a Hugging Face directory and its ``convert_checkpoint --from hf`` checkpoint alike (one
    process here): the model then gives transformers' logits."""
    source = hf_model(kind, tmp_path / "src")
    write_checkpoint(load_weights(source), tmp_path / "ck")
    hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    for path in (source, tmp_path / "ck"):
        init = open_source(str(path))
        cfg = ModelConfig(**init.model)
        model = GPT(cfg)
        init_weights(model, cfg, seed=1)
        load_init_weights([model], init)
        with torch.no_grad():
            assert (model.eval()(ids) - hf(ids).logits).abs().max() < 1e-4, path


@pytest.mark.multiprocess
def test_the_readme_command_continues_pretraining_a_hugging_face_llama_with_its_own_tokenizer(tmp_path):
    """docs/models.md's one command, at world 1: ``train.py checkpoint.init_from=DIR data.tokenizer=DIR data.text=...``
    with no model key takes the model from the directory (Llama 3.2's scaled RoPE, a shorter window), tokenizes with
    its tokenizer.json, and trains from the source's weights (its first loss is the source's own on that batch);
    the checkpoint exports back to a LlamaForCausalLM of that shape."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    text = sorted(Path(sysconfig.get_paths()["stdlib"], "json").glob("*.py"))
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|end_of_text|>"], initial_alphabet=alphabet)
    tokenizer.train([str(f) for f in text], trainer)
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
    hf_cfg = transformers.LlamaConfig(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0,
        tie_word_embeddings=True, rope_scaling={**scaling, "original_max_position_embeddings": 64},
        initializer_range=0.2,
    )  # fmt: skip
    torch.manual_seed(0)
    source = tmp_path / "llama"
    hf = transformers.LlamaForCausalLM(hf_cfg)
    hf.save_pretrained(source)
    tokenizer.save(str(source / "tokenizer.json"))
    run = tmp_path / "run"
    args = [
        f"checkpoint.init_from={source}", "model.seq_len=128",
        f"data.tokenizer={source}", f"data.text=[{text[0].parent}]", f"data.cache_dir={tmp_path / 'cache'}",
        "train.steps=3", "train.global_batch_size=8", "train.micro_batch_size=4", "train.eval_every=0",
        "wandb.mode=disabled", "logging.peak_tflops=1",
    ]  # fmt: skip
    done = run_train(run, args, env=dict(os.environ), cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"initialised from the Hugging Face model {source} (step 0, fresh optimizer)" in done.stdout
    # The source's weights, not a fresh init's: its loss on the first batch, far from a fresh init's log(vocab).
    first = float(done.stdout.split("step 1/3 | loss ")[1].split()[0])
    x, y = first_batch(adopted(tmp_path / "again", args))
    with torch.no_grad():
        expected = F.cross_entropy(hf.eval()(x).logits.flatten(0, 1).double(), y.flatten()).item()
    assert abs(expected - math.log(tokenizer.get_vocab_size())) > 0.5, expected
    assert abs(first - expected) <= 1e-3 * expected, (first, expected)
    saved = load_weights(run / "checkpoints")
    model = saved.config["model"]
    assert (model["n_layers"], model["d_model"], model["n_kv_heads"], model["seq_len"]) == (2, 64, 2, 128)
    assert (model["rope_scaling"], model["rope_factor"], model["rope_original_seq_len"]) == ("llama3", 32.0, 64)
    # Trained on 128-token windows, the model keeps the source's 256 positions, and its export says so.
    write_hf(saved, tmp_path / "hf")
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "hf")
    assert exported.max_position_embeddings == model["max_seq_len"] == 256
    assert exported.rope_parameters["rope_type"] == "llama3" and exported.rope_parameters["factor"] == 32.0
    assert (run / "checkpoints" / "step_00000003" / "tokenizer.json").read_bytes() == (
        source / "tokenizer.json"
    ).read_bytes()
