"""data.tokenizer: datasets tokenized with an existing tokenizer (a Hugging Face tokenizer.json trained here with the
``tokenizers`` package, or a sentencepiece model trained by trident's own prepare code), on standard-library text."""

from __future__ import annotations

import hashlib
import json
import shutil
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from tests.helpers.layouts import tiny, train_in_process
from tests.helpers.processes import tool_process
from trident.config import DataConfig
from trident.data.dataset import TokenDataset, open_dataset
from trident.data.meta import load_meta
from trident.data.prepare import prepare_dataset, resolve_dataset, token_dtype
from trident.data.sources import collect_text_files
from trident.data.tokenizer import FILE_NAMES, HFTokenizer, SentencePieceTokenizer, load_tokenizer
from trident.errors import ConfigError, DataError

HF_VOCAB = 600  # the trained tokenizer.json: 599 BPE pieces and <|endoftext|>
SP_VOCAB = 512
TRICKY = "def f():\n\tif x:\n        return 'héllo ☃'\n\n\n  \r\n"


def quiet(msg: str) -> None:
    pass


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("corpus")
    shutil.copytree(Path(sysconfig.get_paths()["stdlib"]) / "json", root / "json", ignore=shutil.ignore_patterns("_*"))
    return root


@pytest.fixture(scope="module")
def files(corpus) -> list[Path]:
    return collect_text_files([str(corpus)], [".py"])


def _train_hf(files: list[Path], vocab_size: int, special: list[str]) -> str:
    """A byte-level BPE tokenizer.json (GPT-2's kind) trained on ``files``."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    tok.train([str(p) for p in files], trainer)
    return tok.to_str()


@pytest.fixture(scope="module")
def hf_json(files, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    path.write_text(_train_hf(files, HF_VOCAB, ["<|endoftext|>"]))
    return path


@pytest.fixture(scope="module")
def sp_model(files, tmp_path_factory) -> Path:
    """The sentencepiece model trident trains for a dataset, kept under another name (any .model loads)."""
    d = prepare_dataset(files, tmp_path_factory.mktemp("sp") / "trained", SP_VOCAB, log=quiet)
    return Path(shutil.copy(d / "tokenizer.model", d.parent / "mine.model"))


@pytest.fixture(params=["tokenizer.json", "sentencepiece"])
def tokenizer_file(request, hf_json, sp_model) -> Path:
    return hf_json if request.param == "tokenizer.json" else sp_model


def _texts(files: list[Path]) -> list[str]:
    return [t for t in (p.read_text(encoding="utf-8") for p in files) if t]


def test_hf_tokenizer_round_trips(hf_json, files):
    tok = load_tokenizer(hf_json)
    assert isinstance(tok, HFTokenizer) and tok.file_name == "tokenizer.json"
    assert tok.vocab_size == HF_VOCAB and tok.eos_id == 0 and tok.bos_id is None
    assert tok.data == hf_json.read_bytes() and tok.sha256 == hashlib.sha256(hf_json.read_bytes()).hexdigest()
    texts = [*_texts(files), TRICKY]
    batch = tok.encode_batch(texts)
    for text, ids in zip(texts, batch, strict=True):
        assert ids == tok.encode(text) and tok.eos_id not in ids  # its post-processor adds none
        assert max(ids) < tok.vocab_size and tok.decode(ids) == text
    assert sum(map(len, batch)) < sum(map(len, texts)) / 2  # it really merged pieces
    assert load_tokenizer(hf_json.parent).data == tok.data  # a directory holding it


def test_a_directory_with_both_files_gives_the_tokenizer_json_as_transformers_does(sp_model, tmp_path):
    """A Llama 2 directory ships tokenizer.model and tokenizer.json: transformers loads the tokenizer.json, whose
    post-processor puts BOS first, and so does trident."""
    from tests.helpers.hf import BOS, save_bos_tokenizer

    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    save_bos_tokenizer(tmp_path, 10)
    tok = load_tokenizer(tmp_path)
    assert tok.file_name == "tokenizer.json" and tok.encode("w1 w2") == [BOS, 4, 5]


def test_sentencepiece_tokenizer_round_trips(sp_model, files):
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer) and tok.file_name == "tokenizer.model"
    assert tok.vocab_size == SP_VOCAB and tok.eos_id == 1 and tok.bos_id is None
    texts = [*_texts(files), TRICKY]
    for text, ids in zip(texts, tok.encode_batch(texts), strict=True):
        assert ids == tok.encode(text) and max(ids) < SP_VOCAB and tok.decode(ids) == text


def _tokens(dataset: Path, dtype: type) -> np.ndarray:
    """The dataset's tokens read straight from its shard files, in shard order."""
    names = [r["name"] for r in load_meta(dataset)["shards"]]
    return np.concatenate([np.fromfile(dataset / "shards" / f"{name}.bin", dtype=dtype) for name in names])


