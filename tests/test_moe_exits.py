"""A sparse model leaves by every exit with the function it trained: the loss-free balancing bias travels through
the consolidated file, generation and ``checkpoint.init_from`` (under another layout), and a capacity is one
function of the sequence, so a KV-cache decode and a prefix compute what the full forward does. Also the MoE keys'
refusals, zb-v's two chunks, and fp16's skipped steps leaving the bias where it was."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch

import trident.build
from tests.helpers import REPO
from tests.helpers.layouts import make_config, tiny, train_in_process, train_rank
from trident.checkpoint.dcp import read_metadata, read_sharded
from trident.checkpoint.init_from import adopt_init_from, check_init_from
from trident.checkpoint.manager import schedule_changes
from trident.checkpoint.sharded import Sharded
from trident.checkpoint.state import BUFFERS
from trident.config import ModelConfig, MoEConfig, validate
from trident.data.dataset import open_dataset
from trident.data.sampler import GlobalBatchSampler
from trident.errors import ConfigError
from trident.models.gpt import GPT, init_weights, lm_loss_sum
from trident.models.kv_cache import KVCache
from trident.models.moe import step_stats
from trident.parallel.placement import placement_of
from trident.parallel.precision import LossScaler
from trident_dev.consolidated import ModelWeights, load_weights, write_checkpoint, write_consolidated
from trident_dev.ranks import run_distributed

_spec = importlib.util.spec_from_file_location("generate_tool", REPO / "tools" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)

CONF = REPO / "conf"


def small_moe(**moe: object) -> ModelConfig:
    return ModelConfig(
        n_layers=2, d_model=32, n_heads=4, n_kv_heads=2, seq_len=24, vocab_size=64, d_ff=48, bias=False,
        norm="rmsnorm", mlp="swiglu", position="rope", tie_embeddings=False,
        moe=MoEConfig(**{"experts": 4, "top_k": 2, "d_expert": 16, **moe}),
    )  # fmt: skip


def model_of(cfg: ModelConfig, seed: int = 0) -> GPT:
    model = GPT(cfg)
    init_weights(model, cfg, seed)
    return model.eval()


# --- a capacity: one function of the sequence, however its tokens are fed ------------------------------------


def test_a_kv_cache_decode_and_a_prefix_keep_the_pairs_the_full_forward_keeps():
    """At capacity 0.5 (pairs dropped): the prompt then one token at a time through the cache gives the full
    forward's logits at every position, a prefix alone gives its first positions' logits, and the training forward
    is the evaluation's. Greedy generation with the cache gives the tokens of full forwards."""
    cfg = small_moe(capacity_factor=0.5)
    model = model_of(cfg)
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache(24)
        decoded = torch.cat([model(ids[:, :5], cache), *(model(ids[:, t : t + 1], cache) for t in range(5, 24))], 1)
        torch.testing.assert_close(decoded, full, rtol=0, atol=1e-5)
        torch.testing.assert_close(model(ids[:, :9]), full[:, :9], rtol=0, atol=1e-5)
        dropless = model_of(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, capacity_factor=None)))
        assert (dropless(ids) - full).abs().max() > 1e-3  # the capacity drops pairs: the check is not vacuous
        assert torch.equal(model.train()(ids), full)
    model.eval()
    prompt = ids[0, :4].tolist()
    tokens = generate.sample(model, prompt, 20, 0.0, 0, torch.Generator())
    expected = list(prompt)
    with torch.no_grad():
        for _ in range(20):
            expected.append(int(model(torch.tensor([expected]))[0, -1].argmax()))
    assert tokens == expected[len(prompt) :]


