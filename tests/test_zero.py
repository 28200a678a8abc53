"""ZeRO stages 1-3 (with tp, cp, offload, activation checkpointing) give the one-process curve, keep only what their
stage says, and their checkpoints resume under other stages and dp sizes with the uninterrupted losses."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.layouts import assert_same_curve, make_config, tiny, train_in_process
from trident.build import build_parts, layout_of
from trident.parallel.batch import Batch
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology
from trident_dev.ranks import run_distributed

pytestmark = pytest.mark.multiprocess

# Small buckets, so that the non-block stages reduce and gather several of them.
BASE = ("train.steps=6", "parallel.bucket_mb=0.05")


@pytest.fixture
def reference(tiny_dataset, references) -> tuple[list[dict], object]:
    """The one-process zero-0 run (4 micro-batches a step), and its checkpoint of step 3."""
    overrides = tiny(tiny_dataset, *BASE, "train.micro_batch_size=4", "checkpoint.every=3")
    return references.history(overrides), references.run_dir(overrides) / "checkpoints" / "step_00000003"


LAYOUTS = [
    (2, ["parallel.zero=1", "train.micro_batch_size=8"]),
    (2, ["parallel.zero=2", "train.micro_batch_size=2"]),
    (2, ["parallel.zero=3", "train.micro_batch_size=4"]),
    (4, ["parallel.zero=1", "train.micro_batch_size=2"]),
    (4, ["parallel.zero=2", "train.micro_batch_size=4"]),
    (4, ["parallel.zero=3", "train.micro_batch_size=2"]),
    (4, ["parallel.zero=1", "parallel.tp=2", "train.micro_batch_size=4"]),
    (4, ["parallel.zero=2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.micro_batch_size=2"]),
    # Op-level selective recomputation over blocks whose weights ZeRO-3 frees after each forward.
    (4, ["parallel.zero=3", "parallel.tp=2", "train.micro_batch_size=4", "train.activation_checkpointing=selective"]),
    (2, ["parallel.zero=3", "parallel.zero3_gather=step", "parallel.zero3_prefetch=0", "train.micro_batch_size=2"]),
    (2, ["parallel.zero=1", "parallel.offload.optimizer=cpu", "parallel.offload.ratio=1.0"]),
    (4, ["parallel.zero=2", "parallel.offload.optimizer=cpu", "parallel.offload.ratio=0.5"]),
    (
        2,
        [
            "parallel.zero=3",
            "parallel.offload.optimizer=cpu",
            "parallel.offload.ratio=0.5",
            "train.activation_checkpointing=full",
        ],
    ),
    # Context parallelism: ZeRO shards over dp x cp, here the two cp ranks of one sequence, half offloaded.
    (2, ["parallel.cp=2", "parallel.zero=2", "parallel.offload.optimizer=cpu", "parallel.offload.ratio=0.5"]),
]


@pytest.mark.parametrize("world,extra", LAYOUTS, ids=lambda v: str(v) if isinstance(v, int) else " ".join(v))
def test_zero_gives_the_one_process_curve(tiny_dataset, tmp_path, reference, world, extra):
    histories = train_in_process(tmp_path, tiny(tiny_dataset, *BASE, *extra), world=world)
    for history in histories:
        assert_same_curve(reference[0], history)


def test_a_zero2_checkpoint_resumes_at_zero0_and_at_zero3_on_another_dp(tiny_dataset, tmp_path, reference):
    saved = tmp_path / "zero2"
    overrides = tiny(tiny_dataset, *BASE, "parallel.zero=2", "checkpoint.every=3", "train.micro_batch_size=4")
    (history, _) = train_in_process(saved, overrides, world=2)
    assert_same_curve(reference[0], history)
    checkpoint = saved / "checkpoints" / "step_00000003"
    # zero=3 at dp=4 with half of each optimizer shard offloaded: the state loads into host and device pieces.
    offload = ["parallel.offload.optimizer=cpu", "parallel.offload.ratio=0.5"]
    for world, zero, extra in ((1, 0, []), (4, 3, offload)):
        overrides = tiny(tiny_dataset, *BASE, f"parallel.zero={zero}", "train.micro_batch_size=2", *extra)
        resumed = train_in_process(tmp_path / f"zero{zero}", [*overrides, f"checkpoint.resume={checkpoint}"], world)
        for rows in resumed:
            assert_same_curve(reference[0][3:], rows)


def test_a_zero0_checkpoint_resumes_at_zero2_under_tensor_parallelism(tiny_dataset, tmp_path, reference):
    """dp=2 x tp=2: the masters and moments of each tp block's dp shard are boxes of the logical tensors."""
    history, checkpoint = reference
    overrides = tiny(tiny_dataset, *BASE, "parallel.zero=2", "parallel.tp=2", "train.micro_batch_size=4")
    for rows in train_in_process(tmp_path, [*overrides, f"checkpoint.resume={checkpoint}"], world=4):
        assert_same_curve(history[3:], rows)


