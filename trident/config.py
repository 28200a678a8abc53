"""Typed configuration: one dataclass per concern, registered with Hydra's ConfigStore.

The YAML under ``conf/`` fills these in; ``train.py`` converts the Hydra tree to ``Config`` once
and passes the sub-configs down. ``validate`` is the single place every rule lives: it runs on every
rank before the first collective, so a bad config ends all ranks with the same clear message.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.nodes import BooleanNode

from trident.errors import ConfigError
from trident.launcher import launcher
from trident.parallel.pipeline.schedules import SCHEDULES, schedule_error
from trident.parallel.tensor import kv_heads_error, tp_split_error
from trident.parallel.zero.stage3 import GATHER_MODES


@dataclass
class ModelConfig:
    name: str = "gpt-mini"
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    seq_len: int = 256
    vocab_size: int = 8192
    # Feed-forward width; None means 4 * d_model as in GPT-2.
    d_ff: int | None = None  # with mlp=swiglu, the SwiGLU hidden size
    bias: bool = True  # biases in every linear layer (and LayerNorm)
    init_std: float = 0.02
    norm: str = "layernorm"  # layernorm | rmsnorm
    norm_eps: float = 1e-5
    mlp: str = "gelu"  # gelu (GPT-2's tanh approximation) | swiglu (silu(gate) * up)
    position: str = "learned"  # learned (a position table) | rope (rotary, on q and k)
    rope_theta: float = 10000.0
    # RoPE frequency scaling for long contexts: None, or llama3 (Llama 3.1 / 3.2: frequencies with wavelengths past
    # rope_original_seq_len / rope_low_freq_factor divided by rope_factor, those below rope_original_seq_len /
    # rope_high_freq_factor kept, a smooth blend between).
    rope_scaling: str | None = None
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_seq_len: int = 8192
    # Key/value heads: n_heads (default, None) is multi-head attention; fewer is grouped-query, 1 multi-query.
    n_kv_heads: int | None = None
    tie_embeddings: bool = True  # the LM head is the token embedding (GPT-2), or a matrix of its own (Llama 3 8B)
    # The embedding table is padded to a multiple of this times tp (Megatron's
    # make-vocab-size-divisible-by); padded logits are masked, so the loss never changes.
    vocab_multiple: int = 64
    # Dropout on attention probabilities, residual branches and embeddings (0 = none, as in modern pretraining).
    dropout: float = 0.0

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads


# The model keys that fix parameter shapes: a checkpoint loads only into a model with the same ones.
SHAPE_KEYS = (
    "n_layers",
    "d_model",
    "n_heads",
    "n_kv_heads",
    "seq_len",
    "vocab_size",
    "d_ff",
    "bias",
    "norm",
    "mlp",
    "position",
    "tie_embeddings",
)

# Keys a saved config may hold under an older name.
_RENAMED_MODEL_KEYS = {"ln_eps": "norm_eps"}


def model_config_from_dict(saved: dict) -> ModelConfig:
    """The ModelConfig a checkpoint's saved ``model`` section describes: keys saved before a key existed take the
    default (GPT-2's block), renamed keys their new name. Raises TypeError on a key ModelConfig does not have."""
    return ModelConfig(**{_RENAMED_MODEL_KEYS.get(key, key): value for key, value in saved.items()})


@dataclass
class OffloadConfig:
    optimizer: str = "none"  # none | cpu
    ratio: float = 1.0  # fraction of optimizer state stepped on the CPU


@dataclass
class ParallelConfig:
    dp: int | None = None  # None: world_size / (tp * pp)
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    schedule: str | None = None  # gpipe | 1f1b | interleaved | zb-h1; None: 1f1b, or interleaved when vpp > 1
    zero: int = 0
    # ZeRO-3: re-gather a block's parameters for each micro-batch's forward and backward ("micro_batch": least
    # memory), or keep every bucket gathered from its first use to the step's last backward ("step": one gather).
    zero3_gather: str = "micro_batch"
    zero3_prefetch: int = 1  # ZeRO-3: blocks gathered ahead of the running one (0: none)
    sequence_parallel: bool = False
    backend: str = "auto"  # auto | nccl | gloo
    bucket_mb: float = 25.0  # gradient all-reduce bucket size
    timeout_s: int = 600  # collective timeout: a stuck rank fails instead of hanging forever
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    # Launch the layout planner's best layout for the world size (tools/plan.py; trident/plan/auto.py): it chooses
    # dp, tp, pp, vpp, schedule, ZeRO, offload, sequence parallelism, micro-batch size and recomputation, keeping
    # those given on the command line, and says which in one line before training.
    auto: bool = False


@dataclass
class TrainConfig:
    micro_batch_size: int = 4
    global_batch_size: int = 32
    steps: int = 60  # a first try: minutes on a CPU; train.steps=1000 is the full-length run (README)
    seed: int = 1234
    precision: str = "fp32"  # fp32 | bf16 | fp16
    activation_checkpointing: str = "none"  # none | full | selective
    compile: bool = False  # each transformer block compiled with torch.compile (models/compile.py)
    eval_every: int = 20  # 0 disables periodic validation
    # Global batches of validation data per evaluation, at most what the validation set holds; None: up to 4.
    eval_batches: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    # Divergence: stop (exit code 3) after this many steps in a row skipped for non-finite gradients (with fp16,
    # loss-scale overflows; a skip at the scale's floor stops at once), or this many non-finite losses in a row.
    max_skipped_steps: int = 10
    max_nonfinite_losses: int = 3
    # After SIGTERM / SIGINT: how long finishing the step and saving may take before the rank gives up (a
    # collective that cannot finish). Keep it under the launcher's own grace (torchrun --shutdown-timeout: 30).
    stop_grace_s: float = 25.0


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 10
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8


@dataclass
class DataConfig:
    # Text files, directories (searched for data.suffixes) or globs. None: the embedded corpus,
    # the Python standard library's own source (tests excluded).
    text: list[str] | None = None
    suffixes: list[str] = field(default_factory=lambda: [".txt", ".md", ".py", ".rst"])
    # A directory written by tools/prepare_data.py; when set, data.text is not used.
    dataset_dir: str | None = None
    # Where prepared datasets of data.text (or the embedded corpus) are cached.
    cache_dir: str = "~/.cache/trident"
    val_fraction: float = 0.01
    # Lines sampled to train the tokenizer (the whole text is tokenized either way).
    tokenizer_lines: int = 200_000
    # An existing tokenizer to tokenize data.text with instead of training one: a sentencepiece .model, a Hugging
    # Face tokenizer.json, or a directory holding one (an imported model's). None: train a sentencepiece model.
    tokenizer: str | None = None
    # JSON Lines (.jsonl, .jsonl.gz, .jsonl.zst) and Parquet inputs: the field holding each document's text.
    text_field: str = "text"
    # Processes that tokenize data.text when it is prepared (the dataset's bytes are the same for any count).
    workers: int = 1
    # Malformed records (bad JSON, no text field, not UTF-8) tolerated, as a fraction of all records, before the
    # preparation stops.
    max_bad_fraction: float = 0.01
    # Several prepared datasets drawn in proportion, ["DIR:WEIGHT", ...] (weights are normalised); when set, data.text
    # and data.dataset_dir are not used.
    mix: list[str] | None = None
    # Attention stays inside each document of a packed window, and positions restart at each (the eos that ends a
    # document opens the next).
    document_mask: bool = False


@dataclass
class CheckpointConfig:
    dir: str | None = None  # None: <run dir>/checkpoints
    every: int = 0  # save every N steps (0: only at the end); always saved after the last step
    resume: str = "auto"  # auto | none | <path to a checkpoint directory>
    keep_last: int = 0  # 0 keeps every checkpoint
    # Start from the weights (only: a fresh optimizer, step 0) of a trident checkpoint or a local Hugging Face
    # GPT-2 / Llama directory; the model shape is taken from it.
    init_from: str | None = None
    # ``checkpoint.async`` to users: write each checkpoint in the background while training goes on. ``async`` is a
    # Python keyword, so the field is ``async_``; the schema Hydra sees has ``async`` (typed bool) and ``to_config``
    # maps it here, so YAML and the command line say ``checkpoint.async`` like every other key.
    async_: bool = False


# The config keys whose Python field has another name: (section, what users type, the dataclass field).
_RENAMED = (("checkpoint", "async", "async_"),)


@dataclass
class LoggingConfig:
    interval: int = 10  # console line every N steps
    # Peak dense TFLOP/s of one device for MFU; None: measured on a CPU, the datasheet's for a known GPU.
    peak_tflops: float | None = None
    # With pp > 1: append each step's action start/end times per pipeline rank (one pipeline: dp 0, tp 0) to
    # <run dir>/pipeline_timings/rank<r>.jsonl, for tools/plot_schedule.py --measured.
    pipeline_timings: bool = False


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline | online | disabled
    project: str = "trident"
    name: str | None = None
    entity: str | None = None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)


