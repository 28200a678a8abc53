"""Activations traced: what a rank's real model chunk keeps for backward, counted on fake tensors.

A chunk (trident/build.py ``chunk_model``'s GPT of a virtual stage's layers, with the embedding on the first and
the final norm, head and loss on the last) is built and run for one micro-batch under torch's ``FakeTensorMode``,
under the recomputation policy applied as a run applies it (models/checkpointing.py), and measured with the
runtime's own tool (trident/memory/measure.py ``held_by_forward``): the storages created during the forward and
alive after it: by construction the count a real forward's measurement makes, a model feature (a norm, a head
width, a recomputation module) counted with no estimator code. Fake tensors have no data: nothing is allocated.

A pipeline's chunk is run as the executor runs it (parallel/pipeline/executor.py): after the first from a residual
stream received into a buffer that requires grad, and counted with what the executor keeps of the forward until its
backward, the received buffer and the output (the last chunk's loss), as a real chunk keeps them
(tests/test_memory_pipeline.py).

A context-parallel chunk traces as a real cp rank runs it, to the byte (tests/test_cp_memory.py); a GPU layout cannot
trace on a CPU build of torch. Both keep the formula (``traceable``; docs/planning.md, "Memory before launch", says
why). A zero-bubble chunk's deferred I is traced for what it keeps until W (``traced_weight_pass_bytes``). How layers
of a kind, sparse layers' routing and the fake process group are traced: docs/planning.md, "How a chunk is traced".
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.measure import held_by_forward
from trident.memory.params import _key
from trident.models.checkpointing import apply_activation_checkpointing, parse_label, recomputed_layers
from trident.models.gpt import GPT
from trident.models.moe import MoE, TracedRouting, set_loss_multiplier
from trident.parallel.batch import Batch, document_ids
from trident.parallel.context.batch import context_part
from trident.parallel.pipeline.stages import stage_layers
from trident.parallel.precision import autocast
from trident.parallel.random import RNGTracker
from trident.parallel.wgrad import WeightGradStore, defer_weight_grads
from trident.peak import PRECISION_DTYPES

EOS = 1  # packed documents' separator in the traced batch: an eos every 7 tokens, documents crossing cp chunks
DOCUMENT_EVERY = 7


def traceable(m: ModelConfig, layout: Layout) -> bool:
    """Whether the estimator traces ``layout``'s activations: a CPU layout without context parallelism. A GPU layout
    and a cp layout keep trident/memory/activations.py's formula for now (see the module docstring)."""
    return layout.device == "cpu" and layout.cp == 1


_Groups = tuple[dist.ProcessGroup | None, dist.ProcessGroup | None, dist.ProcessGroup | None]


@contextlib.contextmanager
def _fake_groups(tp: int, cp: int, ep: int) -> Iterator[_Groups]:
    """(tp group, cp group, ep group) of a fake world this process is rank 0 of, for the trace's duration; None
    for a group of one."""
    if tp == cp == ep == 1:
        yield None, None, None
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore

    with _own_world():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp * cp * ep)
        # Ranks as trident/parallel/topology.py orders them: tp fastest, then cp within each dp rank; an ep group
        # the first ep members of rank 0's dp x cp group.
        tp_group = dist.new_group(list(range(tp))) if tp > 1 else None
        cp_group = dist.new_group(list(range(0, tp * cp, tp))) if cp > 1 else None
        ep_group = dist.new_group(list(range(0, tp * ep, tp))) if ep > 1 else None
        yield tp_group, cp_group, ep_group


# torch.distributed's module state of a world (distributed_c10d's maps that ``_World`` reads; the default group's
# init method besides), which ``_own_world`` sets aside.
_WORLD_STATE = ("_pg_map", "_pg_names", "_pg_group_ranks", "_pg_backend_config", "_tags_to_pg", "_pg_to_tag")


