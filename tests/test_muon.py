"""optim.name=muon (parallel/zero/muon.py): at one process the update is torch.optim.Muon's on each logical matrix
(models/matrices.py) and torch.optim.AdamW's on the rest, step for step and bit for bit; the matrices are what the
model's fused parameters hold; every layout gives the one-process curve."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import REPO
from trident.build import build_parts, layout_of
from trident.config import compose_config
from trident.models.matrices import matrices_of
from trident.optim import lr_at, optimizer_summary
from trident.parallel.placement import placement_of
from trident.parallel.zero.muon import Matrices
from trident_dev.bench.harness import random_batches


def _cfg(model: str, *extra: str):
    return compose_config(
        REPO / "conf",
        [
            f"model={model}",
            "model.seq_len=32",
            "optim.name=muon",
            "optim.warmup_steps=0",
            "optim.grad_clip=0",
            "train.steps=10",
            "train.micro_batch_size=2",
            "train.global_batch_size=4",
            *extra,
        ],
    )


def _full(zero, param: torch.nn.Parameter, of: str) -> torch.Tensor:
    """The one-process tensor of ``param``'s masters (``of="master"``) or reduced gradient, from its pieces."""
    flat = torch.zeros(param.numel())
    for seg, piece in zero.pieces():
        if piece.param is param:
            values = zero.master(piece) if of == "master" else seg.view(seg.grad, piece)
            flat[piece.start : piece.stop] = values
    return flat.view(param.shape)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_one_process_muon_is_torch_muon_on_each_matrix_and_adamw_on_the_rest(one_process, model: str) -> None:
    cfg = _cfg(model)
    groups = one_process
    parts = build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu"))
    (chunk,) = parts.chunks
    o, m = cfg.optim, cfg.model
    named = dict(chunk.named_parameters())
    split = {n: matrices_of(n, placement_of(p).shape, m) for n, p in named.items()}
    split = {n: s for n, s in split.items() if s is not None}
    # The reference: a parameter per logical matrix for torch's Muon, the others whole for torch's AdamW.
    zero = parts.optimizer.zero
    ref_mats = {n: [torch.nn.Parameter(t) for t in split[n].split(_full(zero, named[n], "master"))] for n in split}
    ref_rest = {n: torch.nn.Parameter(_full(zero, p, "master").clone()) for n, p in named.items() if n not in split}
    muon = torch.optim.Muon(
        [q for mats in ref_mats.values() for q in mats],
        lr=o.muon_lr,
        weight_decay=o.muon_weight_decay,
        momentum=o.muon_momentum,
        nesterov=o.muon_nesterov,
        ns_coefficients=tuple(o.muon_ns_coefficients),
        ns_steps=o.muon_ns_steps,
        adjust_lr_fn=o.muon_adjust_lr,
    )
    decay = [q for q in ref_rest.values() if q.dim() >= 2]
    no_decay = [q for q in ref_rest.values() if q.dim() < 2]
    adamw = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True,
    )  # fmt: skip
    assert ref_mats and ref_rest
    tokens = 4 * m.seq_len
    for step in range(3):
        batches = random_batches(m.vocab_size, 2, 2, m.seq_len, step, 0)
        parts.runner.forward_backward(batches, chunk.loss_sum, 1.0 / tokens)
        for n, mats in ref_mats.items():
            for q, g in zip(mats, split[n].split(_full(zero, named[n], "grad")), strict=True):
                q.grad = g
        for n, q in ref_rest.items():
            q.grad = _full(zero, named[n], "grad").clone()
        lr = lr_at(step, o, cfg.train.steps)
        parts.optimizer.step.step(lr)
        for group in adamw.param_groups:
            group["lr"] = lr
        muon.param_groups[0]["lr"] = lr * (o.muon_lr / o.lr)
        adamw.step()
        muon.step()
        for n, mats in ref_mats.items():
            want = split[n].join([q.detach() for q in mats], torch.empty(named[n].shape))
            assert torch.equal(_full(zero, named[n], "master"), want), (step, n)
        for n, q in ref_rest.items():
            assert torch.equal(_full(zero, named[n], "master"), q.detach()), (step, n)
        # the weights the model runs with are the masters (fp32: the same tensors)
    assert any(s.parts > 1 for s in split.values())  # a fused parameter was split


