"""Mixture-of-experts blocks (models/moe.py): grouped expert products equal the per-expert loop, the router's rules,
capacity and the loss-free bias, the auxiliary losses' gradients, routing counted once under recomputation, the
parameter and FLOP counts, and a short moe-tiny run whose loss falls with its metrics logged."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers.layouts import assert_same_curve, make_config, tiny, train_in_process
from trident.config import ModelConfig, MoEConfig, validate
from trident.errors import ConfigError
from trident.models.checkpointing import apply_activation_checkpointing
from trident.models.gpt import GPT, count_params, flops_per_token, init_weights
from trident.models.moe import MoE, expert_matmul, grouped_mm_fits, set_loss_multiplier, step_stats


def moe_cfg(**moe: object) -> ModelConfig:
    base = dict(experts=4, top_k=2, d_expert=16)
    return ModelConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, seq_len=16, vocab_size=64, d_ff=48, bias=False,
        norm="rmsnorm", mlp="swiglu", position="rope", tie_embeddings=False, moe=MoEConfig(**{**base, **moe}),
    )  # fmt: skip


def block(cfg: ModelConfig, seed: int = 0) -> MoE:
    model = GPT(cfg)
    init_weights(model, cfg, seed)
    return model.layers["0"].mlp


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_products_equal_the_loop(dtype):
    """One grouped product over the experts' runs (one expert with no token) equals a matmul per expert: outputs
    and both gradients."""
    assert grouped_mm_fits((32, 16), dtype), "this torch has no usable torch._grouped_mm"
    counts = [5, 0, 7, 4]
    x = torch.randn(sum(counts), 32, dtype=dtype)
    w = torch.randn(4, 32, 16, dtype=dtype)
    results = []
    for grouped in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = expert_matmul(xi, wi, counts, grouped)
        y.square().sum().backward()
        results.append((y.detach().float(), xi.grad.float(), wi.grad.float()))
    tol = 0 if dtype == torch.float32 else 1e-2
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_the_grouped_block_equals_the_loop_block():
    cfg = moe_cfg()
    loop_cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, grouped_mm=False))
    grouped, loop = block(cfg), block(loop_cfg)
    x = torch.randn(3, 10, 32)
    outs = []
    for m in (grouped, loop):
        xi = x.clone().requires_grad_()
        y = m(xi)
        y.square().sum().backward()
        outs.append((y.detach(), xi.grad, m.experts.down.grad, m.experts.gate.grad))
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block written token by token: each token's k experts' SwiGLU MLPs, weighted by the router."""
    moe, f, d = m.moe, m.experts.f, m.experts.d
    gate, up, down = (p.view(moe.experts, f, d) for p in (m.experts.gate, m.experts.up, m.experts.down))
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        scores = (
            (x[t] @ m.router.weight.T).softmax(-1) if moe.router == "softmax" else (x[t] @ m.router.weight.T).sigmoid()
        )
        top = (scores + m.router.expert_bias).topk(moe.top_k).indices
        w = scores[top] / (scores[top].sum() if moe.norm_topk or moe.router == "sigmoid" else 1)
        for e, we in zip(top.tolist(), w, strict=True):
            out[t] += we * (torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])) @ down[e]
    return out


@pytest.mark.parametrize(
    "moe", [{}, {"norm_topk": False}, {"router": "sigmoid"}, {"top_k": 1}, {"bias_update_rate": 0.1}]
)
def test_routing_matches_the_token_by_token_reference(moe):
    m = block(moe_cfg(**moe))
    if moe.get("bias_update_rate"):  # a bias large enough to put expert 3 in every token's top k
        m.router.expert_bias[3] = 10.0
    x = torch.randn(12, 32)
    with torch.no_grad():
        torch.testing.assert_close(m(x), reference(m, x), rtol=1e-5, atol=1e-6)
        if moe.get("bias_update_rate"):
            assert (m.router(x)[2] == 3).any(-1).all()


def test_a_capacity_drops_the_pairs_past_it_in_token_order():
    m = block(moe_cfg(capacity_factor=0.5, top_k=2))
    m.train()
    x = torch.randn(16, 32)
    cap = m.capacity(16)  # ceil(0.5 * 16 * 2 / 4) = 4
    assert cap == 4
    with torch.no_grad():
        y = m(x)
        _, _, chosen, weights = m.router(x)
        seen = [0] * 4
        expect = torch.zeros_like(x)
        full = reference(m, x)
        for t in range(16):  # keep a pair while its expert has room, in token order
            for e, w in zip(chosen[t].tolist(), weights[t], strict=True):
                if seen[e] < cap:
                    gate, up, down = (p.view(4, 16, 32) for p in (m.experts.gate, m.experts.up, m.experts.down))
                    expect[t] += w * (torch.nn.functional.silu(gate[e] @ x[t]) * (up[e] @ x[t])) @ down[e]
                seen[e] += 1
    torch.testing.assert_close(y, expect, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(y, full)
    holder = torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"mlp": m})})})
    stats = step_stats([holder], m.moe)
    dropped = sum(max(0, s - cap) for s in seen)
    assert dropped > 0 and stats["moe/dropped"] == pytest.approx(dropped / 32)