def test_generation_keeps_the_capacity_of_the_trained_window():
    """tools/generate.py builds the model over its whole context (model.max_seq_len); a capacity stays the one of
    the sequences it trained on (model.seq_len): the first seq_len positions' logits are the trained model's."""
    cfg = dataclasses.replace(small_moe(capacity_factor=0.5), max_seq_len=48)
    trained = model_of(cfg)
    tensors = {name: placement_of(p).real_part(p.data) for name, p in trained.named_parameters()}
    config = dataclasses.asdict(make_config())
    config["model"] = dataclasses.asdict(cfg)
    built = generate.build_model(ModelWeights(tensors, config, 1, None, Path("x")), torch.device("cpu"))
    assert built.cfg.seq_len == 48
    ids = torch.randint(0, 64, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(built(ids), trained(ids), rtol=0, atol=1e-6)


# --- the loss-free bias and fp16's skipped steps ------------------------------------------------------------


def test_a_skipped_step_leaves_the_bias_and_its_routing_is_not_carried_over():
    cfg = small_moe(bias_update_rate=0.01)
    model = model_of(cfg).train()
    bias = model.layers["0"].mlp.router.expert_bias
    model(torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0)))
    row = step_stats([model], cfg.moe, skipped=True)
    assert torch.equal(bias, torch.zeros(4)) and "moe/load/0" in row  # reported, not applied
    model(torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(1)))
    counts = model.layers["0"].mlp.step_counts.clone()  # the next step's own routing only
    step_stats([model], cfg.moe)
    assert torch.equal(bias, 0.01 * torch.sign(counts.mean() - counts).float())


def _fp16_overflowing(rank: int, world: int, cfg, run_dir: Path) -> list[dict]:
    # A real scaler whose starting scale overflows fp16's gradients: its first steps are skipped, halving it.
    original = trident.build.LossScaler
    trident.build.LossScaler = lambda: LossScaler(init_scale=2.0**40)
    try:
        return train_rank(rank, world, cfg, run_dir)
    finally:
        trident.build.LossScaler = original


@pytest.mark.multiprocess
def test_fp16_steps_the_loss_scaler_skips_leave_the_balancing_bias(tiny_dataset, tmp_path):
    overrides = tiny(
        tiny_dataset, "model=moe-tiny", "train.steps=3", "train.eval_every=0", "train.micro_batch_size=8",
        "train.precision=fp16", "train.max_skipped_steps=10", "model.moe.bias_update_rate=0.05",
    )  # fmt: skip
    (rows,) = run_distributed(_fp16_overflowing, 1, make_config(*overrides), tmp_path, timeout_s=300)
    assert all(r.get("skipped") for r in rows), rows
    # Three steps moving it would leave a sum of three signs per expert: never zero.
    saved = tmp_path / "checkpoints" / "step_00000003"
    biases = {f"{BUFFERS}layers.{i}.mlp.router.expert_bias": Sharded.whole(torch.ones(4)) for i in range(2)}
    read_sharded(biases, saved, read_metadata(saved))
    assert all(torch.equal(b.boxes[0][1], torch.zeros(4)) for b in biases.values()), biases


# --- every exit of a trained moe-tiny ------------------------------------------------------------------------


def _mean_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (lm_loss_sum(model(x), y) / y.numel()).item()


