"""Export to Hugging Face GPT-2: a checkpoint saved at tp=2 becomes a directory ``transformers`` loads, with our
logits and the run's tokenizer beside it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import sentencepiece as spm
import torch
import transformers

from tests.helpers.layouts import tiny, train_in_process
from tests.helpers.tools import run_tool
from trident.config import ModelConfig
from trident.models.gpt import GPT, init_weights
from trident.parallel.placement import placement_of
from trident_dev.consolidated import ModelWeights, from_checkpoint, read_model_tensors
from trident_dev.export import model_config, write_hf


def ours(checkpoint: Path) -> GPT:
    """The one-process trident model of a checkpoint's logical tensors."""
    model = GPT(model_config(from_checkpoint(checkpoint)))
    tensors = read_model_tensors(checkpoint)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(placement_of(param).shard(tensors[name]))
    return model.eval()


@pytest.mark.multiprocess
def test_a_tp2_checkpoint_exports_to_hf_gpt2_with_our_logits(tiny_dataset, tmp_path, monkeypatch, capsys):
    # vocab 515 (padded at tp=2 to 640 rows, none of them exported) and an MLP width that is not 4 * d_model.
    overrides = ["model.vocab_size=515", "model.d_ff=96", "parallel.tp=2", "train.steps=2", "train.eval_every=0"]
    train_in_process(tmp_path / "run", tiny(tiny_dataset, "train.micro_batch_size=8", *overrides), world=2)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000002"
    out = tmp_path / "hf"

    code, _, err = run_tool(
        "convert_checkpoint", str(checkpoint.parent), "--to", "hf", "--out", str(out), monkeypatch=monkeypatch,
        capsys=capsys,
    )  # fmt: skip
    assert code == 0, err
    assert err == f"wrote {out}: config.json, model.safetensors, tokenizer.model from {checkpoint} (step 2)\n"
    assert (out / "tokenizer.model").read_bytes() == (tiny_dataset / "tokenizer.model").read_bytes()

    hf, info = transformers.GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info  # every weight came from the file: none left at its random init
    hf.eval()
    assert hf.config.vocab_size == 515 and hf.config.n_positions == 64 and hf.config.n_inner == 96

    # Text through the exported tokenizer, and ids past it (512..514) that only the model's vocab has.
    sp = spm.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    text = sp.encode(2 * "def dumps(obj, *, skipkeys=False):\n    return json.loads(obj)\n")[:61] + [512, 513, 514]
    ids = torch.stack(
        [torch.tensor(text), torch.randint(0, 515, (len(text),), generator=torch.Generator().manual_seed(0))]
    )
    with torch.no_grad():
        expected = ours(checkpoint)(ids)
        got = hf(ids).logits
    assert got.shape == expected.shape == (2, 64, 515)
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


def test_a_bad_target_is_refused_in_one_line_before_the_checkpoint_is_read(tmp_path, monkeypatch, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("mine")
    for args, line in [
        (
            ["--to", "onnx", "--out", str(tmp_path / "x")],
            "error: --to onnx is not a target; use --to consolidated or --to hf",
        ),
        (["--to", "hf", "--out", str(a_file)], f"error: --out {a_file} is a file; --to hf writes a directory"),
    ]:
        code, _, err = run_tool(
            "convert_checkpoint", str(tmp_path / "none"), *args, monkeypatch=monkeypatch, capsys=capsys
        )
        assert code == 2 and err.startswith(line) and err.count("\n") == 1, err
    assert a_file.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_a_model_without_biases_exports_with_zero_biases(tmp_path):
    """model.bias=false: GPT-2 always has biases; zero ones are the same function."""
    cfg = ModelConfig(n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=70, bias=False)
    model = GPT(cfg)
    init_weights(model, cfg, seed=3)
    # The logical tensors: at tp=1 each parameter's real part (the embedding without its padding rows).
    tensors = {name: placement_of(p).real_part(p.detach()) for name, p in model.named_parameters()}
    write_hf(ModelWeights(tensors, {"model": dataclasses.asdict(cfg)}, 0, None, tmp_path), tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = torch.randint(0, 70, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model.eval()(ids), rtol=0, atol=2e-5)
