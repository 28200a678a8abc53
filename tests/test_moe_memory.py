"""The estimator on mixture-of-experts layers (trident/memory/activations.py ``moe_bytes``): what a forward keeps for
backward, measured, against the prediction. Without a capacity and at ep = 1 the rows do not depend on the routing
and the prediction is exact; under ep a rank's rows do, and the prediction is the worst routing's, a bound that a
routing forced to the worst reaches to the byte (CPU, real gloo ranks)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO
from tests.test_memory import _held
from trident.config import ModelConfig, compose_config
from trident.layout import Layout
from trident.memory.activations import BALANCED, POLICIES, WORST, Routing, activation_bytes, routed_rows
from trident.memory.estimate import estimate
from trident.memory.measure import held_by_forward
from trident.models.checkpointing import apply_activation_checkpointing, parse_label
from trident.models.gpt import GPT, init_weights
from trident.models.moe import set_loss_multiplier
from trident.parallel.precision import autocast
from trident.parallel.random import model_parallel_rng
from trident.peak import PRECISION_DTYPES
from trident_dev.ranks import run_distributed

TINY = compose_config(REPO / "conf", ["model=moe-tiny"]).model


def _moe(cfg: ModelConfig, **moe: object) -> ModelConfig:
    return dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **moe))


# moe-tiny (softmax, renormalised top-k, SwiGLU, grouped products); a shared expert with a sigmoid router and the
# loss-free bias; GELU experts as a per-expert loop with raw top-k weights, a dense first layer.
SHAPES = {
    "moe-tiny": TINY,
    "shared-sigmoid": _moe(TINY, shared_experts=1, router="sigmoid", bias_update_rate=0.05),
    "gelu-loop": dataclasses.replace(
        TINY, mlp="gelu", moe=dataclasses.replace(TINY.moe, grouped_mm=False, norm_topk=False, first_dense=1)
    ),
}


def _model(cfg: ModelConfig, ep_group: dist.ProcessGroup | None = None) -> GPT:
    """A model as a run trains it: the auxiliary losses' graph kept (a loss multiplier set)."""
    torch.manual_seed(0)
    model = GPT(cfg, rng=model_parallel_rng(0), ep_group=ep_group)
    init_weights(model, cfg, 0)
    set_loss_multiplier(model, 1.0)
    return model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_sparse_layers_are_predicted_to_the_byte(name: str, precision: str) -> None:
    """Dropless at ep = 1 a sparse layer keeps the same bytes whatever the routing: router, dispatch, experts,
    shared experts, under every recomputation (selective keeps the router's logits and the experts' products)."""
    cfg = SHAPES[name]
    # The activation kept (its products, the routing's and the combine's too), and the whole MLP recomputed.
    policies = [*POLICIES, "selective[norm]", "selective[mlp]"] if name == "moe-tiny" else list(POLICIES)
    held = {p: _held(cfg, p, batch=2, model=_model(cfg), precision=precision) for p in policies}
    layout = Layout(micro_batch_size=2, precision=precision, device="cpu")
    assert {p: activation_bytes(cfg, layout, 0, p) for p in policies} == held
    assert {p: activation_bytes(cfg, layout, 0, p, BALANCED) for p in policies} == held  # dropless: one figure
    dense = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, experts=0))
    assert held["none"] != activation_bytes(dense, layout, 0, "none")  # the sparse layers were counted


def test_a_capacity_keeps_the_forward_within_the_bound() -> None:
    """With a capacity the pairs kept depend on the routing: a forward keeps at most the worst routing's bytes,
    and a balanced routing's figure lies between. A factor of 0.5 keeps 16 pairs an expert a sequence, half of a
    sequence's 128: the bound is below the dropless figure."""
    cfg = _moe(TINY, capacity_factor=0.5)
    layout = Layout(micro_batch_size=2, device="cpu")
    for policy in ("none", "selective"):
        held = _held(cfg, policy, batch=2, model=_model(cfg))
        bound, balanced = (activation_bytes(cfg, layout, 0, policy, r) for r in (WORST, BALANCED))
        assert held <= bound and balanced <= bound, (policy, held, balanced, bound)
    assert activation_bytes(cfg, layout, 0, "none") < activation_bytes(TINY, layout, 0, "none")  # fewer pairs