def _documents(tokens: np.ndarray, eos: int) -> list[np.ndarray]:
    return np.split(tokens, np.flatnonzero(tokens == eos) + 1)[:-1]


def test_a_dataset_records_its_tokenizer_and_holds_its_encoding(tokenizer_file, files, tmp_path):
    tok = load_tokenizer(tokenizer_file)
    out = prepare_dataset(files, tmp_path / "ds", tokenizer=tok, log=quiet)
    assert sorted(p.name for p in out.iterdir()) == sorted(["meta.json", "shards", tok.file_name])
    assert (out / tok.file_name).read_bytes() == tokenizer_file.read_bytes()
    meta = load_meta(out)
    recorded = {k: meta[k] for k in ("tokenizer_file", "tokenizer_sha256", "vocab_size", "eos_id", "dtype")}
    sha = hashlib.sha256(tokenizer_file.read_bytes()).hexdigest()
    assert recorded == {
        "tokenizer_file": tok.file_name,
        "tokenizer_sha256": sha,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "dtype": "uint16",
    }
    expected = [i for text in _texts(files) for i in [*tok.encode(text), tok.eos_id]]
    tokens = _tokens(out, np.uint16)
    assert tokens.tolist() == expected and meta["n_tokens"] == len(expected) == len(tokens)
    assert meta["n_documents"] == len(_texts(files)) == len(_documents(tokens, tok.eos_id))
    ds = TokenDataset(out)
    assert ds.tokenizer_path == out / tok.file_name and ds.vocab_size == tok.vocab_size and ds.eos_id == tok.eos_id
    ds.check_tokenizer()


@pytest.mark.parametrize("template", ["<s> $A", "<s> $A </s>"])
def test_each_document_holds_the_special_tokens_transformers_tokenizer_gives_it(template, tmp_path):
    """A tokenizer.json whose post-processor puts BOS before every text (Llama 2 / 3's): each document of the dataset
    is what transformers' ``tokenizer(text)`` gives, then eos, once (a tokenizer that ends its texts with eos itself
    gets no second). Packed, the eos that ends a document opens the next (parallel/batch.py), its BOS right after."""
    import transformers

    from tests.helpers.hf import BOS, EOS, save_bos_tokenizer
    from trident.parallel.batch import document_ids

    texts = [" ".join(f"w{(7 * d + i) % 40}" for i in range(2 + d)) for d in range(6)]
    (tmp_path / "text").mkdir()
    files = []
    for d, text in enumerate(texts):
        files.append(tmp_path / "text" / f"{d}.txt")
        files[-1].write_text(text)
    path = save_bos_tokenizer(tmp_path, 40, template)
    out = prepare_dataset(files, tmp_path / "ds", tokenizer=load_tokenizer(path), log=quiet)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path))
    expected = [hf(text)["input_ids"] for text in texts]
    assert all(ids[0] == BOS for ids in expected) and (expected[0][-1] == EOS) == template.endswith("</s>")
    tokens = _tokens(out, np.uint16)
    assert tokens.tolist() == [i for ids in expected for i in (ids if ids[-1] == EOS else [*ids, EOS])]
    assert load_meta(out)["n_documents"] == len(texts)
    docs = document_ids(torch.as_tensor(tokens[None].astype(np.int64)), EOS)[0]
    for d in range(1, len(texts)):
        assert tokens[(docs == d).numpy()][:2].tolist() == [EOS, BOS]