def test_the_loss_free_bias_moves_toward_the_mean_load_after_the_step():
    cfg = moe_cfg(bias_update_rate=0.01)
    model = GPT(cfg)
    init_weights(model, cfg, 0)
    model.train()
    model(torch.randint(0, 64, (2, 16)))
    counts = model.layers["0"].mlp.step_counts.clone()
    stats = step_stats([model], cfg.moe)
    bias = model.layers["0"].mlp.router.expert_bias
    assert torch.equal(bias, 0.01 * torch.sign(counts.mean() - counts).float())
    assert stats["moe/load/0"] == pytest.approx(float(counts.max() / counts.mean()))
    assert model.layers["0"].mlp.step_counts.sum() == 0  # the next step counts afresh


def test_the_auxiliary_losses_reach_the_router_gradient():
    """The gradient with aux and z-loss equals that of token loss + coef * aux + coef * z spelled out (the balancing
    loss per sequence, averaged over the sequences)."""
    cfg = moe_cfg(aux_loss_coef=0.1, z_loss_coef=0.01)
    tokens = torch.randint(0, 64, (2, 16))
    grads = []
    for explicit in (False, True):
        model = GPT(cfg)
        init_weights(model, cfg, 0)
        model.train()
        mult = 1 / tokens.numel()
        set_loss_multiplier(model, 0.0 if explicit else mult)
        extra = []
        if explicit:  # recompute each layer's aux and z from its router, on the same inputs
            for layer in model.layers.values():
                layer.ln_2.register_forward_hook(lambda mod, inp, out, got=extra: got.append(out.reshape(-1, 32)))
        loss = model.loss_sum(model(tokens), tokens) * mult
        if explicit:
            for x, layer in zip(extra, model.layers.values(), strict=True):
                logits, scores, chosen, _ = layer.mlp.router(x)
                # Per sequence (2 of 16 tokens): E * sum_i f_i P_i, then the mean over the sequences.
                per_seq = []
                for s in range(2):
                    rows = slice(16 * s, 16 * (s + 1))
                    counts = torch.bincount(chosen[rows].reshape(-1), minlength=4).float()
                    per_seq.append(4 * (counts / (16 * 2) * scores[rows].mean(0)).sum())
                aux = torch.stack(per_seq).mean()
                z = logits.logsumexp(-1).square().mean()
                loss = loss + (0.1 * aux + 0.01 * z)
        loss.backward()
        grads.append(torch.cat([layer.mlp.router.weight.grad.flatten() for layer in model.layers.values()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-8)


def test_recomputation_counts_routing_once():
    cfg = moe_cfg()
    model = GPT(cfg)
    init_weights(model, cfg, 0)
    apply_activation_checkpointing(model, "full")
    model.train()
    tokens = torch.randint(0, 64, (2, 16))
    model.loss_sum(model(tokens), tokens).backward()
    assert model.layers["0"].mlp.step_counts.sum() == tokens.numel() * 2
    assert model.layers["0"].mlp.router.weight.grad is not None


@pytest.mark.parametrize("modules", [("attn_core",), ("norm",), ("norm", "mlp_act"), ("mlp",)])
def test_a_sparse_block_under_each_selective_list_keeps_the_gradients_and_counts_routing_once(modules):
    """The routing statistics run under no_grad in the forward and not in its replay; kept by the policy (a product
    in the MLP region while ``mlp_act`` is not listed), they shifted the cache of ``aten.mul`` by one and the replay
    took a scalar for a [128, 64] activation (CheckpointError; fuzz seed 0 case 34)."""
    cfg = moe_cfg(aux_loss_coef=0.1, z_loss_coef=0.01)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads, counts = [], []
    for policy in ("none", "selective"):
        model = GPT(cfg)
        init_weights(model, cfg, 0)
        set_loss_multiplier(model, 1.0)
        apply_activation_checkpointing(model, policy, modules=modules)
        model.train()
        model.loss_sum(model(tokens), tokens).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        counts.append(model.layers["0"].mlp.step_counts.clone())
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    assert torch.equal(counts[1], counts[0]) and counts[0].sum() == tokens.numel() * cfg.moe.top_k


def test_counts_are_of_every_expert_and_flops_of_the_active_ones():
    cfg = moe_cfg(shared_experts=1, first_dense=1)
    model = GPT(cfg)
    assert isinstance(model.layers["1"].mlp, MoE) and not isinstance(model.layers["0"].mlp, MoE)
    assert count_params(cfg) == sum(p.numel() for p in model.parameters()) - (64 - 64)
    dense = dataclasses.replace(cfg, moe=MoEConfig())
    # Layer 1's MLP: the router, the shared expert and two of four routed experts meet each token.
    mlp = 3 * 32 * 16 * (2 + 1) + 4 * 32 - 3 * 32 * 48
    assert flops_per_token(cfg) - flops_per_token(dense) == 6 * mlp


def test_moe_keys_are_refused_in_one_line():
    cfg = make_config("model=moe-tiny", "model.moe.top_k=5")
    with pytest.raises(ConfigError, match="model.moe.top_k=5 must be between 1 and model.moe.experts=4"):
        validate(cfg, 1)
    for layout in (["parallel.tp=2", "parallel.sequence_parallel=true"], ["parallel.cp=2"]):  # each routes its own
        assert validate(make_config("model=moe-tiny", *layout), 2)


@pytest.mark.multiprocess
def test_moe_tiny_learns_with_the_one_process_curve_at_dp2_zero3_and_resumes_at_dp1(tiny_dataset, tmp_path):
    """moe-tiny with every balancing term on: its loss falls and its routing is logged; at dp 2 (the aux losses
    scaled over the global batch, the routing counts summed over dp) the curve and the loads are one process's; a
    dp 2 ZeRO-3 checkpoint (the loss-free biases in it) resumes at dp 1 with the uninterrupted losses."""
    balancing = ("model.moe.z_loss_coef=1e-3", "model.moe.bias_update_rate=0.05", "model.moe.capacity_factor=1.5")
    overrides = tiny(
        tiny_dataset, "model=moe-tiny", "train.steps=8", "train.eval_every=0", "optim.lr=3e-3", *balancing,
        "train.micro_batch_size=4", "checkpoint.every=4",
    )  # fmt: skip
    (one,) = train_in_process(tmp_path / "one", overrides)
    assert one[-1]["loss"] < one[0]["loss"] - 0.3, [r["loss"] for r in one]
    keys = {"moe/aux_loss", "moe/z_loss", "moe/load/0", "moe/load/1", "moe/dropped"}
    for row in one:
        assert keys <= set(row), keys - set(row)
        assert 0.9 < row["moe/aux_loss"] < 2.0 and row["moe/load/0"] >= 1.0 and 0 <= row["moe/dropped"] < 0.5
    assert '"moe/aux_loss"' in (tmp_path / "one" / "metrics.jsonl").read_text()

    dp2 = train_in_process(tmp_path / "dp2", [*overrides, "parallel.zero=3"], world=2)
    for history in dp2:
        assert_same_curve(one, history)
        for mine, theirs in zip(one, history, strict=True):
            assert mine["moe/load/1"] == pytest.approx(theirs["moe/load/1"])
    checkpoint = tmp_path / "dp2" / "checkpoints" / "step_00000004"
    (resumed,) = train_in_process(tmp_path / "resumed", [*overrides, f"checkpoint.resume={checkpoint}"])
    assert_same_curve(dp2[0][4:], resumed)


@pytest.mark.multiprocess
def test_moe_gives_the_one_process_curve_at_tp2_pp2_with_recomputation(tiny_dataset, tmp_path):
    """Sparse layers 1 and 3 of four (one per pipeline stage: the first stage's aux loss reaches its router through
    backward alone), experts whole on each tp rank, every block recomputed (routing counted once)."""
    overrides = tiny(
        tiny_dataset, "model=moe-tiny", "model.n_layers=4", "model.moe.every=2", "train.steps=3", "train.eval_every=0",
        "train.micro_batch_size=4", "model.moe.bias_update_rate=0.05", "model.moe.z_loss_coef=1e-3",
    )  # fmt: skip
    (one,) = train_in_process(tmp_path / "one", overrides)
    layout = ["parallel.tp=2", "parallel.pp=2", "train.activation_checkpointing=full"]
    for history in train_in_process(tmp_path / "tp2pp2", [*overrides, *layout], world=4):
        assert_same_curve(one, history)
        for mine, theirs in zip(one, history, strict=True):
            for key in ("moe/aux_loss", "moe/load/1", "moe/load/3"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key


def test_balancing_and_capacity_do_not_depend_on_how_sequences_are_grouped():
    """The balancing loss and a capacity act per sequence: one micro-batch of 4 sequences and 4 micro-batches of
    1 (what another micro-batch size, dp or ep gives a rank) train the same router gradient, count the same aux
    loss and drop the same pairs. Per micro-batch, the statistics of 4 sequences are not the mean of each one's."""
    cfg = moe_cfg(aux_loss_coef=0.1, z_loss_coef=0.01, capacity_factor=0.75)
    tokens = torch.randint(0, 64, (4, 16), generator=torch.Generator().manual_seed(3))
    results = []
    for micro_batches in ([tokens], list(tokens.split(1))):
        model = GPT(cfg)
        init_weights(model, cfg, 0)
        model.train()
        mult = 1 / tokens.numel()
        set_loss_multiplier(model, mult)
        for mb in micro_batches:
            (model.loss_sum(model(mb), mb) * mult).backward()
        layers = list(model.layers.values())
        grad = torch.cat([layer.mlp.router.weight.grad.flatten() for layer in layers])
        sums = torch.stack([layer.mlp.step_sums for layer in layers])  # dropped, tokens, n * aux, n * z
        results.append((grad, sums))
    (grad, sums), (grad_1, sums_1) = results
    assert sums[:, 0].sum() > 0  # the capacity drops pairs
    torch.testing.assert_close(sums, sums_1, rtol=1e-6, atol=0)
    torch.testing.assert_close(grad, grad_1, rtol=1e-4, atol=1e-7)
