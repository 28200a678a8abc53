"""Under pipeline parallelism each model chunk's gradient buckets start their dp reduction during the chunk's last
backward of the step, not after the schedule: checked against the executor's recorded action timings on real gloo
ranks (dp=2 x pp=2), with every bucket reduced after the schedule (the runner told no chunk's last backward) as
the control that the check can fail.
That the gradients stay right is the one-process curve of tests/test_pipeline_layouts.py's dp=2 layouts."""

from __future__ import annotations

import json
import time

import pytest
import torch

from trident.build import build_optimizer, layout_of, model_chunks
from trident.config import Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from trident.layout import Layout
from trident.memory.params import stage_params
from trident.parallel.groups import build_process_groups
from trident.parallel.layout import FlatLayout
from trident.parallel.pipeline.executor import PipelineRunner
from trident.parallel.topology import Topology
from trident_dev.bench.harness import random_batches
from trident_dev.ranks import run_distributed

MODEL = ModelConfig(name="t", n_layers=4, d_model=32, n_heads=4, seq_len=16, vocab_size=100)


def test_no_bucket_spans_two_chunks():
    chunks = [[torch.nn.Parameter(torch.zeros(n)) for n in sizes] for sizes in ([3, 4], [5, 2, 2])]
    params = [p for c in chunks for p in c]
    # Without chunks the greedy cut puts chunk 1's first parameter in chunk 0's last bucket (reverse order).
    mixed = FlatLayout.by_size(params, bucket_numel=100, dp_size=2)
    assert len(mixed.spans) == 1
    layout = FlatLayout.by_size(params, bucket_numel=100, dp_size=2, chunks=chunks)
    assert [s.params for s in layout.spans] == [chunks[1][::-1], chunks[0][::-1]]
    assert all(s.numel % 2 == 0 for s in layout.spans)


def _launches(rank: int, world: int, schedule: str, vpp: int, per_chunk: bool, timings) -> dict:
    par = ParallelConfig(dp=2, pp=2, vpp=vpp, schedule=schedule, bucket_mb=0.01)
    cfg = Config(model=MODEL, parallel=par, train=TrainConfig(seed=0), optim=OptimConfig(lr=1e-2))
    groups = build_process_groups(Topology(dp=2, pp=2, tp=1))
    chunks = model_chunks(cfg.model, layout_of(cfg, groups), cfg.train, groups, torch.device("cpu"))
    optimizer = build_optimizer(chunks, layout_of(cfg, groups), cfg.optim, groups)
    reducer = optimizer.reducer
    path = timings / f"rank{rank}.jsonl"
    runner = PipelineRunner(
        chunks, schedule, groups.pp_rank, groups.pp_ranks, groups.pp_group, reducer, "fp32", MODEL.d_model,
        timings=path,
    )  # fmt: skip
    if not per_chunk:  # the control: no chunk's last backward known, so every bucket waits for the schedule's end
        runner.last_weight_ticks = lambda plan: {}
    launches = []  # (time, chunk, bucket index, from a backward hook) of every bucket's reduction, as it starts
    reduce_bucket, launch_chunk = reducer.reduce_bucket, reducer.launch_chunk
    flushing = [False]

    def record(bucket):
        launches.append((time.time(), bucket.chunk, bucket.span.index, not flushing[0]))
        return reduce_bucket(bucket)

    def flush(chunk):
        flushing[0] = True
        try:
            launch_chunk(chunk)
        finally:
            flushing[0] = False

    reducer.reduce_bucket, reducer.launch_chunk = record, flush
    steps = []
    for step in range(2):
        launches.clear()
        batches = random_batches(100, 4, 2, 16, step, seed=step + 10 * groups.dp_rank)
        runner.forward_backward(batches, chunks[-1].loss_sum, 1.0 / 256)
        optimizer.step.step(1e-2)
        optimizer.zero.zero_grad()
        row = json.loads(path.read_text().splitlines()[-1])
        steps.append({"launches": list(launches), "spans": row["spans"], "reduce": row["reduce"]})
    chunks_of = {b.span.index: b.chunk for b in reducer.buckets}
    numels = [s.numel for s in reducer.layout.spans]
    return {
        "steps": steps,
        "pp_rank": groups.pp_rank,
        "dp_rank": groups.dp_rank,
        "chunks_of": chunks_of,
        "numels": numels,
    }


def _last_weight_span(spans: list, chunk: int, stage0: bool) -> int:
    kinds = ("B", "W", "I") if stage0 else ("B", "W")
    return max(i for i, (k, _, c, _, _) in enumerate(spans) if c == chunk and k in kinds)


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule,vpp", [("interleaved", 2), ("zb-h1", 1)])
def test_each_chunks_buckets_launch_during_its_last_backward(tmp_path, schedule, vpp):
    new = run_distributed(_launches, 4, schedule, vpp, True, tmp_path / "new")
    old = run_distributed(_launches, 4, schedule, vpp, False, tmp_path / "old")
    layout = Layout(dp=2, pp=2, vpp=vpp, bucket_mb=0.01)
    for r in new:  # the memory estimator's layout (trident/memory/params.py) is the reducer's, chunk cuts included
        predicted, _ = stage_params(MODEL, layout, r["pp_rank"]).flat(layout)
        assert [s.numel for s in predicted.spans] == r["numels"]
    for per_chunk, results in ((True, new), (False, old)):
        for r in results:
            peer = next(o for o in results if o["pp_rank"] == r["pp_rank"] and o is not r)
            for mine, theirs in zip(r["steps"], peer["steps"], strict=True):
                # Every bucket once, and the same order on both dp ranks (collectives must be issued alike).
                assert sorted(i for _, _, i, _ in mine["launches"]) == sorted(r["chunks_of"])
                assert [i for _, _, i, _ in mine["launches"]] == [i for _, _, i, _ in theirs["launches"]]
            if r["dp_rank"] != 0:  # timings are recorded on dp rank 0's pipeline
                continue
            for step in r["steps"]:
                spans, launches = step["spans"], step["launches"]
                last_action_end = spans[-1][4]
                if not per_chunk:  # the old behaviour: nothing starts before the schedule is over
                    assert all(t >= last_action_end for t, *_ in launches)
                    continue
                for chunk in range(vpp):
                    i = _last_weight_span(spans, chunk, stage0=r["pp_rank"] == 0 and chunk == 0)
                    start, end = spans[i][3], spans[i][4]
                    times = [t for t, c, _, _ in launches if c == chunk]
                    # Started within the chunk's last weight-gradient action (recorded end: after launch_chunk).
                    assert all(start <= t <= end for t in times), (schedule, r["pp_rank"], chunk)
                    if i < len(spans) - 1:  # a chunk done before the rank's last action: on the wire before it
                        assert max(times) < spans[-1][3]
                # Interleaved: chunk 1's last backward is not the rank's last action, so its buckets overlap the rest.
                if vpp == 2:
                    assert _last_weight_span(spans, 1, False) < len(spans) - 1
                    # Most of them from the backward hooks, as their gradients came in, overlapping the backward.
                    assert any(hook for _, c, _, hook in launches if c == chunk)
                assert step["reduce"][0] >= last_action_end
