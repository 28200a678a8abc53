"""A prepared dataset seen as fixed-length training windows.

``tokens.bin`` is memory-mapped, so every rank opens the whole dataset at no memory cost and reads
only the windows it is asked for. Windows do not overlap: window i is tokens
``[i * seq_len, (i + 1) * seq_len]`` (one extra token for the shifted target), which makes an epoch
see every token once and makes the train/validation split a split of window indices.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trident.data.prepare import load_meta
from trident.errors import DataError


class TokenWindows:
    """``count`` consecutive windows of ``seq_len + 1`` tokens, starting at window ``first``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, first: int, count: int):
        self.tokens = tokens
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
        buf = torch.from_numpy(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)].astype(np.int64))
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


class TokenDataset:
    """A dataset directory written by ``prepare_dataset``."""

    def __init__(self, dataset_dir: str | Path):
        self.dir = Path(dataset_dir).expanduser()
        meta = load_meta(self.dir)
        self.vocab_size: int = meta["vocab_size"]
        self.eos_id: int = meta["eos_id"]
        self.n_tokens: int = meta["n_tokens"]
        self.tokenizer_path = self.dir / "tokenizer.model"
        dtype = np.dtype(meta["dtype"])
        path = self.dir / "tokens.bin"
        size = path.stat().st_size
        if size != self.n_tokens * dtype.itemsize:
            raise DataError(
                f"{path} has {size} bytes but meta.json says {self.n_tokens} {dtype.name} tokens; "
                "the dataset is damaged, prepare it again"
            )
        self.tokens = np.memmap(path, dtype=dtype, mode="r", shape=(self.n_tokens,))

    def split(self, seq_len: int, val_fraction: float, min_train_windows: int = 1) -> tuple[TokenWindows, TokenWindows]:
        """Train and validation windows: validation is the last ``val_fraction`` of the windows.

        The window just before validation is dropped: its target token would be the first input
        token of validation, and this way no training window reads a validation token.
        """
        n = max(0, (self.n_tokens - 1) // seq_len)
        n_val = max(1, round(n * val_fraction))
        n_train = n - n_val - 1
        if n_train < min_train_windows:
            raise DataError(
                f"dataset {self.dir} has {self.n_tokens:,} tokens: only {max(0, n_train)} training windows "
                f"of seq_len {seq_len}, fewer than one global batch of {min_train_windows}; "
                "add text or lower model.seq_len / train.global_batch_size"
            )
        return (
            TokenWindows(self.tokens, seq_len, 0, n_train),
            TokenWindows(self.tokens, seq_len, n - n_val, n_val),
        )
