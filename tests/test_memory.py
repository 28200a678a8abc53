"""trident/memory.py and trident/memory_estimate.py: measured bytes count each storage once; the prediction's
parameter structure is the model's own; predicted model states and activations match what real ranks hold."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers.layouts import make_config, tiny, train_in_process
from trident.build import build_parts
from trident.config import Config, ModelConfig, OffloadConfig
from trident.memory import held_by_forward, log_model_states, measure_model_states, summary_line
from trident.memory_estimate import (
    POLICIES,
    Layout,
    activation_bytes,
    chunk_params,
    flat_layout,
    isolated,
    model_states,
    rank_params,
    schedule_order,
)
from trident.models.checkpointing import apply_activation_checkpointing
from trident.models.gpt import GPT, count_params, init_weights
from trident.parallel.batch import Batch, document_ids
from trident.parallel.groups import ProcessGroups, build_process_groups
from trident.parallel.pipeline.stages import stage_layers
from trident.parallel.placement import placement_of
from trident.parallel.precision import autocast
from trident.parallel.random import model_parallel_rng
from trident.parallel.topology import Topology
from trident.peak import PRECISION_DTYPES
from trident.ranks import run_distributed

TINY = ModelConfig(name="gpt-tiny", n_layers=2, d_model=64, n_heads=4, seq_len=64, vocab_size=512)
# Odd sizes: a vocab that pads, a bias-free model, an MLP width that is not 4 d.
SHAPES = [
    TINY,
    ModelConfig(name="odd", n_layers=3, d_model=48, n_heads=6, seq_len=40, vocab_size=515, vocab_multiple=8),
    ModelConfig(name="nobias", n_layers=2, d_model=32, n_heads=2, seq_len=16, vocab_size=100, bias=False, d_ff=80),
]
# conf/model/llama-tiny.yaml: RMSNorm, SwiGLU (fc holds gate and up), RoPE (no position table), 4 query heads
# sharing 2 kv heads (q and kv apart), no biases, an untied head; with a vocab that pads.
LLAMA = ModelConfig(
    name="llama-tiny",
    n_layers=2,
    d_model=64,
    n_heads=4,
    n_kv_heads=2,
    d_ff=176,
    seq_len=64,
    vocab_size=515,
    norm="rmsnorm",
    mlp="swiglu",
    position="rope",
    bias=False,
    tie_embeddings=False,
)
# Each block option on its own against llama-tiny: tied, multi-head (fused qkv) with RoPE, multi-query, learned
# positions with grouped-query attention, biases (RMSNorm has none; LayerNorm does), GELU.
LLAMAS = [
    LLAMA,
    dataclasses.replace(LLAMA, name="llama-tied", tie_embeddings=True),
    dataclasses.replace(LLAMA, name="llama-mha", n_kv_heads=None),
    dataclasses.replace(LLAMA, name="llama-mqa", n_kv_heads=1),
    dataclasses.replace(LLAMA, name="llama-learned", position="learned"),
    dataclasses.replace(LLAMA, name="llama-bias", bias=True),
    dataclasses.replace(LLAMA, name="llama-bias-layernorm", bias=True, norm="layernorm"),
    dataclasses.replace(LLAMA, name="llama-gelu", mlp="gelu"),
]


# --- measurement ----------------------------------------------------------------------------------------------


def test_measure_counts_each_storage_once_and_whole() -> None:
    flat = torch.zeros(100)
    params = [flat[:30].view(5, 6), flat[30:60]]  # two views of one buffer: 400 bytes, counted once
    grads = [torch.zeros(10, dtype=torch.float64), flat[60:]]  # the second is the params' storage: not again
    freed = torch.zeros(8)
    freed.untyped_storage().resize_(0)
    figures = measure_model_states({"params": params, "grads": grads, "optimizer": [freed, torch.zeros(3)]})
    assert figures["params"] == {"device": 0, "host": 400}
    assert figures["grads"] == {"device": 0, "host": 80}
    assert figures["optimizer"] == {"device": 0, "host": 12}
    assert figures["total"] == {"device": 0, "host": 492}
    assert "params 400 B" in summary_line(figures)
    with pytest.raises(ValueError, match="unknown model-state kinds"):
        measure_model_states({"activations": []})


def test_held_by_forward_sees_saved_tensors_not_temporaries_or_parameters() -> None:
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)

    def forward() -> torch.Tensor:
        h = x @ w  # saved by tanh's backward? no: tanh saves its output; mm saves x (existing) and w (existing)
        return torch.tanh(h).sum()

    _, held = held_by_forward(forward, [w, x])
    assert held == 4 * 16 * 4 + 4  # tanh's output, and the loss scalar itself


# --- parameter structure --------------------------------------------------------------------------------------


@pytest.mark.parametrize("cfg", SHAPES + LLAMAS, ids=[c.name for c in SHAPES + LLAMAS])
def test_rank_params_are_the_models_own(cfg: ModelConfig) -> None:
    """Names, order and local sizes equal GPT's named_parameters at tp=1; the sum is count_params plus padding
    (of both tables when the head is untied)."""
    model = GPT(cfg)
    assert rank_params(cfg, Layout(), 0) == [(n, p.numel()) for n, p in model.named_parameters()]
    padding = (model.padded_vocab - cfg.vocab_size) * cfg.d_model * (1 if cfg.tie_embeddings else 2)
    assert sum(n for _, n in rank_params(cfg, Layout(), 0)) == count_params(cfg) + padding


@pytest.mark.parametrize("pp,vpp", [(2, 1), (2, 2), (4, 1)])
@pytest.mark.parametrize("cfg", [SHAPES[0], LLAMA, LLAMAS[1]], ids=["gpt", "llama-untied", "llama-tied"])
def test_pipeline_chunks_are_the_stage_models_own(cfg: ModelConfig, pp: int, vpp: int) -> None:
    """Each chunk's parameters are those of the GPT a pipeline stage builds for it (first: the embedding, and a
    position table only with learned positions; last: the final norm and an lm_head, a tied copy or an untied
    head), and the isolated buckets are the parameters whose gradients build.py sums across stages: a tied
    embedding's two copies, nothing for an untied head."""
    cfg = dataclasses.replace(cfg, n_layers=4)
    chunks = pp * vpp
    layout = Layout(pp=pp, vpp=vpp, schedule="interleaved" if vpp > 1 else None)
    for c in range(chunks):
        model = GPT(cfg, layers=stage_layers(cfg.n_layers, pp, vpp, c), first=c == 0, last=c == chunks - 1)
        assert chunk_params(cfg, 1, pp, vpp, c) == [(n, p.numel()) for n, p in model.named_parameters()]
        summed = {n for n, p in model.named_parameters() if "embedding" in placement_of(p).grad_sums}
        assert summed == {n for n, _ in chunk_params(cfg, 1, pp, vpp, c)} & isolated(cfg, layout)
        if c in (0, chunks - 1):
            assert bool(summed) == cfg.tie_embeddings


