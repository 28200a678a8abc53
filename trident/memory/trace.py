"""Activations traced: what a rank's real model chunk keeps for backward, counted on fake tensors.

A chunk (trident/build.py ``chunk_model``'s GPT of a virtual stage's layers, with the embedding on the first and
the final norm, head and loss on the last) is built and run for one micro-batch under torch's ``FakeTensorMode``,
under the recomputation policy applied as a run applies it (models/checkpointing.py), and measured with the
runtime's own tool (trident/memory/measure.py ``held_by_forward``): the storages created during the forward and
alive after it. So the prediction is by construction the count a real forward's measurement makes, and a model
feature (a norm, a head width, a recomputation module) is counted with no estimator code. Fake tensors have shapes,
dtypes and devices but no data: a trace of llama-8b's layer allocates nothing.

A chunk's layers differ only by their kind (recomputed or not, dense or sparse), and what one keeps does not depend
on the others, so a chunk is traced with one layer of each kind it holds, and once more with a second layer of each
kind it holds several of: the difference is that kind's bytes, scaled by its count (``chunk_bytes``). What the
chunk keeps once (the embedding's, the head's and loss's, the recomputed chunk's mask and positions under packed
documents, the ring plan of context parallelism) is in the first trace. Each trace is cached by what shapes it: the
model, micro-batch size, tp, sequence parallelism, cp and its exchange, precision, packed documents and the layer
kinds (``_trace``).

Tensor parallelism runs over a fake process group (torch's ``fake`` backend: collectives return at once, their
outputs shaped as a real group's). It needs the default process group, so a process that has a real one (a training
run) cannot trace it: ``traceable`` says which layouts the trace covers, and trident/memory/activations.py keeps its
formula for the others. Context parallelism is one of those: its exchanges classify their masks on the host
(parallel/context/core.py ``classify``: ``mask.all()``, ``torch.equal``), which fake tensors cannot answer.

Not traced yet (``traceable``; their formulas stay in activations.py):
- a GPU layout, whose kernels (SDPA's CUDA flash and efficient kernels, fp32 norms under CUDA autocast, flex
  attention) a CPU cannot dispatch, even on fake CUDA tensors (SDPA's kernel choice reads the real device);
- a mixture-of-experts model: a sparse layer's routing decides its shapes on the host (``counts.tolist()`` in
  models/moe.py). ``chunk_bytes`` can run such a layer with its MLP kept out (``moe_bytes`` to add), but at tp=2
  that trace came 2 x 4 sbh + 4 n bytes under the measured forward: not wired in;

A pipeline's chunk is run as the executor runs it (parallel/pipeline/executor.py): after the first from a residual
stream received into a buffer that requires grad, and counted with what the executor keeps of the forward until its
backward, the received buffer and the output (the last chunk's loss), which a real chunk keeps to the byte
(tests/test_memory_pipeline.py).
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.measure import held_by_forward
from trident.memory.params import _key
from trident.models.checkpointing import apply_activation_checkpointing, parse_label, recomputed_layers
from trident.models.gpt import GPT
from trident.models.moe import set_loss_multiplier
from trident.parallel.batch import Batch, document_ids
from trident.parallel.comm import GroupShape
from trident.parallel.context.batch import context_part
from trident.parallel.pipeline.stages import stage_layers
from trident.parallel.precision import autocast
from trident.parallel.random import RNGTracker
from trident.peak import PRECISION_DTYPES

EOS = 1  # packed documents' separator in the traced batch: an eos every 7 tokens, documents crossing cp chunks
DOCUMENT_EVERY = 7


def traceable(m: ModelConfig, layout: Layout) -> bool:
    """Whether the trace covers ``layout``'s activations: a dense model on a CPU, one pipeline chunk, no context
    parallelism, and tp only where this process has no process group of its own (the fake groups need the default
    one). The rest keep trident/memory/activations.py's formula for now (see the module docstring)."""
    if layout.device != "cpu" or layout.cp > 1 or m.moe.enabled:
        return False
    return layout.tp == 1 or not dist.is_initialized()


class _NoMLP(nn.Module):
    """A sparse layer's MLP kept out of the trace (its rows depend on the routing): a fresh tensor that keeps
    nothing, so the block around it keeps what it keeps for any MLP."""

    def forward(self, x: torch.Tensor, **_: object) -> torch.Tensor:
        return torch.zeros_like(x)


@contextlib.contextmanager
def _fake_groups(tp: int, cp: int) -> Iterator[tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]]:
    """(tp group, cp group) of a fake world of tp x cp ranks this process is rank 0 of, for the trace's duration;
    None for a group of one."""
    if tp == 1 and cp == 1:
        yield None, None
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp)
    try:
        # Ranks as trident/parallel/topology.py orders them within a dp rank: tp fastest, then cp.
        tp_group = dist.new_group(list(range(tp))) if tp > 1 else None
        cp_group = dist.new_group(list(range(0, tp * cp, tp))) if cp > 1 else None
        yield tp_group, cp_group
    finally:
        dist.destroy_process_group()


def _batch(m: ModelConfig, layout: Layout) -> Batch:
    """One micro-batch as this cp rank (0) receives it, on real CPU tensors: its positions and spans are computed
    from the token ids (a few integers per token)."""
    b, s = layout.micro_batch_size, m.seq_len
    tokens = torch.full((b, s), 2, dtype=torch.long)
    documents = None
    if layout.document_mask:
        tokens[:, ::DOCUMENT_EVERY] = EOS
        documents = document_ids(tokens, EOS)
    batch = Batch(tokens, tokens.clone(), torch.arange(b), 0, documents)
    return context_part(batch, layout.cp, 0) if layout.cp > 1 else batch