def test_the_matrices_of_fused_parameters_are_the_logical_ones() -> None:
    cfg = _cfg("gpt-tiny")
    m = cfg.model
    h, dh, d = m.n_heads, m.d_model // m.n_heads, m.d_model
    qkv = matrices_of("layers.0.attn.qkv.weight", (3 * h * dh, d), m)
    # rows (h three dh): head i's q rows, then its k rows, then its v rows
    t = torch.arange(3 * h * dh * d, dtype=torch.float32).view(h, 3, dh, d)
    q, k, v = qkv.split(t.view(-1, d))
    assert torch.equal(q, t[:, 0].reshape(h * dh, d)) and torch.equal(v, t[:, 2].reshape(h * dh, d))
    assert torch.equal(qkv.join([q, k, v], torch.empty(3 * h * dh, d)), t.view(-1, d))
    down = Matrices(1, 4, transposed=True)
    e = torch.randn(4 * 6, 3)  # 4 experts' (f=6, d=3) stored rows: each expert's down projection is 3 x 6
    mats = down.split(e)
    assert [tuple(x.shape) for x in mats] == [(3, 6)] * 4 and torch.equal(mats[1], e[6:12].T)
    assert down.shape((24, 3)) == (3, 6)
    for name in ["wte.weight", "lm_head.weight", "wpe.weight", "layers.0.mlp.router.weight", "layers.0.ln_1.weight"]:
        assert matrices_of(name, (8, 8) if "ln" not in name else (8,), m) is None, name


def test_the_summary_says_what_each_parameter_gets() -> None:
    cfg = _cfg("moe-tiny")
    lines = optimizer_summary(cfg.model, cfg.optim)
    text = "\n".join(lines)
    assert "Muon, 4 experts of 64x64: layers.mlp.experts.gate, layers.mlp.experts.up, layers.mlp.experts.down" in text
    adamw = next(line for line in lines if line.startswith("optimizer: AdamW"))
    for name in ["wte.weight", "ln_1.weight", "mlp.router.weight"]:
        assert name in adamw
    assert "attn.q.weight" not in adamw
    assert optimizer_summary(cfg.model, dataclasses.replace(cfg.optim, name="adamw")) == []


def _muon_pieces(rank: int, world: int, overrides: list[str]) -> dict:
    from trident.parallel.groups import build_process_groups
    from trident.parallel.topology import Topology

    cfg = compose_config(REPO / "conf", overrides)
    groups = build_process_groups(Topology(dp=world, tp=1, pp=1))
    parts = build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu"))
    muon = parts.optimizer.zero.muon
    names = {p: n for n, p in parts.chunks[0].named_parameters()}
    return {
        "muon": sorted(names[p.param] for p in muon.params),
        "pieces": {names[p.param]: [(e.piece.start, e.piece.stop) for e in p.entries] for p in muon.params},
        "numel": {names[p.param]: p.param.numel() for p in muon.params},
        "states": sorted({k for s in muon.state.values() for k in s}),
    }


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [0, 3])
def test_zero_shards_cut_the_matrices_and_muon_still_steps_every_one(zero: int) -> None:
    """Under ZeRO-3 the matrices Muon steps are those of one process (DeepSpeed #8438: zero.Init sent every parameter
    to AdamW), and shards cut matrices across ranks (#7807: slices across partitions), each rank stepping the
    momentum of its part; at ZeRO 0 every rank holds every matrix whole."""
    from trident_dev.ranks import run_distributed

    overrides = ["model=llama-tiny", "optim.name=muon", f"parallel.zero={zero}", "parallel.dp=2"]
    a, b = run_distributed(_muon_pieces, 2, overrides, timeout_s=120)
    want = sorted(n for n, p in _one_process_matrices("llama-tiny"))
    assert a["muon"] == b["muon"] == want
    assert a["states"] == ["momentum_buffer"]
    for name, numel in a["numel"].items():
        spans = sorted(a["pieces"][name] + b["pieces"][name])
        if zero == 0:
            assert a["pieces"][name] == b["pieces"][name] == [(0, numel)], name
        else:  # disjoint, together the whole parameter
            assert sum(stop - start for start, stop in spans) == numel, name
    if zero == 3:
        assert any(a["pieces"][n] and b["pieces"][n] for n in want)  # a matrix cut between the two ranks


def _one_process_matrices(model: str):
    from trident.models.gpt import GPT

    cfg = compose_config(REPO / "conf", [f"model={model}"])
    with torch.device("meta"):
        gpt = GPT(cfg.model)
    return [(n, p) for n, p in gpt.named_parameters() if matrices_of(n, tuple(p.shape), cfg.model) is not None]


MUON_STATE_CASES = [(0, "fp32", None), (1, "bf16", 0.5), (2, "fp32", None), (3, "bf16", None), (3, "fp32", 1.0)]