def test_pipeline_split_holds_every_layer_once_and_a_tied_copy() -> None:
    cfg = SHAPES[1]  # 3 layers
    layout = Layout(pp=3)
    stages = [rank_params(cfg, layout, s) for s in range(3)]
    names = [n for stage in stages for n, _ in stage]
    assert names.count("wte.weight") == 1 and names.count("lm_head.weight") == 1  # the last stage's copy of it
    assert [n for n in names if n != "lm_head.weight"] == [n for n, _ in GPT(cfg).named_parameters()]
    assert stages[1] == chunk_params(cfg, 1, 3, 1, 1) and all(n.startswith("layers.1.") for n, _ in stages[1])
    # Both copies of the tied embedding get a bucket of their own, as train.py isolates them.
    wte = dict(stages[0])["wte.weight"]
    for stage in (0, 2):
        spans = flat_layout(stages[stage], Layout(pp=3, dp=2), isolated(cfg, Layout(pp=3))).spans
        assert [s.numel for s in spans if s.params[0].numel() == wte] == [wte + wte % 2]
        assert sum(len(s.params) for s in spans) == len(stages[stage])
    inter = Layout(pp=2, vpp=2, schedule="interleaved")
    cfg4 = ModelConfig(name="4", n_layers=4, d_model=32, n_heads=2, seq_len=16, vocab_size=100)
    assert {n.split(".")[1] for n, _ in rank_params(cfg4, inter, 0) if n.startswith("layers.")} == {"0", "2"}


