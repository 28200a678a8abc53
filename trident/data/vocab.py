"""The model's vocabulary taken from the data's tokenizer, as torchtitan and Megatron take it.

A dataset prepared with its own tokenizer (``data.dataset_dir``, every ``data.mix`` source) or text tokenized with
a given one (``data.tokenizer``) fixes how many ids the embedding must hold. When the command line does not set
``model.vocab_size`` itself, the model follows that tokenizer (the table is padded as always,
``model.vocab_multiple``); a value it does set is kept, and one smaller than the tokenizer stays the one-line error
``resolve_dataset`` gives. Text with no tokenizer given trains one of ``model.vocab_size`` pieces, so nothing follows.
A checkpoint's model (``checkpoint.init_from``) keeps its own vocabulary.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path

from trident.config import Config, DataConfig, mix_entry
from trident.data.meta import load_meta
from trident.data.tokenizer import load_tokenizer
from trident.errors import DataError


def data_vocab(data: DataConfig) -> tuple[int, str] | None:
    """The vocabulary size ``data``'s tokenizer has and where it comes from (a key=value), or None when the data
    trains its own tokenizer or cannot be read yet (opening the data then says what is wrong, in its place)."""
    if data.mix:
        parsed = mix_entry(data.mix[0])
        where, d = (f"data.mix source {parsed[0]}", parsed[0]) if parsed else (None, None)
    elif data.dataset_dir is not None:
        where, d = f"data.dataset_dir={data.dataset_dir}", data.dataset_dir
    elif data.tokenizer is not None:
        try:
            return load_tokenizer(data.tokenizer).vocab_size, f"data.tokenizer={data.tokenizer}"
        except (DataError, OSError, ValueError):
            return None
    else:
        return None
    if d is None:
        return None
    try:
        return int(load_meta(Path(d))["vocab_size"]), where
    except (DataError, OSError, ValueError, KeyError, TypeError):
        return None


def sets_vocab(overrides: Iterable[str]) -> bool:
    """Whether a command line sets model.vocab_size itself (a preset ``model=NAME`` does not: its vocabulary is
    the one of the tokenizer it was made for, which the data may not use)."""
    return any(o.lstrip("+~").partition("=")[0] == "model.vocab_size" for o in overrides)


def adopt_data_vocab(cfg: Config, overrides: Iterable[str]) -> tuple[Config, str | None]:
    """``cfg`` with model.vocab_size of the data's tokenizer when the command line leaves it out, and the line that
    says so (None when nothing changed)."""
    if cfg.checkpoint.init_from is not None or sets_vocab(overrides):
        return cfg, None
    found = data_vocab(cfg.data)
    if found is None or found[0] == cfg.model.vocab_size:
        return cfg, None
    vocab, where = found
    line = (
        f"model.vocab_size={vocab}, from the tokenizer of {where} (the preset says {cfg.model.vocab_size}; "
        "set model.vocab_size to choose)"
    )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab)), line
