"""FP8 training (train.fp8, parallel/fp8.py): at one process a converted layer is torchao's Float8Linear bit for
bit; the conversion rule; on real gloo groups a layer split over tp (with and without sequence parallelism) or over
its tokens (cp) computes one process's FP8 output and gradients, which torchao's per-shard scales would not; and
whole runs under tp, pp, ZeRO-3, cp and ep give the one-process FP8 curve, and resume across layouts."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.layouts import four_layers, make_config, tiny, train_in_process
from trident.config import ModelConfig, MoEConfig, validate
from trident.errors import ConfigError
from trident.models.gpt import GPT
from trident.parallel.fp8 import Fp8Spec, enable_fp8
from trident.parallel.placement import placement_of
from trident.parallel.tensor import ColumnParallelLinear, RowParallelLinear
from trident_dev.ranks import run_distributed

RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


class _Holder(nn.Module):
    """What ``enable_fp8`` reads of a GPT: its layers, tp group and size, cp group."""

    def __init__(self, layer: nn.Module, tp_group=None, cp_group=None) -> None:
        super().__init__()
        self.layer, self.tp_group, self.cp_group = layer, tp_group, cp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_converted_layer_is_torchaos_float8_linear_bit_for_bit(recipe):
    """Ours (emulated on a CPU: the fp8 operands and scales multiplied in fp32, parallel/fp8.py) equals torchao's
    Float8Linear emulated bit for bit, and its ``torch._scaled_mm`` to the fp32 sums' order (the CPU kernel is a
    reference loop: the order a BLAS mm picks can move a sum's last bit and so its bf16 rounding; 5e-7 seen after
    other tests ran)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    linear = nn.Linear(64, 48).to(torch.bfloat16)
    ours = ColumnParallelLinear(64, 48)
    ours.weight.data, ours.bias.data = linear.weight.data.clone(), linear.bias.data.clone()
    assert enable_fp8(_Holder(ours), recipe) == ["layer"]
    config = Float8LinearConfig.from_recipe_name(recipe)
    layers = [ours]
    for emulate in (True, False):
        theirs = convert_to_float8_training(
            nn.Sequential(copy.deepcopy(linear)), config=dataclasses.replace(config, emulate=emulate)
        )
        layers.append(theirs)
    x, dy = _randn(3, 10, 64, seed=1).bfloat16(), _randn(3, 10, 48, seed=2).bfloat16()
    results = []
    for layer in layers:
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(dy)
        weight = layer.weight if layer is ours else layer[0].weight
        results.append((y, xi.grad, weight.grad))
    for a, b, c in zip(*results, strict=True):
        assert torch.equal(a, b)
        torch.testing.assert_close(a, c, rtol=2**-7, atol=1e-5)  # a bf16 rounding of a sum a last bit apart
    plain = nn.functional.linear(x, linear.weight, linear.bias)
    assert not torch.equal(results[0][0], plain)  # it did compute in FP8


def test_the_conversion_rule_leaves_the_head_the_router_the_experts_and_unaligned_layers_in_bf16():
    cfg = ModelConfig(name="t", n_layers=2, d_model=64, n_heads=4, seq_len=16, vocab_size=512)
    converted = enable_fp8(GPT(cfg), "rowwise")
    assert converted == [f"layers.{i}.{m}" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    experts = MoEConfig(experts=4, top_k=2, shared_experts=1, d_expert=32, first_dense=1)
    moe = ModelConfig(name="m", n_layers=2, d_model=64, n_heads=4, seq_len=16, vocab_size=512, d_ff=40, moe=experts)
    # Layer 0's dense MLP (d_ff 40, not a multiple of 16) stays bf16; layer 1's shared expert (32 wide) converts, its
    # router and routed experts do not.
    names = enable_fp8(GPT(moe), "tensorwise")
    assert names == [*(f"layers.{i}.attn.{m}" for i in (0,) for m in ("qkv", "proj")), "layers.1.attn.qkv",
                     "layers.1.attn.proj", "layers.1.mlp.shared.fc", "layers.1.mlp.shared.proj"], names  # fmt: skip
    assert enable_fp8(GPT(cfg), "off") == []


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["train.fp8=rowwise"], "train.fp8=rowwise computes in fp8 around bf16 activations; set train.precision=bf16"),
        (["train.fp8=mxfp8", "train.precision=bf16"], "train.fp8='mxfp8' is not valid; use one of off, tensorwise"),
    ],
)
def test_bad_fp8_settings_are_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(make_config("model=gpt-tiny", *overrides), 1)