def test_a_bf16_run_resumes_exactly_from_its_fp32_masters(tiny_dataset, tmp_path):
    overrides = tiny(tiny_dataset, *BASE, "train.precision=bf16", "parallel.zero=1", "train.micro_batch_size=4")
    (history, _) = train_in_process(tmp_path / "a", [*overrides, "checkpoint.every=3"], world=2)
    checkpoint = tmp_path / "a" / "checkpoints" / "step_00000003"
    (resumed, _) = train_in_process(tmp_path / "b", [*overrides, f"checkpoint.resume={checkpoint}"], world=2)
    assert [(r["loss"], r["grad_norm"]) for r in resumed] == [(r["loss"], r["grad_norm"]) for r in history[3:]]


# --- what each stage holds, measured on the live tensors.


def _build(world: int, tp: int, *overrides: str):
    """A rank's parts as train.py builds them; returns (cfg, groups, model, optimizer, runner)."""
    cfg = make_config("model=gpt-tiny", "model.n_layers=4", "parallel.bucket_mb=0.05", *overrides)
    groups = build_process_groups(Topology(dp=world // tp, pp=1, tp=tp))
    parts = build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu"))
    (model,) = parts.chunks
    return cfg, groups, model, parts.optimizer, parts.runner


def _train(cfg, groups, model, setup, runner, steps: int, inject=None) -> list[tuple[float, bool, float]]:
    """``steps`` optimizer steps on random tokens (each dp rank its own); (grad norm, skipped, scale) per step."""
    gen = torch.Generator().manual_seed(groups.dp_rank)
    out = []
    for step in range(steps):
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 4, cfg.model.seq_len + 1), generator=gen)
        handle = inject(step, model) if inject else None
        scale = setup.step.loss_scale
        micro = [Batch(t[:, :-1], t[:, 1:], torch.arange(4 * m, 4 * m + 4), step) for m, t in enumerate(tokens)]
        runner.forward_backward(micro, model.loss_sum, scale / tokens[..., 1:].numel())
        if handle is not None:
            handle.remove()
        norm, skipped = setup.step.step(1e-3)
        out.append((norm, skipped, scale))
    return out


def _storages(tensors: list[torch.Tensor]) -> int:
    unique = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(unique.values())


def _model_state(rank: int, world: int, zero: int) -> dict:
    cfg, groups, model, setup, runner = _build(world, 1, f"parallel.zero={zero}")
    _train(cfg, groups, model, setup, runner, steps=2)
    tensors = setup.step.model_state_tensors()
    layout = setup.reducer.layout
    return {
        "grads": _storages(tensors["grads"]),
        "optimizer": _storages(tensors["optimizer"]),
        "params": _storages(tensors["params"]),
        "layout": layout.numel,
        "three_largest_buckets": sum(sorted(s.numel for s in layout.spans)[-3:]),
        "peak_staging": getattr(setup.reducer, "peak_staging_bytes", None),
        "no_grad_attr": all(p.grad is None for p in model.parameters()),
    }


