"""data.mix: several prepared datasets drawn in proportion (trident/data/mixture.py).

The sampler is a function of (seed, global sample index) alone, its per-source counts are closed-form, and a mixture
run gives the one-process curve under any layout and resumes under another one with the uninterrupted losses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.helpers import SMALL_CORPUS
from tests.helpers.layouts import assert_same_curve, tiny, train_in_process
from tests.helpers.processes import read_metrics
from trident.config import DataConfig
from trident.data.mixture import MixedWindows, MixtureSampler, integer_weights, open_training_data, source_names
from trident.data.prepare import prepare_dataset
from trident.data.sampler import GlobalBatchSampler
from trident.data.sources import collect_text_files
from trident.data.tokenizer import load_tokenizer
from trident.errors import DataError
from trident_dev.curves import REL

STDLIB = Path(SMALL_CORPUS[0]).parent


def brute_force(sampler: MixtureSampler, n: int) -> list[list[int]]:
    """Each source's count before every sample 0 .. n, by assigning every sample one at a time."""
    counts = [[0] * len(sampler.sizes)]
    for i in range(n):
        source, _ = sampler.assign(torch.tensor([i]))
        row = list(counts[-1])
        row[int(source)] += 1
        counts.append(row)
    return counts


# --- the sampler ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [[0.7, 0.3], [1, 1], [0.9, 0.1], [1 / 3, 2 / 3], [0.123, 0.877]])
def test_two_sources_get_their_weight_to_one_sample_over_10000_windows(weights):
    sampler = MixtureSampler([5000, 700], weights, global_batch_size=100, seed=0)
    stream = torch.cat([sampler.global_batch(step) for step in range(100)])  # 10,000 windows
    from_second = int((stream >= 5000).sum())
    share = weights[1] / sum(weights)
    assert abs(from_second - 10_000 * share) <= 1, (from_second, share)
    assert abs(from_second / 10_000 - share) < 0.02  # the bound, a fortiori
    assert sampler.counts_before(10_000) == [10_000 - from_second, from_second]


def test_three_sources_each_within_one_sample_per_level():
    weights = [0.5, 0.3, 0.2]
    sampler = MixtureSampler([300, 200, 100], weights, global_batch_size=64, seed=3)
    for n in (1, 7, 64, 1000, 9999):
        counts = sampler.counts_before(n)
        assert sum(counts) == n
        assert all(abs(c - n * w) <= 2 for c, w in zip(counts, weights, strict=True)), (n, counts)


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.5, 0.3, 0.2], [1, 5, 2, 3]])
def test_counts_in_closed_form_equal_a_brute_force_count(weights):
    sampler = MixtureSampler([50] * len(weights), weights, global_batch_size=8, seed=0)
    expected = brute_force(sampler, 600)
    assert [sampler.counts_before(i) for i in range(601)] == expected
    # and far into a run, against the assignment of a whole stretch of samples
    start = 10**9 + 17
    source, k = sampler.assign(torch.arange(start, start + 500))
    before = sampler.counts_before(start)
    for s in range(len(weights)):
        mine = k[source == s]
        assert mine.tolist() == list(range(before[s], before[s] + len(mine)))  # its stream's next samples, in order
    assert [before[s] + int((source == s).sum()) for s in range(len(weights))] == sampler.counts_before(start + 500)


def test_deterministic_for_a_seed_and_different_for_another():
    def stream(seed: int) -> torch.Tensor:
        sampler = MixtureSampler([400, 300], [0.6, 0.4], global_batch_size=32, seed=seed)
        return torch.cat([sampler.global_batch(step) for step in range(20)])

    assert torch.equal(stream(5), stream(5))
    assert not torch.equal(stream(5), stream(6))


def test_a_fresh_sampler_resumes_at_any_step_and_any_split():
    ran = MixtureSampler([40, 30, 20], [0.5, 0.25, 0.25], global_batch_size=12, seed=2)
    history = [ran.global_batch(step) for step in range(30)]
    for step in (0, 5, 17, 29):
        fresh = MixtureSampler([40, 30, 20], [0.5, 0.25, 0.25], global_batch_size=12, seed=2)
        assert torch.equal(fresh.global_batch(step), history[step])
        for dp, micro in [(2, 3), (3, 2), (4, 1)]:
            parts = [mb for rank in range(dp) for mb in fresh.micro_batches(step, rank, dp, micro)]
            assert torch.equal(torch.cat(parts), history[step])