@pytest.mark.multiprocess
def test_a_trained_moe_computes_its_function_after_every_exit(tiny_dataset, tmp_path):
    """moe-tiny trained 3 steps with the loss-free bias moving and a capacity that drops pairs. The trained function
    (the run's own validation loss after its last step) is what generation's model computes from the checkpoint
    and from the consolidated file, the cache's decode gives the full forward's logits, and a run started from the
    checkpoint at ep 2 (another bias rate: a training knob) starts at that model's loss on its first batch."""
    overrides = tiny(
        tiny_dataset, "model=moe-tiny", "train.steps=3", "train.eval_every=3", "train.micro_batch_size=8",
        "optim.lr=3e-3", "model.moe.bias_update_rate=0.05", "model.moe.capacity_factor=0.5",
    )  # fmt: skip
    (history,) = train_in_process(tmp_path / "run", overrides)
    assert history[-1]["moe/dropped"] > 0
    cfg = make_config(*overrides)
    _, val = open_dataset(cfg.data, cfg.model.vocab_size).split(
        cfg.model.seq_len, cfg.data.val_fraction, cfg.train.global_batch_size
    )
    x, y = val.batch(torch.arange(cfg.train.global_batch_size))
    trained = history[-1]["val_loss"]

    weights = load_weights(tmp_path / "run" / "checkpoints")
    model = generate.build_model(weights, torch.device("cpu"))
    assert abs(_mean_loss(model, x, y) - trained) <= 1e-5 * trained, (_mean_loss(model, x, y), trained)
    assert len(weights.buffers) == 2 and all(b.abs().min() > 0 for b in weights.buffers.values()), weights.buffers
    unbiased = generate.build_model(dataclasses.replace(weights, buffers={}), torch.device("cpu"))
    with torch.no_grad():  # the bias is part of the function: without it the logits move far past the tolerance
        assert (unbiased(x) - model(x)).abs().max() > 1e-3

    with torch.no_grad():
        full = model(x[:2])
        cache = KVCache(cfg.model.seq_len)
        decoded = torch.cat([model(x[:2, :8], cache), *(model(x[:2, t : t + 1], cache) for t in range(8, 64))], 1)
        torch.testing.assert_close(decoded, full, rtol=0, atol=1e-5)

    write_consolidated(weights, tmp_path / "model.safetensors")
    consolidated = load_weights(tmp_path / "model.safetensors")
    assert consolidated.buffers.keys() == weights.buffers.keys()
    with torch.no_grad():
        torch.testing.assert_close(generate.build_model(consolidated, torch.device("cpu"))(x), model(x))
    converted = write_checkpoint(consolidated, tmp_path / "converted")  # and back to a checkpoint, bias and all
    for name, bias in load_weights(converted).buffers.items():
        assert torch.equal(bias, weights.buffers[name]), name

    ep2 = [
        o for o in tiny(tiny_dataset, "train.steps=1", "train.eval_every=0", "train.micro_batch_size=8")
        if o != "model=gpt-tiny"
    ] + ["parallel.ep=2", "model.moe.bias_update_rate=0.01", f"checkpoint.init_from={converted}"]  # fmt: skip
    started = adopt_init_from(make_config(*ep2), ep2, CONF, tmp_path / "ep2")
    assert started.model.moe.bias_update_rate == 0.01 and started.model.moe.capacity_factor == 0.5
    (first, _) = run_distributed(train_rank, 2, started, tmp_path / "ep2", timeout_s=300)
    train, _ = open_dataset(cfg.data, cfg.model.vocab_size).split(
        cfg.model.seq_len, cfg.data.val_fraction, cfg.train.global_batch_size
    )
    x0, y0 = train.batch(GlobalBatchSampler(len(train), cfg.train.global_batch_size, cfg.train.seed).global_batch(0))
    expected = _mean_loss(model, x0, y0)
    assert abs(first[0]["loss"] - expected) <= 1e-5 * expected, (first[0]["loss"], expected)


# --- init_from: the MoE keys that fix the function, and the knobs a run may change --------------------------


def _moe_checkpoint(root: Path) -> Path:
    cfg = make_config("model=moe-tiny")
    model = model_of(cfg.model)
    tensors = {name: placement_of(p).real_part(p.data) for name, p in model.named_parameters()}
    return write_checkpoint(ModelWeights(tensors, dataclasses.asdict(cfg), 4, None, root), root)


def test_init_from_a_moe_takes_other_training_knobs_and_names_a_key_that_fixes_the_function(tmp_path):
    source = _moe_checkpoint(tmp_path / "src")
    base = ["wandb.mode=disabled", f"checkpoint.init_from={source}"]
    knobs = ["model.moe.bias_update_rate=0.1", "model.moe.capacity_factor=1.25", "model.moe.aux_loss_coef=0.0"]
    cfg = adopt_init_from(make_config(*base, *knobs), [*base, *knobs], CONF, tmp_path / "run")
    moe = cfg.model.moe
    assert (moe.experts, moe.bias_update_rate, moe.capacity_factor, moe.aux_loss_coef) == (4, 0.1, 1.25, 0.0)
    assert check_init_from(cfg, tmp_path / "run").path == source
    with pytest.raises(ConfigError) as info:
        adopt_init_from(make_config(*base, "model.moe.experts=8"), [*base, "model.moe.experts=8"], CONF, tmp_path)
    assert str(info.value) == (
        f"checkpoint.init_from={source} is a trident checkpoint with model.moe.experts=4; the command line sets "
        "model.moe.experts=8: leave it out to take its shape, or start from another model"
    )
    changed = dataclasses.replace(cfg.model, moe=dataclasses.replace(moe, top_k=1, norm_topk=False))
    with pytest.raises(ConfigError, match=r"with model\.moe\.top_k=2, model\.moe\.norm_topk=True; this run's config"):
        check_init_from(dataclasses.replace(cfg, model=changed), tmp_path / "run")


