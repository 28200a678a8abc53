"""``tools/bench.py tp``: tokens/s of trident's tensor parallelism against torch's own (DTensor) and one process,
and the collectives it sends.

    python tools/bench.py tp [--tp 2] [--model gpt-mini] [--micro-batch 4] [--seq-len 128] [--steps 3] [--rounds 4]
        [--ref-threads 1 2]

--seq-len overrides the preset's model.seq_len (gpt-mini's 256 is twice the default here; 0 keeps the preset's).

One invocation on --tp ranks (trident_dev.ranks' pool) trains the variants below of one model config, from the same
initial weights on the same batches, alternating timed blocks in rounds (trident_dev/bench/harness.py), and tables the
median tokens/s of each:

  tp=1        one rank trains the whole model alone (trident at tp=1, built by trident/build.py, through the
              Trainer's step) while the others wait at a barrier: the one-process speed, with the torch threads each
              rank of this launch has (cores / N), or once per count in --ref-threads (e.g. 1 2: 2 is what a lone
              `python train.py` takes on 2 cores; on a busy machine OpenMP threads spinning for a preempted sibling
              can make that several times slower, unless OMP_WAIT_POLICY=passive). "vs tp=1" divides by the fastest
              tp=1 row.
  trident     trident at tp=N as train.py builds it (``build_parts``: model chunks, reducer, the ZeRO optimizer at
              stage 0, GradStep with global-norm clipping and the gradient sums placements ask for) through
              ``Trainer.train_step``; model.loss_sum is the vocab-parallel cross-entropy.
  trident+SP  the same with parallel.sequence_parallel=true.
  DTensor     the same GPT written with nn.Linear / nn.Embedding / nn.LayerNorm (trident_dev/bench/dtensor_model.py:
              same parameter names and shapes, loaded from the tp=1 model's state dict), parallelized with
              torch.distributed.tensor.parallel on a DeviceMesh over the same ranks: qkv and fc ColwiseParallel, the
              projections RowwiseParallel, the token embedding RowwiseParallel (vocab-sharded rows, as
              VocabParallelEmbedding) and the LM head ColwiseParallel on that same, tied weight with Shard(-1) logits,
              so the loss is vocab-parallel cross-entropy under loss_parallel(): the full logits are never gathered,
              as in trident. LayerNorms and wpe are replicated DTensors (distribute_module), so clip_grad_norm_ and
              AdamW see only DTensors.
  DTensor+SP  the same with SequenceParallel LayerNorms, PrepareModuleInput (Shard(1) -> Replicate) on attention
              and MLP, RowwiseParallel(output_layouts=Shard(1)) projections and embedding, and wpe looked up by this
              rank's sequence shard of positions (SequenceParallel on dim 0).

Every step is one micro-batch of --micro-batch sequences (the global batch), fp32: forward, summed token loss
divided by the step's tokens, backward, global-norm clipping at optim.grad_clip, AdamW (trident's hyperparameters,
decay on matrices only) at lr_at(step). The DTensor step is the plain torch loop a user would write:
clip_grad_norm_, optimizer.step, zero_grad. The first step of each variant is untimed: its loss is shown (all must
agree; so must the last timed step's, after the same updates) and its collectives are counted on every rank
(trident_dev/bench/collectives.py), trident's checked against the analytic count.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import loss_parallel

from trident.build import RunParts, build_parts, layout_of, model_chunks
from trident.config import Config, ModelConfig, compose_config, validate
from trident.errors import ConfigError
from trident.loop import Trainer
from trident.optim import lr_at
from trident.parallel.groups import build_process_groups
from trident.parallel.placement import placement_of
from trident.parallel.topology import Topology
from trident_dev.bench.collectives import DTensorComms, comm_table, counting_collectives
from trident_dev.bench.dtensor_model import TorchGPT, parallelize_torch_gpt
from trident_dev.bench.harness import (
    Table,
    adamw_args,
    alternate,
    barrier,
    device_mesh,
    number,
    one_rank_groups,
    pool_backend,
    random_windows,
    rank_device,
    spread,
)
from trident_dev.ranks import run_distributed

HEADER = ["variant", "tokens/s", "spread", "vs tp=1", "vs DTensor", "step-0 loss", "last loss", "rounds (tokens/s)"]


# ---------------------------------------------------------------------------------------------------------------
# What trident's collectives should be, and what DTensor's are (trident_dev/bench/collectives.py counts them).


def analytic_comms(cfg: ModelConfig, b: int, s: int, tp: int, sequence_parallel: bool, sp_numel: int) -> dict:
    """Trident's collectives per step and rank: {(op, in backward, group size, elements): (calls, what)}."""
    h, layers, act = cfg.d_model, cfg.n_layers, b * s * cfg.d_model
    rows = {}
    if sequence_parallel:
        rows[("all_gather", False, tp, act)] = (2 * layers + 1, "2/layer (qkv, fc inputs) + LM head input")
        rows[("reduce_scatter", False, tp, act)] = (2 * layers + 1, "2/layer (attn, mlp proj outputs) + embedding")
        rows[("all_gather", True, tp, act)] = (2 * layers + 1, "adjoints of the forward reduce-scatters")
        rows[("reduce_scatter", True, tp, act)] = (2 * layers + 1, "adjoints of the forward all-gathers")
    else:
        rows[("all_reduce", False, tp, act)] = (2 * layers + 1, "2/layer (attn, mlp proj outputs) + embedding")
        rows[("all_reduce", True, tp, act)] = (2 * layers + 1, "2/layer (d of qkv, fc inputs) + d of LM head input")
    rows[("all_reduce", False, tp, b * s)] = (1, "vocab-parallel CE: max over the vocab")
    rows[("all_reduce", False, tp, 2 * b * s)] = (1, "vocab-parallel CE: sum-exp and target logit")
    if sequence_parallel:
        rows[("all_reduce", False, tp, sp_numel)] = (1, f"GradStep: tp sums (LayerNorms, biases, wpe; {h=})")
    rows[("all_reduce", False, tp, 1)] = (1, "GradStep: global grad norm (world group)")
    return rows


