"""The estimator on pipeline chunks: what a runner keeps of one micro-batch's forward through a later stage's model
chunk, measured on a real chunk (built as trident/build.py builds a stage, run from a residual-stream input that
requires grad, as parallel/pipeline/executor.py runs it), against the trace and the formula, to the byte (CPU, one
process)."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from tests.test_memory import DROPOUT, LLAMA, MOE, SHAPES
from trident.build import chunk_model
from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.activations import POLICIES, activation_bytes, weight_pass_bytes
from trident.memory.measure import _Created, held_by_forward
from trident.models.checkpointing import apply_activation_checkpointing, parse_label
from trident.models.gpt import init_weights
from trident.parallel.fp8 import enable_fp8
from trident.parallel.pipeline.schedules import F, I, build_schedule, stage_of, stage_placement
from trident.parallel.precision import autocast
from trident.parallel.random import RNGTracker
from trident.parallel.wgrad import WeightGradStore, defer_weight_grads, weight_pass
from trident.peak import PRECISION_DTYPES

# Three layers over pp = 3: a first chunk (the embedding), a middle one and a last (the head and loss), one layer
# each; under full/2 the middle chunk's layer 1 runs plain and the last's layer 2 recomputed. GPT-2's LayerNorm keeps
# a received stream itself in either precision, Llama's RMSNorm its fp32 copy in bf16 (with dropout's explicit core).
GPT, ODD, LLAMA3 = (dataclasses.replace(c, n_layers=3) for c in (SHAPES[0], DROPOUT, LLAMA))
LLAMA_DROPOUT = dataclasses.replace(LLAMA3, name="llama-dropout", dropout=0.1)
MOE3 = dataclasses.replace(MOE, n_layers=3)  # layer 0 dense, 1 and 2 sparse with a shared expert
CASES = [(GPT, "fp32"), (ODD, "bf16"), (LLAMA3, "fp32"), (LLAMA3, "bf16"), (LLAMA_DROPOUT, "bf16")]


def _held(cfg: ModelConfig, layout: Layout, stage: int, policy: str) -> int:
    """What the executor keeps of virtual stage ``stage``'s forward of one micro-batch (its ``saved``): the
    received input buffer and the output, with the graph behind them."""
    rng, dtype, b = RNGTracker(0), PRECISION_DTYPES[layout.precision], layout.micro_batch_size
    torch.manual_seed(0)
    chunk = chunk_model(cfg, layout, stage, None, rng)
    init_weights(chunk, cfg, 0)
    chunk.to(dtype)
    name, modules, every = parse_label(policy)
    apply_activation_checkpointing(chunk, name, modules=modules, every=every)
    g = torch.Generator().manual_seed(1)
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, b, cfg.seq_len), generator=g)

    def forward() -> tuple[torch.Tensor, torch.Tensor]:
        x = tokens
        if not chunk.is_first:  # the message from the stage before, received into a buffer of the step
            x = torch.randn(b, cfg.seq_len, cfg.d_model, generator=g).to(dtype).requires_grad_()
        with autocast(layout.precision, x.device), rng.context(0, range(b)):
            out = chunk(x, targets=targets)  # the last chunk's loss, as the runners have it
        return x, out

    rope = [m.inv_freq for m in chunk.modules() if getattr(m, "inv_freq", None) is not None]
    gc.freeze()  # held_by_forward's collection then skips the objects older than the forward, none of it (fast)
    try:
        return held_by_forward(forward, [*chunk.parameters(), *chunk.buffers(), *rope, tokens, targets])[1]
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("cfg,precision", CASES, ids=[f"{c.name}-{p}" for c, p in CASES])
def test_a_pipeline_chunk_keeps_what_is_predicted(cfg: ModelConfig, precision: str) -> None:
    """Each stage of pp = 3 with one micro-batch in flight keeps, beside its layers' activations, the output it
    runs backward from (but the last) and the residual stream it received (but the first) where its first layer
    keeps a copy rather than the tensor itself (RMSNorm's fp32 input in 16 bits): the trace and the formula both
    predict it to the byte, under every recomputation."""
    layout = Layout(pp=3, micro_batches=1, micro_batch_size=2, precision=precision, device="cpu")
    for stage in range(3):
        held = {p: _held(cfg, layout, stage, p) for p in POLICIES}
        assert {p: activation_bytes(cfg, layout, stage, p) for p in POLICIES} == held, stage
        assert {p: activation_bytes(cfg, layout, stage, p, traced=False) for p in POLICIES} == held, stage


def _kept_for_w(cfg: ModelConfig, layout: Layout, stage: int, policy: str) -> int:
    """What virtual stage ``stage``'s chunk keeps of one micro-batch after the executor's deferred I (zb-h1 and
    zb-v past stage 0): the bytes alive after a forward and an I whose weight GEMMs wait in the store, gradients
    of the parameters that got theirs in I dropped (model state, not activations)."""
    rng, dtype, b = RNGTracker(0), PRECISION_DTYPES[layout.precision], layout.micro_batch_size
    torch.manual_seed(0)
    chunk = chunk_model(cfg, layout, stage, None, rng)
    init_weights(chunk, cfg, 0)
    chunk.to(dtype)
    enable_fp8(chunk, layout.fp8)  # before the store, as trident/build.py builds a stage: an FP8 layer defers nothing
    name, modules, every = parse_label(policy)
    apply_activation_checkpointing(chunk, name, modules=modules, every=every)
    store = WeightGradStore()
    defer_weight_grads(chunk, store)
    g = torch.Generator().manual_seed(1)
    targets = torch.randint(0, cfg.vocab_size, (b, cfg.seq_len), generator=g)

    def forward_and_input_pass() -> list:
        x = torch.randn(b, cfg.seq_len, cfg.d_model, generator=g).to(dtype).requires_grad_()  # a received stream
        with autocast(layout.precision, x.device), rng.context(0, range(b)):
            out = chunk(x, targets=targets if chunk.is_last else None)
        store.deferring = True
        torch.autograd.backward(out, torch.ones_like(out))  # the gradient received from the next stage
        store.deferring = False
        assert x.grad is not None  # sent back, then let go
        for p in chunk.parameters():
            p.grad = None
        return store.take()

    gc.freeze()
    try:
        return held_by_forward(forward_and_input_pass, [*chunk.parameters(), *chunk.buffers(), targets])[1]
    finally:
        gc.unfreeze()


@pytest.mark.parametrize("cfg,precision", [*CASES, (MOE3, "fp32")], ids=[*[f"{c.name}-{p}" for c, p in CASES], "moe"])
def test_a_deferred_input_pass_keeps_for_w_what_is_predicted(cfg: ModelConfig, precision: str) -> None:
    """After a deferred I (parallel/wgrad.py) a chunk past stage 0 keeps only its linear layers' inputs and output
    gradients, the same under every recomputation (not the received stream and its gradient, which a kept input's
    graph held until W before); the trace and the formula predict it to the byte, for a middle and the last chunk,
    and the zero-bubble walk holds it from I to W, a forward's bytes before."""
    layout = Layout(pp=3, micro_batches=1, micro_batch_size=2, precision=precision, schedule="zb-h1", device="cpu")
    for stage in (1, 2):
        kept = {p: _kept_for_w(cfg, layout, stage, p) for p in ("none", "full")}
        assert kept["none"] == kept["full"] == weight_pass_bytes(cfg, layout, stage), stage
        assert weight_pass_bytes(cfg, layout, stage, traced=False) == kept["none"], stage
        # One micro-batch: F, I, W on every stage; the peak is the larger of the two holds.
        for p in POLICIES:
            forward = activation_bytes(cfg, dataclasses.replace(layout, schedule="1f1b"), stage, p)
            assert activation_bytes(cfg, layout, stage, p) == max(forward, kept["none"]), (stage, p)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
@pytest.mark.parametrize("cfg", [GPT, LLAMA3, MOE3], ids=["gpt", "llama", "moe"])
def test_what_w_waits_for_under_tp_is_traced_and_formula_alike(cfg: ModelConfig, tp: int, sp: bool) -> None:
    """Under tp (a fake group's ranks) the formula counts what the trace of a real chunk finds: inputs gathered
    whole under sequence parallelism, kv heads replicated at tp 4 over llama's 2 (whose gradient comes in I), a
    sparse layer's shared experts but not its routed ones."""
    layout = Layout(
        pp=3, tp=tp, sequence_parallel=sp, micro_batch_size=3, precision="bf16", schedule="zb-h1", device="cpu"
    )
    for stage in (1, 2):
        assert weight_pass_bytes(cfg, layout, stage) == weight_pass_bytes(cfg, layout, stage, traced=False) > 0


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_layers_keep_nothing_for_w_and_the_formula_knows_which(recipe: str) -> None:
    """Under train.fp8 a converted layer (in and out features multiples of 16) computes its weight gradient in I:
    with d_ff 200 the attention's layers are FP8 and keep nothing, the MLP's stay bf16 and keep their inputs and
    output gradients, as predicted (the formula's: the trace does not convert); with every layer FP8, nothing."""
    for cfg, some in ((dataclasses.replace(GPT, d_ff=200), True), (GPT, False)):
        layout = Layout(pp=3, micro_batches=1, micro_batch_size=2, precision="bf16", schedule="zb-h1", device="cpu")
        plain = weight_pass_bytes(cfg, layout, 1)
        layout = dataclasses.replace(layout, fp8=recipe)
        kept = _kept_for_w(cfg, layout, 1, "none")
        assert kept == weight_pass_bytes(cfg, layout, 1)
        assert (0 < kept < plain) if some else kept == 0


def _alive_bytes(mode: _Created, skip: set[int]) -> int:
    """The bytes of the storages ``mode`` saw created that are still alive, each once, ``skip``'s aside."""
    return sum({ref.cdata: n for ref, n in mode.refs if not ref.expired() and ref.cdata not in skip}.values())


def _peak_held(cfg: ModelConfig, layout: Layout, rank: int, policy: str) -> int:
    """The most pipeline rank ``rank`` holds after any of its actions, run one by one as the executor runs them
    (each F keeps its input and output, each I past stage 0 defers its weight GEMMs into the store, stage 0's I is
    its whole backward, each W runs the GEMMs), every live storage summed, parameters and gradients aside."""
    rng, placement = RNGTracker(0), stage_placement(layout.schedule)
    torch.manual_seed(0)
    store, chunks = WeightGradStore(), {}
    for c in range(layout.vpp):
        stage = stage_of(c, rank, layout.pp, placement)
        chunks[c] = chunk_model(cfg, layout, stage, None, rng)
        init_weights(chunks[c], cfg, 0)
        name, modules, every = parse_label(policy)
        apply_activation_checkpointing(chunks[c], name, modules=modules, every=every)
        if stage > 0:
            defer_weight_grads(chunks[c], store)
    g = torch.Generator().manual_seed(1)
    b, s, d = layout.micro_batch_size, cfg.seq_len, cfg.d_model
    tokens, targets = torch.randint(0, cfg.vocab_size, (2, b, s), generator=g)
    params = [p for chunk in chunks.values() for p in chunk.parameters()]
    state = [*params, *(t for chunk in chunks.values() for t in chunk.buffers()), tokens, targets]
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in state}
    saved, kept, peak = {}, {}, 0
    gc.freeze()
    try:
        with _Created() as alive:
            for a in build_schedule(layout.schedule, layout.pp, layout.vpp, layout.micro_batches)[rank]:
                chunk, key = chunks[a.chunk], (a.micro, a.chunk)
                if a.kind == F:
                    x = tokens if chunk.is_first else torch.randn(b, s, d, generator=g).requires_grad_()  # received
                    with rng.context(0, range(b)):
                        saved[key] = (x, chunk(x, targets=targets if chunk.is_last else None))
                elif a.kind == I:
                    x, out = saved.pop(key)
                    store.deferring = not chunk.is_first
                    torch.autograd.backward(out, None if chunk.is_last else torch.randn(out.shape, generator=g))
                    store.deferring = False
                    kept[key] = store.take()
                    del x, out  # its gradient sent to the stage before
                else:
                    weight_pass(kept.pop(key))
                gc.collect()
                grads = {StorageWeakRef(p.grad.untyped_storage()).cdata for p in params if p.grad is not None}
                peak = max(peak, _alive_bytes(alive, skip | grads))
    finally:
        gc.unfreeze()
    return peak


@pytest.mark.parametrize("policy", ["none", "selective", "full"])
@pytest.mark.parametrize("schedule,rank", [("zb-h1", 1), ("zb-v", 0), ("zb-v", 1)])
def test_a_zero_bubble_rank_holds_at_its_peak_what_the_walk_predicts(schedule: str, rank: int, policy: str) -> None:
    """A zero-bubble rank at pp 2, M 4, run action by action (``_peak_held``), holds at its peak the estimate's
    activations to the byte, under no, selective and full recomputation: zb-h1's last stage, and zb-v's ranks with
    stage 0 or the last stage beside a middle one (their V). With the walk as it was (a forward's bytes held until
    W) zb-h1's last stage read 16% high without recomputation, 3% high under selective and 56% low under full."""
    layout = Layout(pp=2, micro_batches=4, micro_batch_size=2, schedule=schedule, device="cpu")
    cfg = dataclasses.replace(GPT, n_layers=2 * layout.vpp)
    assert _peak_held(cfg, layout, rank, policy) == activation_bytes(cfg, layout, rank, policy)
