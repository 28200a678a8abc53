"""Batch sampling: a function of (seed, step) alone, the same for every dp / micro-batch split."""

from __future__ import annotations

import pytest
import torch

from trident.data.sampler import GlobalBatchSampler, ValidationBatches


@pytest.mark.parametrize("dp, micro", [(1, 24), (1, 1), (2, 3), (3, 4), (4, 2), (8, 3), (24, 1)])
def test_splits_reproduce_global_batch(dp, micro):
    sampler = GlobalBatchSampler(n_samples=100, global_batch_size=24, seed=7)
    for step in (0, 3, 4, 11):
        parts = [mb for rank in range(dp) for mb in sampler.micro_batches(step, rank, dp, micro)]
        assert all(len(mb) == micro for mb in parts)
        assert torch.equal(torch.cat(parts), sampler.global_batch(step))
        # Each micro-batch's samples are named by their global index, whatever the split.
        ids = [s for rank in range(dp) for s in sampler.sample_ids(step, rank, dp, micro)]
        assert [len(s) for s in ids] == [micro] * len(parts)
        assert torch.equal(torch.cat(ids), torch.arange(24 * step, 24 * (step + 1)))


def test_epochs_cover_every_sample_once():
    n, b = 50, 8  # batches straddle epoch boundaries
    sampler = GlobalBatchSampler(n, b, seed=1)
    stream = torch.cat([sampler.global_batch(k) for k in range(3 * n // b + 1)])
    for epoch in range(3):
        assert sorted(stream[epoch * n : (epoch + 1) * n].tolist()) == list(range(n))
    assert not torch.equal(stream[:n], stream[n : 2 * n])


def test_batch_larger_than_dataset():
    sampler = GlobalBatchSampler(n_samples=5, global_batch_size=12, seed=0)
    batch = sampler.global_batch(0)
    assert sorted(batch[:5].tolist()) == sorted(batch[5:10].tolist()) == list(range(5))


def test_seeds_differ():
    a, b = GlobalBatchSampler(1000, 16, seed=0), GlobalBatchSampler(1000, 16, seed=1)
    assert not torch.equal(a.global_batch(0), b.global_batch(0))


def test_resume_needs_only_the_step():
    ran = GlobalBatchSampler(30, 8, seed=3)
    history = [ran.global_batch(k) for k in range(20)]
    for k in (0, 4, 11, 19):
        fresh = GlobalBatchSampler(30, 8, seed=3)
        assert all(torch.equal(fresh.global_batch(j), history[j]) for j in range(k, 20))


def test_divisibility_errors():
    sampler = GlobalBatchSampler(100, 24, seed=0)
    with pytest.raises(ValueError, match="dp_size=5"):
        sampler.rank_batch(0, 0, 5)
    with pytest.raises(ValueError, match="micro-batches of 5"):
        sampler.micro_batches(0, 0, 2, 5)
    with pytest.raises(ValueError, match="dp_rank=2"):
        sampler.rank_batch(0, 2, 2)


def test_validation_batches():
    val = ValidationBatches(n_samples=10, global_batch_size=4, n_batches=4)
    assert len(val) == 4
    stream = torch.cat([val.global_batch(j) for j in range(4)]).tolist()
    assert stream == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]  # wraps when too few
    for j in range(4):
        parts = [mb for rank in range(2) for mb in val.micro_batches(j, rank, 2, 1)]
        assert torch.equal(torch.cat(parts), val.global_batch(j))
    assert val.rank_batch(1, 1, 2).tolist() == [6, 7]
    with pytest.raises(IndexError):
        val.global_batch(4)
