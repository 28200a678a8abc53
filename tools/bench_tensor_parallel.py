"""Tokens/s of trident's tensor parallelism against torch's own (DTensor) and one process, and the bytes it sends.

    torchrun --nproc-per-node 2 tools/bench_tensor_parallel.py [--model gpt-mini] [--micro-batch 4] [--seq-len 128]
        [--steps 3] [--rounds 4] [--ref-threads 1,2]

--seq-len overrides the preset's model.seq_len (gpt-mini's 256 is twice the default here; 0 keeps the preset's).

One invocation on N ranks (tp = N) trains the variants below of one model config, from the same initial weights
(trident's name-seeded init) on the same batches, alternating timed blocks in rounds so machine noise hits all
alike, and prints the median tokens/s of each:

  tp=1        one rank trains the whole model alone (GPT with no tp group, through the same trainer pieces as
              trident below) while the others wait at a barrier: the one-process speed, with the torch threads
              each rank of this launch has (cores / N), or once per count in --ref-threads
              (e.g. 1,2: 2 is what a lone `python train.py` takes on 2 cores; on a busy machine OpenMP threads
              spinning for a preempted sibling can make that several times slower, unless OMP_WAIT_POLICY=passive).
              "vs tp=1" divides by the fastest tp=1 row.
  trident     GPT(cfg, tp_group) at tp=N through trident's own trainer pieces: Trainer.train_step with a
              LocalRunner, a GradReducer over a dp group of one (its fp32 gradient buffer; no dp collective),
              model.loss_sum (vocab-parallel cross-entropy), GradStep (global-norm clipping, AdamW).
  trident+SP  the same with sequence_parallel=True; after_reduce sums the SP-partial gradients over tp
              (parallel.tensor.sum_grads_over_tp).
  DTensor     the same GPT written with nn.Linear / nn.Embedding / nn.LayerNorm (same parameter names and shapes,
              loaded from the tp=1 model's state dict), parallelized with torch.distributed.tensor.parallel on a
              DeviceMesh over the same ranks: qkv and fc ColwiseParallel, the projections RowwiseParallel, the token
              embedding RowwiseParallel (vocab-sharded rows, as VocabParallelEmbedding) and the LM head
              ColwiseParallel on that same, tied weight with Shard(-1) logits, so the loss is vocab-parallel
              cross-entropy under loss_parallel(): the full logits are never gathered, as in trident. LayerNorms
              and wpe are replicated DTensors (distribute_module), so clip_grad_norm_ and AdamW see only DTensors.
  DTensor+SP  the same with SequenceParallel LayerNorms, PrepareModuleInput (Shard(1) -> Replicate) on attention
              and MLP, RowwiseParallel(output_layouts=Shard(1)) projections and embedding, and wpe looked up by this
              rank's sequence shard of positions (SequenceParallel on dim 0).

Every step is one micro-batch of --micro-batch sequences (the global batch), fp32: forward, summed token loss
divided by the step's tokens, backward, global-norm clipping at optim.grad_clip, AdamW with trident's
build_optimizer (same hyperparameters, decay on matrices only) at lr_at(step). The DTensor step is the plain torch
loop a user would write: clip_grad_norm_, optimizer.step, zero_grad. The first step of each variant is untimed: its
loss is printed (all must agree; so must the last timed step's, after the same updates) and its collectives are
counted on every rank. Trident's are counted by wrapping the torch.distributed functions (and the flat all-gather /
reduce-scatter aliases parallel/comm.py binds at import) and checked against the analytic count; DTensor's, which
never pass through those functions, by a dispatch mode that sees its functional collectives.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import inspect
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from omegaconf import OmegaConf
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from torch.utils._python_dispatch import TorchDispatchMode

import trident.parallel.comm as comm
from trident.config import ModelConfig, OptimConfig, TrainConfig
from trident.data.dataset import TokenWindows
from trident.data.sampler import GlobalBatchSampler
from trident.device import pick_backend, pick_device, set_cpu_threads
from trident.loop import Trainer
from trident.models.gpt import GPT, check_tp_split, init_weights
from trident.optim import GradStep, ReplicatedUpdate, build_optimizer, lr_at, set_lr
from trident.parallel.groups import (
    ProcessGroups,
    build_process_groups,
    init_distributed,
    launch_world_size,
    shutdown_distributed,
)
from trident.parallel.reducer import GradReducer
from trident.parallel.tensor import sum_grads_over_tp
from trident.parallel.topology import Topology
from trident.runner import Batch, LocalRunner

# The model presets of the checkout this script belongs to (the YAML under conf/ is not inside the package).
PRESETS = Path(__file__).resolve().parent.parent / "conf" / "model"


def model_config(name: str, seq_len: int | None) -> ModelConfig:
    cfg = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.load(PRESETS / f"{name}.yaml"))
    )
    return dataclasses.replace(cfg, seq_len=seq_len) if seq_len else cfg


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


# ---------------------------------------------------------------------------------------------------------------
# Counting collectives: one row per (op, in backward, group size, elements).

Key = tuple[str, bool, int, int]


class CommLog:
    def __init__(self) -> None:
        self.calls: Counter[Key] = Counter()
        self.element_size = 4

    def add(self, op: str, group_size: int, tensors: list[torch.Tensor]) -> None:
        # Backward runs inside an autograd node; the forward, the loss and the optimizer step do not.
        in_backward = torch._C._current_autograd_node() is not None
        self.calls[(op, in_backward, group_size, sum(t.numel() for t in tensors))] += 1
        self.element_size = tensors[0].element_size()


# torch.distributed function -> (kind, the argument whose bytes count): an all-reduce's tensor, an all-gather's
# output, a reduce-scatter's input. Each is then b*s*h for an activation, whatever the tp size.
_DIST_FUNCTIONS = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "broadcast": ("broadcast", "tensor"),
}


@contextlib.contextmanager
def counting_collectives() -> Iterator[CommLog]:
    """Count every torch.distributed collective called inside the block (trident's path to the backend)."""
    log, depth = CommLog(), [0]

    def counted(fn: Callable, kind: str, arg: str) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0] == 0:  # a collective implemented by another one counts once
                bound = signature.bind(*args, **kwargs).arguments
                tensors = bound[arg]
                group = bound.get("group")
                size = dist.get_world_size(group) if group is not None else dist.get_world_size()
                log.add(kind, size, tensors if isinstance(tensors, list) else [tensors])
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    targets = [(dist, name, *spec) for name, spec in _DIST_FUNCTIONS.items() if hasattr(dist, name)]
    # parallel/comm.py binds the flat all-gather and reduce-scatter once at import: wrap its names too.
    targets += [(comm, "_all_gather_flat", "all_gather", "output_tensor")]
    targets += [(comm, "_reduce_scatter_flat", "reduce_scatter", "input")]
    originals = [(module, name, getattr(module, name)) for module, name, *_ in targets]
    for module, name, kind, arg in targets:
        setattr(module, name, counted(getattr(module, name), kind, arg))
    try:
        yield log
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