def test_stage2_holds_only_its_gradient_shard_and_stage1_its_optimizer_shard():
    """dp=4, fp32: stage 1 keeps the full fp32 gradient buffer and a quarter of AdamW's moments (the masters are
    the parameters); stage 2 keeps a quarter of the gradients, plus a few buckets' staging during backward."""
    stage0, stage1, stage2 = (run_distributed(_model_state, 4, zero)[1] for zero in (0, 1, 2))
    numel = stage1["layout"]
    assert stage1["grads"] == 4 * numel
    assert stage2["grads"] == 4 * numel // 4  # between steps: the shard, nothing else
    # During backward: one bucket being filled and at most two being reduce-scattered.
    assert 0 < stage2["peak_staging"] <= 4 * stage2["three_largest_buckets"] < 4 * numel // 2
    assert stage2["params"] == stage1["params"] == 4 * numel  # fp32 parameters, whole on every rank
    # Moments (8 bytes per element) plus 4-byte step counters: a quarter of stage 0's, give or take the counters.
    assert stage1["optimizer"] == pytest.approx(stage0["optimizer"] / 4, rel=0.02)
    assert stage2["optimizer"] == stage1["optimizer"]
    assert all(s["no_grad_attr"] for s in (stage0, stage1, stage2))


def _stage3_frees(rank: int, world: int, mode: str = "micro_batch") -> dict:
    cfg, groups, model, setup, runner = _build(
        world, 1, "parallel.zero=3", "train.precision=bf16", f"parallel.zero3_gather={mode}"
    )
    store = setup.zero.store
    seen = []
    for block in model.layers.values():
        block.register_forward_hook(lambda m, a, o: seen.append(store.full_bytes()))
    _train(cfg, groups, model, setup, runner, steps=2)
    block_bytes = sum(p.numel() for p in model.layers["0"].parameters()) * 2
    root_bytes = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("layers.")) * 2
    return {
        "after_step": store.full_bytes(),
        "block_storage": [p.untyped_storage().nbytes() for p in model.layers.parameters()],
        "peak": max(seen),
        "root_plus_two_blocks": root_bytes + 2 * block_bytes + 2 * world,  # each bucket padded by < dp
        "all_full": root_bytes + len(model.layers) * block_bytes,
        "layout_bytes": store.layout.numel * 2,  # every bucket with its padding, in bf16
        "dtypes": {p.dtype for p in model.parameters()},
    }


def test_stage3_frees_full_parameters_after_use():
    for got in run_distributed(_stage3_frees, 2):
        assert got["after_step"] == 0 and set(got["block_storage"]) == {0}
        assert got["peak"] <= got["root_plus_two_blocks"] < got["all_full"]
        assert got["dtypes"] == {torch.bfloat16}


def test_stage3_step_mode_keeps_every_block_gathered_until_the_step_ends():
    """parallel.zero3_gather=step: from the second block's forward on, every block gathered before stays (the
    next micro-batch's forward finds them all), and nothing is left gathered after the step."""
    for got in run_distributed(_stage3_frees, 2, "step"):
        assert got["after_step"] == 0 and set(got["block_storage"]) == {0}
        assert got["root_plus_two_blocks"] < got["all_full"] <= got["peak"] == got["layout_bytes"]


def _fp16_overflow(rank: int, world: int) -> dict:
    cfg, groups, model, setup, runner = _build(world, 1, "parallel.zero=2", "train.precision=fp16")
    optimizer = setup.zero
    masters = lambda: torch.cat([s.master.clone() for s in optimizer.segments])  # noqa: E731

    def inject(step: int, model):
        # One rank's gradient overflows at step 1: every rank must skip it.
        if step == 1 and rank == 0:
            return model.layers["0"].mlp.fc.weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        return None

    before = []
    history = []
    for step in range(3):
        before.append(masters())
        history += _train(cfg, groups, model, setup, runner, steps=1, inject=lambda s, m, step=step: inject(step, m))
    after = masters()
    return {
        "skipped": [s for _, s, _ in history],
        "scales": [scale for *_, scale in history] + [setup.step.loss_scale],
        "unchanged_by_skip": torch.equal(before[1], before[2]),
        "changed_by_others": not torch.equal(before[0], before[1]) and not torch.equal(before[2], after),
        "param_bytes": {p.element_size() for p in model.parameters()},
    }


def test_fp16_overflow_on_one_rank_skips_exactly_that_step_everywhere_and_halves_the_scale():
    for got in run_distributed(_fp16_overflow, 2):
        assert got["skipped"] == [False, True, False]
        assert got["scales"] == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
        assert got["unchanged_by_skip"] and got["changed_by_others"]
        assert got["param_bytes"] == {2}