def test_preparing_again_with_another_tokenizer_replaces_the_dataset(files, hf_json, sp_model, tmp_path):
    out = prepare_dataset(files, tmp_path / "ds", tokenizer=load_tokenizer(sp_model), log=quiet)
    prepare_dataset(files, out, tokenizer=load_tokenizer(hf_json), log=quiet)
    assert sorted(p.name for p in out.iterdir()) == ["meta.json", "shards", "tokenizer.json"]
    assert TokenDataset(out).tokenizer_path == out / "tokenizer.json"
    # meta.json, not the files that happen to lie there, says which tokenizer the dataset holds.
    (out / "tokenizer.model").write_bytes(sp_model.read_bytes())
    with pytest.raises(DataError, match=r"prepared with \(its tokenizer.json"):
        open_dataset(DataConfig(dataset_dir=str(out), tokenizer=str(sp_model)), 1024)


def test_ids_past_65535_are_stored_as_uint32(files, hf_json, tmp_path):
    """A tokenizer.json whose ids start at 70000 (the trained one, renumbered): its vocab_size is its largest id + 1,
    not its count of tokens, and the shards take uint32."""
    spec = json.loads(hf_json.read_text())
    spec["model"]["vocab"] = {piece: i + 70_000 for piece, i in spec["model"]["vocab"].items()}
    for added in spec["added_tokens"]:
        added["id"] += 70_000
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(spec))
    tok = load_tokenizer(path)
    assert (tok.vocab_size, tok.eos_id, tok.tok.get_vocab_size()) == (70_000 + HF_VOCAB, 70_000, HF_VOCAB)
    assert (token_dtype(1 << 16), token_dtype((1 << 16) + 1), token_dtype(128_256)) == (np.uint16, np.uint32, np.uint32)
    out = prepare_dataset(files, tmp_path / "ds", tokenizer=tok, log=quiet)
    meta = load_meta(out)
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_600
    tokens = _tokens(out, np.uint32)
    docs = _documents(tokens, 70_000)
    assert [tok.decode(d[:-1].tolist()) for d in docs] == _texts(files) and tokens.min() >= 70_000


def _cfg(corpus: Path, cache: Path, tokenizer: Path | None = None) -> DataConfig:
    return DataConfig(
        text=[str(corpus)], suffixes=[".py"], cache_dir=str(cache), tokenizer=tokenizer and str(tokenizer)
    )


def test_the_cache_key_is_the_tokenizer_file(corpus, files, hf_json, sp_model, tmp_path):
    cache = tmp_path / "cache"
    logs: list[str] = []
    by_json = resolve_dataset(_cfg(corpus, cache, hf_json), 1024, log=logs.append)
    assert sum("preparing dataset" in line for line in logs) == 1
    assert resolve_dataset(_cfg(corpus, cache, hf_json), 1024, log=logs.append) == by_json
    # The key is the file's content, not its path or the model's vocabulary (the tokenizer decides the ids).
    elsewhere = tmp_path / "copy" / "tokenizer.json"
    elsewhere.parent.mkdir()
    shutil.copy(hf_json, elsewhere)
    assert resolve_dataset(_cfg(corpus, cache, elsewhere), HF_VOCAB, log=logs.append) == by_json
    assert sum("preparing dataset" in line for line in logs) == 1
    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    other.write_text(_train_hf(files, HF_VOCAB - 50, ["<|endoftext|>"]))
    by_other = resolve_dataset(_cfg(corpus, cache, other), 1024, log=quiet)
    by_sp = resolve_dataset(_cfg(corpus, cache, sp_model), 1024, log=quiet)
    trained = resolve_dataset(_cfg(corpus, cache), SP_VOCAB, log=quiet)
    assert len({by_json, by_other, by_sp, trained}) == 4
    assert load_meta(by_other)["vocab_size"] == HF_VOCAB - 50 and load_meta(trained)["vocab_size"] == SP_VOCAB
    assert open_dataset(_cfg(corpus, cache, hf_json), 1024).tokenizer_path == by_json / "tokenizer.json"


