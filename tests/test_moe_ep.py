"""Expert parallelism (parallel.ep): the experts divided over ep of the data-parallel ranks, tokens exchanged by
all-to-all (models/moe.py), expert gradients reduced over the expert-data-parallel group: the one-process curve,
and checkpoints that move between ep layouts."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from tests.helpers.layouts import assert_same_curve, make_config, tiny, train_in_process
from trident.config import ModelConfig, MoEConfig, validate
from trident.errors import ConfigError
from trident.models import moe as moe_module
from trident.models.gpt import init_weights
from trident.models.moe import MoE
from trident.parallel import comm
from trident.parallel.placement import Placement
from trident.parallel.topology import Topology
from trident_dev.ranks import run_distributed


def test_ep_groups_are_runs_of_each_dp_group():
    t = Topology(dp=4, pp=1, tp=2, ep=2)
    assert t.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.ep_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert t.expert_dp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    t = Topology(dp=4, pp=2, tp=1, ep=4)
    assert t.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert t.expert_dp_groups() == [[0], [1], [2], [3], [4], [5], [6], [7]]
    # ep drawn from dp x cp, cp fastest: ranks (dp, cp) 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1) at tp=1.
    t = Topology(dp=2, pp=1, tp=1, cp=2, ep=2)
    assert t.ep_groups() == [[0, 1], [2, 3]] and t.expert_dp_groups() == [[0, 2], [1, 3]]
    t = Topology(dp=2, pp=1, tp=2, cp=2, ep=4)  # dp x cp groups [0, 2, 4, 6] [1, 3, 5, 7]
    assert t.ep_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert t.expert_dp_groups() == [[0], [1], [2], [3], [4], [5], [6], [7]]
    t = Topology(dp=1, pp=1, tp=1, cp=4, ep=2)
    assert t.ep_groups() == [[0, 1], [2, 3]] and t.expert_dp_groups() == [[0, 2], [1, 3]]
    cfg = make_config("model=moe-tiny", "train.global_batch_size=24", "parallel.cp=2", "parallel.ep=2")
    assert validate(cfg, 2).ep == 2  # on dp 1: both ranks are one sequence's cp ranks


def test_an_expert_placement_is_a_block_of_rows_per_ep_rank():
    full = torch.arange(8 * 3 * 2.0).view(8 * 3, 2)  # 8 experts of 3 rows
    p = Placement((24, 2), ep_rank=1, ep_size=4)
    assert p.local_shape == p.chunk_sizes == (6, 2) and p.offsets == (6, 0)
    assert torch.equal(p.shard(full), full[6:12]) and p.replicated_over_tp and p.expert_split
    with pytest.raises(ValueError):
        Placement((24, 2), split_dim=1, tp_size=2, ep_size=2)  # experts are whole on each tp rank


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            ["model.moe.experts=4", "parallel.ep=3"],
            6,
            "parallel.ep=3 does not divide model.moe.experts=4; use parallel.ep=2",
        ),
        (["parallel.ep=4"], 2, "parallel.ep=4 does not divide the 2 data-parallel ranks; use parallel.ep=2"),
        (
            ["parallel.cp=2", "parallel.ep=4"],
            2,
            "parallel.ep=4 does not divide the 2 ranks of dp 1 x cp 2; use parallel.ep=2",
        ),
        (["model=gpt-tiny", "parallel.ep=2"], 2, "parallel.ep=2 needs a model with experts"),
    ],
)
def test_ep_is_refused_in_one_line(overrides, world, message):
    cfg = make_config("model=moe-tiny", "train.global_batch_size=24", "train.micro_batch_size=2", *overrides)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as err:
        validate(cfg, world)
    assert "\n" not in str(err.value)


@pytest.mark.multiprocess
def test_moe_tiny_at_ep2_gives_the_one_process_curve_and_resumes_at_ep1_and_ep4_pp2(tiny_dataset, references, tmp_path):
    """ep=2 (dp=2: each rank two of the four experts) under ZeRO-1 (the dense states sharded over dp), capacity and
    balancing bias on: the one-process losses and loads, the model states the estimator predicts; its checkpoint
    resumes at ep=1 on one process, and at ep=4 x pp=2 under ZeRO-3 on eight."""
    balancing = ("model.moe.z_loss_coef=1e-3", "model.moe.bias_update_rate=0.05", "model.moe.capacity_factor=1.5")
    overrides = tiny(
        tiny_dataset, "model=moe-tiny", "train.steps=6", "train.eval_every=0", "optim.lr=3e-3", *balancing,
        "train.micro_batch_size=4", "checkpoint.every=3",
    )  # fmt: skip
    one = references.history(overrides)
    ep2 = train_in_process(tmp_path / "ep2", [*overrides, "parallel.ep=2", "parallel.zero=1"], world=2)
    for history in ep2:
        assert_same_curve(one, history)
        for mine, theirs in zip(one, history, strict=True):
            assert mine["moe/load/1"] == pytest.approx(theirs["moe/load/1"])
    # Each rank holds half of the experts: 2 layers x 3 matrices x 4 experts x 64 x 64 fp32, half of them fewer.
    held = [_param_bytes(d) for d in (references.run_dir(overrides), tmp_path / "ep2")]
    assert held[0] - held[1] == 2 * 3 * 4 * 64 * 64 * 4 // 2
    _assert_estimate_exact(tmp_path / "ep2")
    checkpoint = tmp_path / "ep2" / "checkpoints" / "step_00000003"
    (resumed,) = train_in_process(tmp_path / "resumed", [*overrides, f"checkpoint.resume={checkpoint}"])
    assert_same_curve(ep2[0][3:], resumed)
    # And on 8 ranks at ep 4 x pp 2 under ZeRO-3: each rank reads its one expert's weights and optimizer shard.
    layout = ["parallel.ep=4", "parallel.pp=2", "parallel.zero=3"]
    for history in train_in_process(tmp_path / "ep4pp2", [*overrides, *layout, f"checkpoint.resume={checkpoint}"], 8):
        if history:  # the last stage's ranks log the loss
            assert_same_curve(one[3:], history)


def _assert_estimate_exact(run_dir) -> None:
    """The estimator's model states of each rank's pipeline stage (the largest dp rank's) are what it measured."""
    report = json.loads((run_dir / "memory.json").read_text())
    for kind in ("params", "grads", "optimizer"):
        for stage in report["estimate"]["stages"]:
            measured = max(sum(r[kind].values()) for r in report["ranks"] if r["pp"] == stage["stage"])
            assert measured == sum(stage["model_states"][kind].values()), (kind, stage["stage"])


def _param_bytes(run_dir) -> int:
    params = json.loads((run_dir / "memory.json").read_text())["max"]["params"]
    return params["device"] + params["host"]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.ep=2", "parallel.tp=2"],
        ["parallel.ep=2", "parallel.pp=2", "parallel.vpp=2", "train.activation_checkpointing=full"],
        ["parallel.ep=4", "parallel.zero=1"],
        ["parallel.ep=2"],
        ["parallel.ep=2", "parallel.zero=1"],
        ["parallel.ep=2", "parallel.zero=2", "parallel.offload.optimizer=cpu", "parallel.offload.ratio=0.5"],
        ["parallel.ep=2", "parallel.zero=3"],
        ["parallel.ep=2", "parallel.zero=3", "parallel.pp=2", "train.activation_checkpointing=full"],
    ],
    ids=[
        "ep2-tp2",
        "ep2-pp2-vpp2-full",
        "ep4-zero1",
        "ep2-dp4",
        "ep2-dp4-zero1",
        "ep2-dp4-zero2-offload",
        "ep2-dp4-zero3",
        "ep2-pp2-zero3-full",
    ],
)
def test_moe_at_ep_with_tp_pp_and_ep4_gives_the_one_process_curve(tiny_dataset, references, tmp_path, layout):
    """Four ranks: sparse layers 1 and 3 of four (one per pipeline stage), experts whole on each tp rank, the
    all-to-all in the recomputed forward too; ep=4 holds one expert per rank; ZeRO 1-3 shard the expert states over
    their expert-dp group (of one at ep=4, of two at ep=2 on dp=4) and the dense ones over dp."""
    overrides = tiny(
        tiny_dataset, "model=moe-tiny", "model.n_layers=4", "model.moe.every=2", "train.steps=3", "train.eval_every=0",
        "train.micro_batch_size=2", "model.moe.bias_update_rate=0.05", "model.moe.z_loss_coef=1e-3",
    )  # fmt: skip
    one = references.history(overrides)
    for history in train_in_process(tmp_path / "run", [*overrides, *layout], world=4):
        assert_same_curve(one, history)
        for mine, theirs in zip(one, history, strict=True):
            for key in ("moe/aux_loss", "moe/load/1", "moe/load/3"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
    _assert_estimate_exact(tmp_path / "run")


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"],
        ["parallel.cp=2", "parallel.ep=4", "parallel.zero=1"],
        ["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "parallel.cp_comm=allgather"],
        ["parallel.cp=2", "parallel.ep=2", "data.document_mask=true", "model.seq_len=256"],
    ],
    ids=["tp2-sp-ep2", "cp2-ep4-zero1", "cp2-tp2-sp", "cp2-ep2-documents"],
)
def test_moe_with_a_sequence_split_over_ranks_gives_the_one_process_curve(tiny_dataset, references, tmp_path, layout):
    """Four ranks, each sequence split over tp (sequence parallelism), cp (head-tail chunks) or both: each rank routes
    its own tokens; the balancing loss sums its statistics over the split, the capacity keeps the pairs one process
    keeps (by their place in the whole sequence), the expert and router gradients are summed as the layout sums
    replicated ones; with ep the all-to-all carries each rank's own tokens (at cp 2 x dp 2, ep 4 is drawn from both:
    one expert per rank, a sequence's tokens exchanged between its cp ranks too)."""
    overrides = tiny(
        tiny_dataset, "model=moe-tiny", "model.n_layers=4", "model.moe.every=2", "train.steps=3", "train.eval_every=0",
        "train.micro_batch_size=2", "model.moe.aux_loss_coef=0.1", "model.moe.z_loss_coef=1e-3",
        "model.moe.capacity_factor=1.0", "model.moe.bias_update_rate=0.05",
    )  # fmt: skip
    one = references.history([*overrides, *(o for o in layout if o.startswith(("data.", "model.")))])
    assert all(row["moe/dropped"] > 0 for row in one)
    for history in train_in_process(tmp_path / "run", [*overrides, *layout], world=4):
        assert_same_curve(one, history)
        for mine, theirs in zip(one, history, strict=True):
            for key in ("moe/aux_loss", "moe/z_loss", "moe/dropped", "moe/load/1", "moe/load/3"):
                assert mine[key] == pytest.approx(theirs[key], rel=1e-5), key
    _assert_estimate_exact(tmp_path / "run")


