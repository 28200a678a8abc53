"""Dropout masks derived from (seed, step, sample, site): a tp rank's slice is its part of the one-process mask,
the same context redraws the same mask and any other context another one, recomputation redraws them, pipeline
stages differ, a cp rank's mask is the one-process mask at its tokens; and with dropout on, every layout (context
parallelism too) gives the one-process curve and a checkpoint resumes exactly under another layout."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.helpers.layouts import assert_same_curve, tiny, train_in_process
from trident.config import ModelConfig
from trident.models.gpt import GPT, init_weights
from trident.parallel.random import ATTENTION, ATTENTION_RESIDUAL, MLP_RESIDUAL, Dropout, RNGTracker
from trident_dev.ranks import run_distributed

P = 0.5


def _mask(drop: Dropout, shape: tuple[int, ...], step: int = 3, samples: tuple[int, ...] = (10, 11)) -> torch.Tensor:
    with drop.rng.context(step, samples):
        return drop(torch.ones(len(samples), *shape)) != 0


def test_a_tp_ranks_slice_is_its_part_of_the_one_process_mask():
    rng = RNGTracker(seed=5)
    heads = _mask(Dropout(P, rng, 0, ATTENTION), (4, 8, 8))  # [batch, heads, T, T]
    sequence = _mask(Dropout(P, rng, 0, MLP_RESIDUAL), (8, 6))  # [batch, T, d]
    for rank in range(2):
        mine = _mask(Dropout(P, rng, 0, ATTENTION, shard_dim=0, rank=rank, parts=2), (2, 8, 8))
        assert torch.equal(mine, heads[:, 2 * rank : 2 * rank + 2])
        shard = _mask(Dropout(P, rng, 0, MLP_RESIDUAL, shard_dim=0, rank=rank, parts=2), (4, 6))
        assert torch.equal(shard, sequence[:, 4 * rank : 4 * rank + 4])
    assert 0.3 < heads.float().mean() < 0.7


def test_a_cp_ranks_mask_is_the_one_process_masks_rows_and_columns_at_its_tokens():
    """Context parallelism: a rank holds some tokens of each sample (its own per sample with documents), and under
    sequence parallelism its tp block of them."""
    rng = RNGTracker(seed=5)
    heads = _mask(Dropout(P, rng, 0, ATTENTION), (4, 8, 8))
    sequence = _mask(Dropout(P, rng, 0, MLP_RESIDUAL), (8, 6))
    mine = torch.tensor([[0, 1, 6, 7], [2, 3, 5, 6]])  # each sample's tokens on this rank
    keys = torch.tensor([[0, 1, 6, 7, 2, 3, 4, 5]])  # the gathered keys, the same order for both samples
    pick = [(b, mine[b]) for b in range(2)]
    rows = _mask_of(Dropout(P, rng, 0, MLP_RESIDUAL), (4, 6), {0: (8, mine)})
    assert all(torch.equal(rows[b], sequence[b, t]) for b, t in pick)
    probs = _mask_of(
        Dropout(P, rng, 0, ATTENTION, shard_dim=0, rank=1, parts=2), (2, 4, 8), {1: (8, mine), 2: (8, keys)}
    )
    assert all(torch.equal(probs[b], heads[b, 2:][:, t][:, :, keys[0]]) for b, t in pick)
    for rank in range(2):  # sequence parallelism: this tp rank's block of the tokens
        shard = _mask_of(Dropout(P, rng, 0, MLP_RESIDUAL, shard_dim=0, rank=rank, parts=2), (2, 6), {0: (8, mine)})
        assert all(torch.equal(shard[b], sequence[b, t[2 * rank : 2 * rank + 2]]) for b, t in pick)


def _mask_of(drop: Dropout, shape: tuple[int, ...], tokens: dict) -> torch.Tensor:
    with drop.rng.context(3, (10, 11)):
        return drop(torch.ones(2, *shape), tokens) != 0


def test_the_same_context_draws_the_same_mask_and_any_other_another():
    drop = Dropout(P, RNGTracker(seed=5), 2, ATTENTION_RESIDUAL)
    mask = _mask(drop, (8, 6))
    assert torch.equal(mask, _mask(drop, (8, 6)))
    assert torch.equal(mask, _mask(Dropout(P, RNGTracker(seed=5), 2, ATTENTION_RESIDUAL), (8, 6)))
    # A sample's mask does not depend on the micro-batch it is in (micro-batch size, dp).
    assert torch.equal(mask[1], _mask(drop, (8, 6), samples=(11,))[0])
    assert not torch.equal(mask[0], mask[1])  # another sample
    others = [
        _mask(drop, (8, 6), step=4),
        _mask(Dropout(P, RNGTracker(seed=6), 2, ATTENTION_RESIDUAL), (8, 6)),
        _mask(Dropout(P, drop.rng, 3, ATTENTION_RESIDUAL), (8, 6)),  # another layer
        _mask(Dropout(P, drop.rng, 2, MLP_RESIDUAL), (8, 6)),  # another dropout of the layer
    ]
    for other in others:
        assert not torch.equal(mask[0], other[0]) and not torch.equal(mask[1], other[1])


def test_dropout_needs_the_micro_batchs_context_in_training_only():
    drop = Dropout(P, RNGTracker(seed=5), 0, ATTENTION_RESIDUAL)
    with pytest.raises(RuntimeError, match="rng.context"):
        drop(torch.ones(2, 3))
    with drop.rng.context(0, (4, 5, 6)), pytest.raises(ValueError, match="2 samples has 3 sample ids"):
        drop(torch.ones(2, 3))
    assert torch.equal(drop.eval()(torch.ones(2, 3)), torch.ones(2, 3))


def test_recomputation_redraws_the_forwards_masks_outside_its_context():
    """Backward runs after the runner has left the micro-batch's context: ``checkpoint_contexts`` puts it back
    for the recomputation (every time: a split backward recomputes twice)."""
    rng = RNGTracker(seed=5)
    drop = Dropout(P, rng, 1, MLP_RESIDUAL)
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))

    def grad_of(run) -> torch.Tensor:
        w.grad = None
        with rng.context(7, range(4)):
            y = run(x)
        (y * x).sum().backward()  # outside the context
        return w.grad

    plain = grad_of(lambda x: drop(x @ w))
    recomputed = grad_of(
        lambda x: checkpoint(lambda x: drop(x @ w), x, use_reentrant=False, context_fn=rng.checkpoint_contexts)
    )
    assert torch.equal(recomputed, plain)
    with pytest.raises(RuntimeError, match="rng.context"):
        grad_of(lambda x: checkpoint(lambda x: drop(x @ w), x, use_reentrant=False))


MODEL = ModelConfig(name="t", n_layers=2, d_model=32, n_heads=4, seq_len=16, vocab_size=100, dropout=0.5)


def _stage_masks(rank: int, world: int) -> list[torch.Tensor]:
    """Every mask pipeline stage ``rank`` of 2 (layer ``rank``) draws for one micro-batch."""
    model = GPT(MODEL, rng=RNGTracker(seed=7), layers=[rank], first=rank == 0, last=rank == 1)
    masks = []
    for module in model.modules():
        if isinstance(module, Dropout):
            shape = (MODEL.n_heads, 16, 16) if module.kind == ATTENTION else (16, MODEL.d_model)
            masks.append(_mask(module, shape))
    return masks


@pytest.mark.multiprocess
def test_pipeline_stages_draw_different_masks():
    """Each stage is its own process, seeded alike: no mask of one stage repeats a mask of the other."""
    first, last = run_distributed(_stage_masks, 2)
    assert len(first) == 4 and len(last) == 3  # the embedding's, and each layer's three
    assert not any(a.shape == b.shape and torch.equal(a, b) for a in first for b in last)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_the_explicit_attention_is_sdpas_at_dropout_zero(kv_heads):
    """Training with dropout computes attention by hand (grouped-query heads repeated); with the mask dropping
    nothing it is SDPA's result."""
    torch.manual_seed(0)
    model = GPT(MODEL, rng=RNGTracker(seed=7))
    init_weights(model, MODEL, seed=0)
    attn = model.layers["0"].attn
    attn.drop.p = 1e-12  # keeps everything, but takes the explicit path
    dh = MODEL.d_model // MODEL.n_heads
    q = torch.randn(2, MODEL.n_heads, 16, dh)
    k, v = torch.randn(2, 2, kv_heads, 16, dh)
    with model.rng.context(0, (0, 1)):
        explicit = attn.core(q, k, v)
    attn.eval()
    assert torch.allclose(explicit, attn.core(q, k, v), atol=1e-6)


