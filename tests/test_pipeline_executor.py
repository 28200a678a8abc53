"""The pipeline executor on real gloo ranks: the tied embedding copies stay bit-identical over steps, the measured
action timings are recorded for every action (only when asked), and gloo's receives posted a tick ahead (its
default) train bit-identically to NCCL's plan. That pipeline stages draw different dropout masks is
tests/test_dropout.py's."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from trident.build import build_parts, layout_of
from trident.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from trident.parallel.batch import Batch
from trident.parallel.groups import build_process_groups
from trident.parallel.pipeline.schedules import build_schedule, stage_of
from trident.parallel.placement import placement_of
from trident.parallel.topology import Topology
from trident_dev.ranks import run_distributed

pytestmark = pytest.mark.multiprocess

MODEL = ModelConfig(name="t", n_layers=4, d_model=32, n_heads=4, seq_len=16, vocab_size=100)


def _tied_copies_after_steps(rank: int, world: int, schedule: str, vpp: int, timings) -> dict:
    par = ParallelConfig(pp=world, vpp=vpp, schedule=schedule)
    cfg = Config(model=MODEL, parallel=par, train=TrainConfig(seed=0), optim=OptimConfig(lr=1e-2, grad_clip=1.0))
    groups = build_process_groups(Topology(dp=1, pp=world, tp=1))
    parts = build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu"), timings)
    chunks, runner, step = parts.chunks, parts.runner, parts.optimizer.step
    path = timings / f"rank{rank}.jsonl"
    (copy,) = [p for c in chunks for p in c.parameters() if "embedding" in placement_of(p).grad_sums]
    start = copy.detach().clone()
    gen = torch.Generator().manual_seed(1)
    losses, identical = [], []
    for i in range(3):
        x, y = (torch.randint(0, 100, (2, 16), generator=gen) for _ in range(2))
        batches = [Batch(x, y, torch.arange(2 * m, 2 * m + 2), i) for m in range(4)]
        loss = runner.forward_backward(batches, chunks[-1].loss_sum, 1.0 / 128)
        step.step(1e-2)  # sums the two copies' gradients first, as their placements ask
        losses.append(loss.item())
        # The first stage holds wte, the last lm_head: gather both over the embedding group.
        both = [torch.empty_like(copy) for _ in range(2)]
        dist.all_gather(both, copy.detach(), group=groups.embedding_group)
        identical.append(torch.equal(*both))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return {
        "identical": identical,
        "moved": not torch.equal(start, copy.detach()),
        "losses": losses,
        "rows": rows,
        "is_last": any(c.is_last for c in chunks),
    }


def test_tied_embedding_copies_stay_bit_identical_and_timings_are_recorded(tmp_path):
    for schedule, vpp in (("1f1b", 1), ("interleaved", 2)):
        out = run_distributed(_tied_copies_after_steps, 2, schedule, vpp, tmp_path / schedule)
        for rank, result in enumerate(out):
            assert result["identical"] == [True] * 3 and result["moved"], (schedule, rank)
            # The loss is the last stage's; every other stage returns zero.
            assert all(v > 0 for v in result["losses"]) == result["is_last"]
            assert all(v == 0 for v in result["losses"]) != result["is_last"]
            rows = result["rows"]
            assert len(rows) == 3
            planned = build_schedule(schedule, 2, vpp, 4)[rank]
            for row in rows:
                spans = row["spans"]
                assert [(k, m, c) for k, m, c, _, _ in spans] == [tuple(a) for a in planned]
                assert all(start <= end for *_, start, end in spans)
                assert all(a[4] <= b[3] for a, b in zip(spans, spans[1:], strict=False))  # one action at a time
        assert stage_of(vpp - 1, 1, 2) == 2 * vpp - 1  # the last rank holds the last stage and the loss
    assert Config().logging.pipeline_timings is False


def _trained_with_lead(rank: int, world: int, schedule: str, vpp: int, lead: int | None) -> dict:
    par = ParallelConfig(pp=world, vpp=vpp, schedule=schedule)
    cfg = Config(model=MODEL, parallel=par, train=TrainConfig(seed=0), optim=OptimConfig(lr=1e-2, grad_clip=1.0))
    groups = build_process_groups(Topology(dp=1, pp=world, tp=1))
    parts = build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu"))
    default = parts.runner.lead
    if lead is not None:
        parts.runner.lead = lead
    gen = torch.Generator().manual_seed(3)
    losses = []
    for i in range(3):
        x, y = (torch.randint(0, 100, (2, 16), generator=gen) for _ in range(2))
        batches = [Batch(x.roll(m, 1), y.roll(m, 1), torch.arange(2 * m, 2 * m + 2), i) for m in range(6)]
        losses.append(parts.runner.forward_backward(batches, parts.chunks[-1].loss_sum, 1.0 / 192).item())
        parts.optimizer.step.step(1e-2)
    params = [p.detach().clone() for c in parts.chunks for p in c.parameters()]
    parts.optimizer.remove_hooks()
    return {"default": default, "losses": losses, "params": params}


@pytest.mark.parametrize("schedule,vpp", [("interleaved", 2), ("zb-h1", 1)])
def test_receives_posted_ahead_train_as_in_the_send_tick(schedule, vpp):
    """gloo posts each receive a tick before its send (parallel/pipeline/messages.py); NCCL's plan (lead 0) and a
    longer lead run here too: the same losses and weights, bit for bit."""
    runs = {lead: run_distributed(_trained_with_lead, 2, schedule, vpp, lead) for lead in (None, 0, 3)}
    assert [r["default"] for r in runs[None]] == [1, 1]
    for lead in (0, 3):
        for ours, theirs in zip(runs[None], runs[lead], strict=True):
            assert ours["losses"] == theirs["losses"], lead
            assert all(torch.equal(a, b) for a, b in zip(ours["params"], theirs["params"], strict=True)), lead
    assert runs[None][1]["losses"][0] > 0  # the last stage's loss, not the zeros of the others
