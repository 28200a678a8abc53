"""The BPE tokenizer a dataset is prepared with when none is given: sentencepiece, trained on a uniform sample of
the corpus's lines with byte fallback, so that every byte sequence encodes losslessly and any text file works.

The tokenizer is a function of the text, the vocabulary size, the sample's size and the seed alone: the same on every
machine and every node that prepares the same data.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterable

import sentencepiece as spm

from trident.errors import DataError

# Byte fallback reserves 256 byte pieces; unk and eos come on top, and at least one character.
MIN_VOCAB = 256 + 2 + 1


def sample_lines(texts: Iterable[str], k: int, seed: int) -> list[str]:
    """A uniform sample of ``k`` non-empty lines of ``texts`` (reservoir sampling: one pass, memory of ``k`` lines).

    Sampling here rather than in sentencepiece keeps the tokenizer a function of the text and seed
    alone; sentencepiece's own shuffle differs from run to run, and every node that prepares the
    same data must get the same tokenizer.
    """
    rng = random.Random(seed)
    sample: list[str] = []
    seen = 0
    for text in texts:
        for line in text.splitlines():
            if not line.strip():
                continue
            if seen < k:
                sample.append(line)
            else:
                j = rng.randrange(seen + 1)
                if j < k:
                    sample[j] = line
            seen += 1
    return sample


def train_bpe(texts: Iterable[str], vocab_size: int, tokenizer_lines: int, seed: int) -> bytes:
    """The serialized model of a BPE tokenizer trained on a sample of the lines of ``texts``."""
    lines = sample_lines(texts, tokenizer_lines, seed)
    if not lines:
        raise DataError("the text is empty (no document has a non-blank line); add text")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines),
            model_writer=model,
            vocab_size=vocab_size,
            model_type="bpe",
            byte_fallback=True,
            # Identity normalization and kept whitespace make decode(encode(text)) == text for code.
            normalization_rule_name="identity",
            remove_extra_whitespaces=False,
            allow_whitespace_only_pieces=True,
            split_digits=True,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            # The merges depend on the thread count; one thread makes them the same on every machine
            # and costs little (BPE training on the 12 MB stdlib takes about two seconds).
            num_threads=1,
            minloglevel=2,
            max_sentence_length=16384,
            unk_id=0,
            bos_id=-1,
            eos_id=1,
            pad_id=-1,
        )
    except RuntimeError as e:
        msg = str(e)
        if "too high" in msg:
            raise DataError(
                f"vocab_size {vocab_size} is too large for this text; lower model.vocab_size or add more text"
            ) from None
        if "smaller than required_chars" in msg:
            need = msg.rsplit(" vs ", 1)[-1].split(".")[0]
            raise DataError(
                f"vocab_size {vocab_size} is too small for this text: its characters need at least {need}; "
                "raise model.vocab_size"
            ) from None
        raise
    return model.getvalue()
