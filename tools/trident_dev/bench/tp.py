"""``tools/bench.py tp``: tokens/s of trident's tensor parallelism (+SP) against torch's own (DTensor) and one
process, and the collectives each sends per step, trident's against the analytic count
(docs/benchmarks.md#tp).

    python tools/bench.py tp [--tp 2] [--model gpt-mini] [--micro-batch 4] [--seq-len 128] [--steps 3] [--rounds 4]
        [--ref-threads 1 2]

--seq-len overrides the preset's model.seq_len (gpt-mini's 256 is twice the default here; 0 keeps the preset's).
"""

from __future__ import annotations

import argparse
import contextlib
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
from trident_dev.bench.compare import (
    Column,
    Comparison,
    Outcome,
    Rank,
    Row,
    Run,
    Setting,
    Steps,
    run_settings,
    tabulate,
)
from trident_dev.bench.dtensor_model import TorchGPT, parallelize_torch_gpt
from trident_dev.bench.harness import Table, adamw_args, device_mesh, number, one_rank_groups, random_windows, spread

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
    m, s = cfg.model, cfg.model.seq_len
    tokens = b * s

    def rates(out: Outcome) -> list[float]:
        return [tokens / t for t in out.wall]

    def median(out: Outcome) -> float:
        return statistics.median(rates(out))

    def one_process(row: Row) -> float:  # the fastest tp=1 row
        return max(median(out) for name, out in row.run.outcomes.items() if name.startswith("tp=1"))

    def vs_dtensor(row: Row) -> str:
        if row.name.startswith("tp=1"):
            return "-"
        dtensor = row.of(f"DTensor tp={tp}" + (" +SP" if row.name.endswith("+SP") else ""))
        return f"{median(row.out) / median(dtensor):.3f}"

    columns = [
        Column("variant"),
        Column("tokens/s", lambda r: number(median(r.out))),
        Column("spread", lambda r: spread(rates(r.out))),
        Column("vs tp=1", lambda r: f"{median(r.out) / one_process(r):.3f}"),
        Column("vs DTensor", vs_dtensor),
        Column("step-0 loss", lambda r: f"{r.out.losses[0]:.6f}"),
        Column("last loss", lambda r: f"{r.out.losses[-1]:.6f}"),
        Column("rounds (tokens/s)", lambda r: ", ".join(number(x) for x in rates(r.out))),
    ]

    def title(runs: list[Run]) -> str:
        info = runs[0].info[0]
        return (
            f"model {args.model} (d={m.d_model}, {m.n_layers} layers, {m.n_heads} heads, vocab {m.vocab_size}), "
            f"seq {s}, micro-batch {b} = {b * s} tokens/step, fp32, {info['device']}, {tp} ranks x {info['threads']} "
            f"torch threads, {args.rounds} rounds x {args.steps} steps; vs tp=1: against the fastest tp=1 row"
        )

    setting = Setting(_variants, Job(cfg, args.ref_threads), world=tp)
    comparison = Comparison(title, columns, [setting], warmup=1, steps=args.steps, rounds=args.rounds)
    runs = run_settings(comparison)
    tables = [tabulate(comparison, runs)]
    (run_,) = runs
    outcomes, info = run_.outcomes, run_.info[0]
    size = next(o.figures["element_size"] for o in outcomes.values() if "element_size" in o.figures)
    for sp in (False, True):
        name = f"trident tp={tp}" + (" +SP" if sp else "")
        analytic = analytic_comms(m, b, s, tp, sp, info["sp_numel"])
        title = (
            f"{name}: collectives per step per rank (b*s*h = {b}*{s}*{m.d_model} = {b * s * m.d_model:,} elements "
            f"x {size} bytes)"
        )
        tables.append(comm_table(title, outcomes[name].figures["calls"], size, analytic))
    for sp in (False, True):
        name = f"DTensor tp={tp}" + (" +SP" if sp else "")
        notes = dtensor_notes(m, b, s, tp, outcomes[name].figures["n_params"])
        title = f"{name}: functional collectives per step per rank (measured)"
        tables.append(comm_table(title, outcomes[name].figures["calls"], size, notes))
    same = all(r.figures.get("calls") == o.figures.get("calls") for o in outcomes.values() for r in o.ranks)
    tables[-1].notes.append(
        f"rank 0's counts; every rank's are {'the same' if same else 'NOT the same'}. "
        "phase: bwd inside autograd's backward, fwd anything else (forward, loss, optimizer step). "
        "bytes passed: an all-reduce's tensor, an all-gather's output, a reduce-scatter's input (b*s*h for an "
        "activation at any tp). ring wire: what one rank sends with ring algorithms, 2(N-1)/N of an all-reduce and "
        "(N-1)/N of an all-gather or reduce-scatter; gloo picks its own algorithms."
    )
    return tables


