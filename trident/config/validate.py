"""Validation: every rule a config must satisfy, checked on every rank before the first collective, so a bad config
ends all ranks with the same one-line message naming the key and the fix; and the resolution of a valid config into
the one layout it launches (trident/layout.py).

The rules are one list read in order (each section's keys, then their combinations), so the file stays whole at
~400 lines: a rule split from the others is one a reader checking a combination misses.
"""

from __future__ import annotations

import importlib.util
import math

from trident.config.schema import Config, ModelConfig, ParallelConfig, TrainConfig
from trident.device import device_type
from trident.errors import ConfigError
from trident.layout import Layout, chunks_per_rank
from trident.models.checkpointing import MODULES, POLICIES, SELECTIVE_MODULES
from trident.parallel.context.attention import CP_COMMS
from trident.parallel.context.split import split_error
from trident.parallel.context.ulysses import heads_error
from trident.parallel.fp8 import FP8_RECIPES
from trident.parallel.pipeline.schedules import SCHEDULES, resolve_schedule, schedule_error
from trident.parallel.tensor import kv_heads_error, tp_split_error
from trident.parallel.zero.stage3 import GATHER_MODES


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
    mp = par.tp * par.pp * par.cp
    cp, cp_key = (f" x cp {par.cp}", " / parallel.cp") if par.cp > 1 else ("", "")
    if par.dp is None:
        _need(
            world_size % mp == 0,
            f"world size {world_size} is not divisible by tp {par.tp} x pp {par.pp}{cp} = {mp}; "
            f"launch a multiple of {mp} processes or change parallel.tp / parallel.pp{cp_key}",
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
        f"world size {world_size} != dp {par.dp} x tp {par.tp} x pp {par.pp}{cp} = {par.dp * mp}; {' or '.join(fixes)}",
    )
    return par.dp


def grad_accum_steps(train: TrainConfig, dp: int) -> int:
    """Gradient-accumulation micro-batches per rank per optimizer step."""
    return train.global_batch_size // (train.micro_batch_size * dp)


def _batch_error(tr: TrainConfig, par: ParallelConfig, dp: int, schedule: str, vpp: int) -> str | None:
    """What is wrong with the batch arithmetic of one dp size, or None."""
    per_step = tr.micro_batch_size * dp
    if tr.global_batch_size % per_step != 0:
        return (
            f"train.global_batch_size={tr.global_batch_size} is not divisible by micro_batch_size "
            f"{tr.micro_batch_size} x dp {dp} = {per_step}; use a multiple of {per_step}"
        )
    # Exactly what the schedule builder accepts (the interleaved one takes any micro-batch count).
    error = schedule_error(schedule, par.pp, vpp, grad_accum_steps(tr, dp)) if par.pp > 1 else None
    return None if error is None else f"{error}; change train.global_batch_size or train.micro_batch_size"


def _check_moe(m: ModelConfig) -> None:
    """The ``model.moe`` keys, when the model has experts."""
    moe = m.moe
    _need(moe.experts >= 0, f"model.moe.experts={moe.experts} must be >= 0 (0: a dense model)")
    if not moe.enabled:
        return
    _need(
        1 <= moe.top_k <= moe.experts,
        f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.experts={moe.experts}; "
        f"use model.moe.top_k={min(max(moe.top_k, 1), moe.experts)}",
    )
    _one_of("model.moe.router", moe.router, ("softmax", "sigmoid"))
    _need(
        not (moe.router == "softmax" and moe.norm_topk and moe.top_k == 1),
        "model.moe.norm_topk=true with model.moe.top_k=1 makes every routing weight 1, so the router never learns "
        "from the token loss; set model.moe.norm_topk=false for top_k=1",
    )
    _need(
        not (moe.router == "sigmoid" and moe.top_k == 1),
        "model.moe.router=sigmoid renormalises the chosen scores to sum 1, so with model.moe.top_k=1 every routing "
        "weight is 1 and the router never learns from the token loss; use model.moe.top_k=2 or "
        "model.moe.router=softmax",
    )
    _need(m.expert_dim >= 1, f"model.moe.d_expert={moe.d_expert} must be >= 1")
    _need(moe.shared_experts >= 0, f"model.moe.shared_experts={moe.shared_experts} must be >= 0")
    _need(moe.every >= 1, f"model.moe.every={moe.every} must be >= 1")
    _need(moe.first_dense >= 0, f"model.moe.first_dense={moe.first_dense} must be >= 0")
    for key in ("aux_loss_coef", "z_loss_coef", "bias_update_rate"):
        _need(getattr(moe, key) >= 0, f"model.moe.{key}={getattr(moe, key)} must be >= 0")
    _need(
        moe.capacity_factor is None or moe.capacity_factor > 0,
        f"model.moe.capacity_factor={moe.capacity_factor} must be > 0, or null for dropless routing",
    )