@contextlib.contextmanager
def _own_world() -> Iterator[None]:
    """torch.distributed's state of a world of the trace's own, the process's (a training run's groups, if any) set
    aside meanwhile and given back whole: the module's ``_world`` (the default group) and the maps it reads (every
    group's ranks, names, tags and backend), swapped for fresh ones whose group names no real group has (they count
    on from a million past the real world's), and torch's C++ registry of groups by name, from which the trace's
    own are removed one by one (``destroy_process_group`` would remove the real ones too), the global rank set
    back."""
    c10d = dist.distributed_c10d
    real_world, count = c10d._world, c10d._group_count
    real = {name: getattr(c10d, name) for name in (*_WORLD_STATE, "_default_pg_init_method")}
    rank = real_world.default_pg.rank() if real_world.default_pg is not None else -1
    for name in _WORLD_STATE:
        setattr(c10d, name, {})
    c10d._default_pg_init_method = None
    c10d._world, c10d._group_count = c10d._World(), count + 1_000_000
    try:
        yield
    finally:
        for name in list(c10d._pg_names.values()):
            c10d._unregister_process_group(name)
        for name, value in real.items():
            setattr(c10d, name, value)
        c10d._world, c10d._group_count = real_world, count
        torch._C._distributed_c10d._set_global_rank(rank)