def launch_id() -> str:
    """The default run directory's name, ``YYYY-MM-DD/HH-MM-SS-<launcher pid>``.

    Every local rank of one torchrun job computes the same name (the same launcher), and train.py hands rank 0's
    to the other nodes. Two jobs started in the same second have different launchers, so different names.
    """
    pid, stamp = launcher()
    return datetime.datetime.fromtimestamp(stamp).strftime(f"%Y-%m-%d/%H-%M-%S-{pid}")


def register_configs() -> None:
    """Register the schema (so conf/config.yaml can name it) and the resolvers the YAML uses."""
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(Config)
    for section, key, name in _RENAMED:
        # The key users type, as a typed node beside the field (a bad value is refused like any other key's).
        with open_dict(schema[section]):
            schema[section][key] = BooleanNode(getattr(getattr(Config(), section), name))
    cs.store(name="trident_schema", node=schema)
    if not OmegaConf.has_resolver("launch_id"):
        OmegaConf.register_new_resolver("launch_id", launch_id)


def to_config(node: DictConfig) -> Config:
    """Convert Hydra's tree to the typed ``Config``, refusing keys the schema does not have.

    Plain overrides of unknown keys are already refused by Hydra; ``+key=value`` appends would slip
    through and be silently ignored, so they are caught here.
    """

    def check(sub: DictConfig, schema: object, prefix: str) -> None:
        for key in sub.keys():
            if not hasattr(schema, str(key)):
                raise ConfigError(f"unknown config key {prefix}{key}; the valid keys are in trident/config.py")
            default = getattr(schema, str(key))
            if dataclasses.is_dataclass(default):
                check(sub[key], default, f"{prefix}{key}.")

    for section, key, name in _RENAMED:
        if section in node and key in node[section]:
            if node[section][name] != getattr(getattr(Config(), section), name):
                raise ConfigError(f"unknown config key {section}.{name}; the key is {section}.{key}")
            with open_dict(node[section]):
                node[section][name] = node[section].pop(key)
    check(node, Config(), "")
    return OmegaConf.to_object(node)