def test_each_epoch_of_a_source_sees_each_of_its_windows_once():
    sizes = [37, 11]
    sampler = MixtureSampler(sizes, [0.5, 0.5], global_batch_size=10, seed=1)
    stream = torch.cat([sampler.global_batch(step) for step in range(30)])  # 150 per source: 4+ epochs of each
    first = stream[stream < 37].tolist()
    second = (stream[stream >= 37] - 37).tolist()
    for windows, n in ((first, 37), (second, 11)):
        for epoch in range(len(windows) // n):
            assert sorted(windows[epoch * n : (epoch + 1) * n]) == list(range(n))
        assert windows[:n] != windows[n : 2 * n]


@pytest.mark.parametrize(("sources", "seed"), [(18, 1234), (2, 2**45), (40, 2**63 - 1)])
def test_many_sources_and_large_seeds_draw_batches(sources, seed):
    # Each source's permutation seed is shifted by 2^40 per source: past 2^64 from the 18th source on (and for
    # train.seed=2**45), which the generator refused ("Overflow when unpacking long long").
    sampler = MixtureSampler([5] * sources, [1.0] * sources, global_batch_size=sources * 5, seed=seed)
    batch = sampler.global_batch(1)  # one epoch of every source: each source's 5 windows once
    assert sorted(batch.tolist()) == list(range(sources * 5))
    assert GlobalBatchSampler(7, 7, seed).global_batch(0).sort().values.tolist() == list(range(7))


def test_one_source_is_the_single_dataset_sampler():
    mixed = MixtureSampler([123], [1.0], global_batch_size=16, seed=4)
    plain = GlobalBatchSampler(123, 16, seed=4)
    for step in range(20):
        assert torch.equal(mixed.global_batch(step), plain.global_batch(step))


def test_integer_weights_and_names():
    assert integer_weights([0.7, 0.3]) == [7, 3]
    assert integer_weights([2, 1, 1]) == [2, 1, 1]
    assert integer_weights([0.25, 0.5]) == [1, 2]
    odd = integer_weights([1e-7, 3.14159265358979])  # no small common denominator: units of 2^-24 of the sum
    assert odd[0] >= 1 and abs(odd[1] / sum(odd) - 3.14159265358979 / (3.14159265358979 + 1e-7)) < 1e-6
    assert source_names(["/a/web", "/b/code", "/c/web", "/d/web/"]) == ["web", "code", "web-2", "web-3"]


# --- opening a mixture ------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def second_dataset(tiny_dataset, tmp_path_factory) -> Path:
    """Other standard-library source (http, urllib), tokenized with the tiny dataset's own tokenizer."""
    files = collect_text_files([str(STDLIB / "http"), str(STDLIB / "urllib")], [".py"])
    out = tmp_path_factory.mktemp("mix") / "web"
    return prepare_dataset(files, out, tokenizer=load_tokenizer(tiny_dataset), log=lambda _: None)


@pytest.fixture(scope="session")
def other_tokenizer_dataset(tmp_path_factory) -> Path:
    files = collect_text_files([str(STDLIB / "html")], [".py"])
    return prepare_dataset(files, tmp_path_factory.mktemp("other") / "html", vocab_size=512, log=lambda _: None)


def _open(*mix: str, vocab: int = 512) -> object:
    return open_training_data(DataConfig(mix=list(mix)), vocab, 64, 16, 1)


def test_a_mixture_reads_each_source_windows(tiny_dataset, second_dataset):
    data = _open(f"{tiny_dataset}:0.7", f"{second_dataset}:0.3")
    assert isinstance(data.train, MixedWindows)
    assert data.train.names == [tiny_dataset.name, "web"] and list(data.val) == [tiny_dataset.name, "web"]
    one = open_training_data(DataConfig(dataset_dir=str(tiny_dataset)), 512, 64, 16, 1)
    two = open_training_data(DataConfig(dataset_dir=str(second_dataset)), 512, 64, 16, 1)
    assert len(data.train) == len(one.train) + len(two.train)
    picks = torch.tensor([0, 5, len(one.train) + 3, len(one.train) - 1, len(data.train) - 1])
    x, y = data.train.batch(picks)
    ox, oy = one.train.batch(torch.tensor([0, 5]))
    tx, ty = two.train.batch(torch.tensor([3]))
    assert torch.equal(x[:2], ox) and torch.equal(y[:2], oy) and torch.equal(x[2:3], tx) and torch.equal(y[2:3], ty)
    last_one, last_two = (
        one.train.batch(torch.tensor([len(one.train) - 1])),
        two.train.batch(torch.tensor([-1]) + len(two.train)),
    )
    assert torch.equal(x[3:], torch.cat([last_one[0], last_two[0]]))
    assert torch.equal(y[3:], torch.cat([last_one[1], last_two[1]]))
    assert data.eos_id == one.eos_id and data.tokenizer_path == one.tokenizer_path


def test_a_missing_directory_is_one_line(tiny_dataset, tmp_path):
    with pytest.raises(DataError) as e:
        _open(f"{tiny_dataset}:1", f"{tmp_path / 'nope'}:1")
    assert "\n" not in str(e.value)
    assert f"data.mix source '{tmp_path / 'nope'}' is not a directory" in str(e.value)


def test_different_tokenizers_are_one_line(tiny_dataset, other_tokenizer_dataset):
    with pytest.raises(DataError) as e:
        _open(f"{tiny_dataset}:1", f"{other_tokenizer_dataset}:1")
    msg = str(e.value)
    assert "\n" not in msg and "were prepared with different tokenizers" in msg
    assert f"--tokenizer {tiny_dataset / 'tokenizer.model'}" in msg


def test_a_model_vocabulary_too_small_for_the_sources_is_one_line(tiny_dataset, second_dataset):
    with pytest.raises(DataError) as e:
        _open(f"{tiny_dataset}:1", f"{second_dataset}:1", vocab=300)
    assert "\n" not in str(e.value) and "model.vocab_size" in str(e.value)


# --- training on a mixture --------------------------------------------------------------------------------------


def _mix(tiny_dataset: Path, second_dataset: Path, *extra: str) -> list[str]:
    base = [o for o in tiny(tiny_dataset, *extra) if not o.startswith("data.dataset_dir=")]
    return [*base, f"data.mix=[{tiny_dataset}:0.7,{second_dataset}:0.3]"]


def assert_same_sources(expected: list[dict], got: list[dict]) -> None:
    """``assert_same_curve``, and the same validation loss of each source and tokens of each source at each step."""
    assert_same_curve(expected, got)
    for want, have in zip(expected, got, strict=True):
        keys = sorted(k for k in want if k.startswith(("val_loss/", "tokens/")))
        assert keys == sorted(k for k in have if k.startswith(("val_loss/", "tokens/")))
        for k in keys:
            assert math.isclose(have[k], want[k], rel_tol=REL), (want["step"], k, have[k], want[k])


@pytest.fixture
def mix_reference(tiny_dataset, second_dataset, references) -> tuple[Path, list[dict]]:
    """The one-process mixture run: 8 steps, one micro-batch of 16, validation at steps 4 and 8."""
    overrides = _mix(tiny_dataset, second_dataset, "train.steps=8", "train.micro_batch_size=16")
    return references.run_dir(overrides), references.history(overrides)


@pytest.mark.multiprocess
def test_metrics_carry_tokens_and_validation_loss_per_source(tiny_dataset, second_dataset, mix_reference):
    run_dir, history = mix_reference
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 9))
    one = open_training_data(DataConfig(dataset_dir=str(tiny_dataset)), 512, 64, 16, 1)
    # What the sampler really drew, counted window by window, against the closed form the metrics carry.
    data = _open(f"{tiny_dataset}:0.7", f"{second_dataset}:0.3")
    sampler = data.train.sampler(16, 0)
    drawn = torch.cat([sampler.global_batch(step) for step in range(8)])
    for r in rows:
        web = int((drawn[: 16 * r["step"]] >= len(one.train)).sum())
        assert r["tokens/web"] == 64 * web and r["tokens/tiny"] == 64 * (16 * r["step"] - web)
        assert r["data_ms"] >= 0 and r["data_read_ms"] > 0 and 0 <= r["data_share"] < 1
    assert rows[-1]["tokens/web"] == 64 * 39  # floor(128 * 0.7) = 89 of the 128 windows from tiny, 39 from web
    for r in rows:
        has_val = r["step"] in (4, 8)
        assert ("val_loss" in r) == ("val_loss/tiny" in r) == ("val_loss/web" in r) == has_val
        if has_val:
            assert r["val_loss/tiny"] != r["val_loss/web"]
            assert r["val_loss"] == pytest.approx(0.7 * r["val_loss/tiny"] + 0.3 * r["val_loss/web"], rel=1e-12)
    assert [r["loss"] for r in rows] == [h["loss"] for h in history]


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["parallel.dp=2", "parallel.cp=2"])
def test_a_mixture_gives_the_one_process_curve_at_dp2_and_cp2(
    tiny_dataset, second_dataset, tmp_path, mix_reference, layout
):
    """Both ranks of cp=2 read the same windows of each source (and count each source's tokens once)."""
    overrides = _mix(tiny_dataset, second_dataset, "train.steps=8", "train.micro_batch_size=4", layout)
    for history in train_in_process(tmp_path, overrides, world=2):
        assert_same_sources(mix_reference[1], history)


