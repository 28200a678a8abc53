"""A prepared dataset seen as fixed-length training windows.

The token shards (trident/data/store.py; a format-1 dataset's one ``tokens.bin``) are memory-mapped and seen as one
sequence, so every rank opens the whole dataset at no memory cost and reads only the windows it is asked for.
Windows do not overlap: window i is tokens ``[i * seq_len, (i + 1) * seq_len]`` (one extra token for the shifted
target), and may span two shards. This makes an epoch see every token once and makes the train/validation split a
split of window indices. ``TokenDataset.document_ends`` says where each document ends.
"""

from __future__ import annotations

import hashlib
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from trident.config import DataConfig
from trident.data.meta import damaged, load_meta, rebuild_hint
from trident.data.prepare import resolve_dataset
from trident.data.store import INDEX_DTYPE, SHARDS, ShardedTokens, document_ends, open_shards
from trident.data.tokenizer import TokenizerFileError, tokenizer_from_bytes
from trident.data.verify import check_shards
from trident.errors import DataError


class TokenWindows:
    """``count`` consecutive windows of ``seq_len + 1`` tokens, starting at window ``first``; ``tokens`` is a
    ``ShardedTokens`` or one array."""

    def __init__(self, tokens: ShardedTokens | np.ndarray, seq_len: int, first: int, count: int):
        self.tokens = tokens if isinstance(tokens, ShardedTokens) else ShardedTokens([tokens])
        self.seq_len = seq_len
        self.first = first
        self.count = count

    def __len__(self) -> int:
        return self.count

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``(x, y)``, each a LongTensor [len(indices), seq_len]; y is x shifted by one."""
        idx = indices.tolist()
        if idx and (min(idx) < 0 or max(idx) >= self.count):
            raise IndexError(f"window index out of range [0, {self.count}): {min(idx)}..{max(idx)}")
        starts = (self.first + np.asarray(idx, dtype=np.int64)) * self.seq_len
        buf = torch.from_numpy(self.tokens.read(starts, self.seq_len + 1))
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


class TokenDataset:
    """A dataset directory written by ``prepare_dataset`` (format 2: shards; format 1: one tokens.bin).

    ``rebuild`` is the command an error about a damaged file suggests (see ``open_dataset``).
    """

    def __init__(self, dataset_dir: str | Path, rebuild: str | None = None):
        self.dir = Path(dataset_dir).expanduser()
        self.rebuild = rebuild or rebuild_hint(self.dir)
        meta = load_meta(self.dir, self.rebuild)
        self.format: int = meta["format"]
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        self.n_tokens: int = meta["n_tokens"]
        # The file the dataset holds (tokenizer.model or tokenizer.json): each checkpoint carries a copy.
        self.tokenizer_path = self.dir / meta["tokenizer_file"]
        self.tokenizer_sha256: str | None = meta["tokenizer_sha256"]  # None in a dataset from before the record
        dtype = np.dtype(meta["dtype"])
        if self.format == 1:
            self._shards: list[dict] = []
            path = self.dir / "tokens.bin"
            self._check_size(path, self.n_tokens * dtype.itemsize, f"{self.n_tokens:,} {dtype.name} tokens")
            arrays = [np.memmap(path, dtype=dtype, mode="r", shape=(self.n_tokens,))] if self.n_tokens else []
        else:
            self._shards = meta["shards"]
            for r in self._shards:
                stem = self.dir / SHARDS / r["name"]
                self._check_size(stem.with_suffix(".bin"), r["n_tokens"] * dtype.itemsize, f"{r['n_tokens']:,} tokens")
                self._check_size(
                    stem.with_suffix(".idx"), r["n_documents"] * INDEX_DTYPE.itemsize, f"{r['n_documents']:,} documents"
                )
            arrays = open_shards(self.dir, self._shards, dtype)
        self.tokens = ShardedTokens(arrays)

    def _check_size(self, path: Path, size: int, what: str) -> None:
        try:
            actual = path.stat().st_size
        except OSError as e:
            raise damaged(path, f"unreadable: {e.strerror or e}", self.rebuild) from None
        if actual != size:
            raise damaged(path, f"{actual:,} bytes, but meta.json says {what}", self.rebuild)

    @cached_property
    def document_ends(self) -> np.ndarray:
        """Where each document ends, in tokens from the start (int64, increasing; the last is ``n_tokens``): document
        i is tokens ``[ends[i-1], ends[i])``, its eos last. A format-1 dataset's are found from its eos tokens."""
        if self.format == 1:
            eos = np.flatnonzero(np.asarray(self.tokens[:]) == self.eos_id) + 1
            return eos.astype(np.int64)
        return document_ends(self.dir, self._shards)

    def check_tokenizer(self) -> None:
        """Load the tokenizer once: training never reads it, but every checkpoint carries it for sampling, and a
        damaged one must fail now rather than when the first checkpoint is used."""
        path = self.tokenizer_path
        try:
            data = path.read_bytes()
        except OSError as e:
            raise damaged(path, f"unreadable: {e.strerror or e}", self.rebuild) from None
        try:
            tokenizer = tokenizer_from_bytes(path.name, data, str(path))
        except TokenizerFileError as e:
            raise damaged(path, f"{e.library} cannot load it: {e.detail}", self.rebuild) from None
        if tokenizer.vocab_size != self.vocab_size:
            what = f"a vocabulary of {tokenizer.vocab_size}, but meta.json says vocab_size {self.vocab_size}"
            raise damaged(path, what, self.rebuild)
        if tokenizer.eos_id != self.eos_id:
            raise damaged(path, f"eos id {tokenizer.eos_id}, but meta.json says eos_id {self.eos_id}", self.rebuild)
        if self.tokenizer_sha256 is not None and (sha := hashlib.sha256(data).hexdigest()) != self.tokenizer_sha256:
            what = f"sha256 {sha[:12]}, but meta.json says {self.tokenizer_sha256[:12]}"
            raise damaged(path, what, self.rebuild)

    def check_shards(self) -> None:
        """Check each shard against the sha256 its record holds (trident/data/verify.py): a small corpus now, a
        large one while training runs, every read of the tokens stopping the run once damage is found."""
        if self._shards:  # a format-1 dataset records no sha256
            self.tokens.check = check_shards(self.dir, self._shards, self.rebuild).raise_if_damaged

    def split(
        self, seq_len: int, val_fraction: float, global_batch_size: int = 1, eval_batches: int | None = None
    ) -> tuple[TokenWindows, TokenWindows]:
        """Train and validation windows: validation is the last ``val_fraction`` of the windows.

        The window just before validation is dropped: its target token would be the first input
        token of validation, and this way no training window reads a validation token. The training windows
        must hold one global batch, and the validation windows ``eval_batches`` of them (see ``eval_batch_count``).
        """
        n = max(0, (self.n_tokens - 1) // seq_len)
        n_val = max(1, round(n * val_fraction))
        n_train = n - n_val - 1
        if n_train < global_batch_size:
            raise DataError(
                f"dataset {self.dir} has {self.n_tokens:,} tokens: only {max(0, n_train)} training windows "
                f"of seq_len {seq_len}, fewer than one global batch of {global_batch_size}; "
                "add text or lower model.seq_len / train.global_batch_size"
            )
        if eval_batches is not None and eval_batches > (most := max_eval_batches(n_val, global_batch_size)):
            raise DataError(
                f"train.eval_batches={eval_batches} needs {eval_batches * global_batch_size:,} validation windows "
                f"but dataset {self.dir} holds {n_val:,} of seq_len {seq_len} (data.val_fraction={val_fraction}); "
                f"set train.eval_batches to at most {most} or raise data.val_fraction"
            )
        return (
            TokenWindows(self.tokens, seq_len, 0, n_train),
            TokenWindows(self.tokens, seq_len, n - n_val, n_val),
        )


# The validation set of one evaluation when train.eval_batches is left out: up to this many global batches.
DEFAULT_EVAL_BATCHES = 4


def max_eval_batches(val_windows: int, global_batch_size: int) -> int:
    """The most global batches one evaluation may take: each window once (but at least one batch, which on a
    validation set smaller than a global batch repeats some windows)."""
    return max(1, val_windows // global_batch_size)


def eval_batch_count(eval_batches: int | None, val_windows: int, global_batch_size: int) -> int:
    """``train.eval_batches``, or when left out as many as the validation set holds, up to 4."""
    if eval_batches is not None:
        return eval_batches
    return min(DEFAULT_EVAL_BATCHES, max_eval_batches(val_windows, global_batch_size))


def open_dataset(data: DataConfig, vocab_size: int) -> TokenDataset:
    """The dataset of ``data`` (prepared and cached on first use), checked for damage."""
    path = resolve_dataset(data, vocab_size)
    dataset = TokenDataset(path, rebuild_hint(path, vocab_size, data.dataset_dir is None, data.tokenizer))
    dataset.check_tokenizer()
    dataset.check_shards()
    return dataset