def _shared_experts_error(m: ModelConfig, tp: int) -> str | None:
    """The shared experts are one MLP of ``shared_experts * d_expert`` units split over tp like the dense MLP: a
    one-line message naming both keys if tp does not divide that width, with a d_expert and a tp that do."""
    moe = m.moe
    width = moe.shared_experts * m.expert_dim
    if not moe.enabled or width == 0 or width % tp == 0:
        return None
    step = tp // math.gcd(moe.shared_experts, tp)  # d_expert a multiple of this makes the width one of tp
    fit = -(-m.expert_dim // step) * step
    smaller = max(d for d in range(1, tp) if width % d == 0)
    return (
        f"the shared experts' width model.moe.shared_experts={moe.shared_experts} x model.moe.d_expert="
        f"{m.expert_dim} = {width} is not divisible by parallel.tp={tp}; use model.moe.d_expert={fit} or "
        f"parallel.tp={smaller}"
    )


def _check_ep(ep: int, m: ModelConfig) -> None:
    """``parallel.ep`` against the model (that it divides dp is checked once dp is known)."""
    _need(ep >= 1, f"parallel.ep={ep} must be >= 1")
    if ep == 1:
        return
    experts = m.moe.experts
    _need(experts > 0, f"parallel.ep={ep} needs a model with experts (model.moe.experts > 0); set parallel.ep=1")
    fits = max(k for k in range(1, ep + 1) if experts % k == 0)
    _need(experts % ep == 0, f"parallel.ep={ep} does not divide model.moe.experts={experts}; use parallel.ep={fits}")


def validate(cfg: Config, world_size: int) -> Layout:
    """Check every rule that can be checked before any collective; return the resolved layout (trident/layout.py).

    The fit to the launch (world size = dp x tp x pp) is checked after every rule of the config itself: a config
    that is wrong in itself must say so first, rather than ask for a relaunch that would only reveal its next
    error. Only the batch arithmetic comes after it, since it depends on the dp the launch resolves.
    """
    m, par, tr, opt, ck = cfg.model, cfg.parallel, cfg.train, cfg.optim, cfg.checkpoint

    for key in ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "vocab_multiple"):
        _need(getattr(m, key) >= 1, f"model.{key}={getattr(m, key)} must be >= 1")
    _need(m.ffn_dim >= 1, f"model.d_ff={m.d_ff} must be >= 1")
    _need(
        m.max_seq_len is None or m.max_seq_len >= m.seq_len,
        f"model.max_seq_len={m.max_seq_len} is below model.seq_len={m.seq_len}; the context the model is made for "
        "holds the windows it trains on: raise it, or leave it out",
    )
    _need(0 <= m.dropout < 1, f"model.dropout={m.dropout} must be in [0, 1)")
    _need(
        m.loss_chunk_tokens >= 0,
        f"model.loss_chunk_tokens={m.loss_chunk_tokens} must be >= 0 (tokens per chunk of the loss; 0: unchunked)",
    )
    _need(m.head_dim is None or m.head_dim >= 1, f"model.head_dim={m.head_dim} must be >= 1, or left out")
    _need(
        m.head_dim is not None or m.d_model % m.n_heads == 0,
        f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; choose n_heads that divides d_model "
        "(or set model.head_dim)",
    )
    _one_of("model.qk_norm_scope", m.qk_norm_scope, ("head", "projection"))
    _one_of("model.norm", m.norm, ("layernorm", "rmsnorm"))
    _one_of("model.mlp", m.mlp, ("gelu", "swiglu"))
    _one_of("model.position", m.position, ("learned", "rope"))
    _need(
        m.position != "learned" or m.max_seq_len in (None, m.seq_len),
        f"model.max_seq_len={m.max_seq_len} with model.position=learned: the position table's model.seq_len="
        f"{m.seq_len} rows are all the positions the model has; leave model.max_seq_len out",
    )
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
        m.position != "rope" or m.head_size % 2 == 0,
        f"model.position=rope needs an even head size; "
        f"{'model.head_dim' if m.head_dim is not None else 'd_model / n_heads'} = {m.head_size}",
    )
    _need(
        m.n_kv_heads is None or (m.n_kv_heads >= 1 and m.n_heads % m.n_kv_heads == 0),
        f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} "
        f"(use one of {', '.join(str(k) for k in range(1, m.n_heads + 1) if m.n_heads % k == 0)})",
    )
    _check_moe(m)

    _need(par.tp >= 1 and par.pp >= 1, f"parallel.tp={par.tp} and parallel.pp={par.pp} must be >= 1")
    _need(par.dp is None or par.dp >= 1, f"parallel.dp={par.dp} must be >= 1")
    _one_of("parallel.backend", par.backend, ("auto", "nccl", "gloo"))
    _one_of("parallel.zero", par.zero, (0, 1, 2, 3))
    _need(par.vpp >= 1, f"parallel.vpp={par.vpp} must be >= 1")
    _need(par.vpp == 1 or par.pp > 1, f"parallel.vpp={par.vpp} needs pipeline parallelism (parallel.pp > 1)")
    schedule = resolve_schedule(par.schedule, par.vpp)
    _one_of("parallel.schedule", schedule, SCHEDULES)
    vpp = chunks_per_rank(schedule, par.pp, par.vpp)
    _need(
        schedule != "interleaved" or vpp > 1,
        "parallel.schedule=interleaved needs parallel.vpp > 1 model chunks per pipeline rank",
    )
    _need(
        schedule != "zb-v" or vpp == 2 or par.pp == 1,
        f"parallel.vpp={vpp} with parallel.schedule=zb-v, which runs two model chunks per pipeline rank in a V; "
        "set parallel.vpp=2 (or leave it out)",
    )
    _need(
        vpp == 1 or schedule in ("interleaved", "zb-v"),
        f"parallel.vpp={vpp} needs parallel.schedule=interleaved (or zb-v at vpp=2; got {schedule})",
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
    _context_rules(m, par)

    _check_ep(par.ep, m)

    # Divisibility rules of the model split.
    chunks = par.pp * vpp
    _need(
        m.n_layers % chunks == 0,
        f"model.n_layers={m.n_layers} is not divisible by pp {par.pp} x vpp {vpp} = {chunks}; "
        "change the layer count or the pipeline layout",
    )
    # Heads (and with them d_model), the MLP width and, under sequence parallelism, the sequence split over tp.
    split = [("model.n_heads", m.n_heads), ("model.d_ff", m.ffn_dim)]
    if par.sequence_parallel and par.cp == 1:
        split.append(("model.seq_len", m.seq_len))
    for key, value in split:
        error = tp_split_error(key, value, par.tp)
        _need(error is None, error or "")
    error = kv_heads_error(m.n_heads, m.kv_heads, par.tp)
    _need(error is None, error or "")
    error = _shared_experts_error(m, par.tp)
    _need(error is None, error or "")
    _need(
        not (m.qk_norm and m.qk_norm_scope == "projection") or m.kv_heads % par.tp == 0,
        f"model.qk_norm_scope=projection normalises all {m.kv_heads} kv heads together, which parallel.tp={par.tp} "
        f"does not divide; use a parallel.tp that divides model.n_kv_heads",
    )

    _need(tr.micro_batch_size >= 1, f"train.micro_batch_size={tr.micro_batch_size} must be >= 1")
    _need(tr.global_batch_size >= 1, f"train.global_batch_size={tr.global_batch_size} must be >= 1")
    _need(tr.steps >= 1, f"train.steps={tr.steps} must be >= 1")
    _need(-(2**63) <= tr.seed < 2**63, f"train.seed={tr.seed} must fit 64 bits; use an integer in [0, 2^63)")
    _one_of("train.precision", tr.precision, ("fp32", "bf16", "fp16"))
    _one_of("train.fp8", tr.fp8, FP8_RECIPES)
    _need(
        tr.fp8 == "off" or tr.precision == "bf16",
        f"train.fp8={tr.fp8} computes in fp8 around bf16 activations; set train.precision=bf16 (or train.fp8=off)",
    )
    _need(
        tr.fp8 == "off" or importlib.util.find_spec("torchao") is not None,
        f"train.fp8={tr.fp8} needs torchao: pip install 'trident-pretrain[fp8]' (or train.fp8=off)",
    )
    _one_of("train.activation_checkpointing", tr.activation_checkpointing, POLICIES)
    modules = list(tr.recompute_modules)
    _need(
        bool(modules) and set(modules) <= set(MODULES) and len(set(modules)) == len(modules),
        f"train.recompute_modules={modules} must name some of {', '.join(MODULES)}, each once",
    )
    _need(
        tr.activation_checkpointing == "selective" or tuple(modules) == SELECTIVE_MODULES,
        f"train.recompute_modules={modules} is what train.activation_checkpointing=selective recomputes, "
        f"not {tr.activation_checkpointing}; set train.activation_checkpointing=selective",
    )
    _need(tr.recompute_every >= 1, f"train.recompute_every={tr.recompute_every} must be >= 1 (1: every block)")
    _need(
        tr.activation_checkpointing != "none" or tr.recompute_every == 1,
        f"train.recompute_every={tr.recompute_every} recomputes blocks under a policy; set "
        "train.activation_checkpointing to selective, attention or full",
    )
    _one_of("train.device", tr.device, ("auto", "cpu", "cuda"))
    _need(tr.eval_every >= 0, f"train.eval_every={tr.eval_every} must be >= 0 (0 disables evaluation)")
    _need(tr.eval_batches is None or tr.eval_batches >= 1, f"train.eval_batches={tr.eval_batches} must be >= 1")
    _need(tr.max_skipped_steps >= 1, f"train.max_skipped_steps={tr.max_skipped_steps} must be >= 1")
    _need(tr.max_nonfinite_losses >= 1, f"train.max_nonfinite_losses={tr.max_nonfinite_losses} must be >= 1")
    _need(tr.replay_every >= 0, f"train.replay_every={tr.replay_every} must be >= 0 (0: no replay)")
    _need(
        str(tr.compile).lower() in ("auto", "true", "false"),
        f"train.compile={tr.compile} must be auto (compiled on CUDA, eager on a CPU), true or false",
    )
    _need(tr.replay_action in ("stop", "warn"), f"train.replay_action={tr.replay_action} must be stop or warn")
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
    _need(opt.name in ("adamw", "muon"), f"optim.name={opt.name} must be adamw or muon")
    if opt.name == "muon":
        _need(opt.muon_lr > 0 and math.isfinite(opt.muon_lr), f"optim.muon_lr={opt.muon_lr} must be a positive number")
        _need(opt.muon_weight_decay >= 0, f"optim.muon_weight_decay={opt.muon_weight_decay} must be >= 0")
        _need(0 <= opt.muon_momentum < 1, f"optim.muon_momentum={opt.muon_momentum} must be in [0, 1)")
        _need(1 <= opt.muon_ns_steps < 100, f"optim.muon_ns_steps={opt.muon_ns_steps} must be in [1, 100)")
        _need(
            len(opt.muon_ns_coefficients) == 3,
            f"optim.muon_ns_coefficients={list(opt.muon_ns_coefficients)} must be three numbers [a, b, c]",
        )
        _need(opt.muon_ns_dtype in ("bf16", "fp32"), f"optim.muon_ns_dtype={opt.muon_ns_dtype} must be bf16 or fp32")
        adjust, kinds = opt.muon_adjust_lr, ("original", "match_rms_adamw")
        _need(adjust in kinds, f"optim.muon_adjust_lr={adjust} must be original or match_rms_adamw")

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
    dp = resolve_dp(par, world_size, _batch_error(tr, par, par.dp, schedule, vpp) if par.dp is not None else None)
    ranks = dp * par.cp  # the ranks holding the same piece of the model, ep's to draw from
    fits = max(k for k in range(1, par.ep + 1) if ranks % k == 0 and m.moe.experts % k == 0)
    held = f"{dp} data-parallel ranks" if par.cp == 1 else f"{ranks} ranks of dp {dp} x cp {par.cp}"
    _need(ranks % par.ep == 0, f"parallel.ep={par.ep} does not divide the {held}; use parallel.ep={fits}")
    error = _batch_error(tr, par, dp, schedule, vpp)
    _need(error is None, error or "")
    return _resolve(cfg, dp, schedule, vpp)


def _context_rules(m: ModelConfig, par: ParallelConfig) -> None:
    """Context parallelism (parallel/context/): the split of the sequence and the exchange."""
    _need(par.cp >= 1, f"parallel.cp={par.cp} must be >= 1")
    _one_of("parallel.cp_comm", par.cp_comm, CP_COMMS)
    if par.cp == 1:
        return
    error = split_error(m.seq_len, par.cp)
    _need(error is None, error or "")
    if par.sequence_parallel:  # each cp rank's tokens are split again over tp
        step = 2 * par.cp * par.tp
        fit = max(step, m.seq_len // step * step)
        _need(
            m.seq_len % step == 0,
            f"model.seq_len={m.seq_len} does not split into 2 x parallel.cp={par.cp} chunks, each rank's split again "
            f"over parallel.tp={par.tp} (sequence parallelism); set model.seq_len={fit}",
        )
    if par.cp_comm == "ulysses":
        error = heads_error(m.n_heads, m.kv_heads, par.cp, par.tp)
        _need(error is None, error or "")


def _resolve(cfg: Config, dp: int, schedule: str, vpp: int) -> Layout:
    """The layout a valid config launches with dp ranks and vpp chunks a pipeline rank: settings that do not apply
    take Layout's defaults, so one launch has one layout (no schedule at pp = 1, no gather mode below ZeRO 3, no
    ratio without offload)."""
    par, tr, default = cfg.parallel, cfg.train, Layout()
    zero3 = par.zero == 3
    return Layout(
        dp=dp,
        tp=par.tp,
        pp=par.pp,
        vpp=vpp,
        cp=par.cp,
        cp_comm=par.cp_comm if par.cp > 1 else default.cp_comm,
        schedule=schedule if par.pp > 1 else None,
        zero=par.zero,
        zero3_gather=par.zero3_gather if zero3 else default.zero3_gather,
        zero3_prefetch=par.zero3_prefetch if zero3 else default.zero3_prefetch,
        offload=par.offload.optimizer,
        offload_ratio=par.offload.ratio if par.offload.optimizer != "none" else default.offload_ratio,
        sequence_parallel=par.sequence_parallel,
        ep=par.ep,
        activation_checkpointing=tr.activation_checkpointing,
        recompute_modules=tuple(tr.recompute_modules)
        if tr.activation_checkpointing == "selective"
        else (default.recompute_modules),
        recompute_every=tr.recompute_every,
        micro_batch_size=tr.micro_batch_size,
        micro_batches=grad_accum_steps(tr, dp),
        bucket_mb=par.bucket_mb,
        precision=tr.precision,
        device=device_type(tr.device),
        document_mask=cfg.data.document_mask,
        async_checkpoint=cfg.checkpoint.async_,
        optimizer=cfg.optim.name,
        fp8=tr.fp8,
        compile=str(tr.compile).lower(),
    )
