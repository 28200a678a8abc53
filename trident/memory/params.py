"""The parameters a rank holds, read from the model itself.

A rank of pipeline stage r holds the model chunks of virtual stages r, r + pp, ... (parallel/pipeline/stages.py), or
under zb-v's V placement r and 2 pp - 1 - r (parallel/pipeline/schedules.py ``stage_of``).
Each is built as trident/build.py builds it (``chunk_model``: the GPT of the stage's layers, the embedding on the
first, the final norm and LM head on the last) but on the meta device, with a ``GroupShape`` (parallel/comm.py) in
place of the tp group: every layer shapes its parameters as on a real tp rank, and nothing is allocated or
communicated. Every tp rank holds the same local shapes (the vocabulary is padded to split evenly, and grouped-query
kv weights that tp does not divide are held whole by every rank), so tp rank 0 stands for all of them;
tests/test_memory.py builds every rank, and compares the meta chunks with real ones.

From the chunks come the parameters' names and sizes in registration order (``StageParams.named``), each chunk's,
and the flat layout the runtime lays them out in (``StageParams.flat``: trident/build.py ``flat_layout`` itself,
on the meta parameters: the reducer's buckets, or ZeRO-3's one per block, and the parameters isolated in buckets of
their own by their placements, a tied embedding and its copy under pp > 1). The model's whole count stays
``count_params``'s formula (models/gpt.py), which the tests check against the meta model.

Building a stage costs a few milliseconds per layer and the planner prices thousands of layouts, so a stage is built
once per (model, tp, pp, vpp, sequence parallelism) and its flat layouts once per (ZeRO 3 or not, dp, buckets).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from dataclasses import dataclass, field

import torch

from trident.build import chunk_model, flat_layout
from trident.config import ModelConfig
from trident.layout import Layout
from trident.models.gpt import GPT, CausalSelfAttention
from trident.parallel.comm import GroupShape
from trident.parallel.layout import FlatLayout
from trident.parallel.pipeline.schedules import V, holder_of, stage_of, stage_placement
from trident.parallel.zero.stage3 import ChunkUnits


def rank_chunks(layout: Layout, stage: int) -> list[int]:
    """The global indices of the model chunks pipeline stage ``stage`` holds: stage, stage + pp, ... (under zb-v
    stage and 2 pp - 1 - stage), as build.py places them."""
    placement = stage_placement(layout.schedule)
    return [stage_of(v, stage, layout.pp, placement) for v in range(layout.vpp)]


def chunk_models(m: ModelConfig, layout: Layout, stage: int, tp_rank: int = 0) -> list[GPT]:
    """The model chunks tp rank ``tp_rank`` of pipeline stage ``stage`` holds, built on the meta device (under
    expert parallelism ep rank 0's experts: every ep rank holds as many)."""
    group, ep_group = GroupShape(tp_rank, layout.tp), GroupShape(0, layout.ep) if layout.ep > 1 else None
    with torch.device("meta"):
        return [chunk_model(m, layout, c, group, ep_group=ep_group) for c in rank_chunks(layout, stage)]


@dataclass(eq=False)
class StageParams:
    """The parameters a rank of pipeline stage ``stage`` holds: its model chunks on the meta device."""

    stage: int
    chunks: list[GPT]
    _flat: dict[tuple, tuple[FlatLayout, list[ChunkUnits]]] = field(default_factory=dict, repr=False)

    @functools.cached_property
    def per_chunk(self) -> list[list[tuple[str, int]]]:
        """(name, local numel) of each chunk's parameters, in registration order."""
        return [[(name, p.numel()) for name, p in chunk.named_parameters()] for chunk in self.chunks]

    @functools.cached_property
    def named(self) -> list[tuple[str, int]]:
        """(name, local numel) of every parameter, chunk after chunk."""
        return [p for chunk in self.per_chunk for p in chunk]

    @functools.cached_property
    def numel(self) -> int:
        """Parameter elements the rank holds (local, unpadded)."""
        return sum(n for _, n in self.named)

    def flat(self, layout: Layout) -> tuple[FlatLayout, list[ChunkUnits]]:
        """The flat layout of these parameters at ``layout``'s ZeRO stage, dp and buckets, as trident/build.py lays
        them out, and at stage 3 each chunk's buckets."""
        n = layout.grad_ranks  # the buckets are padded to split over dp x cp
        key = (n, True) if layout.zero == 3 else (n, False, layout.bucket_mb, layout.precision)
        if key not in self._flat:
            self._flat[key] = flat_layout(self.chunks, layout, n)
        return self._flat[key]


def stage_params(m: ModelConfig, layout: Layout, stage: int) -> StageParams:
    """The parameters a rank of pipeline stage ``stage`` holds under ``layout`` (built once per model, tp, pp, vpp
    and sequence parallelism)."""
    sp = layout.sequence_parallel and layout.tp > 1
    placement = stage_placement(layout.schedule)
    return _stage_params(_key(m), layout.tp, layout.pp, layout.vpp, sp, stage, placement, layout.ep)


def chunk_params(m: ModelConfig, layout: Layout, chunk: int) -> list[tuple[str, int]]:
    """(name, local numel) of model chunk ``chunk`` of pp * vpp (its virtual stage), in registration order."""
    rank, local = holder_of(chunk, layout.pp, stage_placement(layout.schedule))
    return stage_params(m, layout, rank).per_chunk[local]


def local_heads(m: ModelConfig, tp: int) -> tuple[int, int]:
    """The query heads and the key/value heads a tp rank computes, as the model's attention has them: its 1/tp of
    the kv heads when tp divides them, else the one its query heads read."""
    return _local_heads(_key(m), tp)


# A model config as a hashable value (the config is a mutable dataclass): its fields in order, so that
# ``ModelConfig(*key)`` rebuilds it. An attrgetter: the planner makes a key for every layout it prices.
_fields = operator.attrgetter(*(f.name for f in dataclasses.fields(ModelConfig)))


def _key(m: ModelConfig) -> tuple:
    key = _fields(m)
    # The one list field (model.eos_ids, an imported model's) as a tuple, which hashes.
    return key if m.eos_ids is None else tuple(tuple(v) if isinstance(v, list) else v for v in key)


@functools.lru_cache(maxsize=512)
def _stage_params(
    model: tuple, tp: int, pp: int, vpp: int, sp: bool, stage: int, placement: str, ep: int = 1
) -> StageParams:
    # One build per placement: the V's schedule stands for it (every loop-placed schedule places alike).
    schedule = "zb-v" if placement == V else None
    layout = Layout(dp=ep, tp=tp, pp=pp, vpp=vpp, sequence_parallel=sp, schedule=schedule, ep=ep)
    return StageParams(stage, chunk_models(ModelConfig(*model), layout, stage))


@functools.lru_cache(maxsize=512)
def _local_heads(model: tuple, tp: int) -> tuple[int, int]:
    with torch.device("meta"):
        attention = CausalSelfAttention(ModelConfig(*model), GroupShape(0, tp), False, None, 0)
    return attention.n_heads, attention.n_kv_heads
