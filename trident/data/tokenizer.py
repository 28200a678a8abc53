"""A tokenizer as trident uses it: a sentencepiece model (what trident trains, ``tokenizer.model``) or a Hugging
Face ``tokenizer.json`` (the ``tokenizers`` package: what Llama 3 and most Hub models ship), behind one interface.

A tokenizer travels as its file: a prepared dataset, a checkpoint and a Hugging Face export each hold it under its
own name (``FILE_NAMES``), so the file that tokenized the data is the one that decodes the samples.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import sentencepiece as spm

from trident.errors import ConfigError, DataError

SENTENCEPIECE, HF = "tokenizer.model", "tokenizer.json"
FILE_NAMES = (SENTENCEPIECE, HF)
EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|eot_id|>")
_BOS_TOKENS = ("<|begin_of_text|>", "<s>", "<bos>")


class TokenizerFileError(DataError):
    """A tokenizer file its library cannot read; ``library`` names that library and ``detail`` says what it said."""

    def __init__(self, where: str, library: str, detail: str) -> None:
        super().__init__(f"cannot read tokenizer {where}: {detail}")
        self.library, self.detail = library, detail


class Tokenizer:
    """``file_name`` (one of FILE_NAMES) and its bytes ``data``; ``vocab_size`` ids (its largest id + 1: the ids a
    model must cover), ``eos_id`` (ends every document of a dataset) and ``bos_id`` (None when the tokenizer has
    none)."""

    file_name: str
    data: bytes
    vocab_size: int
    eos_id: int | None
    bos_id: int | None
    # How ``encode`` reads the file, beside its bytes: part of what a prepared dataset is keyed by, so that shards a
    # trident that added no special tokens wrote are never taken for this encoding's. Empty: the file alone says.
    encoding: str = ""
    # Threads ``encode_batch`` may use (None: every CPU this process may run on); a worker process among several
    # sets 1.
    threads: int | None = None

    @property
    def sha256(self) -> str:
        """The hex sha256 of the file: what a dataset records, and what tells one tokenizer from another."""
        return hashlib.sha256(self.data).hexdigest()

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, with the special tokens the tokenizer file says to add (a ``tokenizer.json``'s
        post-processor; a sentencepiece model says none)."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: list[int]) -> str:
        raise NotImplementedError


class SentencePieceTokenizer(Tokenizer):
    file_name = SENTENCEPIECE

    def __init__(self, data: bytes, where: str = "tokenizer.model") -> None:
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=data)
        except Exception as e:  # sentencepiece raises RuntimeError or its own errors on a bad model
            raise TokenizerFileError(where, "sentencepiece", " ".join(str(e).split())) from None
        self.data = data
        self.vocab_size = self.sp.get_piece_size()
        self.eos_id = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.bos_id = self.sp.bos_id() if self.sp.bos_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, num_threads=self.threads or _threads())

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)


class HFTokenizer(Tokenizer):
    """A ``tokenizer.json``. Encoding adds the special tokens its post-processor adds, as transformers'
    ``tokenizer(text)`` does: Llama 2 / 3's put their BOS (``<s>``, ``<|begin_of_text|>``) before every text, which a
    model continued from them expects at the start of each document and of each prompt. The vocabulary size counts
    the added tokens too (Llama 3: 128000 + 256 special = 128256)."""

    file_name = HF
    encoding = "+special-tokens"

    def __init__(self, data: bytes, where: str = "tokenizer.json") -> None:
        from tokenizers import Tokenizer as Backend  # only runs that use a Hugging Face tokenizer need the package

        try:
            self.tok = Backend.from_str(data.decode("utf-8"))
        except Exception as e:  # tokenizers raises its own Exception subclasses; a bad file may not be UTF-8
            raise TokenizerFileError(where, "tokenizers", " ".join(str(e).split())) from None
        self.data = data
        # The largest id + 1, not the count: added tokens may leave ids unused, and every id must fit the model.
        self.vocab_size = max(self.tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.eos_id = next((i for t in EOS_TOKENS if (i := self.tok.token_to_id(t)) is not None), None)
        self.bos_id = next((i for t in _BOS_TOKENS if (i := self.tok.token_to_id(t)) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


def _threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def tokenizer_from_bytes(file_name: str, data: bytes, where: str | None = None) -> Tokenizer:
    if file_name == SENTENCEPIECE:
        return SentencePieceTokenizer(data, where or file_name)
    if file_name == HF:
        return HFTokenizer(data, where or file_name)
    raise DataError(f"{where or file_name}: a tokenizer is a sentencepiece {SENTENCEPIECE} or a Hugging Face {HF}")


def find_tokenizer_file(directory: Path) -> Path | None:
    """The tokenizer file a directory holds (a dataset, a checkpoint, a Hugging Face model), or None. A Hugging Face
    directory may hold both (Llama 2's): its tokenizer.json is the one transformers loads, whose post-processor
    says which special tokens to add; trident's own directories hold one."""
    for name in (HF, SENTENCEPIECE):
        if (directory / name).is_file():
            return directory / name
    return None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A sentencepiece ``.model``, a ``tokenizer.json``, or a directory holding one of them."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = find_tokenizer_file(path)
        if found is None:
            raise DataError(f"{path} holds no {SENTENCEPIECE} or {HF}")
        path = found
    if path.suffix == ".json":
        name = HF
    elif path.suffix == ".model":
        name = SENTENCEPIECE
    else:
        raise DataError(f"{path} is not a tokenizer: give a sentencepiece .model, a tokenizer.json or their directory")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read tokenizer {path}: {e.strerror or e}") from None
    return tokenizer_from_bytes(name, data, str(path))


def check_eos(tokenizer: Tokenizer, where: str) -> None:
    """A dataset ends every document with eos: a tokenizer without one cannot make it."""
    if tokenizer.eos_id is None:
        which = "its eos id is -1" if tokenizer.file_name == SENTENCEPIECE else f"none of {' '.join(EOS_TOKENS)}"
        raise DataError(
            f"tokenizer {where} has no end-of-text token ({which}), and a dataset ends every document with one; "
            "use a tokenizer that has one"
        )


def check_vocab_fit(tokenizer: Tokenizer, where: str, vocab_size: int) -> None:
    """The model's embedding must have a row for every id of the tokenizer (more rows are fine: unused)."""
    if tokenizer.vocab_size > vocab_size:
        raise ConfigError(
            f"tokenizer {where} has a vocabulary of {tokenizer.vocab_size} but model.vocab_size is {vocab_size}; "
            f"set model.vocab_size>={tokenizer.vocab_size}"
        )