class _ShapesOnly(TorchDispatchMode):
    """What fake tensors cannot run for a sparse layer, by its shapes alone: ``bincount`` (its length depends on
    the largest value; every count of models/moe.py has ``minlength`` above its values, so that length, the values
    left unknown as fake tensors leave them all) and ``_grouped_mm`` outside bf16 (torch's meta function has only
    the CUDA kernel's dtype check; the CPU kernel takes fp32 too, shaped alike: [rows, out], a weight's gradient
    [groups, in, out])."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten.bincount.default:
            x, minlength = args[0], kwargs.get("minlength", args[2] if len(args) > 2 else 0)
            return torch.zeros(minlength, dtype=torch.int64, device=x.device)
        if func is torch.ops.aten._grouped_mm.default and args[0].dtype != torch.bfloat16:
            a, b = args[0], args[1]
            if a.dim() == b.dim() == 2:  # the weights' gradient, a group per offset
                return a.new_empty((len(kwargs["offs"] if "offs" in kwargs else args[2]), a.shape[0], b.shape[1]))
            if a.dim() != 2 or b.dim() != 3:
                raise NotImplementedError(f"the trace runs _grouped_mm of 2-D rows by 3-D weights, not {func}")
            return a.new_empty((a.shape[0], b.shape[-1]))
        return func(*args, **kwargs)


def traced_routing(m: ModelConfig, layout: Layout, sent: int, received: int) -> TracedRouting:
    """A routing of ``sent`` pairs kept by this rank (ep rank 0) and ``received`` rows for its experts from the ep
    group (trident/memory/activations.py ``routed_rows``): its L = E / ep experts take received / ep of its own
    pairs and as many from every other rank, the rest of its pairs go to the others' experts, each count as even as
    integers allow (what a layer keeps depends on the totals alone)."""
    experts, ep = m.moe.experts, layout.ep
    local = experts // ep
    own = received // ep

    def even(total: int, parts: int) -> list[int]:
        return [total // parts + (i < total % parts) for i in range(parts)]

    if ep == 1:
        return TracedRouting(even(sent, experts))
    mine = even(own, local)
    return TracedRouting(mine + even(sent - own, experts - local), [mine] * ep)


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
    rows: tuple[int, int] | None = None,
    weight_pass: bool = False,
) -> int:
    """Bytes the chunk of global ``layers`` (with the embedding if ``first``, the head and loss if ``last``) keeps
    for backward after one micro-batch's forward under recomputation ``policy`` (a label with ``/N``); its sparse
    layers routed as ``rows`` says (``traced_routing``); with ``weight_pass`` what it keeps after a deferred I."""
    m = ModelConfig(*model)
    layout = Layout(
        micro_batch_size=b, tp=tp, sequence_parallel=sp, cp=cp, cp_comm=cp_comm, document_mask=documents, ep=ep
    )
    batch = _batch(m, layout)
    routing = traced_routing(m, layout, *rows) if rows is not None else None
    # held_by_forward collects garbage to see what the forward really left alive; the objects that existed before
    # the trace are none of it, and leaving them out of the collection (a full one costs ~0.5 s in a big process)
    # leaves the count unchanged.
    gc.freeze()
    try:
        return _traced(m, layout, batch, precision, first, last, layers, policy, routing, weight_pass)
    finally:
        gc.unfreeze()


def _traced(
    m: ModelConfig,
    layout: Layout,
    batch: Batch,
    precision: str,
    first: bool,
    last: bool,
    layers: tuple[int, ...],
    policy: str,
    routing: TracedRouting | None,
    weight_pass: bool = False,
) -> int:
    b, tp, sp, cp, ep = layout.micro_batch_size, layout.tp, layout.sequence_parallel, layout.cp, layout.ep
    dtype = PRECISION_DTYPES[precision]
    name, modules, every = parse_label(policy)
    with _fake_groups(tp, cp, ep) as (tp_group, cp_group, ep_group), FakeTensorMode() as mode:
        rng = RNGTracker(0)
        chunk = GPT(m, tp_group, sp, rng, layers, first, last, cp_group, layout.cp_comm, ep_group)
        for module in chunk.modules():
            if isinstance(module, MoE):
                module.traced = routing
        _fake_cast(chunk, dtype)
        set_loss_multiplier(chunk, 1.0)  # as a runner has it: the auxiliary losses' graph kept
        apply_activation_checkpointing(chunk, name, modules=modules, every=every)
        store = WeightGradStore()
        if weight_pass:
            defer_weight_grads(chunk, store)
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
                out = chunk(x, documents=ids, positions=positions, index=index, keys=batch.keys, targets=targets)
            # What a runner keeps of a forward until its backward (parallel/pipeline/executor.py ``saved``): the
            # received input and the output it runs backward from, the last chunk's loss.
            if not weight_pass:
                return x, out
            store.deferring = True  # the executor's deferred I: what it keeps for W alone outlives it
            torch.autograd.backward(out, torch.ones_like(out))
            for p in chunk.parameters():
                p.grad = None
            return store.take()

        with _ShapesOnly() if m.moe.enabled else contextlib.nullcontext():  # a mode costs every op a call
            _, held = held_by_forward(forward, [*state, *inputs])
    return held


def _canonical(m: ModelConfig, layers: Iterable[int], policy: str) -> tuple[int, ...]:
    """``layers`` in order, each replaced by the first global index after the one before of the same kind (recomputed
    under ``policy`` or not, sparse or dense): a chunk of the same shapes, so that chunks alike share one trace
    (what a layer keeps depends on its kind, not its index)."""
    name, _, every = parse_label(policy)

    def kind(i: int) -> tuple[bool, bool]:
        return bool(recomputed_layers([i], name, every)), m.moe.is_sparse(i)

    out: list[int] = []
    for i in sorted(layers):
        j = out[-1] + 1 if out else 0
        while kind(j) != kind(i):
            j += 1
        out.append(j)
    return tuple(out)


def chunk_bytes(m: ModelConfig, layout: Layout, chunk: int, policy: str, rows: tuple[int, int] | None = None) -> int:
    """What model chunk ``chunk`` (a virtual stage) keeps per micro-batch under ``policy``, traced; a sparse layer
    routed as ``rows`` says (pairs this rank keeps, rows its experts receive: trident/memory/activations.py
    ``routed_rows``)."""
    chunks = layout.pp * layout.vpp
    held = list(stage_layers(m.n_layers, layout.pp, layout.vpp, chunk))
    name, _, every = parse_label(policy)
    recomputed = set(recomputed_layers(held, name, every))
    by_kind: dict[tuple[bool, bool], list[int]] = {}
    for i in held:
        by_kind.setdefault((i in recomputed, m.moe.is_sparse(i)), []).append(i)

    def trace(layers: list[int]) -> int:
        return _trace_layers(m, layout, layers, policy, rows, chunk == 0, chunk == chunks - 1)

    total = trace([indices[0] for indices in by_kind.values()])
    kept = policy.partition("/")[0]
    for (recomputed_kind, sparse), indices in by_kind.items():  # the others of a kind: its layer's bytes each
        if len(indices) > 1:
            policy_of = kept if recomputed_kind else "none"
            total += (len(indices) - 1) * traced_layer_bytes(m, layout, policy_of, sparse, rows)
    return total


def _trace_layers(
    m: ModelConfig,
    layout: Layout,
    layers,
    policy: str,
    rows: tuple[int, int] | None,
    first: bool,
    last: bool,
    direct: bool = False,
) -> int:
    """``_trace`` of these layers of ``m`` in one chunk (the embedding on it if ``first``, the head if ``last``),
    keyed by what of the layout shapes them. What a chunk keeps is affine in its micro-batch's sequences b from two
    on (each tensor is per sequence, like the activations and the routing's rows, or shared by them, like RoPE's
    tables and a causal mask; at one some per-sequence copies are views), so above three sequences it is the traces
    of two and three extrapolated (``direct``: traced at b all the same; tests/test_memory_trace.py checks the two
    agree): the planner's many micro-batch sizes cost at most three traces."""
    b = layout.micro_batch_size
    if rows is not None and m.moe.enabled and (rows[0] % b or rows[1] % b):
        direct = True  # a routing not even over the sequences (none routed_rows gives): traced as it is

    def at(n: int) -> int:
        routed = (rows[0] // b * n, rows[1] // b * n) if rows is not None and m.moe.enabled else None
        return _trace(
            _key(m),
            n,
            layout.tp,
            layout.sequence_parallel and layout.tp > 1,
            layout.cp,
            layout.cp_comm if layout.cp > 1 else "ring",
            layout.precision,
            layout.document_mask,
            layout.ep,
            first,
            last,
            _canonical(m, layers, policy),
            policy,
            routed,
        )

    if direct or b <= 3:
        return at(b)
    two, three = at(2), at(3)
    return two + (b - 2) * (three - two)


def traced_layer_bytes(
    m: ModelConfig, layout: Layout, policy: str, sparse: bool, rows: tuple[int, int] | None = None
) -> int:
    """What one layer of a kind (``sparse`` or dense) keeps per micro-batch under ``policy`` (a label without
    ``/N``), traced: a one-chunk model with the layer beside another (or alone, in a one-layer model) less the same
    without it, as ``chunk_bytes`` scales a kind."""
    layer = next(i for i in range(m.n_layers) if m.moe.is_sparse(i) == sparse)
    others = tuple(i for i in range(m.n_layers) if i != layer)[:1]

    def trace(layers: tuple[int, ...]) -> int:
        return _trace_layers(m, layout, layers, policy, rows, True, True)

    return trace((*others, layer)) - trace(others)


def traced_weight_pass_bytes(m: ModelConfig, layout: Layout, sparse: bool, rows: tuple[int, int] | None = None) -> int:
    """What a deferred I keeps for W of one layer of a kind per micro-batch (parallel/wgrad.py), traced on a middle
    chunk of that layer alone; its sparse layers routed as ``rows`` says."""
    layer = next(i for i in range(m.n_layers) if m.moe.is_sparse(i) == sparse)
    sp, comm = layout.sequence_parallel and layout.tp > 1, layout.cp_comm if layout.cp > 1 else "ring"
    shape = (layout.tp, sp, layout.cp, comm, layout.precision, layout.document_mask, layout.ep)
    return _trace(_key(m), layout.micro_batch_size, *shape, False, False, (layer,), "none", rows, True)