class DTensorComms(TorchDispatchMode):
    """Count the functional collectives DTensor issues (it never calls the torch.distributed functions)."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.log, self.group_size = CommLog(), group_size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # Modes run before tensor subclasses: step aside so DTensor desugars into collectives on plain tensors,
        # which come back through here (torch's CommDebugMode does the same).
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        if getattr(func, "namespace", None) in ("_c10d_functional", "c10d"):
            name = func._overloadpacket.__name__.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
            kind = next((k for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") if k in name), None)
            if kind is not None:
                counted = out if kind == "all_gather" else args[0]
                tensors = counted if isinstance(counted, list | tuple) else [counted]
                self.log.add(kind, self.group_size, [t for t in tensors if isinstance(t, torch.Tensor)])
        return out


def ring_wire_bytes(op: str, group_size: int, nbytes: int) -> float:
    """Bytes one rank sends for ``nbytes`` passed, with ring algorithms (what NCCL runs; gloo may send more)."""
    if group_size == 1:
        return 0.0
    share = (group_size - 1) / group_size
    return 2 * share * nbytes if op == "all_reduce" else share * nbytes


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
        rows[("all_reduce", False, tp, sp_numel)] = (1, f"sum_grads_over_tp (LayerNorms, row biases, wpe; {h=})")
    rows[("all_reduce", False, tp, 1)] = (1, "GradStep: global grad norm (world group)")
    rows[("all_reduce", False, 1, 1)] = (1, "Trainer: loss over the dp group of one (no wire)")
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


def comm_table(title: str, log: CommLog, analytic: dict) -> str:
    """One row per kind of collective; ``analytic`` maps a row to (expected calls or None, what it is)."""
    es = log.element_size
    expected_keys = {key for key, (calls, _) in analytic.items() if calls is not None}
    keys = sorted(set(log.calls) | expected_keys, key=lambda k: (-k[3], k[0], k[1], k[2]))
    lines = [
        title,
        f"  {'op':<15}{'phase':<6}{'group':>6}{'elements':>11}{'calls':>7}{'analytic':>9}"
        f"{'bytes passed':>14}{'ring wire':>12}  what",
    ]
    total = expected = wire = 0
    for key in keys:
        op, backward, group, numel = key
        calls = log.calls.get(key, 0)
        want, what = analytic.get(key, (None, ""))
        nbytes = calls * numel * es
        total += nbytes
        expected += (want or 0) * numel * es
        wire += ring_wire_bytes(op, group, nbytes)
        flag = "" if want is None or want == calls else "  <-- differs"
        lines.append(
            f"  {op:<15}{'bwd' if backward else 'fwd':<6}{group:>6}{numel:>11,}{calls:>7}"
            f"{'' if want is None else want:>9}{nbytes:>14,}{ring_wire_bytes(op, group, nbytes):>12,.0f}  {what}{flag}"
        )
    lines.append(f"  total bytes passed {total:,} (ring wire {wire:,.0f})")
    if expected_keys:
        lines[-1] += f"; analytic {expected:,}: {'equal' if total == expected else 'DIFFERENT'}"
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# The same GPT in plain torch modules, for torch.distributed.tensor.parallel (its styles take nn.Linear/Embedding).


class TorchAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d, self.head_dim = cfg.d_model, cfg.head_dim
        self.qkv = nn.Linear(d, 3 * d, bias=cfg.bias)
        self.proj = nn.Linear(d, d, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # qkv is laid out head by head, (h three d): a colwise block of rows holds whole heads, h = local heads.
        q, k, v = rearrange(self.qkv(x), "b t (h three d) -> three b h t d", three=3, d=self.head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(rearrange(y, "b h t d -> b t (h d)"))


class TorchMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class TorchBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.attn = TorchAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.mlp = TorchMLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TorchGPT(nn.Module):
    """models/gpt.py's GPT with the same parameter names, in plain modules; lm_head shares wte's weight."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleDict({str(i): TorchBlock(cfg) for i in range(cfg.n_layers)})
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=cfg.ln_eps, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.sequence_shard = (0, 1)  # (this rank's shard, shards): which positions the residual stream holds

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        shard, shards = self.sequence_shard
        n = idx.shape[1] // shards
        x = self.wte(idx) + self.wpe(torch.arange(shard * n, (shard + 1) * n, device=idx.device))
        for block in self.layers.values():
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _replicated_input(module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)