def _run(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(dy)
    return [y.detach(), x.grad, layer.weight.grad.clone()]


def _split_case(kind: str, recipe: str, rank: int, world: int, control: bool) -> tuple[list, list]:
    """A layer of ``kind`` split over the world (tp, tp with SP, or its tokens as cp splits them) and the same at one
    process, both FP8: (this rank's output, input gradient and weight gradient; the one-process ones cut to match).
    ``control``: the split layer scales each shard by its own amax, as torchao's Float8Linear would."""
    group = dist.group.WORLD
    b, t, d, f = 2, 8, 32, 64
    row, sp, tokens = kind.startswith("row"), kind.endswith("sp"), kind == "tokens"
    k, n = (f, d) if row else (d, f)
    x, w, dy = _randn(b, t, k, seed=1), _randn(n, k, seed=2), _randn(b, t, n, seed=3)
    make = (lambda g: RowParallelLinear(k, n, g, bias=False, sequence_parallel=sp)) if row else None
    make = make or (lambda g: ColumnParallelLinear(k, n, g, bias=False, sequence_parallel=sp))
    one = make(None)
    one.weight.data.copy_(w)
    enable_fp8(_Holder(one), recipe)
    expected = _run(one, x, dy)
    split = make(None if tokens else group)
    split.weight.data.copy_(placement_of(split.weight).shard(w))
    enable_fp8(_Holder(split, None if tokens else group, group if tokens else None), recipe)
    if control:
        split.fp8 = Fp8Spec(split.fp8.config, split.fp8.mm, (), (), ())

    def seq(v: torch.Tensor) -> torch.Tensor:  # this rank's part of the tokens
        return v.chunk(world, dim=1)[rank]

    def cols(v: torch.Tensor) -> torch.Tensor:
        return v.chunk(world, dim=-1)[rank]

    if tokens:
        got = _run(split, seq(x), seq(dy))
        dist.all_reduce(got[2], group=group)  # the weight gradient: a partial sum over the tokens (dp x cp reduces)
        return got, [seq(expected[0]), seq(expected[1]), expected[2]]
    if row:
        got = _run(split, cols(x), seq(dy) if sp else dy)
        return got, [seq(expected[0]) if sp else expected[0], cols(expected[1]), cols(expected[2])]
    got = _run(split, seq(x) if sp else x, cols(dy))
    return got, [cols(expected[0]), seq(expected[1]) if sp else expected[1], expected[2].chunk(world, dim=0)[rank]]


def _check_split_layers(rank: int, world: int, recipe: str) -> list[float]:
    """Each split: the max relative difference from one process with the layout's scales, and with per-shard ones."""
    out = []
    for kind in ("column", "column-sp", "row", "row-sp", "tokens"):
        for control in (False, True):
            got, expected = _split_case(kind, recipe, rank, world, control)
            out.append(max(float((g - e).abs().max() / e.abs().max()) for g, e in zip(got, expected, strict=True)))
    return out


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", RECIPES)
def test_a_split_layer_computes_the_one_process_fp8_output_and_gradients(recipe):
    """fp32 operands, so that only the order of sums separates a split layer from one process. Tensorwise: the same
    scales and fp8 values, to 1e-6, where torchao's per-shard amax is FP8 rounding apart (1e-3 and more). Rowwise:
    torchao returns a rowwise GEMM in bf16, so the partial products a split sums (a row-parallel output, a
    column-parallel input gradient, a token split's weight gradient) are bf16-rounded (2^-8) before the sum; and its
    power-of-2 scales make a shard's own amax change only values in FP8's subnormal range (the scales themselves:
    the next test)."""
    for diffs in run_distributed(_check_split_layers, 2, recipe):
        exact, per_shard = diffs[0::2], diffs[1::2]
        if recipe == "tensorwise":
            assert max(exact) < 1e-6, exact
            assert min(per_shard) > 1e-3, per_shard
        else:
            assert max(exact) < 2**-7, exact


def _check_casts(rank: int, world: int) -> list[tuple]:
    """A [16, 32] tensor split over the world along each dim, cast tensorwise and rowwise along each axis with the
    split's groups: (whether the scales and fp8 values are the one-process cast's part; with no groups, whether the
    scales are). Rank 1's part is 1/4 of rank 0's in magnitude, so its own amax is another."""
    from trident.parallel.fp8 import _float8

    f8 = _float8()
    mm, group, out = f8.tensor.LinearMMConfig(), dist.group.WORLD, []
    x = _randn(16, 32, seed=5)
    for dim in (0, 1):
        scaled = torch.cat([part * 0.25**r for r, part in enumerate(x.chunk(world, dim=dim))], dim=dim)
        mine = scaled.chunk(world, dim=dim)[rank]
        split_dims = ((group,), ()) if dim == 0 else ((), (group,))
        for recipe in ("tensorwise", "rowwise"):
            config = f8.recipe.from_recipe_name(recipe)
            for axis in (0, -1):
                spec, c = Fp8Spec(config, mm, (), (), ()), config.cast_config_input
                cases = ((scaled, ((), ())), (mine, split_dims), (mine, ((), ())))
                one, split, alone = (spec.cast(t, c, "input", d, axis) for t, d in cases)
                scale = one._scale
                if scale.dim() and axis % 2 != dim:  # rowwise along the other axis: the scales of this rank's rows
                    scale = scale.chunk(world, dim=dim)[rank]
                data = one._data.chunk(world, dim=dim)[rank]
                same = torch.equal(split._scale, scale) and torch.equal(split._data.float(), data.float())
                out.append((dim, axis, recipe, same, torch.equal(alone._scale, scale)))
    return out


@pytest.mark.multiprocess
def test_a_split_tensor_is_cast_with_the_whole_tensors_scales():
    """The claim itself: split along either dim, a tensor cast tensorwise or rowwise along either axis gets the
    one-process scales and FP8 values, bit for bit; its shard's own amax would give other scales wherever the amax
    spans the split (tensorwise, or rowwise along the split dim)."""
    ranks = run_distributed(_check_casts, 2)
    for cases in zip(*ranks, strict=True):
        dim, axis, recipe = cases[0][:3]
        assert all(same for *_, same, _ in cases), (dim, axis, recipe)
        spans = recipe == "tensorwise" or axis % 2 == dim
        assert all(alone for *_, alone in cases) != spans, (dim, axis, recipe, [c[-1] for c in cases])


def _backward_gemms(policy: str, recipe: str) -> tuple[int, list[torch.Tensor]]:
    """The aten.mm calls of one backward of two-layer gpt-tiny (bf16) under ``policy``, and the gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trident.models.checkpointing import apply_activation_checkpointing
    from trident.models.gpt import init_weights
    from trident.parallel.precision import autocast
    from trident.parallel.random import model_parallel_rng

    class Count(TorchDispatchMode):
        mm = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            self.mm += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    cfg = ModelConfig(name="t", n_layers=2, d_model=64, n_heads=4, seq_len=32, vocab_size=512)
    torch.manual_seed(0)
    rng = model_parallel_rng(0)
    model = GPT(cfg, rng=rng)
    init_weights(model, cfg, 0)
    model.to(torch.bfloat16)
    enable_fp8(model, recipe)
    apply_activation_checkpointing(model, policy)
    x, y = torch.randint(0, 512, (2, 2, 32), generator=torch.Generator().manual_seed(1))
    with autocast("bf16", x.device), rng.context(0, range(2)):
        loss = model(x, targets=y)
    with Count() as count:
        loss.backward()
    return count.mm, [p.grad for p in model.parameters()]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_selective_recomputation_keeps_the_fp8_gemms_as_it_keeps_bf16s(recipe):
    """Selective recomputation keeps every matrix product's output (models/checkpointing.py); an FP8 layer's runs in
    its autograd.Function's grad-less forward, which the policy once recomputed like routing statistics: the
    backward then ran each converted layer's forward GEMM again. Now as many GEMMs as without recomputation, and the
    same gradients."""
    kept, grads = _backward_gemms("none", recipe)
    selective, again = _backward_gemms("selective", recipe)
    assert selective == kept
    assert all(torch.equal(a, b) for a, b in zip(grads, again, strict=True))
    assert _backward_gemms("full", recipe)[0] > kept  # full recomputation reruns them, as it should


def test_enable_fp8_does_not_copy_the_weights():
    """The weights stay the parameters they were (what checkpoints, ZeRO and export hold)."""
    cfg = ModelConfig(name="t", n_layers=1, d_model=64, n_heads=4, seq_len=16, vocab_size=512)
    model = GPT(cfg)
    before = {name: p for name, p in model.named_parameters()}
    snapshot = copy.deepcopy(model.state_dict())
    enable_fp8(model, "tensorwise")
    assert {name: p for name, p in model.named_parameters()} == before
    assert model.state_dict().keys() == snapshot.keys()


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_process_fp8_trains_within_2_percent_of_the_bf16_curve(tiny_dataset, tmp_path, references, recipe):
    """50 steps of gpt-tiny (gpt-mini on the embedded corpus: docs/parallelism.md#fp8-training): FP8's curve is not
    bf16's, and at every step within 2% of it (measured: 7.4e-5 tensorwise, 1.8e-4 rowwise)."""
    base = tiny(tiny_dataset, "train.steps=50", "train.precision=bf16", "train.eval_every=0")
    base.append("train.micro_batch_size=16")
    bf16 = [r["loss"] for r in references.history(base)]
    (history,) = train_in_process(tmp_path, [*base, f"train.fp8={recipe}"])
    fp8 = [r["loss"] for r in history]
    assert fp8 != bf16
    assert fp8 == pytest.approx(bf16, rel=2e-2)
    assert fp8[-1] < fp8[0] - 1.0  # and it learns


# Whole runs. A layout sums some products in another order than one process (a tp all-reduce, cp's attention, a pp
# stage's tied-embedding sum, dp's gradient reduction): one bf16 ulp (2^-8) here and there, which in bf16 alone moves
# these curves by at most 1.1e-5 (loss) and 9.7e-4 (gradient norm) over 6 steps. FP8 turns some of those ulps into
# FP8 ulps: a value within 2^-8 of a rounding boundary of e4m3 (an ulp of 1/8) or e5m2 (gradients, 1/4) lands on the
# other side, ~2 * 2^-8 / 2^-3 = 6% of the values a difference touches, so two layouts' FP8 curves differ by about as
# much as FP8 and bf16 do at one process (measured: up to 5.4e-5 and 4.1e-3 between layouts, 9.7e-5 and 3.0e-3
# between FP8 and bf16). The tolerances are 3-5x those. (A layout that scaled by each shard's own amax measured
# 8.5e-5 and 8e-3: the curves cannot tell it apart; the split-layer tests above do.)
LOSS_REL, NORM_REL = 3e-4, 1.5e-2


def _fp8_run(dataset, recipe: str, *extra: str) -> list[str]:
    """6 steps of four-layer gpt-tiny in bf16 with FP8 matmuls, micro-batches of 2."""
    return four_layers(dataset, 6, "train.precision=bf16", f"train.fp8={recipe}", "train.eval_every=0", *extra)


def _assert_fp8_curve(expected: list[dict], got: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for want, have in zip(expected, got, strict=True):
        assert have["loss"] == pytest.approx(want["loss"], rel=LOSS_REL), (want["step"], have["loss"], want["loss"])
        norms = (want["step"], have["grad_norm"], want["grad_norm"])
        assert have["grad_norm"] == pytest.approx(want["grad_norm"], rel=NORM_REL), norms


FP8_LAYOUTS = {
    "tp2-sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pp=2"],
    "dp2-zero3": ["parallel.dp=2", "parallel.zero=3"],
    "cp2": ["parallel.cp=2"],
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("layout", list(FP8_LAYOUTS))
def test_each_layout_gives_the_one_process_fp8_curve(tiny_dataset, tmp_path, references, recipe, layout):
    reference = references.history(_fp8_run(tiny_dataset, recipe))
    bf16 = references.history(four_layers(tiny_dataset, 6, "train.precision=bf16", "train.eval_every=0"))
    assert [r["loss"] for r in reference] != [r["loss"] for r in bf16]  # FP8 is on
    for history in train_in_process(tmp_path, _fp8_run(tiny_dataset, recipe, *FP8_LAYOUTS[layout]), world=2):
        _assert_fp8_curve(reference, history)


@pytest.mark.multiprocess
def test_the_high_precision_weight_gradient_recipe_gives_the_one_process_curve_under_tp(
    tiny_dataset, tmp_path, references
):
    """rowwise_with_gw_hp: its weight-gradient GEMM in bf16 (no cast of the output gradient or the input along the
    tokens), the other two in FP8 with their amax reduced over tp, at tp=2 with sequence parallelism."""
    overrides = _fp8_run(tiny_dataset, "rowwise_with_gw_hp")
    reference = references.history(overrides)
    assert [r["loss"] for r in reference] != [r["loss"] for r in references.history(_fp8_run(tiny_dataset, "rowwise"))]
    for history in train_in_process(tmp_path, [*overrides, *FP8_LAYOUTS["tp2-sp"]], world=2):
        _assert_fp8_curve(reference, history)


@pytest.mark.multiprocess
def test_fp8_composes_with_compiled_blocks(tiny_dataset, tmp_path, references):
    """train.compile=true with train.fp8: each block compiled around its FP8 linear layers (eager islands: their
    collectives and torchao's tensor subclass), the eager FP8 curve to the FP8 tolerance (inductor's own fusions of
    the bf16 arithmetic between them move values across FP8 rounding boundaries as another order of sums does)."""
    overrides = _fp8_run(tiny_dataset, "rowwise")
    (compiled,) = train_in_process(tmp_path, [*overrides, "train.compile=true"])
    _assert_fp8_curve(references.history(overrides), compiled)


@pytest.mark.multiprocess
def test_llama_with_kv_heads_replicated_over_tp_gives_the_one_process_fp8_curve(tiny_dataset, tmp_path, references):
    """SwiGLU's gate and up, and one kv head that both tp ranks hold whole, each using its block of rows
    (``ReplicatedColumnLinear``: the weight's amax and its output gradient's reduced over tp too)."""
    llama = ("model=llama-tiny", "model.n_kv_heads=1", "model.vocab_size=512")
    overrides = _fp8_run(tiny_dataset, "rowwise", *llama)
    reference = references.history(overrides)
    for history in train_in_process(tmp_path, [*overrides, *FP8_LAYOUTS["tp2-sp"]], world=2):
        _assert_fp8_curve(reference, history)


@pytest.mark.multiprocess
def test_moe_at_ep2_gives_the_one_process_fp8_curve(tiny_dataset, tmp_path, references):
    """moe-tiny: attention in FP8, the routed experts in bf16, each rank holding two of the four experts."""
    overrides = _fp8_run(tiny_dataset, "tensorwise", "model=moe-tiny", "model.n_layers=2", "model.vocab_size=512")
    reference = references.history(overrides)
    for history in train_in_process(tmp_path, [*overrides, "parallel.ep=2", "parallel.dp=2"], world=2):
        _assert_fp8_curve(reference, history)


@pytest.mark.multiprocess
def test_an_fp8_checkpoint_resumes_across_layouts_with_the_uninterrupted_losses(tiny_dataset, tmp_path, references):
    """Saved at tp=2 with sequence parallelism after step 3, resumed at one process and at dp=2 ZeRO-3: the fp32
    masters are the checkpoint's as in any run, and the next three steps are the uninterrupted run's."""
    base = _fp8_run(tiny_dataset, "rowwise", "checkpoint.every=3")
    saved = train_in_process(tmp_path / "tp2", [*base, *FP8_LAYOUTS["tp2-sp"]], world=2)[0]
    checkpoint = tmp_path / "tp2" / "checkpoints" / "step_00000003"
    for name, world, extra in (("one", 1, []), ("dp2-zero3", 2, FP8_LAYOUTS["dp2-zero3"])):
        resumed = train_in_process(tmp_path / name, [*base, *extra, f"checkpoint.resume={checkpoint}"], world=world)
        for history in resumed:
            _assert_fp8_curve(saved[3:], history)


def test_the_planner_prices_the_converted_layers_gemms_at_the_fp8_peak() -> None:
    """train.fp8: the linear layers parallel/fp8.py converts run their three GEMMs at the datasheet's FP8 peak (the
    weight gradient's in 16 bits under rowwise_with_gw_hp), the head stays bf16, and the step is shorter than bf16's
    on an H100."""
    from tests.helpers import REPO
    from trident.config import compose_config, validate
    from trident.plan.cost import _shape
    from trident.plan.ops import chunk_ops
    from trident.plan.planner import predict
    from trident.plan.profile import DATASHEETS

    def cfg(*extra: str):
        return compose_config(REPO / "conf", ["model=gpt-small", "train.precision=bf16", *extra])

    for recipe in ("tensorwise", "rowwise_with_gw_hp"):
        c = cfg(f"train.fp8={recipe}")
        layout = validate(c, 1)
        assert layout.fp8 == recipe
        ops = [o for o in chunk_ops(c.model, _shape(c.model, layout), 2, True, True, "none") if o.kind == "matmul"]
        low = [o for o in ops if o.shape[4] == "fp8"]
        # 4 linear layers a block (qkv, proj, fc, proj) x 2 blocks x (F, I, W); the head's three and the
        # attention's stay 16-bit
        assert sum(o.count for o in low) == 4 * 2 * (3 if recipe == "tensorwise" else 2), recipe
        assert all(o.shape[1] != c.model.vocab_size for o in low)
    h100 = DATASHEETS["h100"]
    bf16, fp8 = (predict(c, 1, h100).time for c in (cfg(), cfg("train.fp8=tensorwise")))
    assert fp8.compute < bf16.compute and fp8.step < bf16.step