def _dispatch_rank(rank: int, world: int, shape: tuple[int, int, int, int]) -> dict[str, int]:
    d, experts, top_k, f = shape
    cfg = ModelConfig(d_model=d, n_heads=1, mlp="swiglu", bias=False, n_layers=1,
                      moe=MoEConfig(experts=experts, top_k=top_k, d_expert=f))  # fmt: skip
    whole, mine = MoE(cfg), MoE(cfg, ep_group=dist.group.WORLD)
    for m in (whole, mine):  # name-seeded: the same router, and each rank's experts the rows of its block
        init_weights(
            torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"mlp": m})})}), cfg, 0
        )
    assert torch.equal(mine.experts.up, whole.experts.up.chunk(world)[rank])
    x = torch.randn(2 * world, 8, d, generator=torch.Generator().manual_seed(0))  # every rank's 2 sequences of 8
    xs = x.clone().requires_grad_()
    expected = whole(xs)
    expected.square().sum().backward()

    def same(mine: torch.Tensor, theirs: torch.Tensor) -> bool:
        if (d, experts, top_k) == (32, 4, 2):
            return torch.equal(mine, theirs)
        torch.testing.assert_close(mine, theirs)
        return True

    calls, padded, exchange = {}, moe_module.PADDED_DISPATCH_BYTES, comm._exchange
    try:
        for name, limit in (("padded", padded), ("counts first", 0)):
            moe_module.PADDED_DISPATCH_BYTES = limit
            exchanges = []

            def counted(*args, exchanges=exchanges):  # noqa: ANN002
                exchanges.append(1)
                return exchange(*args)

            comm._exchange = counted
            mine.zero_grad()
            xr = x[2 * rank : 2 * rank + 2].clone().requires_grad_()
            out = mine(xr)
            out.square().sum().backward()
            assert same(out, expected[2 * rank : 2 * rank + 2]), name
            assert same(xr.grad, xs.grad[2 * rank : 2 * rank + 2]), name
            torch.testing.assert_close(mine.experts.down.grad, whole.experts.down.grad.chunk(world)[rank])
            calls[name] = len(exchanges)
    finally:
        moe_module.PADDED_DISPATCH_BYTES = padded
        comm._exchange = exchange
    return calls


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "shape", [(32, 4, 2, 16), (16, 40, 3, 16), (17, 40, 3, 8)], ids=["one-row-header", "3-row-header", "odd-rows"]
)
def test_both_dispatches_give_the_one_process_output_and_gradients(shape):
    """A small dispatch pads each rank's rows to the most it can send, its counts in the same all-to-all; a large one
    sends the counts first. Both give every rank the one-process output and gradients of its tokens; the padded
    one makes one exchange fewer (the process group's all-to-alls, counted where parallel/comm.py starts them: the
    padded blocks and the combine, the two in backward). With 20 local experts the counts take three rows of a
    block; with 68-byte rows (d 17) each block rounds up to an even number of rows (8-byte aligned counts). Bitwise
    for moe-tiny's 4 experts of top 2; the others to a tolerance (a misplaced row is far outside it): with 40 experts
    of top 3 a token of half the batch can round one ulp apart from the whole batch's, as it did before these
    blocks (an odd width's matmuls round by a row's alignment too)."""
    for calls in run_distributed(_dispatch_rank, 2, shape, backend="gloo", timeout_s=120):
        assert calls == {"padded": 2 + 2, "counts first": 3 + 2}