def _local_output(module: nn.Module, output: DTensor, mesh: DeviceMesh) -> torch.Tensor:
    return output.to_local()


def parallelize_torch_gpt(model: TorchGPT, mesh: DeviceMesh, sequence_parallel: bool) -> TorchGPT:
    """Megatron's layout with torch's styles; the residual stream is Replicate, or Shard(1) with SP."""
    stream = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "lm_head": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1), use_local_output=False),
    }
    for i in model.layers:
        p = f"layers.{i}."
        plan[p + "attn.qkv"] = ColwiseParallel()
        plan[p + "attn.proj"] = RowwiseParallel(output_layouts=stream)
        plan[p + "mlp.fc"] = ColwiseParallel()
        plan[p + "mlp.proj"] = RowwiseParallel(output_layouts=stream)
        if sequence_parallel:
            plan[p + "ln_1"] = SequenceParallel()
            plan[p + "ln_2"] = SequenceParallel()
            plan[p + "attn"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
            plan[p + "mlp"] = PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())
    if sequence_parallel:
        plan["ln_f"] = SequenceParallel()
        # wpe takes this rank's shard of the positions, so its output is the residual stream's shard.
        plan["wpe"] = SequenceParallel(sequence_dim=0, use_local_output=True)
    parallelize_module(model, mesh, plan)
    if not sequence_parallel:
        # Replicated DTensor parameters with local inputs and outputs: clip_grad_norm_ and AdamW's foreach
        # kernels refuse a mix of plain tensors and DTensors.
        for name in ["wpe", "ln_f", *(f"layers.{i}.{ln}" for i in model.layers for ln in ("ln_1", "ln_2"))]:
            distribute_module(model.get_submodule(name), mesh, None, _replicated_input, _local_output)
    model.lm_head.weight = model.wte.weight  # parallelize_module distributed the tied weight twice: tie it again
    if sequence_parallel:
        model.sequence_shard = (mesh.get_local_rank(), mesh.size())
    return model