# --- every layout gives the one-process curve, and a checkpoint resumes under another ---------------------------


def _run(dataset, *extra: str) -> list[str]:
    return tiny(dataset, "model.dropout=0.1", "train.steps=6", "train.micro_batch_size=4", *extra)


@pytest.fixture
def reference(tiny_dataset, references) -> tuple[list[dict], object]:
    """The one-process run with dropout 0.1, saving at step 3: its curve and that checkpoint."""
    overrides = _run(tiny_dataset, "checkpoint.every=3")
    return references.history(overrides), references.run_dir(overrides) / "checkpoints" / "step_00000003"


LAYOUTS = [
    pytest.param(1, ["train.micro_batch_size=1"], id="mbs1"),
    pytest.param(2, [], id="dp2"),
    pytest.param(2, ["parallel.tp=2"], id="tp2"),
    pytest.param(2, ["parallel.tp=2", "parallel.sequence_parallel=true"], id="tp2-sp"),
    pytest.param(2, ["parallel.pp=2", "parallel.schedule=1f1b"], id="pp2-1f1b"),
    pytest.param(
        2, ["parallel.pp=2", "parallel.schedule=zb-h1", "train.activation_checkpointing=full"], id="pp2-zbh1-full"
    ),
    # Op-level selective recomputation: the explicit core's masks redrawn inside the selective contexts, the
    # sequence-parallel collectives rerun; under zb-h1 each block replayed twice (its I and its W pass).
    pytest.param(
        2,
        ["parallel.tp=2", "parallel.sequence_parallel=true", "train.activation_checkpointing=selective"],
        id="tp2-sp-selective",
    ),
    pytest.param(
        2,
        ["parallel.pp=2", "parallel.schedule=zb-h1", "train.activation_checkpointing=selective"],
        id="pp2-zbh1-selective",
    ),
    # Context parallelism: each rank keeps the masks' rows at the tokens it holds (head-tail), and the attention
    # probabilities' columns at the gathered keys; with tp and sequence parallelism its heads and its tp block of
    # those tokens, the selective replay redrawing them.
    pytest.param(2, ["parallel.cp=2"], id="cp2"),
    pytest.param(
        4,
        [
            "parallel.cp=2",
            "parallel.tp=2",
            "parallel.sequence_parallel=true",
            "train.activation_checkpointing=selective",
            "train.recompute_modules=[attn_core]",
        ],
        id="cp2-tp2-sp-selective",
    ),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("world,extra", LAYOUTS)
def test_with_dropout_every_layout_gives_the_one_process_curve(tiny_dataset, tmp_path, reference, world, extra):
    for history in train_in_process(tmp_path, _run(tiny_dataset, *extra), world=world):
        assert_same_curve(reference[0], history)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world,extra",
    [
        pytest.param(1, [], id="same-layout"),
        pytest.param(4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true"], id="tp2-pp2-sp"),
    ],
)
def test_with_dropout_a_checkpoint_resumes_with_the_uninterrupted_losses(
    tiny_dataset, tmp_path, reference, world, extra
):
    history, saved = reference
    resumed = train_in_process(tmp_path, _run(tiny_dataset, f"checkpoint.resume={saved}", *extra), world=world)
    for rows in resumed:
        assert_same_curve(history[3:], rows)