class _Counted(Steps):
    """A variant whose first step's collectives are counted (``counting``: a context giving the log, or a mode
    holding it)."""

    def __init__(self, step: Callable[[int], float], counting: Callable[[], object], **figures: object) -> None:
        super().__init__(step)
        self.counting, self.log, self.more = counting, None, figures

    def step(self, i: int) -> float:
        if i > 0:
            return super().step(i)
        with self.counting() as counter:
            loss = super().step(i)
        self.log = getattr(counter, "log", counter)
        return loss

    def figures(self) -> dict:
        return {"calls": dict(self.log.calls), "element_size": self.log.element_size, **self.more}


class TridentVariant(_Counted):
    """trident at ``cfg``'s layout on ``groups``, as train.py builds it, stepped by the Trainer."""

    def __init__(self, cfg: Config, groups, device: torch.device, counting: Callable[[], object]) -> None:
        self.parts: RunParts = build_parts(cfg, layout_of(cfg, groups), groups, device)
        data = random_windows(cfg.model.vocab_size, cfg.model.seq_len, 64 * cfg.train.global_batch_size)
        self.trainer = Trainer(cfg, groups, self.parts, (data, data))
        self.sp_numel = sum(p.numel() for p in self.parts.chunks[0].parameters() if "tp" in placement_of(p).grad_sums)
        super().__init__(lambda i: self.trainer.train_step(i, self.trainer.micro_batches(i)).loss, counting)

    def close(self) -> None:
        self.parts.optimizer.remove_hooks()


class DTensorVariant(_Counted):
    def __init__(self, cfg: Config, mesh: DeviceMesh, sequence_parallel: bool, weights: dict, batches) -> None:
        m = cfg.model
        model = TorchGPT(m)
        # trident pads the vocab rows of wte (vocab_multiple); the real rows are the weights.
        wte = weights["wte.weight"][: m.vocab_size]
        model.load_state_dict({**weights, "wte.weight": wte, "lm_head.weight": wte})
        self.model = parallelize_torch_gpt(model.to(mesh.device_type), mesh, sequence_parallel)
        self.optimizer = torch.optim.AdamW(**adamw_args(self.model, cfg))
        self.optim_cfg, self.total_steps, self.batches = cfg.optim, cfg.train.steps, batches
        tp = mesh.size()
        super().__init__(self.train, lambda: DTensorComms(tp), n_params=len(list(self.model.parameters())))

    def train(self, step: int) -> float:
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


def _variants(rank: Rank, job: Job) -> dict[str, Callable[[], Steps]]:
    tp, device = rank.world, rank.device
    threads = max(1, (os.cpu_count() or 1) // tp)
    torch.set_num_threads(threads)
    rank.info.update(device=device.type, threads=threads)
    cfg = job.cfg
    groups = build_process_groups(Topology(dp=1, pp=1, tp=tp))
    alone = dist.new_group([0])  # every rank takes part in creating it; only rank 0 is in it
    mesh = device_mesh(groups.tp_group, device.type, "tp")
    one = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1))
    sp = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, sequence_parallel=True))
    built: dict[bool, TridentVariant] = {}

    def reference(n: int) -> Steps:
        """The whole model on rank 0 with ``n`` torch threads; every other rank only waits."""
        if rank.rank != 0:
            return Steps(lambda step: float("nan"))
        inner = TridentVariant(one, one_rank_groups(alone), device, contextlib.nullcontext)

        def step(i: int) -> float:
            torch.set_num_threads(n)
            try:
                return inner.trainer.train_step(i, inner.trainer.micro_batches(i)).loss
            finally:
                torch.set_num_threads(threads)

        return Steps(step, close=inner.close)

    def trident(with_sp: bool) -> TridentVariant:
        built[with_sp] = TridentVariant(sp if with_sp else cfg, groups, device, counting_collectives)
        rank.info["sp_numel"] = built[with_sp].sp_numel
        return built[with_sp]

    def dtensor(with_sp: bool) -> DTensorVariant:
        # The tp=1 model's weights, for the DTensor twins to load: built as the one-process run builds them.
        (plain,) = model_chunks(
            one.model, layout_of(one, one_rank_groups(None)), one.train, one_rank_groups(None), device
        )
        return DTensorVariant(cfg, mesh, with_sp, plain.state_dict(), built[False].trainer.micro_batches)

    variants: dict[str, Callable[[], Steps]] = {
        f"tp=1, {n} thread{'s' if n > 1 else ''}": (lambda n=n: reference(n)) for n in job.ref_threads or [threads]
    }
    variants[f"trident tp={tp}"] = lambda: trident(False)
    variants[f"trident tp={tp} +SP"] = lambda: trident(True)
    variants[f"DTensor tp={tp}"] = lambda: dtensor(False)
    variants[f"DTensor tp={tp} +SP"] = lambda: dtensor(True)
    return variants
