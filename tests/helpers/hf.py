"""A Llama-style ``tokenizer.json`` built offline with the ``tokenizers`` package: a word-level vocabulary whose
post-processor puts ``<s>`` before every text, as Llama 2 / 3 tokenizers put their BOS, and ``</s>`` its end of
text."""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from tokenizers.processors import TemplateProcessing

BOS, EOS = 1, 2


def bos_tokenizer(n_words: int, template: str = "<s> $A") -> Tokenizer:
    """``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, then the words ``w0 w1 ...`` (``n_words`` of them), split on spaces;
    ``encode`` gives ``template`` (``<s> $A``, or ``<s> $A </s>`` for a tokenizer that ends each text too), as
    transformers' ``tokenizer(text)`` does."""
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(n_words))])}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    pair = f"{template} {template.replace('$A', '$B')}"
    tokenizer.post_processor = TemplateProcessing(
        single=template, pair=pair, special_tokens=[("<s>", BOS), ("</s>", EOS)]
    )
    return tokenizer


def save_bos_tokenizer(directory: Path, n_words: int, template: str = "<s> $A") -> Path:
    """``bos_tokenizer(n_words, template)`` saved as ``directory/tokenizer.json``; returns its path."""
    path = directory / "tokenizer.json"
    bos_tokenizer(n_words, template).save(str(path))
    return path