# --- the pipeline schedules' micro-batches in flight ----------------------------------------------------------


def _peak_in_flight(schedule: str, pp: int, vpp: int, m: int, stage: int) -> int:
    held = peak = 0
    for kind, _, _ in schedule_order(schedule, pp, vpp, m, stage):
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def test_schedule_orders_run_every_pass_once_and_hold_the_textbook_count() -> None:
    """Each (chunk, micro-batch) has one F before its one B; in flight: GPipe M, 1F1B min(pp - r, M), interleaved
    Megatron's warm-up + 1, whose layer count on stage 0 is Korthikanti's L (1 + (pp - 1) / (pp vpp))."""
    pp, m = 4, 8
    for schedule, vpp in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
        for stage in range(pp):
            order = schedule_order(schedule, pp, vpp, m, stage)
            forwards = [(c, mb) for kind, c, mb in order if kind == "F"]
            backwards = [(c, mb) for kind, c, mb in order if kind == "B"]
            assert sorted(forwards) == sorted(backwards) == sorted({(c, mb) for c in range(vpp) for mb in range(m)})
            assert all(order.index(("F", c, mb)) < order.index(("B", c, mb)) for c, mb in forwards)
    assert [_peak_in_flight("gpipe", pp, 1, m, r) for r in range(pp)] == [m] * pp
    assert [_peak_in_flight("1f1b", pp, 1, m, r) for r in range(pp)] == [4, 3, 2, 1]
    assert _peak_in_flight("1f1b", pp, 1, 2, 0) == 2
    chunk_forwards = _peak_in_flight("interleaved", pp, 2, m, 0)
    layers, chunks = 8, pp * 2
    assert chunk_forwards * layers / chunks == pytest.approx(layers * (1 + (pp - 1) / (pp * 2)))


# --- activations: predicted against what a forward really keeps -----------------------------------------------


def _held(
    cfg: ModelConfig,
    policy: str,
    batch: int,
    model: GPT | None = None,
    precision: str = "fp32",
    documents: bool = False,
) -> int:
    torch.manual_seed(0)
    rng = model_parallel_rng(0)  # dropout's masks are derived from the micro-batch it runs in
    if model is None:
        model = GPT(cfg, rng=rng)
        init_weights(model, cfg, 0)
    # 16-bit parameters under autocast, as trident trains them (the ZeRO optimizer casts them at build).
    model.to(PRECISION_DTYPES[precision])
    apply_activation_checkpointing(model, policy)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=g)
    ids = None
    if documents:  # packed documents: an eos every 7 tokens, the document ids the loader computes
        x[:, ::7] = EOS
        ids = document_ids(x, EOS)

    def forward() -> torch.Tensor:
        with autocast(precision, x.device), rng.context(0, range(batch)):
            logits = model(x, documents=ids)
        return model.loss_sum(logits, y)

    rope = [m.inv_freq for m in model.modules() if getattr(m, "inv_freq", None) is not None]  # RoPE's frequencies
    inputs = [x, y] if ids is None else [x, y, ids]
    _, held = held_by_forward(forward, [*model.parameters(), *rope, *inputs])  # model state, not activations
    return held


# With dropout, training runs the attention core explicitly: its s^2 tensors replace the fused kernel's logsumexp
# (and with grouped-query attention, k and v repeated to every query head replace the kv projection's output).
DROPOUT = dataclasses.replace(SHAPES[1], name="odd-dropout", dropout=0.1)
ACTIVATION_SHAPES = [
    *SHAPES[:2],
    DROPOUT,
    *LLAMAS,
    dataclasses.replace(LLAMA, name="llama-dropout", dropout=0.1),
    dataclasses.replace(LLAMAS[2], name="llama-mha-dropout", dropout=0.1),
]


