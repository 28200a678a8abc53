"""The planner's space as the tests read it whole (trident/plan/space.py): the full grid of every planned key, and
every candidate of ``Space`` with the validator's verdict."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from trident.config import Config
from trident.layout import PLANNED_KEYS, Layout
from trident.parallel.context.attention import CP_COMMS
from trident.parallel.pipeline.schedules import SCHEDULES
from trident.parallel.zero.stage3 import GATHER_MODES
from trident.plan.space import OFFLOAD_RATIOS, RECOMPUTATIONS, Keys, Space, divisors


def _keys(*values: object) -> Keys:
    return dict(zip(PLANNED_KEYS, values, strict=True))


def grid(cfg: Config, world: int) -> Iterator[Keys]:
    """The full product of every planned key's domain for this model, world and global batch (dp left to the
    world)."""
    m, tr = cfg.model, cfg.train
    offloads = (("none", 1.0), *(("cpu", r) for r in OFFLOAD_RATIOS))
    for cp, comm, tp, pp, vpp, schedule, zero, (offload, ratio), sp, mbs, (
        recompute,
        every,
    ), gather, ep in itertools.product(
        divisors(world),
        CP_COMMS,
        divisors(world),
        divisors(world),
        divisors(m.n_layers),
        (None, *SCHEDULES),
        range(4),
        offloads,
        (False, True),
        divisors(tr.global_batch_size),
        RECOMPUTATIONS,
        GATHER_MODES,
        divisors(world) if m.moe.enabled else (1,),
    ):
        yield _keys(None, cp, comm, tp, pp, vpp, schedule, zero, offload, ratio, sp, mbs, recompute, every, gather, ep)


@dataclass
class Enumeration:
    accepted: list[tuple[Layout, Config]]  # the validator's layout, and the config that launches it
    refused: list[tuple[Keys, str]]  # the validator's line


def enumerate_layouts(cfg: Config, world: int) -> Enumeration:
    """Every candidate with the validator's verdict (as ``Space`` reads them), shape by shape, each with every
    variant."""
    out = Enumeration([], [])
    space = Space(cfg, world)
    for i in range(len(space.shapes)):
        for j in range(len(space.variants)):
            verdict = space.verdict(i, j)
            if isinstance(verdict, str):
                out.refused.append((space.keys(i, j), verdict))
            else:
                out.accepted.append((verdict, verdict.apply(cfg)))
    return out