def dtensor_notes(cfg: ModelConfig, b: int, s: int, tp: int, n_params: int) -> dict:
    """What DTensor's collectives are, as far as their sizes tell (no analytic count)."""
    act, h = b * s * cfg.d_model, cfg.d_model
    notes = {
        ("all_reduce", False, tp, b * s): "loss_parallel CE: max, sum-exp and target logit, one each",
        ("all_reduce", False, tp, n_params): "clip_grad_norm_: the per-parameter norms (_NormPartial)",
        ("all_reduce", False, tp, h): "SP: Partial grads of LayerNorms re-reduced at each use (clip + 3 in AdamW)",
        ("all_reduce", False, tp, s * h): "SP: the Partial grad of wpe, likewise",
    }
    for op in ("all_reduce", "all_gather", "reduce_scatter"):
        for backward in (False, True):
            notes[(op, backward, tp, act)] = "activations, as trident's"
    return {key: (None, what) for key, what in notes.items()}


# ---------------------------------------------------------------------------------------------------------------
# The run.


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=2, help="ranks, all in one tensor-parallel group")
    p.add_argument("--model", default="gpt-mini", help="a preset under conf/model")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (one micro-batch per step)")
    p.add_argument("--seq-len", type=int, default=128, help="model.seq_len and the training window (0: the preset's)")
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=4, help="alternating timed blocks per variant; the median is reported")
    p.add_argument("--ref-threads", type=int, nargs="+", help="torch threads of the tp=1 runs (default: a rank's)")


@dataclasses.dataclass
class Job:
    cfg: Config  # at tp=N, without sequence parallelism
    steps: int
    rounds: int
    ref_threads: list[int] | None


