"""The config schema: one dataclass per concern (model, parallel, train, optim, data, checkpoint, logging, wandb).

The YAML under ``conf/`` fills these in (trident/config/compose.py registers them with Hydra); ``validate``
(trident/config/validate.py) checks them and resolves the layout. Defaults here are what a key left out means.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(unsafe_hash=True)  # hashable, as the model's keys are (the memory estimator caches by them)
class MoEConfig:
    """Mixture-of-experts MLPs (models/moe.py) on the sparse layers; ``experts=0``: a dense model."""

    experts: int = 0  # routed experts per sparse layer
    top_k: int = 2  # experts each token is sent to
    shared_experts: int = 0  # experts every token goes through (DeepSeek), one MLP of shared_experts * d_expert
    d_expert: int | None = None  # each expert's hidden size; None: model.d_ff
    # Which layers are sparse: layer i (from 0) when i >= first_dense and (i + 1) % every == 0 (Qwen3-MoE's
    # decoder_sparse_step, DeepSeek's first_k_dense_replace); the others keep the dense MLP of model.d_ff.
    every: int = 1
    first_dense: int = 0
    # softmax (Mixtral, Qwen3-MoE, OLMoE: softmax over all experts, then the top k) | sigmoid (DeepSeek-V3: sigmoid
    # scores, the top k weights always normalised to sum to 1).
    router: str = "softmax"
    norm_topk: bool = True  # softmax router: renormalise the top-k weights to sum to 1 (Mixtral yes, Qwen3/OLMoE no)
    aux_loss_coef: float = 0.0  # load-balancing loss (Switch / GShard: E * sum_i f_i * P_i), added to the loss
    z_loss_coef: float = 0.0  # router z-loss (ST-MoE: mean logsumexp(logits)^2), added to the loss
    # Loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing experts only, moved by
    # this much after each optimizer step toward the mean load (+ when under-loaded, - when over); 0: off.
    bias_update_rate: float = 0.0
    # None: dropless (every token reaches its k experts). A number: each expert takes at most
    # ceil(capacity_factor * seq_len * top_k / experts) of a sequence's tokens, in token order; the rest dropped.
    capacity_factor: float | None = None
    grouped_mm: bool = True  # experts as one grouped matrix product (torch._grouped_mm) where possible, else a loop

    @property
    def enabled(self) -> bool:
        return self.experts > 0

    def is_sparse(self, layer: int) -> bool:
        return self.enabled and layer >= self.first_dense and (layer + 1) % self.every == 0


@dataclass
class ModelConfig:
    name: str = "gpt-mini"
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 4
    seq_len: int = 256
    # Left off the command line, the data's tokenizer's when the data has one (trident/data/vocab.py).
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
    # Tokens per chunk of the loss, the LM head's matmul fused with the cross-entropy (parallel/tensor.py): never the
    # whole [tokens, vocab] logits in training. 0: the whole logits at once.
    loss_chunk_tokens: int = 1024
    # Dropout on attention probabilities, residual branches and embeddings (0 = none, as in modern pretraining).
    dropout: float = 0.0
    # The longest context the model is made for (a Hugging Face export's max_position_embeddings); None: seq_len. A run
    # started from a model (checkpoint.init_from) keeps its source's, so training on shorter windows (a smaller
    # seq_len, with RoPE) leaves the model's context as it was. Learned positions have seq_len, no more.
    max_seq_len: int | None = None
    # The token ids a Hugging Face config.json gives generation (bos_token_id, eos_token_id: Llama 3.1 Instruct ends
    # at any of three), kept from the model a run started from so that its export gives them back; None: the
    # tokenizer's.
    bos_id: int | None = None
    eos_ids: list[int] | None = None
    # Each attention head's width; None: d_model / n_heads. Qwen3 decouples it (30B-A3B: hidden 2048, 32 heads of
    # 128): q, k and v project to heads x head_dim, the output projection from it.
    head_dim: int | None = None
    qk_norm: bool = False  # RMSNorm of the queries and keys before RoPE (Qwen3, OLMoE)
    # What qk_norm normalises: each head's vector, one gain of head_dim shared by the heads (Qwen3), or the whole
    # projection, q's heads x head_dim and k's kv heads x head_dim, a gain per unit (OLMoE, OLMo 2).
    qk_norm_scope: str = "head"  # head | projection
    moe: MoEConfig = field(default_factory=MoEConfig)

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # a saved config's section (dataclasses.asdict, config.json)
            self.moe = MoEConfig(**self.moe)

    @property
    def expert_dim(self) -> int:
        return self.moe.d_expert if self.moe.d_expert is not None else self.ffn_dim

    @property
    def ffn_dim(self) -> int:
        return self.d_ff if self.d_ff is not None else 4 * self.d_model

    @property
    def head_size(self) -> int:
        """Each attention head's width: ``head_dim``, or d_model / n_heads when it is not set."""
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads if self.n_kv_heads is not None else self.n_heads

    @property
    def context_len(self) -> int:
        return self.max_seq_len if self.max_seq_len is not None else self.seq_len


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
    "head_dim",
    "qk_norm",
    "qk_norm_scope",
    "moe",
)

