"""The layouts a launch could use: every combination of the planned keys (trident/layout.py ``PLANNED_KEYS``), kept
or refused by train.py's own validator (trident/config/validate.py ``validate``), never by rules of the planner's.

Context parallelism (``parallel.cp``, with each ``parallel.cp_comm``) is a dimension like the others: cp ranks
splitting each sequence, dp the world left over by cp x tp x pp. So is expert parallelism (``parallel.ep``) for a
model with experts: every ep dividing both dp and the expert count (1 for a dense model).

The planner's candidates are layouts: the validator resolves each combination of keys into the one ``Layout`` the
launch would run. ``grid`` is the keys' full product over each key's domain; ``key_sets`` skips the combinations
that only repeat another launch (a schedule named at pp = 1, an offload ratio with no offload, a gather mode below
ZeRO 3, ...) or cannot name a launch of this world, and ``enumerate_layouts`` hands each one to ``validate``.
tests/test_plan.py checks that what it lists is exactly what the validator accepts of the full grid.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from trident.config import Config, validate
from trident.errors import ConfigError
from trident.layout import PLANNED_KEYS, Layout, with_keys
from trident.parallel.context.attention import CP_COMMS
from trident.parallel.pipeline.schedules import SCHEDULES
from trident.parallel.zero.stage3 import GATHER_MODES

# (train.activation_checkpointing, train.recompute_every), one domain: no recomputation, op-level selective, full
# recomputation of every second block (memory between none and full at half its recompute) and of every block.
# attention is left out (selective keeps less for no more matmul work), as are selective's other module lists.
RECOMPUTATIONS = (("none", 1), ("selective", 1), ("full", 2), ("full", 1))
OFFLOAD_RATIOS = (0.5, 1.0)

Keys = dict[str, object]  # planned key -> value


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


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


def key_sets(cfg: Config, world: int) -> Iterator[Keys]:
    """The grid without repeats of one launch and without what cannot name a launch of this world: cp x tp x pp not
    dividing it, or a micro-batch not dividing the batch each dp rank takes. At cp = 1 the exchange is unused (the
    validator resolves it to the default), so only the default is listed."""
    m, tr = cfg.model, cfg.train
    for cp, tp in itertools.product(divisors(world), divisors(world)):
        if world % (cp * tp):
            continue
        for comm, pp in itertools.product(CP_COMMS if cp > 1 else (Layout.cp_comm,), divisors(world // (cp * tp))):
            dp = world // (cp * tp * pp)
            eps = [e for e in divisors(dp) if m.moe.experts % e == 0] if m.moe.enabled else [1]
            per_rank = tr.global_batch_size // dp if tr.global_batch_size % dp == 0 else 0
            for vpp in divisors(m.n_layers // pp) if pp > 1 and m.n_layers % pp == 0 else [1]:
                schedules = [None] if pp == 1 else ["gpipe", "1f1b", "zb-h1"] if vpp == 1 else ["interleaved"]
                if vpp == 2 and pp > 1:
                    schedules.append("zb-v")
                for schedule, zero in itertools.product(schedules, range(4)):
                    offloads = [("none", 1.0)] + ([("cpu", r) for r in OFFLOAD_RATIOS] if zero >= 1 else [])
                    for (offload, ratio), (recompute, every), mbs, sp, gather, ep in itertools.product(
                        offloads,
                        RECOMPUTATIONS,
                        divisors(per_rank) if per_rank else [],
                        (False, True) if tp > 1 else (False,),
                        GATHER_MODES if zero == 3 else ("micro_batch",),
                        eps,
                    ):
                        yield _keys(
                            None,
                            cp,
                            comm,
                            tp,
                            pp,
                            vpp,
                            schedule,
                            zero,
                            offload,
                            ratio,
                            sp,
                            mbs,
                            recompute,
                            every,
                            gather,
                            ep,
                        )


@dataclass
class Enumeration:
    accepted: list[tuple[Layout, Config]]  # the validator's layout, and the config that launches it
    refused: list[tuple[Keys, str]]  # the validator's line


def judge(cfg: Config, world: int, keys: Keys) -> tuple[Layout, Config] | str:
    """The validator's verdict on one candidate: its layout and the config that launches it, or its line."""
    try:
        layout = validate(with_keys(cfg, keys), world)
    except ConfigError as e:
        return str(e)
    return layout, layout.apply(cfg)


def enumerate_layouts(cfg: Config, world: int) -> Enumeration:
    """Every candidate with the validator's verdict."""
    out = Enumeration([], [])
    for keys in key_sets(cfg, world):
        verdict = judge(cfg, world, keys)
        if isinstance(verdict, str):
            out.refused.append((keys, verdict))
        else:
            out.accepted.append(verdict)
    return out