def test_a_model_vocabulary_smaller_than_the_tokenizer_is_refused(corpus, tokenizer_file, tmp_path):
    n = load_tokenizer(tokenizer_file).vocab_size
    cfg = _cfg(corpus, tmp_path / "cache", tokenizer_file)
    with pytest.raises(ConfigError) as e:
        open_dataset(cfg, n - 1)
    assert str(e.value) == (
        f"tokenizer data.tokenizer={tokenizer_file} has a vocabulary of {n} but model.vocab_size is {n - 1}; "
        f"set model.vocab_size>={n}"
    )
    assert not (tmp_path / "cache").exists()  # refused before preparing anything
    assert open_dataset(cfg, n).vocab_size == n
    assert open_dataset(cfg, n + 100).vocab_size == n  # a larger model vocabulary leaves rows unused


def test_a_tokenizer_without_eos_is_refused(corpus, files, tmp_path):
    no_eos = tmp_path / "tokenizer.json"
    no_eos.write_text(_train_hf(files, 400, []))
    sp_dir = tmp_path / "sp"
    sp_dir.mkdir()
    spm.SentencePieceTrainer.train(
        input=str(files[0]), model_prefix=str(sp_dir / "m"), vocab_size=300, eos_id=-1, bos_id=-1, minloglevel=2
    )
    sp_no_eos = sp_dir / "m.model"
    with pytest.raises(DataError) as e:
        open_dataset(_cfg(corpus, tmp_path / "cache", no_eos), 1024)
    assert str(e.value) == (
        f"tokenizer data.tokenizer={no_eos} has no end-of-text token (none of <|end_of_text|> <|endoftext|> </s> "
        "<eos> <|eot_id|>), and a dataset ends every document with one; use a tokenizer that has one"
    )
    with pytest.raises(DataError) as e:
        open_dataset(_cfg(corpus, tmp_path / "cache", sp_no_eos), 1024)
    assert str(e.value) == (
        f"tokenizer data.tokenizer={sp_no_eos} has no end-of-text token (its eos id is -1), and a dataset ends every "
        "document with one; use a tokenizer that has one"
    )
    with pytest.raises(DataError, match=r"^tokenizer tokenizer.json has no end-of-text token"):
        prepare_dataset(files, tmp_path / "ds", tokenizer=load_tokenizer(no_eos), log=quiet)
    assert not (tmp_path / "ds").exists()


def test_a_dataset_dir_with_another_tokenizer_is_refused(files, hf_json, sp_model, tmp_path):
    ds = prepare_dataset(files, tmp_path / "ds", tokenizer=load_tokenizer(hf_json), log=quiet)
    assert open_dataset(DataConfig(dataset_dir=str(ds), tokenizer=str(hf_json)), 1024).dir == ds
    with pytest.raises(DataError) as e:
        open_dataset(DataConfig(dataset_dir=str(ds), tokenizer=str(sp_model)), 1024)
    mine, theirs = hashlib.sha256(sp_model.read_bytes()).hexdigest(), hashlib.sha256(hf_json.read_bytes()).hexdigest()
    assert str(e.value) == (
        f"data.tokenizer={sp_model} (sha256 {mine[:12]}) is not the tokenizer data.dataset_dir={ds} was prepared with "
        f"(its tokenizer.json, sha256 {theirs[:12]}); drop data.tokenizer to use the dataset's own, or prepare the "
        f"dataset again: python tools/prepare_data.py --text YOUR_TEXT --out DIR --tokenizer {sp_model}"
    )


def test_a_dataset_from_before_the_record_stays_readable(files, sp_model, hf_json, tmp_path):
    """Datasets written before meta.json named the tokenizer: tokenizer.model, no tokenizer_file or sha256."""
    old = prepare_dataset(files, tmp_path / "old", SP_VOCAB, log=quiet)
    meta = json.loads((old / "meta.json").read_text())
    del meta["tokenizer_file"], meta["tokenizer_sha256"]
    (old / "meta.json").write_text(json.dumps(meta))
    ds = open_dataset(DataConfig(dataset_dir=str(old)), SP_VOCAB)
    assert ds.tokenizer_path == old / "tokenizer.model" and ds.tokenizer_sha256 is None and ds.vocab_size == SP_VOCAB
    # Its tokenizer's sha256 is its file's: the same tokenizer given as data.tokenizer fits, another does not.
    assert open_dataset(DataConfig(dataset_dir=str(old), tokenizer=str(sp_model)), SP_VOCAB).dir == old
    with pytest.raises(DataError, match="is not the tokenizer data.dataset_dir="):
        open_dataset(DataConfig(dataset_dir=str(old), tokenizer=str(hf_json)), 1024)


