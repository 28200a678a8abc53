"""model.vocab_size follows the data's tokenizer when the command line leaves it out (trident/data/vocab.py): a
prepared dataset's, every mixture source's, or a given tokenizer's; a value the command line sets is kept, and one
smaller than the tokenizer is a one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.helpers import REPO, SMALL_CORPUS
from tests.helpers.processes import output_lines, run_train
from trident.data.mixture import open_training_data
from trident.data.sources import collect_text_files
from trident.errors import ConfigError, DataError
from trident_dev.tool_config import load_config

CONF = REPO / "conf"
HF_VOCAB = 600  # more than gpt-tiny's 512


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer.json of HF_VOCAB pieces, trained offline by the tokenizers library."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=HF_VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = collect_text_files(SMALL_CORPUS[:1], [".py"])
    tok.train([str(p) for p in files], trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    assert Tokenizer.from_file(str(path)).get_vocab_size() == HF_VOCAB
    return path


def test_a_prepared_dataset_sets_the_vocabulary(tiny_dataset):
    # gpt-mini's preset says 8192; the dataset's tokenizer has 512 pieces.
    cfg = load_config(CONF, ["model=gpt-mini", f"data.dataset_dir={tiny_dataset}"])
    assert cfg.model.vocab_size == 512
    # Every source of a mixture shares the one tokenizer: the first one's is the mixture's.
    cfg = load_config(CONF, ["model=gpt-mini", f"data.mix=[{tiny_dataset}:1]"])
    assert cfg.model.vocab_size == 512


def test_a_given_tokenizer_sets_the_vocabulary(hf_tokenizer):
    cfg = load_config(CONF, ["model=gpt-tiny", f"data.tokenizer={hf_tokenizer}"])
    assert cfg.model.vocab_size == HF_VOCAB


def test_an_explicit_vocabulary_is_kept(tiny_dataset, hf_tokenizer):
    cfg = load_config(CONF, ["model=gpt-tiny", "model.vocab_size=1024", f"data.dataset_dir={tiny_dataset}"])
    assert cfg.model.vocab_size == 1024
    # A checkpoint's model keeps its own vocabulary (checkpoint.init_from says the shape).
    cfg = load_config(CONF, ["model=gpt-mini", f"data.dataset_dir={tiny_dataset}", "checkpoint.init_from=/nowhere"])
    assert cfg.model.vocab_size == 8192
    # Text without a tokenizer trains one of model.vocab_size pieces: nothing to follow.
    cfg = load_config(CONF, ["model=gpt-mini", f"data.text=[{SMALL_CORPUS[0]}]"])
    assert cfg.model.vocab_size == 8192


def test_an_explicit_smaller_vocabulary_is_one_line(tiny_dataset, hf_tokenizer):
    cfg = load_config(CONF, ["model=gpt-tiny", "model.vocab_size=300", f"data.dataset_dir={tiny_dataset}"])
    with pytest.raises(DataError) as e:
        open_training_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len, 8, None)
    assert "\n" not in str(e.value) and "model.vocab_size >= 512" in str(e.value)
    cfg = load_config(CONF, ["model=gpt-tiny", "model.vocab_size=512", f"data.tokenizer={hf_tokenizer}"])
    with pytest.raises(ConfigError) as e:
        open_training_data(cfg.data, cfg.model.vocab_size, cfg.model.seq_len, 8, None)
    assert "\n" not in str(e.value) and f"model.vocab_size>={HF_VOCAB}" in str(e.value)


@pytest.mark.multiprocess
def test_train_follows_the_tokenizer(hf_tokenizer, tmp_path):
    """The command a user types: gpt-tiny's preset has 512 ids, the tokenizer 600; the run trains with 600."""
    proc = run_train(
        tmp_path / "run",
        [
            "model=gpt-tiny",
            f"data.text=[{SMALL_CORPUS[0]}]",
            f"data.tokenizer={hf_tokenizer}",
            f"data.cache_dir={tmp_path / 'cache'}",
            "train.steps=1",
            "train.global_batch_size=2",
            "train.micro_batch_size=2",
            "train.eval_every=0",
            "wandb.mode=disabled",
        ],
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"model.vocab_size={HF_VOCAB}, from the tokenizer of data.tokenizer={hf_tokenizer}" in proc.stdout
    lines = output_lines(proc.stdout)
    assert any("step 1" in line or "step     1" in line for line in lines), proc.stdout[-2000:]
