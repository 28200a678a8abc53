"""Every data-parallel layout gives the one-process run's curve, and a checkpoint moves between them."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.layouts import assert_same_curve, make_config, tiny, train_in_process
from trident.build import build_parts, layout_of
from trident.loop import Trainer
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.bench.harness import random_windows
from trident_dev.ranks import run_distributed

pytestmark = pytest.mark.multiprocess


def _dp(dataset, *extra: str) -> list[str]:
    """8 steps of gpt-tiny."""
    return tiny(dataset, "train.steps=8", *extra)


@pytest.fixture
def reference(tiny_dataset, references) -> list[dict]:
    """The one-process run: 8 steps, one micro-batch of 16 per step."""
    return references.history(_dp(tiny_dataset, "train.micro_batch_size=16"))


# dp=2 with 4 micro-batches of 2 a rank is the saving run of the checkpoint test below.
@pytest.mark.parametrize("dp,mbs", [(2, 8), (4, 4), (4, 1)], ids=lambda v: str(v))
def test_dp_gives_the_one_process_curve_and_norm(tiny_dataset, tmp_path, reference, dp, mbs):
    histories = train_in_process(tmp_path, _dp(tiny_dataset, f"train.micro_batch_size={mbs}"), world=dp)
    assert len(histories) == dp
    for history in histories:  # every rank knows the loss and the global norm, not just the logging rank
        assert_same_curve(reference, history)


def test_a_dp2_checkpoint_resumes_at_dp1_and_dp4_with_the_uninterrupted_losses(tiny_dataset, tmp_path, reference):
    saved = tmp_path / "dp2"
    histories = train_in_process(saved, _dp(tiny_dataset, "checkpoint.every=4", "train.micro_batch_size=2"), world=2)
    assert len(histories) == 2
    for history in histories:
        assert_same_curve(reference, history)
    checkpoint = saved / "checkpoints" / "step_00000004"
    for dp in (1, 4):
        resumed = train_in_process(
            tmp_path / f"dp{dp}",
            _dp(tiny_dataset, "train.micro_batch_size=2", f"checkpoint.resume={checkpoint}"),
            world=dp,
        )
        for rows in resumed:
            assert_same_curve(histories[0][4:], rows)


def _step_collectives(rank: int, world: int, cfg) -> tuple[list[str], int]:
    groups = build_process_groups(Topology(dp=world, pp=1, tp=1))
    data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 4 * cfg.train.global_batch_size)
    parts = build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu"))
    trainer = Trainer(cfg, groups, parts, (data, data), prefetch=False)
    trainer.train_step(0, trainer.micro_batches(0))  # the optimizer's state exists from here on
    with torch.profiler.profile() as prof:
        trainer.train_step(1, trainer.micro_batches(1))
    parts.optimizer.remove_hooks()
    return [e.name for e in prof.events() if e.name.startswith("c10d::")], len(parts.optimizer.reducer.buckets)


@pytest.mark.parametrize("dp", [1, 2])
def test_a_data_parallel_step_issues_only_the_collectives_its_math_needs(tmp_path, dp):
    """One process issues no collective at all; dp replicas all-reduce their gradient buckets and the loss, and
    take the norm each on its own (their gradients are the same all-reduced ones)."""
    overrides = ("model=gpt-tiny", "train.global_batch_size=8", "train.micro_batch_size=2", "parallel.bucket_mb=0.1")
    cfg = make_config(*overrides)
    for collectives, buckets in run_distributed(_step_collectives, dp, cfg):
        assert buckets > 1
        assert collectives == ([] if dp == 1 else ["c10d::allreduce_"] * (buckets + 1)), collectives


# Tensor parallelism: tp alone, with sequence parallelism, and combined with dp; vocab 515 is divided by no tp,
# so the padded columns of the vocab-parallel head are exercised too. tp=2 with sequence parallelism and tp=4 are
# the saving runs of the checkpoint test below.
def _tp(dataset, *extra: str) -> list[str]:
    return tiny(dataset, "train.steps=6", "train.micro_batch_size=4", "model.vocab_size=515", *extra)


@pytest.fixture
def reference_515(tiny_dataset, references) -> list[dict]:
    """The one-process run, which saves a checkpoint at step 3 (the tp=1 source of the checkpoint test)."""
    return references.history(_tp(tiny_dataset, "checkpoint.every=3"))


TP_LAYOUTS = [
    (2, 2, []),
    (4, 2, ["parallel.sequence_parallel=true"]),  # dp=2 x tp=2
]


@pytest.mark.parametrize("world,tp,extra", TP_LAYOUTS, ids=lambda v: str(v))
def test_tp_gives_the_one_process_curve(tiny_dataset, tmp_path, reference_515, world, tp, extra):
    histories = train_in_process(tmp_path, _tp(tiny_dataset, f"parallel.tp={tp}", *extra), world=world)
    for history in histories:
        assert_same_curve(reference_515, history)


def test_tp_checkpoints_resume_at_other_tp(tiny_dataset, tmp_path, references, reference_515):
    """tp=2 (with SP) -> tp=1 and tp=4; tp=1 and tp=4 -> tp=2: each gives the uninterrupted run's next losses. The
    tp=2 (SP) and tp=4 runs that save give the one-process curve on every rank."""
    saved = {"tp1": references.run_dir(_tp(tiny_dataset, "checkpoint.every=3")) / "checkpoints" / "step_00000003"}
    sources = [
        ("tp2", 2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ("tp4", 4, ["parallel.tp=4"]),
    ]
    for name, world, extra in sources:
        histories = train_in_process(tmp_path / name, _tp(tiny_dataset, "checkpoint.every=3", *extra), world=world)
        assert len(histories) == world
        for history in histories:
            assert_same_curve(reference_515, history)
        saved[name] = tmp_path / name / "checkpoints" / "step_00000003"
    for source, world, tp in [("tp2", 1, 1), ("tp2", 4, 4), ("tp1", 2, 2), ("tp4", 2, 2)]:
        resumed = train_in_process(
            tmp_path / f"{source}-to-tp{tp}",
            _tp(tiny_dataset, f"parallel.tp={tp}", f"checkpoint.resume={saved[source]}"),
            world=world,
        )
        for rows in resumed:
            assert_same_curve(reference_515[3:], rows)