def test_the_worst_routing_loads_one_ep_rank_with_every_token() -> None:
    """moe-tiny (4 experts, top 2) at ep 2: each of 2 x 64 tokens sends 2 pairs; the worst routing puts them all on
    one rank's 2 experts, which receives them from both ranks; a balanced routing receives what it sends; a
    capacity of 1.0 (32 pairs an expert a sequence) keeps half of the worst."""
    layout = Layout(micro_batch_size=2, dp=2, ep=2, device="cpu")
    assert routed_rows(TINY, layout) == Routing(128, 256, 512)
    assert routed_rows(TINY, layout, BALANCED) == Routing(128, 256, 256)
    assert routed_rows(_moe(TINY, capacity_factor=1.0), layout) == Routing(128, 256, 256)
    assert routed_rows(TINY, dataclasses.replace(layout, ep=1)) == Routing(128, 256, 256)
    report = estimate(TINY, layout).to_dict()
    assert report["activations_are"] == "bound"
    stage = report["stages"][0]
    assert stage["activations_balanced"]["none"] < stage["activations"]["none"]


def _held_at_ep(cfg: ModelConfig, group: dist.ProcessGroup, policy: str, precision: str, worst: bool) -> int:
    model = _model(cfg, group).to(PRECISION_DTYPES[precision])
    if worst:  # the loss-free bias picks experts 0 and 1 (ep rank 0's) for every token of every rank
        for m in model.modules():
            if hasattr(m, "expert_bias"):
                m.expert_bias.copy_(torch.tensor([100.0, 100.0, 0.0, 0.0]))
    name, modules, every = parse_label(policy)
    apply_activation_checkpointing(model, name, modules=modules, every=every)
    g = torch.Generator().manual_seed(1 + dist.get_rank(group))
    x, y = torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_len), generator=g)

    def forward() -> torch.Tensor:
        with autocast(precision, x.device), model.rng.context(0, range(2)):
            loss = model(x, targets=y)
        time.sleep(0.1)  # gloo's worker lets go of a collective's buffers a moment after it returns
        return loss

    rope = [m.inv_freq for m in model.modules() if getattr(m, "inv_freq", None) is not None]
    return held_by_forward(forward, [*model.parameters(), *model.buffers(), *rope, x, y])[1]


def _ep_ranks(rank: int, world: int, cfg: ModelConfig) -> dict:
    group = dist.new_group(list(range(world)))
    out = {}
    for precision in ("fp32", "bf16"):
        for policy in POLICIES:
            out[precision, policy, "worst"] = _held_at_ep(cfg, group, policy, precision, worst=True)
        out[precision, "none", "learned"] = _held_at_ep(cfg, group, "none", precision, worst=False)
    return out


@pytest.mark.multiprocess
def test_at_ep2_the_worst_routing_is_predicted_to_the_byte_and_bounds_a_real_one() -> None:
    """Two gloo ranks at ep 2, the bias forcing every token's pairs onto rank 0's experts: rank 0 keeps what the
    estimator predicts to the byte (its experts' rows from both ranks, the permutations, the all-to-all's returned
    outputs), rank 1 less; under the learned routing both keep at most the bound."""
    cfg = _moe(TINY, bias_update_rate=0.05)
    ranks = run_distributed(_ep_ranks, 2, cfg)
    for (precision, policy, routing), rank0 in ranks[0].items():
        layout = Layout(dp=2, ep=2, micro_batch_size=2, precision=precision, device="cpu")
        bound = activation_bytes(cfg, layout, 0, policy)
        rank1 = ranks[1][precision, policy, routing]
        if routing == "worst":
            assert rank0 == bound, (precision, policy, rank0, bound)
            assert rank1 <= bound and (rank1 < bound or policy == "full")
        else:
            assert max(rank0, rank1) <= bound, (precision, rank0, rank1, bound)


def test_selective_recomputation_of_sparse_layers_gives_the_gradients_of_none() -> None:
    """Selective recomputation keeps the experts' grouped products (models/checkpointing.py, as every other matmul;
    the byte counts above see it): the recomputed forward reuses them, and the gradients are those of none."""
    cfg = _moe(TINY, shared_experts=1, z_loss_coef=1e-3)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, cfg.vocab_size, (2, 2, cfg.seq_len), generator=g)
    grads = []
    for policy in ("none", "selective"):
        model = _model(cfg)
        apply_activation_checkpointing(model, policy)
        model.loss_sum(model(x), y).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=0, atol=1e-6, msg=name)