def _fake_cast(model: nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for a model of fake tensors: each floating parameter and buffer replaced by its cast
    (a tied parameter once), as the ZeRO optimizer casts a run's model at build."""
    cast: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_floating_point() and p.dtype != dtype:
                if id(p) not in cast:
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
                module._parameters[name] = cast[id(p)]
        for name, t in module._buffers.items():
            if t is not None and t.is_floating_point() and t.dtype != dtype:
                module._buffers[name] = t.to(dtype)


@functools.lru_cache(maxsize=4096)
def _trace(
    model: tuple,
    b: int,
    tp: int,
    sp: bool,
    cp: int,
    cp_comm: str,
    precision: str,
    documents: bool,
    ep: int,
    first: bool,
    last: bool,
    layers: tuple[int, ...],
    policy: str,
) -> int:
    """Bytes the chunk of global ``layers`` (with the embedding if ``first``, the head and loss if ``last``) keeps
    for backward after one micro-batch's forward under recomputation ``policy`` (a label with ``/N``)."""
    m = ModelConfig(*model)
    layout = Layout(micro_batch_size=b, tp=tp, sequence_parallel=sp, cp=cp, cp_comm=cp_comm, document_mask=documents)
    batch = _batch(m, layout)
    dtype = PRECISION_DTYPES[precision]
    name, modules, every = parse_label(policy)
    # held_by_forward collects garbage to see what the forward really left alive; the objects that existed before
    # the trace are none of it, and leaving them out of the collection (a full one costs ~0.5 s in a big process)
    # leaves the count unchanged.
    gc.freeze()
    try:
        return _traced(m, layout, batch, dtype, precision, ep, first, last, layers, name, modules, every)
    finally:
        gc.unfreeze()


def _traced(
    m: ModelConfig,
    layout: Layout,
    batch: Batch,
    dtype: torch.dtype,
    precision: str,
    ep: int,
    first: bool,
    last: bool,
    layers: tuple[int, ...],
    name: str,
    modules: tuple[str, ...],
    every: int,
) -> int:
    b, tp, sp, cp, cp_comm = layout.micro_batch_size, layout.tp, layout.sequence_parallel, layout.cp, layout.cp_comm
    with _fake_groups(tp, cp) as (tp_group, cp_group), FakeTensorMode() as mode:
        rng = RNGTracker(0)
        ep_group = GroupShape(0, ep) if ep > 1 else None
        chunk = GPT(m, tp_group, sp, rng, layers, first, last, cp_group, cp_comm, ep_group)
        for block in chunk.layers.values():
            if m.moe.enabled and m.moe.is_sparse(block.attn.layer):
                block.mlp = _NoMLP()
        _fake_cast(chunk, dtype)
        set_loss_multiplier(chunk, 1.0)  # as a runner has it: the auxiliary losses' graph kept
        apply_activation_checkpointing(chunk, name, modules=modules, every=every)
        tokens, targets = mode.from_tensor(batch.tokens), mode.from_tensor(batch.targets)
        ids = None if batch.documents is None else mode.from_tensor(batch.documents)
        positions = None if batch.positions is None else mode.from_tensor(batch.positions)
        index = None if batch.index is None else mode.from_tensor(batch.index)
        inputs = [t for t in (tokens, targets, ids, positions, index) if t is not None]
        rope = [a.inv_freq for a in chunk.modules() if getattr(a, "inv_freq", None) is not None]
        state = [*chunk.parameters(), *chunk.buffers(), *rope]

        def forward() -> object:
            x = tokens
            if not first:  # the residual stream received from the stage before, into a buffer of the step's
                shape = (b, tokens.shape[1] // (tp if sp and tp > 1 else 1), m.d_model)
                x = torch.empty(shape, dtype=dtype).requires_grad_()
            with autocast(precision, torch.device("cpu")), rng.context(0, range(b)):
                out = chunk(x, documents=ids, positions=positions, index=index)
            # What a runner keeps of a forward until its backward (parallel/pipeline/executor.py ``saved``): the
            # received input and the output it runs backward from, the last chunk's loss.
            return x, chunk.loss_sum(out, targets) if last else out

        _, held = held_by_forward(forward, [*state, *inputs])
    return held


def chunk_bytes(m: ModelConfig, layout: Layout, chunk: int, policy: str) -> tuple[int, list[tuple[str, int]]]:
    """What model chunk ``chunk`` (a virtual stage) keeps per micro-batch under ``policy``, traced, but for its sparse
    layers' MLPs; and those: (the policy each sparse layer runs under, its count)."""
    chunks = layout.pp * layout.vpp
    held = list(stage_layers(m.n_layers, layout.pp, layout.vpp, chunk))
    name, _, every = parse_label(policy)
    recomputed = set(recomputed_layers(held, name, every))
    by_kind: dict[tuple[bool, bool], list[int]] = {}
    for i in held:
        by_kind.setdefault((i in recomputed, m.moe.is_sparse(i)), []).append(i)
    sp = layout.sequence_parallel and layout.tp > 1

    def trace(layers: list[int]) -> int:
        return _trace(
            _key(m),
            layout.micro_batch_size,
            layout.tp,
            sp,
            layout.cp,
            layout.cp_comm if layout.cp > 1 else "ring",
            layout.precision,
            layout.document_mask,
            layout.ep,
            chunk == 0,
            chunk == chunks - 1,
            tuple(sorted(layers)),
            policy,
        )

    one_each = [indices[0] for indices in by_kind.values()]
    total = trace(one_each)
    for indices in by_kind.values():
        if len(indices) > 1:
            total += (len(indices) - 1) * (trace([*one_each, indices[1]]) - trace(one_each))
    kept = policy.partition("/")[0]
    sparse = [(kept if r else "none", len(indices)) for (r, s), indices in by_kind.items() if s]
    return total, sparse