@pytest.mark.multiprocess
def test_a_dp2_mixture_checkpoint_resumes_at_tp2_and_pp2(tiny_dataset, second_dataset, tmp_path, mix_reference):
    saved = tmp_path / "dp2"
    overrides = _mix(tiny_dataset, second_dataset, "train.steps=8", "checkpoint.every=4", "train.micro_batch_size=8")
    (history, _) = train_in_process(saved, overrides, world=2)
    assert_same_sources(mix_reference[1], history)
    checkpoint = saved / "checkpoints" / "step_00000004"
    base = _mix(tiny_dataset, second_dataset, "train.steps=8", "train.micro_batch_size=4")
    for layout in ("parallel.tp=2", "parallel.pp=2"):
        resumed = train_in_process(tmp_path / layout, [*base, layout, f"checkpoint.resume={checkpoint}"], world=2)
        for rows in resumed:
            assert_same_sources(mix_reference[1][4:], rows)
        assert [r["step"] for r in read_metrics(tmp_path / layout)] == [5, 6, 7, 8]


@pytest.mark.multiprocess
def test_a_resume_with_other_weights_is_refused(tiny_dataset, second_dataset, tmp_path):
    saved = tmp_path / "saved"
    train_in_process(saved, _mix(tiny_dataset, second_dataset, "train.steps=2", "train.eval_every=0"))
    other = [o for o in tiny(tiny_dataset, "train.steps=4") if not o.startswith("data.dataset_dir=")]
    other += [f"data.mix=[{tiny_dataset}:0.5,{second_dataset}:0.5]", f"checkpoint.dir={saved / 'checkpoints'}"]
    with pytest.raises(RuntimeError, match="CheckpointError: the checkpoint was trained on data.mix="):
        train_in_process(tmp_path / "other", other)


