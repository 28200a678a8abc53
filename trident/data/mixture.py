"""Several prepared datasets drawn in proportion: ``data.mix=[DIR:WEIGHT, ...]``.

Which source global sample i (= step * global batch + position) comes from is a function of i and the weights
alone, never of a rank or of what came before, so a run resumes at any layout from its step alone, and the number of
samples each source received before sample i is known in closed form (``MixtureSampler.counts_before``):

- Hierarchical Beatty sequences. Source 0 takes sample i iff ``floor((i + 1) p0) - floor(i p0) = 1`` with
  ``p0 = w0 / (w0 + w1 + ...)``; it has then received ``floor(i p0)`` samples before i. The samples it does not take
  are numbered 0, 1, 2, ... among themselves (sample i is number ``i - floor(i p0)``) and go through the same test
  with source 1 and ``p1 = w1 / (w1 + w2 + ...)``, and so on; the last source takes what reaches it. Every source's
  share of any prefix of the stream is its weight to within one sample per level, and the sources interleave evenly
  (no long runs of one source).
- Within a source, its k-th sample is window ``perm_e[k mod n]`` of that source's own epoch ``e = k // n``, a
  permutation seeded by (seed, source, epoch) as for one dataset (trident/data/sampler.py): each epoch of a source
  sees each of its windows once. Source 0's permutations are the single-dataset ones, so ``data.mix=[DIR:1]`` trains
  on exactly the batches of ``data.dataset_dir=DIR``.

The weights are made integers first (0.7 and 0.3 -> 7 and 3; any weights -> units of 2^-24 of their sum) so that the
arithmetic is exact integer arithmetic on every machine.

All sources share one tokenizer (the same file bytes), and the model's vocabulary covers it. Each source keeps its
own validation split; validation reports a loss per source and their mean weighted by the mixture's weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from trident.config import DataConfig, mix_entry
from trident.data.dataset import TokenWindows, open_dataset
from trident.data.sampler import Batches, EpochPermutations
from trident.errors import DataError

# Integer weights above this total are rounded to units of 1/2^24 of the sum (products stay far inside int64).
_MAX_TOTAL = 1 << 24
# A source's permutation seeds are the single-dataset ones shifted by this times the source's position.
_SOURCE_SEED_STRIDE = 1 << 40


def integer_weights(weights: list[float]) -> list[int]:
    """Integer weights in the proportion of ``weights``: exact for decimal weights whose common denominator is small
    (0.7 / 0.3 -> 7 / 3, 2 / 1 -> 2 / 1), else each rounded to a unit of 2^-24 of the sum (at least 1)."""
    if not weights or any(not (math.isfinite(w) and w > 0) for w in weights):
        raise ValueError(f"mixture weights must be finite and > 0, got {weights}")
    fractions = [Fraction(repr(float(w))) for w in weights]
    den = math.lcm(*(f.denominator for f in fractions))
    ints = [int(f * den) for f in fractions]
    g = math.gcd(*ints)
    ints = [i // g for i in ints]
    if sum(ints) <= _MAX_TOTAL:
        return ints
    total = sum(weights)
    return [max(1, round(w / total * _MAX_TOTAL)) for w in weights]


class MixtureSampler(Batches):
    """Global batches over several sources' training windows, in one flat index space: source s's window w is
    ``offsets[s] + w`` (``MixedWindows`` reads it back). See the module's docstring for the assignment."""

    def __init__(self, sizes: list[int], weights: list[float], global_batch_size: int, seed: int):
        if not sizes or len(sizes) != len(weights) or min(sizes) < 1 or global_batch_size < 1:
            raise ValueError(f"need one weight per source, sources of >= 1 window and a batch >= 1, got {sizes}")
        self.sizes = list(sizes)
        self.weights = integer_weights(list(weights))
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.offsets = [0, *np.cumsum(self.sizes).tolist()][:-1]
        # Level l: source l takes a share p_l = weights[l] / rest[l] of the samples that reach it.
        self.rest = [sum(self.weights[level:]) for level in range(len(self.weights))]
        self._perms = [EpochPermutations(n, seed + s * _SOURCE_SEED_STRIDE) for s, n in enumerate(self.sizes)]

    def counts_before(self, i: int) -> list[int]:
        """How many of the samples 0 .. i-1 each source received (closed form, exact integers)."""
        counts, r = [], int(i)
        for level in range(len(self.sizes) - 1):
            took = r * self.weights[level] // self.rest[level]
            counts.append(took)
            r -= took
        counts.append(r)
        return counts

    def assign(self, samples: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each global sample's source and its number within that source's stream (k: its k-th sample)."""
        samples = samples.to(torch.long)
        if len(samples) and int(samples.max()) + 1 > (2**62) // self.rest[0]:
            raise OverflowError(f"sample index {int(samples.max())} is past what the mixture's int64 arithmetic holds")
        source = torch.full_like(samples, len(self.sizes) - 1)
        k = samples.clone()  # its number among the samples that reach the current level
        pending = torch.ones_like(samples, dtype=torch.bool)
        for level in range(len(self.sizes) - 1):
            num, den = self.weights[level], self.rest[level]
            r = k[pending]
            before = r * num // den
            hit = (r + 1) * num // den - before == 1
            idx = pending.nonzero().squeeze(1)
            source[idx[hit]] = level
            k[idx[hit]] = before[hit]
            k[idx[~hit]] = r[~hit] - before[~hit]
            pending[idx[hit]] = False
        return source, k

    def global_batch(self, step: int) -> torch.Tensor:
        """The flat window indices of step ``step``: a LongTensor [global_batch_size]."""
        start = step * self.global_batch_size
        source, k = self.assign(torch.arange(start, start + self.global_batch_size))
        out = torch.empty_like(k)
        for s in source.unique().tolist():
            mine = source == s
            ks = k[mine]  # consecutive: a source's samples of one batch are the next ones of its stream
            first = int(ks[0])
            out[mine] = self.offsets[s] + self._perms[s].windows(first, first + len(ks))[ks - first]
        return out


class MixedWindows:
    """The training windows of several sources as one flat index space (``MixtureSampler``'s): source s's window w
    is index ``offsets[s] + w``. ``batch`` reads each source's share with that source's own (vectorised) read."""

    def __init__(self, names: list[str], sources: list[TokenWindows], weights: list[float]):
        if not sources or len({w.seq_len for w in sources}) != 1:
            raise ValueError("a mixture needs sources of one seq_len")
        self.names, self.sources, self.weights = list(names), list(sources), list(weights)
        self.sizes = [len(w) for w in sources]
        self.seq_len = sources[0].seq_len
        self.offsets = torch.tensor([0, *np.cumsum(self.sizes).tolist()])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def sampler(self, global_batch_size: int, seed: int) -> MixtureSampler:
        return MixtureSampler(self.sizes, self.weights, global_batch_size, seed)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``(x, y)`` of flat window indices, each a LongTensor [len(indices), seq_len]."""
        indices = indices.to(torch.long)
        if len(indices) and (int(indices.min()) < 0 or int(indices.max()) >= len(self)):
            raise IndexError(f"window index out of range [0, {len(self)}): {int(indices.min())}..{int(indices.max())}")
        source = torch.searchsorted(self.offsets, indices, right=True) - 1
        x = torch.empty(len(indices), self.seq_len, dtype=torch.long)
        y = torch.empty_like(x)
        for s in source.unique().tolist():
            mine = source == s
            x[mine], y[mine] = self.sources[s].batch(indices[mine] - self.offsets[s])
        return x, y


@dataclass
class TrainingData:
    """What train.py trains on: the training windows (one dataset's, or a mixture's), the validation windows (one
    set, or one per source by name), and the tokenizer every checkpoint carries."""

    train: TokenWindows | MixedWindows
    val: TokenWindows | Mapping[str, TokenWindows]
    tokenizer_path: Path
    eos_id: int
    vocab_size: int

    @property
    def pair(self) -> tuple[TokenWindows | MixedWindows, TokenWindows | Mapping[str, TokenWindows]]:
        return self.train, self.val


def source_names(dirs: list[str]) -> list[str]:
    """Each source's name in the metrics: its directory's basename, made unique with -2, -3, ... when repeated."""
    names: list[str] = []
    for d in dirs:
        base = Path(d).expanduser().resolve().name or "source"
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


def open_training_data(
    data: DataConfig,
    vocab_size: int,
    seq_len: int,
    global_batch_size: int,
    eval_batches: int | None,
) -> TrainingData:
    """The data of a run: ``data.mix``'s sources when set, else the one dataset of ``data`` (``open_dataset``)."""
    if not data.mix:
        ds = open_dataset(data, vocab_size)
        train, val = ds.split(seq_len, data.val_fraction, global_batch_size, eval_batches)
        return TrainingData(train, val, ds.tokenizer_path, ds.eos_id, ds.vocab_size)
    entries = []
    for entry in data.mix:
        parsed = mix_entry(entry)
        if parsed is None:
            raise DataError(f"data.mix entry {entry!r} is not DIR:WEIGHT with a weight > 0")
        entries.append(parsed)
    names = source_names([d for d, _ in entries])
    trains, vals, first, first_sha = [], {}, None, None
    for (d, _), name in zip(entries, names, strict=True):
        path = Path(d).expanduser()
        if not path.is_dir():
            raise DataError(
                f"data.mix source {d!r} is not a directory; prepare it first: "
                f"python tools/prepare_data.py --text YOUR_TEXT --out {d}"
            )
        try:
            ds = open_dataset(dataclasses.replace(data, dataset_dir=str(path), mix=None), vocab_size)
        except DataError as e:
            raise DataError(f"data.mix source {d!r}: {e}") from None
        sha = hashlib.sha256(ds.tokenizer_path.read_bytes()).hexdigest()
        if first is None:
            first, first_sha = (d, ds), sha
        elif sha != first_sha or ds.eos_id != first[1].eos_id or ds.vocab_size != first[1].vocab_size:
            raise DataError(
                f"data.mix sources {first[0]!r} and {d!r} were prepared with different tokenizers "
                f"(sha256 {first_sha[:12]} and {sha[:12]}); a mixture needs one tokenizer: prepare {d} again with "
                f"python tools/prepare_data.py --text YOUR_TEXT --out {d} --tokenizer {first[1].tokenizer_path}"
            )
        train, val = ds.split(seq_len, data.val_fraction, global_batch_size, eval_batches)
        trains.append(train)
        vals[name] = val
    assert first is not None
    mixed = MixedWindows(names, trains, [w for _, w in entries])
    return TrainingData(mixed, vals, first[1].tokenizer_path, first[1].eos_id, first[1].vocab_size)