def _reductions_rank(rank: int, world: int, _: None) -> dict[int, tuple[int, int, int]]:
    """moe-tiny at ep = dp = 2, per ZeRO stage, after one step: (dense buckets, expert buckets, collectives the
    expert buckets issued: gradient reductions and parameter gathers)."""
    from trident.build import build_parts, layout_of
    from trident.loop import Trainer
    from trident.models.moe import moe_layers
    from trident.parallel.groups import build_process_groups
    from trident.parallel.placement import is_expert
    from trident_dev.bench.harness import random_windows

    out = {}
    for zero in (0, 1, 2, 3):
        cfg = make_config("model=moe-tiny", "parallel.ep=2", f"parallel.zero={zero}", "train.global_batch_size=8",
                          "train.micro_batch_size=2", "optim.warmup_steps=0")  # fmt: skip
        groups = build_process_groups(Topology(dp=world, pp=1, tp=1, ep=2))
        parts = build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu"))
        data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 4 * cfg.train.global_batch_size)
        trainer = Trainer(cfg, groups, parts, (data, data))
        trainer.train_step(0, trainer.micro_batches(0))
        # The runner gave the step's token-loss multiplier to every sparse layer's auxiliary losses.
        assert {m.loss_multiplier for m in moe_layers(parts.chunks).values()} == {1 / trainer.tokens_per_step}
        opt = parts.optimizer
        spans = opt.zero.store.layout.spans if zero == 3 else opt.reducer.layout.spans
        expert = [s.index for s in spans if is_expert(s.params[0])]
        if zero <= 1:  # the reducer's bucket works (stage 1: reduce-scatters)
            issued = sum(opt.reducer.buckets[i].work is not None for i in expert)
        else:
            issued = sum(opt.reducer._work[i] is not None for i in expert)
        if zero in (1, 2):  # the store's all-gathers after the update: one a bucket that has others to gather from
            issued += len(opt.zero.store._work) - (len(spans) - len(expert))
        if zero == 3:
            issued += sum(opt.zero.store._work[i] is not None for i in expert)
        out[zero] = (len(spans) - len(expert), len(expert), issued)
        opt.remove_hooks()
    return out


@pytest.mark.multiprocess
def test_at_ep_equal_to_dp_expert_buckets_issue_no_collective_and_split_no_dense_bucket():
    """With as many ep ranks as dp ranks every expert-dp group is one rank: its gradients are already the sum and its
    shards the whole, so no reduction or gather is issued for them at any ZeRO stage; and the expert weights share
    buckets with each other beside the dense run, so the dense parameters stay in one bucket (stages 0-2), as at
    ep = 1. Stage 3 keeps one bucket a block and an expert weight a bucket (parallel/zero/stage3.py)."""
    for got in run_distributed(_reductions_rank, 2, None, backend="gloo", timeout_s=300):
        assert got == {0: (1, 1, 0), 1: (1, 1, 0), 2: (1, 1, 0), 3: (3, 6, 0)}, got