def _muon_states(rank: int, world: int, model: str, cases: list) -> list[dict]:
    from tests.test_memory import _measure_states
    from trident.parallel.groups import build_process_groups
    from trident.parallel.topology import Topology

    groups = build_process_groups(Topology(dp=world, tp=1, pp=1))
    out = []
    for zero, precision, ratio in cases:
        offload = ["parallel.offload.optimizer=cpu", f"parallel.offload.ratio={ratio}"] if ratio else []
        cfg = compose_config(
            REPO / "conf",
            [f"model={model}", "optim.name=muon", f"parallel.zero={zero}", f"train.precision={precision}", *offload],
        )
        got = _measure_states(cfg, groups, None)
        out.append({"dp_rank": groups.dp_rank, "states": got["states"], "layout": layout_of(cfg, groups)})
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", ["llama-tiny", "moe-tiny"])
def test_the_estimator_counts_one_momentum_per_muon_element_to_the_byte(model: str) -> None:
    """dp=2 at ZeRO 0-3, fp32 and bf16, offload: each rank's measured optimizer states (masters, Muon's momentum
    for its matrices' pieces, AdamW's two moments and step counters for the rest) are the estimate to the byte, and
    below AdamW's."""
    import dataclasses as dc

    from trident.memory.params import stage_params
    from trident.memory.states import model_states
    from trident_dev.ranks import run_distributed

    ranks = run_distributed(_muon_states, 2, model, MUON_STATE_CASES, timeout_s=240)
    for r in ranks:
        for case, got in zip(MUON_STATE_CASES, r, strict=True):
            layout = dc.replace(got["layout"], device="cpu")
            assert layout.optimizer == "muon"
            cfg = compose_config(REPO / "conf", [f"model={model}"]).model
            predicted = model_states(stage_params(cfg, layout, 0), layout, got["dp_rank"])
            for kind in ("params", "grads", "optimizer", "total"):
                assert got["states"][kind] == predicted.figures[kind], (case, kind)
            adamw = dc.replace(layout, optimizer="adamw")
            below = model_states(stage_params(cfg, adamw, 0), adamw, got["dp_rank"]).figures["optimizer"]
            assert sum(predicted.figures["optimizer"].values()) < sum(below.values()), case
            assert predicted.optimizer_step > 0


def test_the_planner_prices_newton_schulz_and_the_owners_sums() -> None:
    """Newton-Schulz's FLOPs are counted per logical matrix (llama-tiny by hand: per layer q 64x64, k and v 32x64
    apart, o 64x64, gate, up and down 176 x 64), and a Muon step costs more optimizer time than AdamW's, the
    Newton-Schulz FLOPs spread over the stage's ranks and their sums and broadcasts on the wire."""
    from trident.config import validate
    from trident.plan.cost import NS_STEPS, muon_work
    from trident.plan.planner import predict
    from trident.plan.profile import DATASHEETS

    cfg = _cfg("llama-tiny")
    m = cfg.model

    def ns(r: int, c: int) -> int:
        r, c = sorted((r, c))
        return NS_STEPS * (4 * r * r * c + 2 * r**3)

    per_layer = ns(64, 64) + 2 * ns(32, 64) + ns(64, 64) + 3 * ns(176, 64)
    flops, whole = muon_work(m, validate(cfg, 1), 0)
    assert flops == m.n_layers * per_layer
    assert whole == m.n_layers * (64 * 64 + 64 * 64 + 64 * 64 + 3 * 176 * 64)
    for world, extra in ((1, []), (4, ["parallel.tp=2", "parallel.dp=2", "parallel.zero=1"])):
        muon = _cfg("llama-tiny", *extra)
        adamw = dataclasses.replace(muon, optim=dataclasses.replace(muon.optim, name="adamw"))
        with_muon, without = (predict(c, world, DATASHEETS["h100"]).time for c in (muon, adamw))
        assert with_muon.optimizer > without.optimizer, (world, with_muon.optimizer, without.optimizer)


def test_adamw_is_adamw_alone(one_process) -> None:
    """optim.name=adamw (the default) builds no Muon and keeps AdamW's moments for every piece (Megatron #6642: its
    use_muon=False was ignored)."""
    cfg = _cfg("llama-tiny", "optim.name=adamw")
    parts = build_parts(cfg, layout_of(cfg, one_process), one_process, torch.device("cpu"))
    zero = parts.optimizer.zero
    assert zero.muon is None
    (chunk,) = parts.chunks
    batches = random_batches(cfg.model.vocab_size, 2, 2, cfg.model.seq_len, 0, 0)
    parts.runner.forward_backward(batches, chunk.loss_sum, 1.0)
    parts.optimizer.step.step(1e-3)
    kinds = {k for seg, piece in zero.pieces() for k in zero.optimizer_of(seg, piece).state[zero.master(piece)]}
    assert kinds == {"step", "exp_avg", "exp_avg_sq"}