def compose_config(conf_dir: Path | str, overrides: Iterable[str] = ()) -> Config:
    """The typed config ``train.py`` builds from ``overrides``, composed from the YAML under ``conf_dir`` (a
    checkout's conf/), for the tests and tools that start runs as a user would."""
    from hydra import compose, initialize_config_dir  # here: only the tools and tests compose outside train.py

    register_configs()
    with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base="1.3"):
        return to_config(compose("config", overrides=list(overrides)))


def mix_entry(entry: str) -> tuple[str, float] | None:
    """A ``data.mix`` entry ``DIR:WEIGHT`` as (DIR, WEIGHT), or None when it is not one (a weight must be > 0)."""
    path, sep, weight = str(entry).rpartition(":")
    try:
        value = float(weight)
    except ValueError:
        return None
    if not sep or not path or not math.isfinite(value) or value <= 0:
        return None
    return path, value


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _one_of(key: str, value: object, allowed: tuple) -> None:
    _need(value in allowed, f"{key}={value!r} is not valid; use one of {', '.join(map(str, allowed))}")


def resolve_dp(par: ParallelConfig, world_size: int, batch_error: str | None = None) -> int:
    """dp may be left out: it is world_size / (tp * pp). ``batch_error``: what is wrong with the batch arithmetic
    of an explicit dp, if anything; then relaunching for that dp is not offered, as it would fix nothing."""
    _need(par.tp >= 1 and par.pp >= 1, f"parallel.tp={par.tp} and parallel.pp={par.pp} must be >= 1")
    mp = par.tp * par.pp
    if par.dp is None:
        _need(
            world_size % mp == 0,
            f"world size {world_size} is not divisible by tp {par.tp} x pp {par.pp} = {mp}; "
            f"launch a multiple of {mp} processes or change parallel.tp / parallel.pp",
        )
        return world_size // mp
    _need(par.dp >= 1, f"parallel.dp={par.dp} must be >= 1")
    fixes = [f"set parallel.dp={world_size // mp}"] if world_size % mp == 0 else []
    if batch_error is None:
        fixes.append(f"launch {par.dp * mp} processes")
    if not fixes:
        fixes.append(f"leave parallel.dp out and launch a multiple of {mp} processes")
    _need(
        par.dp * mp == world_size,
        f"world size {world_size} != dp {par.dp} x tp {par.tp} x pp {par.pp} = {par.dp * mp}; {' or '.join(fixes)}",
    )
    return par.dp