# ---------------------------------------------------------------------------------------------------------------
# The variants: each trains on step(i, micro-batches) and returns the step's mean token loss.


class TridentVariant:
    def __init__(
        self,
        cfg: ModelConfig,
        groups: ProcessGroups,
        sequence_parallel: bool,
        data: TokenWindows,
        train_cfg: TrainConfig,
        optim_cfg: OptimConfig,
        device: torch.device,
    ) -> None:
        tp_group = groups.tp_group if groups.tp_size > 1 else None
        self.model = GPT(cfg, tp_group, sequence_parallel=sequence_parallel)
        init_weights(self.model, cfg, seed=0)
        self.model.to(device)
        chunks = [self.model]
        reducer = GradReducer(list(self.model.parameters()), groups.dp_group)
        sp_grads = [reducer.grad(p) for p in self.model.sequence_parallel_params()]
        self.sp_numel = sum(g.numel() for g in sp_grads)
        self.trainer = Trainer(
            train_cfg=train_cfg,
            optim_cfg=optim_cfg,
            groups=groups,
            model_chunks=chunks,
            runner=LocalRunner(chunks, reducer, train_cfg.precision),
            loss_fn=self.model.loss_sum,
            grad_step=GradStep(
                ReplicatedUpdate(build_optimizer(chunks, optim_cfg), reducer), groups, optim_cfg.grad_clip
            ),
            train_data=data,
            val_data=data,
            device=device,
            flops_per_token=1.0,
            peak_flops=None,
            checkpointer=None,
            make_logger=lambda _: None,
            after_reduce=(lambda: sum_grads_over_tp(sp_grads, groups.tp_group)) if sp_grads else None,
        )

    def step(self, step: int, micro: list[Batch]) -> float:
        return self.trainer.train_step(step, micro).loss


class DTensorVariant:
    def __init__(
        self,
        cfg: ModelConfig,
        mesh: DeviceMesh,
        sequence_parallel: bool,
        weights: dict[str, torch.Tensor],
        train_cfg: TrainConfig,
        optim_cfg: OptimConfig,
        device: torch.device,
    ) -> None:
        model = TorchGPT(cfg)
        # trident pads the vocab rows of wte (vocab_multiple); the real rows are the weights.
        wte = weights["wte.weight"][: cfg.vocab_size]
        model.load_state_dict({**weights, "wte.weight": wte, "lm_head.weight": wte})
        self.model = parallelize_torch_gpt(model.to(device), mesh, sequence_parallel)
        self.optimizer = build_optimizer([self.model], optim_cfg)
        self.optim_cfg, self.total_steps = optim_cfg, train_cfg.steps

    def step(self, step: int, micro: list[Batch]) -> float:
        self.model.train()
        x, y, tokens = micro[0].tokens, micro[0].targets, micro[0].tokens.numel()
        with loss_parallel():
            logits = self.model(x)  # this rank's vocab block, a DTensor sharded on the last dim
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")
            (loss / tokens).backward()
        if self.optim_cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.optim_cfg.grad_clip, foreach=True)
        set_lr(self.optimizer, lr_at(step, self.optim_cfg, self.total_steps))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.to_local().item() / tokens