@pytest.mark.multiprocess
def test_a_one_source_mixture_trains_as_its_dataset(tiny_dataset, tmp_path):
    plain = tiny(tiny_dataset, "train.steps=4", "train.micro_batch_size=16")
    (expected,) = train_in_process(tmp_path / "plain", plain)
    mixed = [o for o in plain if not o.startswith("data.dataset_dir=")] + [f"data.mix=[{tiny_dataset}:1]"]
    (got,) = train_in_process(tmp_path / "mixed", mixed)
    # Its one source's validation loss is the run's validation loss; the plain run reports only the latter.
    assert all(r["val_loss/tiny"] == r["val_loss"] for r in got if "val_loss" in r)
    assert_same_curve(expected, [{k: v for k, v in r.items() if not k.startswith("val_loss/")} for r in got])
    assert [r["tokens/tiny"] for r in got] == [r["tokens"] for r in got]


@pytest.mark.multiprocess
def test_a_one_dataset_checkpoint_resumes_as_a_one_source_mixture(tiny_dataset, second_dataset, tmp_path):
    # data.mix=[DIR:1] is DIR's own stream, so a checkpoint saved without a mixture carries over exactly; a real
    # mixture is another stream, refused with a line saying what differs (was: "cannot read checkpoint file
    # .../trainer.json: KeyError 'mix'", which reads as a damaged checkpoint).
    plain = tiny(tiny_dataset, "train.steps=4", "train.micro_batch_size=16", "train.eval_every=0")
    (expected,) = train_in_process(tmp_path / "plain", plain)
    saved = tmp_path / "saved"
    train_in_process(saved, [*plain, "train.steps=2"])
    resume = [o for o in plain if not o.startswith("data.dataset_dir=")] + [f"checkpoint.dir={saved / 'checkpoints'}"]
    two = f"data.mix=[{tiny_dataset}:1,{second_dataset}:1]"
    with pytest.raises(RuntimeError, match=r"trained on one dataset \(data.dataset_dir, no data.mix\), this run has"):
        train_in_process(tmp_path / "two", [*resume, two])
    (got,) = train_in_process(tmp_path / "mixed", [*resume, f"data.mix=[{tiny_dataset}:1]"])
    assert [r["step"] for r in got] == [3, 4]
    assert_same_curve(expected[2:], [{k: v for k, v in r.items() if not k.startswith("tokens/")} for r in got])