def grad_accum_steps(train: TrainConfig, dp: int) -> int:
    """Gradient-accumulation micro-batches per rank per optimizer step."""
    return train.global_batch_size // (train.micro_batch_size * dp)


def resolve_schedule(par: ParallelConfig) -> str:
    if par.schedule is not None:
        return par.schedule
    return "interleaved" if par.vpp > 1 else "1f1b"


def _batch_error(tr: TrainConfig, par: ParallelConfig, dp: int, schedule: str) -> str | None:
    """What is wrong with the batch arithmetic of one dp size, or None."""
    per_step = tr.micro_batch_size * dp
    if tr.global_batch_size % per_step != 0:
        return (
            f"train.global_batch_size={tr.global_batch_size} is not divisible by micro_batch_size "
            f"{tr.micro_batch_size} x dp {dp} = {per_step}; use a multiple of {per_step}"
        )
    # Exactly what the schedule builder accepts (the interleaved one takes any micro-batch count).
    error = schedule_error(schedule, par.pp, par.vpp, grad_accum_steps(tr, dp)) if par.pp > 1 else None
    return None if error is None else f"{error}; change train.global_batch_size or train.micro_batch_size"


def validate(cfg: Config, world_size: int) -> int:
    """Check every rule that can be checked before any collective; return the resolved dp size.

    The fit to the launch (world size = dp x tp x pp) is checked after every rule of the config itself: a config
    that is wrong in itself must say so first, rather than ask for a relaunch that would only reveal its next
    error. Only the batch arithmetic comes after it, since it depends on the dp the launch resolves.
    """
    m, par, tr, opt, ck = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.checkpoint

    for key in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "vocab_multiple"):
        _need(getattr(m, key) >= 1, f"model.{key}={getattr(m, key)} must be >= 1")
    _need(m.ffn_dim >= 1, f"model.d_ff={m.d_ff} must be >= 1")
    _need(0 <= m.dropout < 1, f"model.dropout={m.dropout} must be in [0, 1)")
    _need(
        m.d_model % m.n_heads == 0,
        f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; choose n_heads that divides d_model",
    )
    _one_of("model.norm", m.norm, ("layernorm", "rmsnorm"))
    _one_of("model.mlp", m.mlp, ("gelu", "swiglu"))
    _one_of("model.position", m.position, ("learned", "rope"))
    _need(m.norm_eps > 0, f"model.norm_eps={m.norm_eps} must be > 0")
    _need(m.rope_theta > 0, f"model.rope_theta={m.rope_theta} must be > 0")
    _need(
        m.rope_scaling in (None, "llama3"),
        f"model.rope_scaling={m.rope_scaling!r} is not valid; use null (plain RoPE) or llama3",
    )
    if m.rope_scaling is not None:
        _need(m.position == "rope", f"model.rope_scaling={m.rope_scaling} needs model.position=rope")
        _need(m.rope_factor >= 1, f"model.rope_factor={m.rope_factor} must be >= 1")
        _need(m.rope_original_seq_len >= 1, f"model.rope_original_seq_len={m.rope_original_seq_len} must be >= 1")
        _need(
            0 < m.rope_low_freq_factor < m.rope_high_freq_factor,
            f"model.rope_low_freq_factor={m.rope_low_freq_factor} must be > 0 and below "
            f"model.rope_high_freq_factor={m.rope_high_freq_factor}",
        )
    _need(
        m.position != "rope" or m.head_dim % 2 == 0,
        f"model.position=rope needs an even head size; d_model / n_heads = {m.head_dim}",
    )
    _need(
        m.n_kv_heads is None or (m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads == 0),
        f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} "
        f"(use one of {', '.join(str(k) for k in range(1, m.n_heads + 1) if m.n_heads % k == 0)})",
    )

    _need(par.tp >= 1 and par.pp >= 1, f"parallel.tp={par.tp} and parallel.pp={par.pp} must be >= 1")
    _need(par.dp is None or par.dp >= 1, f"parallel.dp={par.dp} must be >= 1")
    _one_of("parallel.backend", par.backend, ("auto", "nccl", "gloo"))
    _one_of("parallel.zero", par.zero, (0, 1, 2, 3))
    _need(par.vpp >= 1, f"parallel.vpp={par.vpp} must be >= 1")
    _need(par.vpp == 1 or par.pp > 1, f"parallel.vpp={par.vpp} needs pipeline parallelism (parallel.pp > 1)")
    schedule = resolve_schedule(par)
    _one_of("parallel.schedule", schedule, SCHEDULES)
    _need(
        schedule != "interleaved" or par.vpp > 1,
        "parallel.schedule=interleaved needs parallel.vpp > 1 model chunks per pipeline rank",
    )
    _need(
        par.vpp == 1 or schedule == "interleaved",
        f"parallel.vpp={par.vpp} needs parallel.schedule=interleaved (got {schedule})",
    )
    _need(par.bucket_mb > 0, f"parallel.bucket_mb={par.bucket_mb} must be > 0")
    _need(par.timeout_s > 0, f"parallel.timeout_s={par.timeout_s} must be > 0")
    _one_of("parallel.offload.optimizer", par.offload.optimizer, ("none", "cpu"))
    _need(0.0 <= par.offload.ratio <= 1.0, f"parallel.offload.ratio={par.offload.ratio} must be in [0, 1]")
    _need(
        par.offload.optimizer == "none" or par.zero >= 1,
        "parallel.offload.optimizer=cpu needs a ZeRO stage (parallel.zero >= 1)",
    )
    _one_of("parallel.zero3_gather", par.zero3_gather, GATHER_MODES)
    _need(par.zero3_prefetch >= 0, f"parallel.zero3_prefetch={par.zero3_prefetch} must be >= 0 (blocks ahead)")
    _need(
        not par.sequence_parallel or par.tp > 1,
        "parallel.sequence_parallel=true needs parallel.tp > 1",
    )

    # Divisibility rules of the model split.
    chunks = par.pp * par.vpp
    _need(
        m.n_layers % chunks == 0,
        f"model.n_layers={m.n_layers} is not divisible by pp {par.pp} x vpp {par.vpp} = {chunks}; "
        "change the layer count or the pipeline layout",
    )
    # Heads (and with them d_model), the MLP width and, under sequence parallelism, the sequence split over tp.
    split = [("model.n_heads", m.n_heads), ("model.d_ff", m.ffn_dim)]
    if par.sequence_parallel:
        split.append(("model.seq_len", m.seq_len))
    for key, value in split:
        error = tp_split_error(key, value, par.tp)
        _need(error is None, error or "")
    error = kv_heads_error(m.n_heads, m.kv_heads, par.tp)
    _need(error is None, error or "")

    _need(tr.micro_batch_size >= 1, f"train.micro_batch_size={tr.micro_batch_size} must be >= 1")
    _need(tr.global_batch_size >= 1, f"train.global_batch_size={tr.global_batch_size} must be >= 1")
    _need(tr.steps >= 1, f"train.steps={tr.steps} must be >= 1")
    _one_of("train.precision", tr.precision, ("fp32", "bf16", "fp16"))
    _one_of("train.activation_checkpointing", tr.activation_checkpointing, ("none", "full", "selective"))
    _one_of("train.device", tr.device, ("auto", "cpu", "cuda"))
    _need(tr.eval_every >= 0, f"train.eval_every={tr.eval_every} must be >= 0 (0 disables evaluation)")
    _need(tr.eval_batches is None or tr.eval_batches >= 1, f"train.eval_batches={tr.eval_batches} must be >= 1")
    _need(tr.max_skipped_steps >= 1, f"train.max_skipped_steps={tr.max_skipped_steps} must be >= 1")
    _need(tr.max_nonfinite_losses >= 1, f"train.max_nonfinite_losses={tr.max_nonfinite_losses} must be >= 1")
    _need(
        tr.stop_grace_s > 0 and math.isfinite(tr.stop_grace_s),
        f"train.stop_grace_s={tr.stop_grace_s} must be a positive number of seconds",
    )

    _need(opt.lr > 0 and math.isfinite(opt.lr), f"optim.lr={opt.lr} must be a positive number")
    _need(0 <= opt.min_lr <= opt.lr, f"optim.min_lr={opt.min_lr} must be between 0 and optim.lr={opt.lr}")
    _need(opt.warmup_steps >= 0, f"optim.warmup_steps={opt.warmup_steps} must be >= 0")
    _need(opt.weight_decay >= 0, f"optim.weight_decay={opt.weight_decay} must be >= 0")
    _need(opt.grad_clip >= 0, f"optim.grad_clip={opt.grad_clip} must be >= 0 (0 disables clipping)")
    _need(0 <= opt.beta1 < 1 and 0 <= opt.beta2 < 1, "optim.beta1 and optim.beta2 must be in [0, 1)")
    _need(opt.eps > 0, f"optim.eps={opt.eps} must be > 0")

    _need(0 < cfg.data.val_fraction < 1, f"data.val_fraction={cfg.data.val_fraction} must be in (0, 1)")
    _need(cfg.data.tokenizer_lines >= 1000, "data.tokenizer_lines must be >= 1000")
    _need(cfg.data.workers >= 1, f"data.workers={cfg.data.workers} must be >= 1")
    _need(
        0 <= cfg.data.max_bad_fraction < 1,
        f"data.max_bad_fraction={cfg.data.max_bad_fraction} must be in [0, 1)",
    )
    for entry in cfg.data.mix or ():
        _need(mix_entry(entry) is not None, f"data.mix entry {entry!r} is not DIR:WEIGHT with a weight > 0")
    _need(cfg.data.mix is None or len(cfg.data.mix) >= 1, "data.mix=[] names no dataset; give DIR:WEIGHT entries")
    _need(ck.every >= 0, f"checkpoint.every={ck.every} must be >= 0 (0: only at the end)")
    _need(ck.keep_last >= 0, f"checkpoint.keep_last={ck.keep_last} must be >= 0 (0 keeps all)")
    _need(ck.resume != "", "checkpoint.resume must be auto, none or a checkpoint path")
    _one_of("wandb.mode", cfg.wandb.mode, ("offline", "online", "disabled"))
    _need(cfg.logging.interval >= 1, f"logging.interval={cfg.logging.interval} must be >= 1")
    _need(
        cfg.logging.peak_tflops is None or cfg.logging.peak_tflops > 0,
        "logging.peak_tflops must be > 0 (or null to measure or look it up)",
    )

    # The fit to the launch comes before the batch arithmetic: the arithmetic of a dp that cannot run on this
    # world (parallel.dp=3 on 2 processes) would ask for a batch change that fixes nothing.
    dp = resolve_dp(par, world_size, _batch_error(tr, par, par.dp, schedule) if par.dp is not None else None)
    error = _batch_error(tr, par, dp, schedule)
    _need(error is None, error or "")
    return dp