class ReferenceVariant:
    """The whole model on rank 0 with ``threads`` torch threads; every other rank only waits."""

    def __init__(self, inner: TridentVariant | None, threads: int) -> None:
        self.inner, self.threads = inner, threads

    def step(self, step: int, micro: list[Batch]) -> float:
        if self.inner is None:
            return float("nan")
        threads = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            return self.inner.step(step, micro)
        finally:
            torch.set_num_threads(threads)


def one_rank_groups(group: dist.ProcessGroup | None) -> ProcessGroups | None:
    """Every group of a one-process layout, all ``group`` (rank 0 alone); None on the other ranks."""
    if group is None:
        return None
    return ProcessGroups(Topology(1, 1, 1), 0, group, group, group, group, group, group, (0,))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt-mini")
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per step (one micro-batch per step)")
    p.add_argument("--seq-len", type=int, default=128, help="model.seq_len and the training window (0: the preset's)")
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=4, help="alternating timed blocks per variant; the median is reported")
    p.add_argument("--ref-threads", help="torch threads of the tp=1 runs, comma-separated (default: a rank's)")
    args = p.parse_args()

    cfg = model_config(args.model, args.seq_len)
    tp = launch_world_size()
    if tp < 2:
        raise SystemExit("launch N >= 2 ranks: torchrun --nproc-per-node N tools/bench_tensor_parallel.py (tp = N)")
    try:  # before joining the group: a bad shape never hangs
        check_tp_split(cfg, tp, sequence_parallel=True)
    except ValueError as e:
        raise SystemExit(f"{e} (--seq-len sets model.seq_len here)") from None
    device = pick_device("auto")
    init_distributed(pick_backend("auto", device), device)
    rank = dist.get_rank()
    groups = build_process_groups(Topology(dp=1, pp=1, tp=tp))
    alone = dist.new_group([0])  # every rank takes part in creating it; only rank 0 is in it
    mesh = init_device_mesh(device.type, (tp,))
    if device.type == "cpu":
        set_cpu_threads()
    ref_threads = [int(n) for n in args.ref_threads.split(",")] if args.ref_threads else [torch.get_num_threads()]
    b, s = args.micro_batch, cfg.seq_len
    train_cfg = TrainConfig(micro_batch_size=b, global_batch_size=b, steps=10**6, precision="fp32")
    optim_cfg = OptimConfig(warmup_steps=0)

    # Random tokens: throughput does not depend on what the tokens say.
    n_windows = 64 * b
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, n_windows * s + 1).astype(np.int64)
    data = TokenWindows(tokens, s, 0, n_windows)
    sampler = GlobalBatchSampler(n_windows, b, train_cfg.seed)

    def batches(step: int) -> list[Batch]:
        windows, samples = sampler.micro_batches(step, 0, 1, b), sampler.sample_ids(step, 0, 1, b)
        return [Batch(*data.batch(w), s, step).to(device) for w, s in zip(windows, samples, strict=True)]

    def trident(groups: ProcessGroups, sp: bool) -> TridentVariant:
        return TridentVariant(cfg, groups, sp, data, train_cfg, optim_cfg, device)

    one = one_rank_groups(alone if rank == 0 else None)
    plain = GPT(cfg)  # the tp=1 model's weights: what the DTensor models load
    init_weights(plain, cfg, seed=0)
    weights = plain.state_dict()
    references = {
        f"tp=1, {n} thread{'s' if n > 1 else ''}": ReferenceVariant(trident(one, False) if one else None, n)
        for n in ref_threads
    }
    variants = {
        **references,
        f"trident tp={tp}": trident(groups, False),
        f"trident tp={tp} +SP": trident(groups, True),
        f"DTensor tp={tp}": DTensorVariant(cfg, mesh, False, weights, train_cfg, optim_cfg, device),
        f"DTensor tp={tp} +SP": DTensorVariant(cfg, mesh, True, weights, train_cfg, optim_cfg, device),
    }
    names = list(variants)

    def run(name: str, first_step: int, n: int) -> tuple[float, float]:
        sync(device)
        start = time.perf_counter()
        loss = 0.0
        for step in range(first_step, first_step + n):
            loss = variants[name].step(step, batches(step))
        sync(device)
        return time.perf_counter() - start, loss

    # Step 0 of each variant, untimed: its loss, and its collectives counted.
    first_loss, logs = {}, {}
    for name in names:
        if name.startswith("trident"):
            with counting_collectives() as logs[name]:
                _, first_loss[name] = run(name, 0, 1)
        elif name.startswith("DTensor"):
            with DTensorComms(tp) as mode:
                _, first_loss[name] = run(name, 0, 1)
            logs[name] = mode.log
        else:
            _, first_loss[name] = run(name, 0, 1)

    every_rank: list[dict] = [{} for _ in range(tp)]
    dist.all_gather_object(every_rank, {name: dict(log.calls) for name, log in logs.items()})
    same_everywhere = all(counts == every_rank[0] for counts in every_rank)

    rates: dict[str, list[float]] = {name: [] for name in names}
    last_loss: dict[str, float] = {}
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:  # rotate the order every round
            elapsed, last_loss[name] = run(name, 1 + r * args.steps, args.steps)
            rates[name].append(args.steps * b * s / elapsed)

    if rank == 0:
        median = {name: statistics.median(v) for name, v in rates.items()}
        one_process = max(median[name] for name in references)
        print(
            f"model {args.model} (d={cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads, vocab "
            f"{cfg.vocab_size}), seq {s}, micro-batch {b} = {b * s} tokens/step, fp32, {device.type}, {tp} ranks x "
            f"{torch.get_num_threads()} torch threads, {args.rounds} rounds x {args.steps} steps; "
            "vs tp=1: against the fastest tp=1 row",
            flush=True,
        )
        print(
            f"{'variant':<22}{'tokens/s':>10}{'vs tp=1':>9}{'vs DTensor':>12}{'step-0 loss':>13}"
            f"{'last loss':>11}  rounds (tokens/s)"
        )
        for name in names:
            dtensor = f"DTensor tp={tp}" + (" +SP" if name.endswith("+SP") else "")
            vs_dtensor = f"{median[name] / median[dtensor]:.3f}" if name not in references else "-"
            print(
                f"{name:<22}{median[name]:>10,.0f}{median[name] / one_process:>9.3f}{vs_dtensor:>12}"
                f"{first_loss[name]:>13.6f}{last_loss[name]:>11.6f}  {', '.join(f'{x:,.0f}' for x in rates[name])}"
            )
        for sp in (False, True):
            name = f"trident tp={tp}" + (" +SP" if sp else "")
            analytic = analytic_comms(cfg, b, s, tp, sp, variants[name].sp_numel)
            title = (
                f"\n{name}: collectives per step per rank (b*s*h = {b}*{s}*{cfg.d_model} = {b * s * cfg.d_model:,} "
                f"elements x {logs[name].element_size} bytes)"
            )
            print(comm_table(title, logs[name], analytic))
        for sp in (False, True):
            name = f"DTensor tp={tp}" + (" +SP" if sp else "")
            notes = dtensor_notes(cfg, b, s, tp, len(list(variants[name].model.parameters())))
            print(comm_table(f"\n{name}: functional collectives per step per rank (measured)", logs[name], notes))
        print(
            f"\nrank 0's counts; every rank's are {'the same' if same_everywhere else 'NOT the same'}. "
            "phase: bwd inside autograd's backward, fwd anything else (forward, loss, optimizer step).\n"
            "bytes passed: an all-reduce's tensor, an all-gather's output, a reduce-scatter's input (b*s*h for an "
            "activation at any tp).\nring wire: what one rank sends with ring algorithms, 2(N-1)/N of an "
            "all-reduce and (N-1)/N of an all-gather or reduce-scatter; gloo picks its own algorithms.",
            flush=True,
        )
    shutdown_distributed()


if __name__ == "__main__":
    main()
