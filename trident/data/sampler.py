"""Which windows make up each batch.

The global batch of a step is a pure function of (seed, step, dataset size, global batch size).
Data-parallel ranks take contiguous slices of it and split their slice into micro-batches, so
changing dp or the micro-batch size changes who computes what but never what is trained on, and
resuming at step k needs nothing but k. Each micro-batch also has its samples' global indices (``sample_ids``:
step * global batch size + position in the step's batch), which name a sample whatever the layout: dropout
derives its masks from them.
"""

from __future__ import annotations

import torch


def _check_split(total: int, parts: int, what: str) -> None:
    if parts < 1 or total % parts:
        raise ValueError(f"a batch of {total} samples cannot be split evenly into {what}")


class Batches:
    """Rank and micro-batch slicing shared by training and validation batches."""

    global_batch_size: int

    def global_batch(self, step: int) -> torch.Tensor:
        raise NotImplementedError

    def rank_batch(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """This rank's contiguous share of the global batch: ``global_batch_size / dp_size`` indices."""
        return self._share(self.global_batch(step), dp_rank, dp_size)

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[torch.Tensor]:
        """This rank's share split into micro-batches of ``micro_batch_size``, in order."""
        return _split(self.rank_batch(step, dp_rank, dp_size), micro_batch_size)

    def sample_ids(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[torch.Tensor]:
        """The global sample indices of the micro-batches ``micro_batches`` returns, one for one."""
        start = step * self.global_batch_size
        positions = torch.arange(start, start + self.global_batch_size)
        return _split(self._share(positions, dp_rank, dp_size), micro_batch_size)

    def _share(self, batch: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
        _check_split(self.global_batch_size, dp_size, f"dp_size={dp_size} ranks")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is not in [0, {dp_size})")
        per_rank = self.global_batch_size // dp_size
        return batch[dp_rank * per_rank : (dp_rank + 1) * per_rank]


_Batches = Batches  # the name it had


def _split(mine: torch.Tensor, micro_batch_size: int) -> list[torch.Tensor]:
    _check_split(len(mine), micro_batch_size, f"micro-batches of {micro_batch_size}")
    return list(mine.split(micro_batch_size))


class EpochPermutations:
    """The shuffled order of each epoch over ``n_samples`` windows: a permutation seeded by (seed, epoch) alone.
    The two most recent are kept (a batch spans at most two epochs unless the dataset is smaller than it)."""

    def __init__(self, n_samples: int, seed: int):
        self.n_samples = n_samples
        self.seed = seed
        self._perms: dict[int, torch.Tensor] = {}

    def __call__(self, epoch: int) -> torch.Tensor:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            # Modulo 2^64, the generator's seed range: the same seed as before wherever that was in range, and no
            # overflow for a large train.seed or a mixture's later sources (shifted by 2^40 each).
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % 2**64)
            self._perms[epoch] = torch.randperm(self.n_samples, generator=g)
        return self._perms[epoch]

    def windows(self, start: int, end: int) -> torch.Tensor:
        """The windows of a stream's samples ``start .. end - 1``: sample k is position k % n of epoch k // n."""
        n, parts, g = self.n_samples, [], start
        while g < end:
            epoch, pos = divmod(g, n)
            take = min(n - pos, end - g)
            parts.append(self(epoch)[pos : pos + take])
            g += take
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)


class GlobalBatchSampler(Batches):
    """Shuffled epochs over ``n_samples`` windows, cut into global batches.

    Global sample g = step * B + i is position g % n of epoch g // n, whose order is a permutation
    seeded by (seed, epoch). Batches run across epoch boundaries, so no sample is dropped or repeated
    within an epoch.
    """

    def __init__(self, n_samples: int, global_batch_size: int, seed: int):
        if n_samples < 1 or global_batch_size < 1:
            raise ValueError(f"need n_samples >= 1 and global_batch_size >= 1, got {n_samples} and {global_batch_size}")
        self.n_samples = n_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self._perm = EpochPermutations(n_samples, seed)

    def global_batch(self, step: int) -> torch.Tensor:
        """The window indices of step ``step``: a LongTensor [global_batch_size]."""
        start = step * self.global_batch_size
        return self._perm.windows(start, start + self.global_batch_size)


class ValidationBatches(Batches):
    """The fixed validation set of one evaluation: ``n_batches`` global batches of windows 0, 1, 2, ...

    Every evaluation sees the same samples in the same order, so validation losses are comparable
    across steps and runs. With fewer than ``n_batches * B`` windows the indices wrap around.
    """

    def __init__(self, n_samples: int, global_batch_size: int, n_batches: int):
        if n_samples < 1 or global_batch_size < 1 or n_batches < 1:
            raise ValueError(
                f"need n_samples, global_batch_size and n_batches >= 1, got {n_samples}, "
                f"{global_batch_size}, {n_batches}"
            )
        self.n_samples = n_samples
        self.global_batch_size = global_batch_size
        self.n_batches = n_batches

    def __len__(self) -> int:
        return self.n_batches

    def global_batch(self, step: int) -> torch.Tensor:
        """Batch ``step`` (0 <= step < n_batches) of the evaluation."""
        if not 0 <= step < self.n_batches:
            raise IndexError(f"validation batch {step} is not in [0, {self.n_batches})")
        start = step * self.global_batch_size
        return torch.arange(start, start + self.global_batch_size) % self.n_samples