def run(args: argparse.Namespace) -> list[Table]:
    tp, b = args.tp, args.micro_batch
    if tp < 2:
        raise SystemExit("error: --tp must be >= 2 (the ranks of one tensor-parallel group)")
    overrides = [f"model={args.model}", f"parallel.tp={tp}", f"train.micro_batch_size={b}"]
    overrides += [f"train.global_batch_size={b}", "train.steps=1000000", "optim.warmup_steps=0"]
    if args.seq_len:
        overrides.append(f"model.seq_len={args.seq_len}")
    cfg = compose_config(args.conf, overrides)
    try:  # before any rank starts, as train.py decides: a bad shape never hangs
        validate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=True)), tp)
    except ConfigError as e:
        raise SystemExit(f"error: {e} (--seq-len sets model.seq_len here)") from None
    job = Job(cfg, args.steps, args.rounds, args.ref_threads)
    r = run_distributed(_rank, tp, job, backend=pool_backend(tp), timeout_s=24 * 3600)[0]

    m, s = cfg.model, cfg.model.seq_len
    tokens = b * s
    rates = {name: [tokens / t for t in v["wall"]] for name, v in r["variants"].items()}
    median = {name: statistics.median(v) for name, v in rates.items()}
    references = [name for name in rates if name.startswith("tp=1")]
    one_process = max(median[name] for name in references)
    t = Table(
        f"model {args.model} (d={m.d_model}, {m.n_layers} layers, {m.n_heads} heads, vocab {m.vocab_size}), seq {s}, "
        f"micro-batch {b} = {b * s} tokens/step, fp32, {r['device']}, {tp} ranks x {r['threads']} torch threads, "
        f"{args.rounds} rounds x {args.steps} steps; vs tp=1: against the fastest tp=1 row",
        HEADER,
    )
    for name, v in r["variants"].items():
        dtensor = f"DTensor tp={tp}" + (" +SP" if name.endswith("+SP") else "")
        t.add(
            name,
            number(median[name]),
            spread(rates[name]),
            f"{median[name] / one_process:.3f}",
            f"{median[name] / median[dtensor]:.3f}" if name not in references else "-",
            f"{v['first_loss']:.6f}",
            f"{v['last_loss']:.6f}",
            ", ".join(number(x) for x in rates[name]),
        )
    tables = [t]
    size = r["element_size"]
    for sp in (False, True):
        name = f"trident tp={tp}" + (" +SP" if sp else "")
        log = r["variants"][name]
        analytic = analytic_comms(m, b, s, tp, sp, r["sp_numel"])
        title = (
            f"{name}: collectives per step per rank (b*s*h = {b}*{s}*{m.d_model} = {b * s * m.d_model:,} elements "
            f"x {size} bytes)"
        )
        tables.append(comm_table(title, log["calls"], size, analytic))
    for sp in (False, True):
        name = f"DTensor tp={tp}" + (" +SP" if sp else "")
        notes = dtensor_notes(m, b, s, tp, r["n_params"][name])
        title = f"{name}: functional collectives per step per rank (measured)"
        tables.append(comm_table(title, r["variants"][name]["calls"], size, notes))
    tables[-1].notes.append(
        f"rank 0's counts; every rank's are {'the same' if r['same_everywhere'] else 'NOT the same'}. "
        "phase: bwd inside autograd's backward, fwd anything else (forward, loss, optimizer step). "
        "bytes passed: an all-reduce's tensor, an all-gather's output, a reduce-scatter's input (b*s*h for an "
        "activation at any tp). ring wire: what one rank sends with ring algorithms, 2(N-1)/N of an all-reduce and "
        "(N-1)/N of an all-gather or reduce-scatter; gloo picks its own algorithms."
    )
    return tables


class TridentVariant:
    """trident at ``cfg``'s layout on ``groups``, as train.py builds it, stepped by the Trainer."""

    def __init__(self, cfg: Config, groups, device: torch.device) -> None:
        self.parts: RunParts = build_parts(cfg, layout_of(cfg, groups), groups, device)
        data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)
        self.trainer = Trainer(cfg, groups, self.parts, (data, data))
        self.sp_numel = sum(p.numel() for p in self.parts.chunks[0].parameters() if "tp" in placement_of(p).grad_sums)

    def step(self, step: int) -> float:
        return self.trainer.train_step(step, self.trainer.micro_batches(step)).loss