def test_a_damaged_or_swapped_tokenizer_json_is_refused(files, hf_json, tmp_path):
    ds = prepare_dataset(files, tmp_path / "ds", tokenizer=load_tokenizer(hf_json), log=quiet)
    hint = f"rebuild it: python tools/prepare_data.py --text YOUR_TEXT --out {ds} --tokenizer YOUR_TOKENIZER"
    path = ds / "tokenizer.json"
    path.write_text('{"version": "1.0", "model": ')
    with pytest.raises(DataError) as e:
        open_dataset(DataConfig(dataset_dir=str(ds)), 1024)
    message = str(e.value)
    assert message.startswith(f"dataset file {path} is damaged (tokenizers cannot load it: ") and "\n" not in message
    assert message.endswith(hint)
    # Another tokenizer of the same vocabulary and eos: only its sha256 tells.
    spec = json.loads(hf_json.read_text())
    spec["decoder"] = None
    path.write_text(json.dumps(spec))
    with pytest.raises(DataError) as e:
        open_dataset(DataConfig(dataset_dir=str(ds)), 1024)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    recorded = hashlib.sha256(hf_json.read_bytes()).hexdigest()
    assert (
        str(e.value)
        == f"dataset file {path} is damaged (sha256 {sha[:12]}, but meta.json says {recorded[:12]}); {hint}"
    )


@pytest.mark.multiprocess
def test_prepare_data_cli_takes_a_tokenizer(corpus, hf_json, tmp_path):
    out = tmp_path / "ds"
    r = tool_process(
        "prepare_data", "--text", str(corpus), "--out", str(out), "--tokenizer", str(hf_json), cwd=tmp_path
    )
    assert r.returncode == 0, r.stderr
    assert f"vocab {HF_VOCAB}, tokenizer.json" in r.stdout
    assert load_meta(out)["tokenizer_sha256"] == hashlib.sha256(hf_json.read_bytes()).hexdigest()
    both = tool_process(
        "prepare_data", "--out", str(tmp_path / "x"), "--tokenizer", str(hf_json), "--vocab-size", "512", cwd=tmp_path
    )
    assert both.returncode == 2 and "argument --vocab-size: not allowed with argument --tokenizer" in both.stderr
    neither = tool_process("prepare_data", "--out", str(tmp_path / "x"), cwd=tmp_path)
    assert neither.returncode == 2 and "one of the arguments --vocab-size --tokenizer is required" in neither.stderr
    missing = tool_process(
        "prepare_data",
        "--text",
        str(corpus),
        "--out",
        str(tmp_path / "x"),
        "--tokenizer",
        str(tmp_path / "no.json"),
        cwd=tmp_path,
    )
    assert missing.returncode == 2 and missing.stderr.startswith(f"error: cannot read tokenizer {tmp_path / 'no.json'}")
    assert missing.stderr.count("\n") == 1 and not (tmp_path / "x").exists()


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_training_with_a_tokenizer_json_keeps_it_in_the_checkpoint(model, corpus, hf_json, tmp_path):
    overrides = [o for o in tiny(Path("unused")) if not o.startswith("data.dataset_dir=")]
    overrides += [
        f"model={model}",
        f"model.vocab_size={HF_VOCAB + 40}",
        f"data.text=[{corpus}]",
        "data.suffixes=[.py]",
        f"data.tokenizer={hf_json}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "train.steps=3",
        "train.eval_every=0",
    ]
    history = train_in_process(tmp_path / "run", overrides)[0]
    assert [row["step"] for row in history] == [1, 2, 3]
    assert all(np.isfinite(row["loss"]) for row in history)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_00000003"
    # The checkpoint carries the dataset's tokenizer under its own name, byte for byte.
    held = [checkpoint / name for name in FILE_NAMES if (checkpoint / name).is_file()]
    assert held == [checkpoint / "tokenizer.json"] and held[0].read_bytes() == hf_json.read_bytes()
