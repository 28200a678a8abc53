"""The layouts a launch could use: every combination of the planned keys (trident/layout.py ``PLANNED_KEYS``), kept
or refused by train.py's own validator (trident/config/validate.py ``validate``), never by rules of the planner's.

Context parallelism (``parallel.cp``, with each ``parallel.cp_comm``) is a dimension like the others: cp ranks
splitting each sequence, dp the world left over by cp x tp x pp. So is expert parallelism (``parallel.ep``) for a
model with experts: every ep dividing both the dp x cp ranks that hold the same piece of the model (an ep group is
a run of them, parallel/topology.py) and the expert count (1 for a dense model).

The planner's candidates are layouts: the validator resolves each combination of keys into the one ``Layout`` the
launch would run. The candidates skip, of the keys' full product over each key's domain (the tests' ``grid``,
tests/helpers/plan_space.py), the combinations that only repeat another launch (a schedule named at pp = 1, an
offload ratio with no offload, a gather mode below ZeRO 3, ...) or cannot name a launch of this world: they are
every shape (``shapes``: cp, tp, pp, vpp, schedule, sequence parallelism, micro-batch, ep) with every variant
(``variants``: ZeRO, offload, recomputation, gather mode). ``Space`` has the validator judge each shape and each
variant once, not each of their hundreds of thousands of products. tests/test_plan.py checks that what it accepts
is exactly what the validator accepts of the full grid.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator

from trident.config import Config, validate
from trident.errors import ConfigError
from trident.layout import PLANNED_KEYS, Layout, with_keys
from trident.parallel.context.attention import CP_COMMS
from trident.parallel.zero.stage3 import GATHER_MODES

# (train.activation_checkpointing, train.recompute_every), one domain: no recomputation, op-level selective, full
# recomputation of every second block (memory between none and full at half its recompute) and of every block.
# attention is left out (selective keeps less for no more matmul work), as are selective's other module lists.
RECOMPUTATIONS = (("none", 1), ("selective", 1), ("full", 2), ("full", 1))
OFFLOAD_RATIOS = (0.5, 1.0)

Keys = dict[str, object]  # planned key -> value


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# The keys a shape is (how the ranks split the model and the batch) and those a variant is (what each rank keeps and
# recomputes), in the order a candidate's keys list them.
SHAPE_KEYS = (
    "parallel.cp",
    "parallel.cp_comm",
    "parallel.tp",
    "parallel.pp",
    "parallel.vpp",
    "parallel.schedule",
    "parallel.sequence_parallel",
    "train.micro_batch_size",
    "parallel.ep",
)
VARIANT_KEYS = tuple(k for k in PLANNED_KEYS if k not in SHAPE_KEYS and k != "parallel.dp")


def shapes(cfg: Config, world: int) -> Iterator[Keys]:
    """The shapes of a launch of this world: cp, tp and pp whose product divides it, a micro-batch dividing the
    batch each dp rank takes, and expert parallelism drawn from the dp x cp ranks that hold the same piece of the
    model (parallel/topology.py), dividing the expert count (1 for a dense model). At cp = 1 the exchange is unused
    (the validator resolves it to the default), so only the default is listed; a schedule is named only at pp > 1."""
    m, tr = cfg.model, cfg.train
    for cp, tp in itertools.product(divisors(world), divisors(world)):
        if world % (cp * tp):
            continue
        for comm, pp in itertools.product(CP_COMMS if cp > 1 else (Layout.cp_comm,), divisors(world // (cp * tp))):
            dp = world // (cp * tp * pp)
            eps = [e for e in divisors(dp * cp) if m.moe.experts % e == 0] if m.moe.enabled else [1]
            per_rank = tr.global_batch_size // dp if tr.global_batch_size % dp == 0 else 0
            for vpp in divisors(m.n_layers // pp) if pp > 1 and m.n_layers % pp == 0 else [1]:
                schedules = [None] if pp == 1 else ["gpipe", "1f1b", "zb-h1"] if vpp == 1 else ["interleaved"]
                if vpp == 2 and pp > 1:
                    schedules.append("zb-v")
                for schedule, mbs, sp, ep in itertools.product(
                    schedules,
                    divisors(per_rank) if per_rank else [],
                    (False, True) if tp > 1 else (False,),
                    eps,
                ):
                    yield {
                        "parallel.cp": cp,
                        "parallel.cp_comm": comm,
                        "parallel.tp": tp,
                        "parallel.pp": pp,
                        "parallel.vpp": vpp,
                        "parallel.schedule": schedule,
                        "parallel.sequence_parallel": sp,
                        "train.micro_batch_size": mbs,
                        "parallel.ep": ep,
                    }


def variants() -> list[Keys]:
    """What a rank of any shape may keep and recompute: each ZeRO stage, optimizer offload (and its ratio) only with
    one, each recomputation, ZeRO-3's gather mode only at ZeRO 3. The first is the plain one (ZeRO 0, nothing
    offloaded or recomputed)."""
    out = []
    for zero in range(4):
        offloads = [("none", 1.0)] + ([("cpu", r) for r in OFFLOAD_RATIOS] if zero >= 1 else [])
        for (offload, ratio), (recompute, every), gather in itertools.product(
            offloads, RECOMPUTATIONS, GATHER_MODES if zero == 3 else ("micro_batch",)
        ):
            out.append(
                {
                    "parallel.zero": zero,
                    "parallel.offload.optimizer": offload,
                    "parallel.offload.ratio": ratio,
                    "parallel.zero3_gather": gather,
                    "train.activation_checkpointing": recompute,
                    "train.recompute_every": every,
                }
            )
    return out


def candidate(shape: Keys, variant: Keys) -> Keys:
    """One candidate's keys, in ``PLANNED_KEYS``' order (dp left to the world)."""
    both = {"parallel.dp": None, **shape, **variant}
    return {key: both[key] for key in PLANNED_KEYS}


class Space:
    """The candidates of a model, world and batch with the validator's verdicts, judged a shape and a variant at a
    time: each shape once with the plain variant, each variant once on the first accepted shape. A shape's keys and
    a variant's are read by separate rules of the validator, so a candidate is accepted exactly when both are, as
    the shape's layout with the fields the variant sets, and refused with its shape's line otherwise
    (tests/test_plan.py checks this against the validator on every point of the full grid). Where that cannot be
    read off (a variant refused, or no shape accepted to try the variants on), the candidate goes to ``judge``.
    ``keep`` (``_may_match``'s given keys) limits both."""

    def __init__(self, cfg: Config, world: int, keep: Callable[[Keys], bool] | None = None) -> None:
        self.cfg, self.world = cfg, world
        keep = keep or (lambda keys: True)
        self.variants = [v for v in variants() if keep(v)]
        self.shapes: list[Keys] = []
        self.bases: list[Layout | str] = []  # each shape's layout with the plain variant, or the validator's line
        plain = variants()[0]
        for shape in shapes(cfg, world):
            if keep(shape):
                self.shapes.append(shape)
                self.bases.append(_verdict(cfg, world, candidate(shape, plain)))
        reference = next((i for i, b in enumerate(self.bases) if not isinstance(b, str)), None)
        self.reference = reference  # the shape the variants are judged on (None: none is accepted)
        self.variant_keys = VARIANT_KEYS
        # Each variant as the layout fields it changes from the plain one (or its line, or None: not read off).
        self.changes: list[dict[str, object] | str | None] = []
        for variant in self.variants:
            if reference is None:
                self.changes.append(None)
                continue
            verdict = judge(cfg, world, candidate(self.shapes[reference], variant))
            if isinstance(verdict, str):
                self.changes.append(verdict)
                continue
            self.changes.append(_changed(self.bases[reference], verdict[0]))

    def keys(self, shape: int, variant: int) -> Keys:
        return candidate(self.shapes[shape], self.variants[variant])

    def verdict(self, shape: int, variant: int) -> Layout | str:
        """The validator's layout of one candidate, or its line."""
        base, change = self.bases[shape], self.changes[variant]
        if isinstance(change, dict):
            return base if isinstance(base, str) else dataclasses.replace(base, **change)
        verdict = judge(self.cfg, self.world, self.keys(shape, variant))
        return verdict if isinstance(verdict, str) else verdict[0]

    def recompute_of(self, variant: int) -> tuple[object, object]:
        """A variant's recomputation (its schedule walk and step bound are those of every ZeRO stage and offload)."""
        v = self.variants[variant]
        return v["train.activation_checkpointing"], v["train.recompute_every"]

    def readable(self, variant: int) -> bool:
        """Whether a variant's verdicts are read off its shape's (else each goes to ``judge``)."""
        return isinstance(self.changes[variant], dict)


def _verdict(cfg: Config, world: int, keys: Keys) -> Layout | str:
    """``judge``'s layout or line, without the config that launches it."""
    try:
        return validate(with_keys(cfg, keys), world)
    except ConfigError as e:
        return str(e)


def _changed(base: Layout, layout: Layout) -> dict[str, object]:
    return {
        f.name: getattr(layout, f.name)
        for f in dataclasses.fields(Layout)
        if getattr(layout, f.name) != getattr(base, f.name)
    }


def judge(cfg: Config, world: int, keys: Keys) -> tuple[Layout, Config] | str:
    """The validator's verdict on one candidate: its layout and the config that launches it, or its line."""
    try:
        layout = validate(with_keys(cfg, keys), world)
    except ConfigError as e:
        return str(e)
    return layout, layout.apply(cfg)