# Of model.moe, the keys that fix a shape or the function a model's weights compute (a checkpoint resumes, and a run
# starts from one, only with the same); the others are training knobs (the auxiliary losses, how fast the balancing
# bias moves, a capacity: a fine-tune may choose its own) and the kernel, which a run may set as it likes.
MOE_FIXED = ("experts", "top_k", "shared_experts", "d_expert", "every", "first_dense", "router", "norm_topk")

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
    # Context parallelism: each sequence split head-tail over cp ranks (parallel/context/), which exchange keys and
    # values by cp_comm: ring (K/V blocks passed around), allgather (K/V gathered) or ulysses (heads all-to-all).
    cp: int = 1
    cp_comm: str = "ring"
    # Expert parallelism: each sparse layer's experts divided over ep ranks drawn from the data-parallel ones (ep
    # divides dp and model.moe.experts), tokens exchanged by all-to-all (models/moe.py).
    ep: int = 1
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
    # FP8 matmuls through torchao (parallel/fp8.py): off | tensorwise | rowwise | rowwise_with_gw_hp; needs bf16
    fp8: str = "off"
    # none | selective | attention | full (models/checkpointing.py): what backward recomputes instead of keeping
    activation_checkpointing: str = "none"
    # What selective recomputes, of norm, mlp_act, attn_core, mlp; it keeps the other modules' matmuls' outputs.
    recompute_modules: list[str] = field(default_factory=lambda: ["norm", "mlp_act"])
    recompute_every: int = (
        1  # recompute only every N-th block (global layers 0, N, 2N, ...): memory between none and all
    )
    # Each transformer block compiled with torch.compile (models/compile.py): auto on CUDA and eager on a CPU, or
    # true / false.
    compile: str = "auto"
    eval_every: int = 20  # 0 disables periodic validation
    # Global batches of validation data per evaluation, at most what the validation set holds; None: up to 4.
    eval_batches: int | None = None
    device: str = "auto"  # auto | cpu | cuda
    # Divergence: stop (exit code 3) after this many steps in a row skipped for non-finite gradients (with fp16,
    # loss-scale overflows; a skip at the scale's floor stops at once), or this many non-finite losses in a row.
    max_skipped_steps: int = 10
    max_nonfinite_losses: int = 3
    # Every N-th step's forward and backward run twice and are compared bitwise on every rank (trident/replay.py);
    # 0: never. On a mismatch: stop (exit code 5) or warn and go on.
    replay_every: int = 0
    replay_action: str = "stop"  # stop | warn
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
    # adamw | muon: Muon (parallel/zero/muon.py) steps the hidden matrices (each logical matrix: q, k, v and each
    # expert's apart; models/matrices.py), AdamW at the keys above the embeddings, the head, norms, biases, router.
    name: str = "adamw"
    muon_lr: float = 0.02  # Muon's peak learning rate; the schedule (warm-up, cosine to min_lr / lr of it) is AdamW's
    muon_weight_decay: float = 0.1  # decoupled: W <- W (1 - lr wd), at Muon's unadjusted lr
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.7750, 2.0315])
    muon_adjust_lr: str = "original"  # original: sqrt(max(1, out / in)) | match_rms_adamw: 0.2 sqrt(max(out, in))
    # bf16: torch.optim.Muon's Newton-Schulz | fp32: the same iteration in fp32 (slower; layouts agree to fp32's
    # rounding, where bf16's moves with the gradients' last bits)
    muon_ns_dtype: str = "bf16"


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
    # Resume the weights and start the optimizer state afresh: how a run resumes a checkpoint saved under the other
    # optim.name (refused otherwise).
    fresh_optimizer: bool = False
    keep_last: int = 0  # 0 keeps every checkpoint
    # Start from the weights (only: a fresh optimizer, step 0) of a trident checkpoint or a local Hugging Face
    # GPT-2 / Llama directory; the model shape is taken from it.
    init_from: str | None = None
    # ``checkpoint.async`` to users: write each checkpoint in the background while training goes on. ``async`` is a
    # Python keyword, so the field is ``async_``; the schema Hydra sees has ``async`` (typed bool) and ``to_config``
    # maps it here, so YAML and the command line say ``checkpoint.async`` like every other key.
    async_: bool = False


# The config keys whose Python field has another name: (section, what users type, the dataclass field).
RENAMED = (("checkpoint", "async", "async_"),)


@dataclass
class LoggingConfig:
    interval: int = 10  # console line every N steps
    # Peak dense TFLOP/s of one device for MFU; None: measured on a CPU, the datasheet's for a known GPU.
    peak_tflops: float | None = None
    # With pp > 1: append each step's action start/end times per pipeline rank (one pipeline: dp 0, tp 0) to
    # <run dir>/pipeline_timings/rank<r>.jsonl, for tools/plot_schedule.py --measured.
    pipeline_timings: bool = False
    # Profile step N (1-based; 0: none) with torch.profiler and write each rank's events of it to
    # <run dir>/step_profile/rank<r>.json (trident/step_profile.py), which tools/plan.py --measure splits.
    profile_step: int = 0


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