class DTensorVariant:
    def __init__(self, cfg: Config, mesh: DeviceMesh, sequence_parallel: bool, weights: dict, batches) -> None:
        m = cfg.model
        model = TorchGPT(m)
        # trident pads the vocab rows of wte (vocab_multiple); the real rows are the weights.
        wte = weights["wte.weight"][: m.vocab_size]
        model.load_state_dict({**weights, "wte.weight": wte, "lm_head.weight": wte})
        self.model = parallelize_torch_gpt(model.to(mesh.device_type), mesh, sequence_parallel)
        self.optimizer = torch.optim.AdamW(**adamw_args(self.model, cfg))
        self.optim_cfg, self.total_steps, self.batches = cfg.optim, cfg.train.steps, batches

    def step(self, step: int) -> float:
        self.model.train()
        x, y, *_ = self.batches(step)[0]
        tokens = x.numel()
        with loss_parallel():
            logits = self.model(x)  # this rank's vocab block, a DTensor sharded on the last dim
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            (loss / tokens).backward()
        if self.optim_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip, foreach=True)
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.optim_cfg, self.total_steps)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.to_local().item() / tokens


def _rank(rank: int, tp: int, job: Job) -> dict:
    threads = max(1, (os.cpu_count() or 1) // tp)
    torch.set_num_threads(threads)
    device = rank_device(rank, tp)
    cfg = job.cfg
    groups = build_process_groups(Topology(dp=1, pp=1, tp=tp))
    alone = dist.new_group([0])  # every rank takes part in creating it; only rank 0 is in it
    mesh = device_mesh(groups.tp_group, device.type, "tp")
    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1))
    sp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=True))

    def reference(n: int) -> Callable[[int], float]:
        """The whole model on rank 0 with ``n`` torch threads; every other rank only waits."""
        if rank != 0:
            return lambda step: float("nan")
        inner = TridentVariant(one, one_rank_groups(alone), device)

        def step(i: int) -> float:
            torch.set_num_threads(n)
            try:
                return inner.step(i)
            finally:
                torch.set_num_threads(threads)

        return step

    ours, ours_sp = TridentVariant(cfg, groups, device), TridentVariant(sp, groups, device)
    # The tp=1 model's weights, for the DTensor twins to load: built as the one-process run builds them.
    (plain,) = model_chunks(one.model, layout_of(one, one_rank_groups(None)), one.train, one_rank_groups(None), device)
    weights = plain.state_dict()
    variants: dict[str, Callable[[int], float]] = {
        f"tp=1, {n} thread{'s' if n > 1 else ''}": reference(n) for n in job.ref_threads or [threads]
    }
    variants[f"trident tp={tp}"] = ours.step
    variants[f"trident tp={tp} +SP"] = ours_sp.step
    dtensor = {sp: DTensorVariant(cfg, mesh, sp, weights, ours.trainer.micro_batches) for sp in (False, True)}
    variants[f"DTensor tp={tp}"] = dtensor[False].step
    variants[f"DTensor tp={tp} +SP"] = dtensor[True].step

    # Step 0 of each variant, untimed: its loss, and its collectives counted.
    first_loss, logs = {}, {}
    for name, step in variants.items():
        if name.startswith("trident"):
            with counting_collectives() as logs[name]:
                first_loss[name] = step(0)
        elif name.startswith("DTensor"):
            with DTensorComms(tp) as mode:
                first_loss[name] = step(0)
            logs[name] = mode.log
        else:
            first_loss[name] = step(0)
    every_rank: list[dict] = [{} for _ in range(tp)]
    dist.all_gather_object(every_rank, {name: dict(log.calls) for name, log in logs.items()})

    last_loss: dict[str, float] = {}

    def timed(name: str) -> Callable[[int], None]:
        def step(i: int) -> None:
            last_loss[name] = variants[name](1 + i)

        return step

    timings = alternate(
        {name: timed(name) for name in variants},
        warmup=0,
        steps=job.steps,
        rounds=job.rounds,
        sync=lambda: barrier(device),
    )
    for v in (ours, ours_sp):
        v.parts.optimizer.remove_hooks()
    return {
        "device": device.type,
        "threads": threads,
        "sp_numel": ours_sp.sp_numel,
        "element_size": next(iter(logs.values())).element_size,
        "same_everywhere": all(counts == every_rank[0] for counts in every_rank),
        "n_params": {
            f"DTensor tp={tp}" + (" +SP" if k else ""): len(list(v.model.parameters())) for k, v in dtensor.items()
        },
        "variants": {
            name: {
                "wall": timings[name].wall,
                "first_loss": first_loss[name],
                "last_loss": last_loss[name],
                "calls": dict(logs[name].calls) if name in logs else {},
            }
            for name in variants
        },
    }
