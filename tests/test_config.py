"""trident/config.py: every validation rule, the batch arithmetic, and the Hydra presets under conf/."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf

from trident import config
from trident.config import Config, TrainConfig, grad_accum_steps, validate
from trident.errors import ConfigError, one_line
from trident.models.gpt import count_params

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")


def make(overrides: dict[str, object] | None = None) -> Config:
    """The default Config with dotted-key overrides, e.g. {"parallel.tp": 2}."""
    cfg = Config()
    for key, value in (overrides or {}).items():
        *path, name = key.split(".")
        node = cfg
        for part in path:
            node = getattr(node, part)
        assert hasattr(node, name), f"no config key {key}"  # a typo here must not pass silently
        setattr(node, name, value)
    return cfg


# --- configurations that must be accepted, with the dp size validate() resolves.

VALID = [
    pytest.param({}, 1, 1, id="defaults-world1"),
    pytest.param({}, 2, 2, id="defaults-world2"),
    pytest.param({}, 4, 4, id="defaults-world4"),
    pytest.param({}, 8, 8, id="defaults-world8"),
    pytest.param({"train.micro_batch_size": 2, "train.global_batch_size": 64}, 8, 8, id="world8-gas4"),
    pytest.param({"parallel.tp": 2, "parallel.pp": 2}, 8, 2, id="world8-tp2-pp2-dp-inferred"),
    pytest.param({"parallel.dp": 2, "parallel.tp": 2, "parallel.pp": 2}, 8, 2, id="world8-dp-explicit"),
    pytest.param({"parallel.pp": 2, "parallel.vpp": 2}, 2, 1, id="interleaved-by-vpp"),
    pytest.param({"parallel.pp": 2, "parallel.schedule": "gpipe"}, 4, 2, id="gpipe"),
    pytest.param({"parallel.pp": 2, "parallel.schedule": "zb-h1"}, 2, 1, id="zb-h1"),
    pytest.param({"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "zb-v"}, 2, 1, id="zb-v"),
    # The interleaved schedule runs any micro-batch count, not only multiples of pp (here 3 over pp=2).
    pytest.param(
        {"parallel.pp": 2, "parallel.vpp": 2, "train.micro_batch_size": 8, "train.global_batch_size": 24},
        2,
        1,
        id="interleaved-gas-not-a-multiple-of-pp",
    ),
    pytest.param({"parallel.zero": 1, "parallel.offload.optimizer": "cpu"}, 2, 2, id="zero1-offload"),
    pytest.param({"parallel.tp": 2, "parallel.sequence_parallel": True}, 2, 1, id="sequence-parallel"),
    pytest.param({"train.precision": "bf16", "train.activation_checkpointing": "selective"}, 1, 1, id="bf16"),
    pytest.param({"optim.min_lr": 1e-3, "optim.warmup_steps": 0, "optim.grad_clip": 0.0}, 1, 1, id="edges"),
    pytest.param({"parallel.cp": 2}, 4, 2, id="cp2-dp-inferred"),
    pytest.param({"parallel.cp": 2, "parallel.tp": 2, "parallel.cp_comm": "ulysses"}, 4, 1, id="cp2-tp2-ulysses"),
]


@pytest.mark.parametrize(("overrides", "world", "dp"), VALID)
def test_valid_configs(overrides: dict, world: int, dp: int) -> None:
    assert validate(make(overrides), world).dp == dp


# --- every rule: (overrides, world size, fragments the message must contain; the first names the key).

INVALID = [
    # Fit of the layout to the launch.
    pytest.param({"parallel.dp": 2}, 4, ["parallel.dp", "world size 4", "= 2"], id="world!=dp*tp*pp"),
    pytest.param({"parallel.tp": 2, "parallel.pp": 2}, 6, ["parallel.tp", "world size 6"], id="world%(tp*pp)"),
    pytest.param({"parallel.dp": 0}, 1, ["parallel.dp=0"], id="dp<1"),
    pytest.param({"parallel.tp": 0}, 1, ["parallel.tp=0"], id="tp<1"),
    pytest.param({"parallel.pp": 0}, 1, ["parallel.pp=0"], id="pp<1"),
    pytest.param({"parallel.vpp": 0}, 1, ["parallel.vpp=0"], id="vpp<1"),
    # Model split.
    pytest.param({"parallel.pp": 3}, 3, ["model.n_layers=4", "pp 3"], id="layers%pp"),
    pytest.param({"parallel.pp": 2, "parallel.vpp": 4}, 2, ["model.n_layers=4", "vpp 4"], id="layers%(pp*vpp)"),
    pytest.param({"parallel.tp": 3}, 3, ["model.n_heads=4", "parallel.tp=3"], id="heads%tp"),
    pytest.param({"model.n_heads": 3}, 1, ["model.d_model=256", "model.n_heads=3"], id="d_model%heads"),
    pytest.param({"parallel.tp": 2, "model.d_ff": 1023}, 2, ["model.d_ff=1023"], id="d_ff%tp"),
    pytest.param(
        {"parallel.tp": 2, "parallel.sequence_parallel": True, "model.seq_len": 255},
        2,
        ["model.seq_len=255"],
        id="seq_len%tp-with-sp",
    ),
    # Schedules.
    pytest.param(
        {"parallel.pp": 2, "parallel.vpp": 2, "parallel.schedule": "1f1b"},
        2,
        ["parallel.vpp=2", "interleaved"],
        id="vpp-without-interleaved",
    ),
    pytest.param({"parallel.vpp": 2}, 1, ["parallel.vpp=2", "parallel.pp > 1"], id="vpp-without-pp"),
    pytest.param({"parallel.schedule": "interleaved"}, 1, ["parallel.schedule", "vpp"], id="interleaved-vpp1"),
    pytest.param({"parallel.schedule": "zb"}, 1, ["parallel.schedule='zb'"], id="unknown-schedule"),
    pytest.param(
        {"parallel.pp": 2, "parallel.vpp": 4, "parallel.schedule": "zb-v"},
        2,
        ["parallel.vpp=4", "zb-v", "set parallel.vpp=2"],
        id="zb-v-vpp4",
    ),
    # Batch arithmetic.
    pytest.param(
        {"train.micro_batch_size": 8, "train.global_batch_size": 20},
        1,
        ["train.global_batch_size=20", "= 8"],
        id="gbs%micro",
    ),
    pytest.param(
        {"train.micro_batch_size": 16, "train.global_batch_size": 32},
        4,
        ["train.global_batch_size=32", "16 x dp 4 = 64"],
        id="gbs%(micro*dp)",
    ),
    pytest.param({"train.micro_batch_size": 0}, 1, ["train.micro_batch_size=0"], id="micro<1"),
    pytest.param({"train.global_batch_size": 0}, 1, ["train.global_batch_size=0", ">= 1"], id="gbs<1"),
    # Choices.
    pytest.param({"train.precision": "fp8"}, 1, ["train.precision='fp8'"], id="precision"),
    pytest.param({"parallel.backend": "mpi"}, 1, ["parallel.backend='mpi'"], id="backend"),
    pytest.param({"parallel.zero": 4}, 1, ["parallel.zero=4"], id="zero"),
    pytest.param({"train.activation_checkpointing": "some"}, 1, ["train.activation_checkpointing"], id="ckpt"),
    pytest.param(
        {"train.activation_checkpointing": "selective", "train.recompute_modules": ["norm", "softmax"]},
        1,
        ["train.recompute_modules=['norm', 'softmax']", "norm, mlp_act, attn_core, mlp"],
        id="recompute-modules",
    ),
    pytest.param(
        {"train.activation_checkpointing": "selective", "train.recompute_modules": []},
        1,
        ["train.recompute_modules=[]"],
        id="recompute-modules-empty",
    ),
    pytest.param(
        {"train.activation_checkpointing": "full", "train.recompute_modules": ["mlp"]},
        1,
        ["train.recompute_modules=['mlp']", "train.activation_checkpointing=selective"],
        id="recompute-modules-not-selective",
    ),
    pytest.param(
        {"train.activation_checkpointing": "full", "train.recompute_every": 0},
        1,
        ["train.recompute_every=0", ">= 1"],
        id="recompute-every<1",
    ),
    pytest.param({"train.recompute_every": 2}, 1, ["train.recompute_every=2", "policy"], id="recompute-every-none"),
    pytest.param({"wandb.mode": "dryrun"}, 1, ["wandb.mode='dryrun'"], id="wandb-mode"),
    pytest.param({"train.device": "tpu"}, 1, ["train.device='tpu'"], id="device"),
    pytest.param({"parallel.offload.optimizer": "nvme"}, 1, ["parallel.offload.optimizer='nvme'"], id="offload"),
    # Feature combinations.
    pytest.param(
        {"parallel.offload.optimizer": "cpu"}, 1, ["parallel.offload.optimizer", "parallel.zero"], id="offload-zero0"
    ),
    pytest.param({"parallel.offload.ratio": 1.5}, 1, ["parallel.offload.ratio=1.5"], id="offload-ratio"),
    pytest.param({"parallel.zero3_gather": "always"}, 1, ["parallel.zero3_gather='always'", "step"], id="zero3-gather"),
    pytest.param({"parallel.zero3_prefetch": -1}, 1, ["parallel.zero3_prefetch=-1", ">= 0"], id="zero3-prefetch"),
    pytest.param({"parallel.sequence_parallel": True}, 1, ["parallel.sequence_parallel", "tp"], id="sp-tp1"),
    pytest.param({"parallel.bucket_mb": 0.0}, 1, ["parallel.bucket_mb"], id="bucket"),
    pytest.param({"parallel.timeout_s": 0}, 1, ["parallel.timeout_s"], id="timeout"),
    # Model sizes.
    pytest.param({"model.n_layers": 0}, 1, ["model.n_layers=0"], id="n_layers<1"),
    pytest.param({"model.d_model": 0}, 1, ["model.d_model=0"], id="d_model<1"),
    pytest.param({"model.n_heads": 0}, 1, ["model.n_heads=0"], id="n_heads<1"),
    pytest.param({"model.seq_len": 0}, 1, ["model.seq_len=0"], id="seq_len<1"),
    pytest.param({"model.vocab_size": 0}, 1, ["model.vocab_size=0"], id="vocab<1"),
    pytest.param({"model.vocab_multiple": 0}, 1, ["model.vocab_multiple=0"], id="vocab_multiple<1"),
    pytest.param({"model.d_ff": 0}, 1, ["model.d_ff=0"], id="d_ff<1"),
    # Optimizer and schedule.
    pytest.param({"optim.lr": 0.0}, 1, ["optim.lr=0.0"], id="lr=0"),
    pytest.param({"optim.lr": -1e-3}, 1, ["optim.lr"], id="lr<0"),
    pytest.param({"optim.lr": math.nan}, 1, ["optim.lr=nan"], id="lr-nan"),
    pytest.param({"optim.lr": math.inf}, 1, ["optim.lr=inf"], id="lr-inf"),
    pytest.param({"optim.min_lr": 1e-2}, 1, ["optim.min_lr=0.01"], id="min_lr>lr"),
    pytest.param({"optim.min_lr": -1e-5}, 1, ["optim.min_lr"], id="min_lr<0"),
    pytest.param({"train.steps": -1}, 1, ["train.steps=-1"], id="steps<0"),
    pytest.param({"train.steps": 0}, 1, ["train.steps=0"], id="steps=0"),
    pytest.param({"optim.warmup_steps": -1}, 1, ["optim.warmup_steps=-1"], id="warmup<0"),
    pytest.param({"optim.weight_decay": -0.1}, 1, ["optim.weight_decay"], id="wd<0"),
    pytest.param({"optim.grad_clip": -1.0}, 1, ["optim.grad_clip"], id="clip<0"),
    pytest.param({"optim.beta1": 1.0}, 1, ["optim.beta1"], id="beta1=1"),
    pytest.param({"optim.beta2": -0.1}, 1, ["optim.beta2"], id="beta2<0"),
    pytest.param({"optim.eps": 0.0}, 1, ["optim.eps"], id="eps=0"),
    # Evaluation, data, checkpoints, logging.
    pytest.param({"train.eval_every": -1}, 1, ["train.eval_every=-1"], id="eval_every<0"),
    pytest.param({"train.eval_batches": 0}, 1, ["train.eval_batches=0"], id="eval_batches<1"),
    pytest.param({"train.max_skipped_steps": 0}, 1, ["train.max_skipped_steps=0"], id="max_skipped<1"),
    pytest.param({"train.max_nonfinite_losses": 0}, 1, ["train.max_nonfinite_losses=0"], id="max_nonfinite<1"),
    pytest.param({"train.stop_grace_s": 0.0}, 1, ["train.stop_grace_s=0.0"], id="stop_grace=0"),
    pytest.param({"data.val_fraction": 0.0}, 1, ["data.val_fraction"], id="val_fraction=0"),
    pytest.param({"data.val_fraction": 1.0}, 1, ["data.val_fraction"], id="val_fraction=1"),
    pytest.param({"data.tokenizer_lines": 999}, 1, ["data.tokenizer_lines"], id="tokenizer_lines"),
    # The block (issue 18).
    pytest.param({"model.norm": "batchnorm"}, 1, ["model.norm='batchnorm'", "layernorm, rmsnorm"], id="norm"),
    pytest.param({"model.mlp": "relu"}, 1, ["model.mlp='relu'", "gelu, swiglu"], id="mlp"),
    pytest.param({"model.position": "alibi"}, 1, ["model.position='alibi'", "learned, rope"], id="position"),
    pytest.param({"model.norm_eps": 0.0}, 1, ["model.norm_eps=0.0"], id="norm_eps"),
    pytest.param({"model.rope_theta": -1.0}, 1, ["model.rope_theta=-1.0"], id="rope_theta"),
    pytest.param({"model.n_kv_heads": 3}, 1, ["model.n_kv_heads=3 must divide model.n_heads=4", "1, 2, 4"], id="kv3"),
    pytest.param({"model.n_kv_heads": 0}, 1, ["model.n_kv_heads=0"], id="kv0"),
    pytest.param({"model.rope_scaling": "yarn"}, 1, ["model.rope_scaling='yarn'", "null (plain RoPE)"], id="rs-yarn"),
    pytest.param({"model.rope_scaling": "llama3"}, 1, ["model.rope_scaling=llama3 needs model.position=rope"], id="rs"),
    pytest.param(
        {"model.rope_scaling": "llama3", "model.position": "rope", "model.rope_low_freq_factor": 4.0},
        1,
        ["model.rope_low_freq_factor=4.0 must be > 0 and below model.rope_high_freq_factor=4.0"],
        id="rope-freq-factors",
    ),
    pytest.param(
        {"model.position": "rope", "model.n_heads": 4, "model.d_model": 12},
        1,
        ["model.position=rope needs an even head size; d_model / n_heads = 3"],
        id="rope-odd-head",
    ),
    pytest.param(
        {"model.n_heads": 12, "model.n_kv_heads": 4, "model.d_model": 768, "parallel.tp": 6},
        6,
        ["model.n_kv_heads=4 neither splits over nor replicates across parallel.tp=6", "parallel.tp=1 or 2 or 4 or 12"],
        id="kv-tp",
    ),
    pytest.param(
        {"model.position": "rope", "model.seq_len": 64, "model.max_seq_len": 32},
        1,
        ["model.max_seq_len=32 is below model.seq_len=64"],
        id="context-below-window",
    ),
    pytest.param(
        {"model.seq_len": 64, "model.max_seq_len": 128},
        1,
        ["model.max_seq_len=128 with model.position=learned", "leave model.max_seq_len out"],
        id="context-learned",
    ),
    pytest.param({"data.workers": 0}, 1, ["data.workers=0 must be >= 1"], id="workers"),
    pytest.param({"data.max_bad_fraction": 1.0}, 1, ["data.max_bad_fraction=1.0 must be in [0, 1)"], id="bad-frac"),
    pytest.param({"data.mix": ["a:0.5", "b"]}, 1, ["data.mix entry 'b' is not DIR:WEIGHT"], id="mix-no-weight"),
    pytest.param({"data.mix": ["a:0"]}, 1, ["data.mix entry 'a:0' is not DIR:WEIGHT with a weight > 0"], id="mix-0"),
    pytest.param({"data.mix": []}, 1, ["data.mix=[] names no dataset"], id="mix-empty"),
    pytest.param({"checkpoint.every": -1}, 1, ["checkpoint.every=-1"], id="ckpt-every"),
    pytest.param({"train.seed": 2**64}, 1, [f"train.seed={2**64} must fit 64 bits"], id="seed-past-64-bits"),
    pytest.param({"checkpoint.keep_last": -1}, 1, ["checkpoint.keep_last=-1"], id="keep_last"),
    pytest.param({"checkpoint.resume": ""}, 1, ["checkpoint.resume"], id="resume-empty"),
    pytest.param({"logging.interval": 0}, 1, ["logging.interval=0"], id="log-interval"),
    pytest.param({"logging.peak_tflops": 0.0}, 1, ["logging.peak_tflops"], id="peak_tflops"),
    # Context parallelism: the head-tail split, the heads ulysses spreads, the fit to the world.
    pytest.param(
        {"parallel.cp": 4, "model.seq_len": 100},
        4,
        ["model.seq_len=100 does not split into 2 x parallel.cp=4 equal chunks; set model.seq_len=96"],
        id="cp-seq-len",
    ),
    pytest.param(
        {"parallel.cp": 2, "parallel.tp": 2, "parallel.sequence_parallel": True, "model.seq_len": 68},
        4,
        ["model.seq_len=68 does not split", "set model.seq_len=64"],
        id="cp-sp-seq-len",
    ),
    pytest.param(
        {"parallel.cp": 8, "parallel.cp_comm": "ulysses", "model.seq_len": 256},
        8,
        ["parallel.cp_comm=ulysses spreads model.n_heads=4", "set parallel.cp_comm=ring"],
        id="cp-ulysses-heads",
    ),
    pytest.param(
        {
            "parallel.cp": 4,
            "parallel.cp_comm": "ulysses",
            "model.d_model": 384,
            "model.n_heads": 12,
            "model.n_kv_heads": 6,
        },
        4,
        [
            "parallel.cp_comm=ulysses cannot spread 6 kv heads per tp rank (model.n_kv_heads=6)",
            "set parallel.cp_comm=ring",
        ],
        id="cp-ulysses-kv-heads",
    ),
    pytest.param({"parallel.cp": 2, "parallel.cp_comm": "x"}, 2, ["parallel.cp_comm='x' is not valid"], id="cp-comm"),
    pytest.param({"parallel.cp": 0}, 1, ["parallel.cp=0 must be >= 1"], id="cp-0"),
    pytest.param(
        {"parallel.cp": 2, "parallel.tp": 2},
        6,
        ["world size 6 is not divisible by tp 2 x pp 1 x cp 2 = 4", "parallel.tp / parallel.pp / parallel.cp"],
        id="cp-world",
    ),
]


@pytest.mark.parametrize(("overrides", "world", "fragments"), INVALID)
def test_invalid_configs(overrides: dict, world: int, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate(make(overrides), world)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


# --- the fit to the launch is checked last: a config wrong in itself says so before asking for a relaunch.

LAUNCH_LAST = [
    # `python train.py parallel.tp=2` used to say "launch 2 processes"; launched so, it said "not implemented".
    pytest.param({"parallel.zero": 3, "parallel.zero3_gather": "x"}, 1, "parallel.zero3_gather='x'", id="zero3-gather"),
    pytest.param({"parallel.tp": 2, "model.n_heads": 3}, 1, "model.d_model=256 is not divisible", id="shape"),
    pytest.param({"parallel.pp": 2, "model.n_layers": 3}, 1, "model.n_layers=3", id="split"),
    pytest.param({"parallel.dp": 2, "train.precision": "fp8"}, 1, "train.precision='fp8'", id="choice"),
]


@pytest.mark.parametrize(("overrides", "world", "message"), LAUNCH_LAST)
def test_the_launch_hint_comes_after_every_other_check(overrides: dict, world: int, message: str) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate(make(overrides), world)
    assert message in str(excinfo.value) and "world size" not in str(excinfo.value), str(excinfo.value)


# --- an explicit dp that does not fit the launch is the first thing said, before the batch arithmetic (issue 17).

DP_MISFIT = [
    # parallel.dp=3 on 2 processes used to ask for a global batch divisible by 12: no batch makes it run.
    pytest.param({"parallel.dp": 3}, 2, "set parallel.dp=2", "launch 3", id="dp3-world2"),
    # dp=4 fits the default batch (32 = 4 x 8), so launching 4 processes is offered too.
    pytest.param({"parallel.dp": 4}, 2, "set parallel.dp=2 or launch 4 processes", None, id="dp4-world2"),
    pytest.param({"parallel.dp": 3, "parallel.tp": 2}, 3, "leave parallel.dp out", "launch 6", id="no-dp-fits"),
]


@pytest.mark.parametrize(("overrides", "world", "hint", "not_offered"), DP_MISFIT)
def test_an_explicit_dp_that_does_not_fit_the_world_is_said_first(
    overrides: dict, world: int, hint: str, not_offered: str | None
) -> None:
    with pytest.raises(ConfigError) as excinfo:
        validate(make(overrides), world)
    message = str(excinfo.value)
    assert message.startswith(f"world size {world} != dp {overrides['parallel.dp']}"), message
    assert hint in message and "global_batch_size" not in message, message
    assert not_offered is None or not_offered not in message, message


@pytest.mark.parametrize(
    ("micro", "global_batch", "dp", "steps"),
    [(8, 32, 1, 4), (8, 32, 2, 2), (8, 32, 4, 1), (2, 64, 4, 8), (1, 1, 1, 1), (3, 36, 3, 4)],
)
def test_grad_accum_steps(micro: int, global_batch: int, dp: int, steps: int) -> None:
    train = TrainConfig(micro_batch_size=micro, global_batch_size=global_batch)
    assert grad_accum_steps(train, dp) == steps
    assert steps * micro * dp == global_batch


def test_validation_resolves_one_layout() -> None:
    """The schedule from vpp (none without a pipeline), the micro-batch count from the batch, and the settings that
    do not apply to a launch at their defaults: two configs that launch the same run give one layout."""
    pp2 = {"parallel.pp": 2, "model.n_layers": 4}
    assert validate(make(pp2), 2).schedule == "1f1b"
    assert validate(make(pp2 | {"parallel.vpp": 2}), 2).schedule == "interleaved"
    assert validate(make(pp2 | {"parallel.schedule": "gpipe"}), 2).schedule == "gpipe"
    assert validate(make({"parallel.schedule": "gpipe"}), 1).schedule is None
    layout = validate(make({"train.micro_batch_size": 2, "parallel.dp": 2}), 2)
    assert (layout.dp, layout.micro_batches, layout.global_batch_size) == (2, 8, 32)
    same = [{"parallel.zero3_gather": "step"}, {"parallel.offload.ratio": 0.5}, {"parallel.zero3_prefetch": 3}]
    assert {validate(make(o), 1) for o in same} == {validate(make(), 1)}
    zero3 = validate(make({"parallel.zero": 3, "parallel.zero3_gather": "step", "parallel.zero3_prefetch": 3}), 1)
    assert (zero3.zero3_gather, zero3.zero3_prefetch) == ("step", 3)
    layout = validate(make({"parallel.tp": 2, "parallel.sequence_parallel": True}), 2)
    assert validate(layout.apply(make()), 2) == layout  # a layout written back into a config launches itself


# --- Hydra: conf/ composes into the typed schema.

PRESETS = {
    # name: (n_layers, d_model, n_heads, seq_len, vocab_size)
    "gpt-tiny": (2, 64, 4, 64, 512),
    "gpt-mini": (4, 256, 4, 256, 8192),
    "gpt-small": (12, 768, 12, 1024, 50257),
    "gpt-medium": (24, 1024, 16, 1024, 50257),
    "gpt-1.3b": (24, 2048, 16, 2048, 50257),
}


@pytest.fixture
def hydra_conf():
    config.register_configs()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        yield


def _compose(*overrides: str) -> Config:
    cfg = OmegaConf.to_object(compose(config_name="config", overrides=list(overrides)))
    assert isinstance(cfg, Config)
    return cfg


LLAMA_PRESETS = {
    # name: (n_layers, d_model, n_heads, n_kv_heads, d_ff, seq_len, vocab_size, tied, parameters)
    "llama-tiny": (2, 64, 4, 2, 176, 64, 512, False, 158_016),
    "llama-150m": (12, 768, 12, 4, 3072, 1024, 32000, False, 152_980_224),
    "llama-1b": (16, 2048, 32, 8, 8192, 2048, 128256, True, 1_235_814_400),  # Llama 3.2 1B: 1.24B
    "llama-8b": (32, 4096, 32, 8, 14336, 8192, 128256, False, 8_030_261_248),  # Llama 3 8B: 8.03B
}


@pytest.mark.parametrize("preset", LLAMA_PRESETS)
def test_llama_presets(hydra_conf, preset: str) -> None:
    m = _compose(f"model={preset}").model
    layers, d, heads, kv, f, seq, vocab, tied, params = LLAMA_PRESETS[preset]
    shape = (m.n_layers, m.d_model, m.n_heads, m.n_kv_heads, m.d_ff, m.seq_len, m.vocab_size)
    assert shape == (layers, d, heads, kv, f, seq, vocab)
    assert (m.norm, m.mlp, m.position, m.bias, m.tie_embeddings) == ("rmsnorm", "swiglu", "rope", False, tied)
    assert count_params(m) == params
    assert m.rope_scaling == ("llama3" if preset == "llama-1b" else None)  # Llama 3.2's; Llama 3 8B had none


def test_a_config_saved_before_the_llama_keys_reads_as_gpt2() -> None:
    """Checkpoints of earlier versions saved ``ln_eps`` and none of the block keys: they keep their meaning."""
    old = {"name": "gpt-tiny", "n_layers": 2, "d_model": 64, "n_heads": 4, "seq_len": 64, "vocab_size": 512}
    m = config.model_config_from_dict({**old, "ln_eps": 1e-6})
    assert m.norm_eps == 1e-6
    assert (m.norm, m.mlp, m.position, m.kv_heads, m.tie_embeddings) == ("layernorm", "gelu", "learned", 4, True)


@pytest.mark.parametrize("preset", PRESETS)
def test_model_presets(hydra_conf, preset: str) -> None:
    cfg = _compose(f"model={preset}")
    m = cfg.model
    assert m.name == preset
    assert (m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size) == PRESETS[preset]
    assert m.d_ff is None and m.ffn_dim == 4 * m.d_model
    assert validate(cfg, 1).dp == 1


def test_default_model_is_gpt_mini(hydra_conf) -> None:
    cfg = _compose()
    assert cfg.model.name == "gpt-mini"
    assert cfg.parallel.dp is None and cfg.train == TrainConfig()


def test_overrides_are_typed(hydra_conf) -> None:
    cfg = _compose(
        "model=gpt-small",
        "model.d_ff=1024",
        "parallel.dp=2",
        "parallel.sequence_parallel=true",
        "train.precision=bf16",
        "optim.lr=3e-4",
        "data.text=[a.txt,b/]",
    )
    assert cfg.model.name == "gpt-small" and cfg.model.d_ff == 1024
    assert cfg.parallel.dp == 2 and cfg.parallel.sequence_parallel is True
    assert cfg.train.precision == "bf16"
    assert isinstance(cfg.optim.lr, float) and cfg.optim.lr == pytest.approx(3e-4)
    assert cfg.data.text == ["a.txt", "b/"]


@pytest.mark.parametrize(
    "override",
    [
        "parallel.tp=abc",
        "model.n_layers=1.5",
        "train.steps=many",
        "parallel.sequence_parallel=maybe",
        "parallel.nonexistent=1",
        "nonexistent=1",
        "model.n_layer=4",
    ],
)
def test_bad_override_is_rejected(hydra_conf, override: str) -> None:
    key = override.split("=", 1)[0]
    with pytest.raises(ConfigCompositionException, match=key.replace(".", r"\.")):
        compose(config_name="config", overrides=[override])


def test_unknown_model_preset_is_rejected(hydra_conf) -> None:
    with pytest.raises(MissingConfigException, match="model/gpt-huge"):
        compose(config_name="config", overrides=["model=gpt-huge"])


def test_one_line_folds_indented_items_into_the_line_above() -> None:
    text = "In 'config': Could not find 'model/x'\n\nAvailable options in 'model':\n\tgpt-tiny\n\tgpt-mini\n"
    assert one_line(text) == "In 'config': Could not find 'model/x'; Available options in 'model': gpt-tiny, gpt-mini"
    assert one_line("Could not override 'a.b'.\nKey 'b' not in 'A'") == "Could not override 'a.b'; Key 'b' not in 'A'"


def test_compose_config_gives_each_caller_its_own_copy_and_composes_again_when_conf_changes(tmp_path):
    """compose_config keeps its last results: a caller that changes its config changes no one else's, and an
    edited preset (same overrides) is read afresh."""
    import shutil

    conf = tmp_path / "conf"
    shutil.copytree(Path(CONF_DIR), conf)
    first = config.compose_config(conf, ["model=gpt-tiny"])
    first.model.n_layers = 99
    assert config.compose_config(conf, ["model=gpt-tiny"]).model.n_layers == 2
    preset = conf / "model" / "gpt-tiny.yaml"
    preset.write_text(preset.read_text().replace("n_layers: 2", "n_layers: 3"))
    assert config.compose_config(conf, ["model=gpt-tiny"]).model.n_layers == 3