# --- refusals and zb-v ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, world, line",
    [
        (
            ["model.moe.top_k=1"],
            1,
            "model.moe.norm_topk=true with model.moe.top_k=1 makes every routing weight 1, so the router never learns "
            "from the token loss; set model.moe.norm_topk=false for top_k=1",
        ),
        (
            ["model.moe.top_k=1", "model.moe.router=sigmoid", "model.moe.norm_topk=false"],
            1,
            "model.moe.router=sigmoid renormalises the chosen scores to sum 1, so with model.moe.top_k=1 every routing "
            "weight is 1 and the router never learns from the token loss; use model.moe.top_k=2 or "
            "model.moe.router=softmax",
        ),
        (
            ["model.moe.shared_experts=1", "model.moe.d_expert=33", "parallel.tp=2"],
            2,
            "the shared experts' width model.moe.shared_experts=1 x model.moe.d_expert=33 = 33 is not divisible by "
            "parallel.tp=2; use model.moe.d_expert=34 or parallel.tp=1",
        ),
        (
            ["model.moe.shared_experts=3", "model.moe.d_expert=30", "parallel.tp=4"],
            4,
            "the shared experts' width model.moe.shared_experts=3 x model.moe.d_expert=30 = 90 is not divisible by "
            "parallel.tp=4; use model.moe.d_expert=32 or parallel.tp=3",
        ),
        (
            ["parallel.pp=2", "parallel.vpp=3", "parallel.schedule=zb-v", "model.n_layers=6"],
            2,
            "parallel.vpp=3 with parallel.schedule=zb-v, which runs two model chunks per pipeline rank in a V; set "
            "parallel.vpp=2 (or leave it out)",
        ),
    ],
    ids=["norm_topk-top1", "sigmoid-top1", "shared-width-tp2", "shared-width-tp4", "zb-v-vpp3"],
)
def test_moe_and_zb_v_refusals_are_one_line(overrides, world, line):
    with pytest.raises(ConfigError) as info:
        validate(make_config("model=moe-tiny", *overrides), world)
    assert str(info.value) == line


def test_top_k_1_trains_without_renormalising_and_every_preset_validates():
    assert validate(make_config("model=moe-tiny", "model.moe.top_k=1", "model.moe.norm_topk=false"), 1)
    assert validate(make_config("model=moe-tiny", "model.moe.shared_experts=1", "parallel.tp=2"), 2)
    for preset in sorted((CONF / "model").glob("*.yaml")):
        assert validate(make_config(f"model={preset.stem}"), 1), preset.stem


def test_zb_v_runs_two_chunks_when_vpp_is_left_out():
    layout = validate(make_config("model=gpt-tiny", "model.n_layers=4", "parallel.pp=2", "parallel.schedule=zb-v"), 2)
    assert (layout.schedule, layout.vpp, layout.chunks) == ("zb-v", 2, 4)
    explicit = validate(
        make_config("model=gpt-tiny", "model.n_layers=4", "parallel.pp=2", "parallel.vpp=2", "parallel.schedule=zb-v"),
        2,
    )
    assert explicit == layout


# --- resume: model.moe's training knobs may change, its function keys may not --------------------------------


@pytest.mark.multiprocess
def test_a_resume_may_change_the_moe_training_knobs_but_not_its_function(tiny_dataset, tmp_path):
    overrides = tiny(tiny_dataset, "model=moe-tiny", "train.steps=3", "checkpoint.every=2", "train.eval_every=0")
    train_in_process(tmp_path / "run", [*overrides, "train.steps=2"])
    resume = [*overrides, f"checkpoint.dir={tmp_path / 'run' / 'checkpoints'}"]
    (history,) = train_in_process(tmp_path / "knobs", [*resume, "model.moe.aux_loss_coef=0.05"])
    assert [row["step"] for row in history] == [3]
    assert schedule_changes(
        {"model": {"moe": dataclasses.asdict(MoEConfig(experts=4))}},
        {"model": {"moe": dataclasses.asdict(MoEConfig(experts=4, aux_loss_coef=0.05))}},
    ) == ["model.moe.aux_loss_coef 0.0 -> 0.05"]  # what the resumed run's note says
    with pytest.raises(Exception, match=r"has model\.moe\.top_k=2 but this run has 1"):
        train_in_process(tmp_path / "function", [*resume, "model.moe.top_k=1", "model.moe.norm_topk=false"])
