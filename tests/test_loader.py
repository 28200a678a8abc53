"""The loop's batch building (trident/data/loader.py ``BatchLoader``): the batches of a step whoever reads them,
read ahead in the background without changing them, their document ids when data.document_mask is on, and the
loader's figures in a real run's metrics."""

from __future__ import annotations

import runpy

import numpy as np
import pytest
import torch

from tests.helpers import REPO
from tests.helpers.layouts import tiny, train_in_process
from trident.data.loader import BatchLoader
from trident.data.sampler import GlobalBatchSampler
from trident.parallel.batch import document_ids

EOS = 1


class Windows:
    """Non-overlapping windows over a fixed token stream with an eos every few tokens (irregularly)."""

    def __init__(self, count: int, seq_len: int, fail_at: int | None = None):
        rng = np.random.default_rng(0)
        self.tokens = rng.integers(2, 50, count * seq_len + 1)
        self.tokens[rng.random(len(self.tokens)) < 0.1] = EOS
        self.seq_len, self.count, self.fail_at = seq_len, count, fail_at

    def __len__(self) -> int:
        return self.count

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fail_at is not None and self.fail_at in indices.tolist():
            raise OSError(f"cannot read window {self.fail_at}")
        starts = indices.numpy()[:, None] * self.seq_len
        buf = torch.from_numpy(self.tokens[starts + np.arange(self.seq_len + 1)])
        return buf[:, :-1].contiguous(), buf[:, 1:].contiguous()


def _loader(windows: Windows, eos_id: int | None = None, prefetch: bool = True, dp: tuple[int, int] = (0, 1)):
    sampler = GlobalBatchSampler(len(windows), global_batch_size=8, seed=0)
    return BatchLoader(windows, sampler, dp[0], dp[1], 2, torch.device("cpu"), eos_id, prefetch)


def test_a_batch_is_the_sampler_windows_with_their_sample_ids():
    windows = Windows(40, 16)
    loader = _loader(windows, dp=(1, 2))
    batches = loader.read(3)
    sampler = GlobalBatchSampler(40, 8, seed=0)
    want = sampler.global_batch(3)[4:]  # rank 1 of 2: the second half, two micro-batches of 2
    assert [b.step for b in batches] == [3, 3]
    assert torch.equal(torch.cat([b.sample_ids for b in batches]), torch.arange(28, 32))
    x, y = windows.batch(want)
    assert torch.equal(torch.cat([b.tokens for b in batches]), x)
    assert torch.equal(torch.cat([b.targets for b in batches]), y)
    assert all(b.documents is None for b in batches)  # data.document_mask off


def test_document_mask_fills_the_document_ids_of_every_batch():
    windows = Windows(40, 16)
    batches = _loader(windows, eos_id=EOS).read(0)
    for b in batches:
        assert b.documents is not None
        assert torch.equal(b.documents, document_ids(b.tokens, EOS))
        # a new document at each eos (an eos in the first column opens document 0)
        for row, docs in zip(b.tokens, b.documents, strict=True):
            assert docs.tolist() == [
                max(0, int((row[: t + 1] == EOS).sum()) - int(row[0] == EOS)) for t in range(len(row))
            ]
    assert any(int(b.documents.max()) > 0 for b in batches)  # the test's windows do hold several documents
    # validation batches go through the same building (trident/loop.py Trainer.evaluate_sources)
    assert all(
        b.documents is not None for b in _loader(windows, eos_id=EOS).read(0, windows, GlobalBatchSampler(40, 8, 1))
    )


def test_reading_ahead_gives_the_same_batches_as_reading_now():
    windows = Windows(30, 8)
    ahead, now = _loader(windows, eos_id=EOS), _loader(windows, eos_id=EOS, prefetch=False)
    try:
        for step in range(12):  # past an epoch boundary
            got, waited = ahead.get(step, last=12)
            assert waited >= 0 and ahead.last_read_s > 0
            want = now.read(step)
            for a, b in zip(got, want, strict=True):
                assert a.step == b.step
                for u, v in zip(a, b, strict=True):
                    assert u == v if u is None or isinstance(u, (int, tuple)) else torch.equal(u, v)
            # the next step is being read already, and none after the last
            assert (ahead._next is not None) == (step + 1 < 12)
            if ahead._next is not None:
                assert ahead._next[0] == step + 1
    finally:
        ahead.close()


def test_a_jump_reads_the_asked_step_and_a_failed_read_ahead_raises_at_its_step():
    windows = Windows(30, 8)
    loader = _loader(windows)
    try:
        loader.get(0)
        got, _ = loader.get(5)  # not the step read ahead (a resume, a test): read now
        assert torch.equal(torch.cat([b.sample_ids for b in got]), torch.arange(40, 48))
    finally:
        loader.close()
    sampler = GlobalBatchSampler(30, 8, seed=0)
    bad = int(sampler.global_batch(1)[0])
    loader = _loader(Windows(30, 8, fail_at=bad))
    try:
        loader.get(0)  # step 1 is now being read in the background, and fails there
        with pytest.raises(OSError, match=f"cannot read window {bad}"):
            loader.get(1)
    finally:
        loader.close()


@pytest.mark.multiprocess
def test_a_run_logs_what_reading_costs_it(tiny_dataset, tmp_path):
    (history,) = train_in_process(tmp_path, tiny(tiny_dataset, "train.steps=3", "train.micro_batch_size=4"))
    for row in history:
        assert 0 <= row["data_ms"] <= 1e3 * row["step_time_s"]
        assert row["data_read_ms"] > 0 and row["data_share"] == pytest.approx(row["data_ms"] / 1e3 / row["step_time_s"])


@pytest.mark.multiprocess
def test_the_loader_bench_prints_both_loaders_of_each_preset(tiny_dataset):
    """tools/bench.py loader on a tiny setting, through the tool's own parsing: its rows and finite figures (never
    how fast anything is)."""
    tool = runpy.run_path(str(REPO / "tools" / "bench.py"))
    argv = ["loader", "--models", "gpt-tiny", "llama-tiny", "--steps", "2", "--rounds", "2", "--warmup", "1"]
    module, args = tool["parse"]([*argv, "--set", f"data.dataset_dir={tiny_dataset}"])
    (table,) = module.run(args)
    assert table.header == [
        "model",
        "loader",
        "step ms",
        "read ms",
        "wait ms",
        "loader share of step",
        "spread of share",
    ]
    assert [(row[0].split()[0], row[1]) for row in table.rows] == [
        (model, loader) for model in ("gpt-tiny", "llama-tiny") for loader in ("read ahead", "read in the step")
    ]
    for row in table.rows:
        step, read, wait, share = (float(c.replace(",", "").rstrip("%")) for c in row[2:6])
        assert step > 0 and read > 0 and 0 <= wait <= step and 0 <= share <= 100
    for row in table.rows[1::2]:  # read in the step: the step waits for the whole read
        assert row[3] == row[4] and row[3] != "0.000"