EOS = 1
DOCUMENT_SHAPES = [SHAPES[0], DROPOUT, LLAMA, dataclasses.replace(LLAMA, name="llama-dropout", dropout=0.1)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("cfg", DOCUMENT_SHAPES, ids=[c.name for c in DOCUMENT_SHAPES])
def test_activation_prediction_with_packed_documents_matches_a_forward(cfg: ModelConfig, precision: str) -> None:
    """data.document_mask on a CPU: SDPA's float copy of the dense mask in each layer, the inverted mask the
    explicit core keeps under dropout, per-sample RoPE tables and position ids, and under recomputation the mask
    and positions its arguments keep, predicted to the byte."""
    held = {p: _held(cfg, p, batch=2, precision=precision, documents=True) for p in POLICIES}
    layout = Layout(micro_batch_size=2, precision=precision, device="cpu", document_mask=True)
    predicted = {p: activation_bytes(cfg, layout, 0, p) for p in POLICIES}
    assert predicted == held
    plain = Layout(micro_batch_size=2, precision=precision, device="cpu")
    assert all(predicted[p] > activation_bytes(cfg, plain, 0, p) for p in POLICIES)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("cfg", ACTIVATION_SHAPES, ids=[c.name for c in ACTIVATION_SHAPES])
def test_activation_prediction_matches_a_forward(cfg: ModelConfig, precision: str) -> None:
    """What one micro-batch's forward keeps for backward (storages created and still alive, parameters and
    input left out) is predicted to the byte for each policy, and full < selective < none: GPT-2's blocks and
    each Llama option (RMSNorm's composite on a CPU, SwiGLU's three hidden tensors, RoPE's rotated q and k and
    its tables, grouped-query k and v at their own width, no position ids with RoPE, an untied head)."""
    held = {p: _held(cfg, p, batch=2, precision=precision) for p in POLICIES}
    layout = Layout(micro_batch_size=2, precision=precision, device="cpu")
    predicted = {p: activation_bytes(cfg, layout, 0, p) for p in POLICIES}
    assert predicted == held
    assert held["full"] < held["selective"] < held["none"]


# --- model states on real ranks -------------------------------------------------------------------------------

# (zero, precision, offload ratio or None, bucket_mb): small buckets give many padded buckets and offload cuts.
STATE_CASES = [
    (0, "fp32", None, 0.01),
    (0, "bf16", None, 25.0),
    (1, "fp32", None, 0.01),
    (1, "bf16", 0.5, 0.01),
    (2, "fp32", None, 0.01),
    (2, "bf16", 1.0, 25.0),
    (3, "fp32", None, 25.0),
    (3, "bf16", 0.5, 25.0),
]


def _config(cfg: ModelConfig, zero: int, precision: str, ratio: float | None, bucket_mb: float, tp: int) -> Config:
    config = Config(model=cfg)
    config.parallel.zero, config.parallel.bucket_mb, config.parallel.tp = zero, bucket_mb, tp
    if ratio is not None:
        config.parallel.offload = OffloadConfig(optimizer="cpu", ratio=ratio)
    config.train.precision = precision
    return config


def _measure_states(config: Config, groups: ProcessGroups, run_dir: Path | None, seq: int | None = None) -> dict:
    """Build the reducer, optimizer and step as train.py does, run one step of two micro-batches (of ``seq``
    tokens: model states do not depend on it), measure."""
    cfg = config.model
    parts = build_parts(config, groups, torch.device("cpu"))
    setup, (model,) = parts.optimizer, parts.chunks
    try:
        g = torch.Generator().manual_seed(groups.dp_rank)
        tokens = torch.randint(0, cfg.vocab_size, (2, 2, seq or cfg.seq_len), generator=g)
        micro = [Batch(x, x, torch.arange(2 * m, 2 * m + 2), 0) for m, x in enumerate(tokens)]
        parts.runner.forward_backward(micro, model.loss_sum, 1.0)
        setup.step.step(1e-3)
        out = {"states": measure_model_states(setup.step.model_state_tensors()), "named": model.named_parameters()}
        # Stages 2-3: the most staging memory the reducer held at once during the step.
        out["staging"] = getattr(setup.reducer, "peak_staging_bytes", 0)
        if run_dir is not None:
            out["logged"] = log_model_states(setup.step, groups, run_dir)
        return out
    finally:
        setup.remove_hooks()


def _states_on_ranks(rank: int, world: int, cfg: ModelConfig, tp: int, cases: list, run_dir: Path) -> list[dict]:
    groups = build_process_groups(Topology(dp=world // tp, pp=1, tp=tp))
    out = []
    for i, case in enumerate(cases):
        result = _measure_states(_config(cfg, *case, tp=tp), groups, run_dir if i == 0 else None)
        out.append({"dp_rank": groups.dp_rank, "params": [(n, p.numel()) for n, p in result.pop("named")], **result})
    return out


def _predicted(cfg: ModelConfig, case: tuple, dp: int, tp: int, dp_rank: int) -> dict:
    zero, precision, ratio, bucket_mb = case
    layout = Layout(
        dp=dp,
        tp=tp,
        zero=zero,
        precision=precision,
        offload="cpu" if ratio is not None else "none",
        offload_ratio=ratio if ratio is not None else 1.0,
        bucket_mb=bucket_mb,
        device="cpu",
    )
    return model_states(rank_params(cfg, layout, 0), layout, dp_rank)


def _check_states(ranks: list[list[dict]], cfg: ModelConfig, cases: list, dp: int, tp: int) -> None:
    """Each rank's parameters are the predicted ones and its measured model states the prediction to the byte."""
    for r in ranks:
        for case, got in zip(cases, r, strict=True):
            assert got["params"] == rank_params(cfg, Layout(tp=tp), 0), case
            predicted = _predicted(cfg, case, dp, tp, got["dp_rank"])
            for kind in ("params", "grads", "optimizer", "total"):
                measured, expected = got["states"][kind], predicted.figures[kind]
                assert measured == expected, (case, kind, measured, expected)
            largest = max(
                s.numel
                for s in flat_layout(
                    rank_params(cfg, Layout(dp=dp, tp=tp, zero=case[0]), 0),
                    Layout(dp=dp, tp=tp, zero=case[0], bucket_mb=case[3]),
                ).spans
            )
            if case[0] >= 2:  # at least the largest bucket, at most it and the MAX_IN_FLIGHT largest in flight
                assert 4 * largest <= got["staging"] <= predicted.staging, (case, got["staging"], predicted.staging)


@pytest.mark.multiprocess
@pytest.mark.parametrize("cfg", [SHAPES[1], LLAMA], ids=["gpt-odd", "llama-tiny"])
def test_model_states_match_the_prediction_at_every_stage(tmp_path: Path, cfg: ModelConfig) -> None:
    """dp=2: zero 0-3, fp32 and bf16, offload ratios 0.5 and 1.0, many padded buckets or one: each rank's
    measured parameters, gradients and optimizer states are the prediction to the byte, and stage 2-3's staging
    peak lies between the largest bucket and the prediction; memory.json holds every rank and the max."""
    ranks = run_distributed(_states_on_ranks, 2, cfg, 1, STATE_CASES, tmp_path, timeout_s=240)
    _check_states(ranks, cfg, STATE_CASES, dp=2, tp=1)
    report = json.loads((tmp_path / "memory.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    assert report["max"] == ranks[0][0]["logged"]
    assert report["max"]["total"]["host"] >= max(r["total"]["host"] for r in report["ranks"])


TP_CASES = [(0, "fp32", None, 0.01), (1, "bf16", 0.5, 0.01), (2, "fp32", None, 25.0), (3, "bf16", None, 25.0)]
# (model, tp, world): gpt with a vocab of 515 padded over tp; llama-tiny's 2 kv heads split over tp=2 and, at tp=4,
# held whole by every rank.
TP_STATES = {
    "gpt-odd-tp2": (SHAPES[1], 2, 4),
    "llama-tp2-kv-split": (LLAMA, 2, 4),
    "llama-tp4-kv-replicated": (LLAMA, 4, 8),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(TP_STATES))
def test_model_states_match_the_prediction_with_tensor_parallelism(tmp_path: Path, name: str) -> None:
    """dp=2 x tp: the same, for each rank's tp slices (and replicated kv weights)."""
    cfg, tp, world = TP_STATES[name]
    ranks = run_distributed(_states_on_ranks, world, cfg, tp, TP_CASES, tmp_path, timeout_s=300)
    _check_states(ranks, cfg, TP_CASES, dp=world // tp, tp=tp)


def _tp(rank: int, world: int, cfg: ModelConfig, documents: bool) -> dict:
    group = dist.group.WORLD
    out = {"params": [(n, p.numel()) for n, p in GPT(cfg, group).named_parameters()]}
    # The least of three forwards: a gloo collective's work object may still hold its tensor (the loss's amax,
    # all-reduced over tp) for a moment after it completes, a communication buffer, not an activation.
    for sp in (False, True):
        out[sp] = {
            p: min(
                _held(cfg, p, batch=2, model=GPT(cfg, group, sequence_parallel=sp), documents=documents)
                for _ in range(3)
            )
            for p in POLICIES
        }
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "cfg,tp,documents",
    [(SHAPES[1], 2, False), (LLAMA, 2, False), (LLAMA, 4, False), (SHAPES[1], 2, True), (LLAMA, 2, True)],
    ids=["gpt-odd-tp2", "llama-tp2", "llama-tp4", "gpt-odd-tp2-documents", "llama-tp2-documents"],
)
def test_tp_parameters_and_activations_match_the_prediction(cfg: ModelConfig, tp: int, documents: bool) -> None:
    """At tp=2 and 4 (vocab 515 padded, so the ranks' blocks differ in real rows; llama-tiny's kv heads split at
    tp=2, replicated at tp=4): each rank's parameters are the predicted ones, and the activations of one
    micro-batch with and without sequence parallelism are predicted to the byte on the rank with the most; also
    with packed documents (the mask whole on every rank, the positions' shard under sequence parallelism)."""
    ranks = run_distributed(_tp, tp, cfg, documents)
    layout = Layout(tp=tp, micro_batch_size=2, device="cpu")
    for r in ranks:
        assert r["params"] == rank_params(cfg, layout, 0)
    for sp in (False, True):
        lay = Layout(tp=tp, sequence_parallel=sp, micro_batch_size=2, device="cpu", document_mask=documents)
        for p in POLICIES:
            measured = max(r[sp][p] for r in ranks)
            assert activation_bytes(cfg, lay, 0, p) == measured, (sp, p)


@pytest.mark.multiprocess
def test_a_run_logs_its_model_states_beside_the_prediction(tiny_dataset: Path, tmp_path: Path) -> None:
    """train.py writes memory.json once, after the first step: every rank's bytes, the max, and the estimate of
    the same layout, which the measured bytes match within 5% (zero 1, bf16, dp=2: no staging pool)."""
    overrides = tiny(tiny_dataset, "train.steps=2", "parallel.zero=1", "train.precision=bf16", "train.eval_every=0")
    train_in_process(tmp_path, overrides, world=2)
    report = json.loads((tmp_path / "memory.json").read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    (stage,) = report["estimate"]["stages"]
    assert report["estimate"]["layout"]["zero"] == 1 and report["estimate"]["layout"]["dp"] == 2
    for r in report["ranks"]:
        for kind in ("params", "grads", "optimizer", "total"):
            measured, predicted = r[kind], stage["model_states"][kind]
            assert sum(measured.values()) == pytest.approx(sum(predicted.values()), rel=0.05), kind
    assert report["max"]["total"] == {
        place: max(r["total"][place] for r in report["ranks"]) for place in ("device", "host")
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "extra",
    [["parallel.zero=1"], ["parallel.zero=2", "model.tie_embeddings=true", "parallel.bucket_mb=0.01"]],
    ids=["untied-zero1", "tied-zero2-small-buckets"],
)
def test_a_llama_pipeline_run_logs_the_predicted_model_states(
    tiny_dataset: Path, tmp_path: Path, extra: list[str]
) -> None:
    """llama-tiny at dp=2 x pp=2, bf16: memory.json's measured model states of every rank equal the prediction for
    its stage and dp rank to the byte (untied: the last stage's own lm_head, no bucket of its own; tied: the
    embedding and its copy in buckets of their own), and the logged estimate of each stage is its largest dp rank."""
    overrides = tiny(
        tiny_dataset,
        "model=llama-tiny",
        "train.steps=1",
        "parallel.dp=2",
        "parallel.pp=2",
        "train.precision=bf16",
        "train.eval_every=0",
        *extra,
    )
    train_in_process(tmp_path, overrides, world=4)
    report = json.loads((tmp_path / "memory.json").read_text())
    config = make_config(*overrides)
    layout = Layout.from_config(config, 2, "cpu")
    m = config.model
    assert {(r["pp"], r["dp"]) for r in report["ranks"]} == {(s, d) for s in range(2) for d in range(2)}
    for r in report["ranks"]:
        predicted = model_states(rank_params(m, layout, r["pp"]), layout, r["dp"], isolated(m, layout)).figures
        assert {kind: r[kind] for kind in predicted} == predicted, r
    for stage in report["estimate"]["stages"]:
        rows = [r for r in report["ranks"] if r["pp"] == stage["stage"]]
        assert stage["model_states"]["total"] == max((r["total"] for r in rows), key=lambda t: sum(t.values()))


# --- ZeRO-3 under pipeline parallelism: model states and the gathered parameters -------------------------------

# (model, schedule, vpp, zero3_gather, zero3_prefetch, precision): the tied embedding and its copy in buckets of
# their own, interleaved chunks (one without a root), zb-h1's blocks held from I to W, both gather modes.
ZERO3_PP_CASES = [
    (
        dataclasses.replace(LLAMA, name="llama-tied", tie_embeddings=True, n_layers=6),
        "1f1b",
        1,
        "micro_batch",
        1,
        "bf16",
    ),
    (dataclasses.replace(LLAMA, n_layers=4), "1f1b", 1, "step", 1, "fp32"),
    (dataclasses.replace(SHAPES[0], n_layers=8), "interleaved", 2, "micro_batch", 0, "fp32"),
    (dataclasses.replace(SHAPES[0], n_layers=8), "gpipe", 1, "micro_batch", 2, "bf16"),
    (dataclasses.replace(LLAMA, n_layers=6), "zb-h1", 1, "micro_batch", 1, "fp32"),
]


def _zero3_pp_config(case: tuple) -> Config:
    cfg, schedule, vpp, mode, prefetch, precision = case
    config = Config(model=cfg)
    par = config.parallel
    par.zero, par.pp, par.vpp, par.schedule, par.zero3_gather, par.zero3_prefetch = 3, 2, vpp, schedule, mode, prefetch
    config.train.precision = precision
    return config


def _zero3_pp_on_ranks(rank: int, world: int) -> list[dict]:
    groups = build_process_groups(Topology(dp=world // 2, pp=2, tp=1))
    out = []
    for case in ZERO3_PP_CASES:
        config = _zero3_pp_config(case)
        cfg = config.model
        parts = build_parts(config, groups, torch.device("cpu"))
        setup = parts.optimizer
        try:
            g = torch.Generator().manual_seed(groups.dp_rank)
            tokens = torch.randint(0, cfg.vocab_size, (4, 2, cfg.seq_len), generator=g)
            micro = [Batch(x, x, torch.arange(2 * m, 2 * m + 2), 0) for m, x in enumerate(tokens)]
            parts.runner.forward_backward(micro, parts.chunks[-1].loss_sum, 1.0)
            setup.step.step(1e-3)
            store = setup.zero.store
            out.append(
                {
                    "pp": groups.pp_rank,
                    "dp": groups.dp_rank,
                    "states": measure_model_states(setup.step.model_state_tensors()),
                    "peak_gathered": store.peak_full_bytes,
                    "after_step": store.full_bytes(),
                }
            )
        finally:
            setup.remove_hooks()
    return out


@pytest.mark.multiprocess
def test_zero3_pipeline_model_states_and_gathered_parameters_match_the_prediction() -> None:
    """dp=2 x pp=2, ZeRO-3, 4 micro-batches: each rank's measured model states are the prediction for its stage and
    dp rank to the byte, and the most parameter memory gathered at once is the estimator's ``gathered`` to the byte
    (the roots and 1 + prefetch blocks per micro-batch, every bucket in step mode or off zb-h1's first stage); after
    the step nothing is gathered."""
    ranks = run_distributed(_zero3_pp_on_ranks, 4, timeout_s=240)
    for r in ranks:
        for case, got in zip(ZERO3_PP_CASES, r, strict=True):
            config = _zero3_pp_config(case)
            m = config.model
            layout = dataclasses.replace(Layout.from_config(config, 2, "cpu"), micro_batches=4)
            predicted = model_states(rank_params(m, layout, got["pp"]), layout, got["dp"], isolated(m, layout))
            assert got["states"] == predicted.figures, case
            assert got["peak_gathered"] == predicted.gathered, (case, got["pp"], got["peak_gathered"])
            assert got["after_step"] == 0, case
