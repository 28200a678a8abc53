"""The layouts a launch could use: every combination of the layout keys, kept or refused by train.py's own
validator (trident/config.py ``validate``), never by rules of the planner's.

A ``Candidate`` fixes the layout keys: tp, pp (dp is what the world leaves), vpp, schedule, ZeRO stage, optimizer
offload and its ratio, recomputation, micro-batch size, sequence parallelism and ZeRO-3's gather mode. ``grid`` is
their full product over each key's domain; ``candidates`` skips the combinations that only repeat another launch (a
schedule named at pp = 1, an offload ratio with no offload, a gather mode below ZeRO 3, ...) or that name a value
twice, and ``enumerate_layouts`` hands each one to ``validate``. tests/test_plan.py checks that what it lists is
exactly what the validator accepts of the full grid.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from trident.config import Config, ParallelConfig, resolve_schedule, validate
from trident.errors import ConfigError
from trident.parallel.pipeline.schedules import SCHEDULES
from trident.parallel.zero.stage3 import GATHER_MODES

POLICIES = ("none", "selective", "full")
OFFLOAD_RATIOS = (0.5, 1.0)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Candidate:
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    schedule: str | None = None
    zero: int = 0
    offload: str = "none"
    ratio: float = 1.0
    recompute: str = "none"
    micro_batch: int = 1
    sequence_parallel: bool = False
    zero3_gather: str = "micro_batch"  # parallel.zero3_gather: re-gather per micro-batch, or keep for the step

    def overrides(self) -> list[str]:
        """The train.py overrides that launch this layout (dp follows from the world size)."""
        out = [
            "parallel.dp=null",
            f"parallel.tp={self.tp}",
            f"parallel.pp={self.pp}",
            f"parallel.vpp={self.vpp}",
            f"parallel.schedule={self.schedule or 'null'}",
            f"parallel.zero={self.zero}",
            f"parallel.offload.optimizer={self.offload}",
            f"parallel.offload.ratio={self.ratio:g}",
            f"parallel.sequence_parallel={str(self.sequence_parallel).lower()}",
            f"train.micro_batch_size={self.micro_batch}",
            f"train.activation_checkpointing={self.recompute}",
            f"parallel.zero3_gather={self.zero3_gather}",
        ]
        return out

    def short(self, dp: int) -> str:
        """``dp4 tp2 pp2 1f1b zero1 mbs2``, naming only what differs from the defaults."""
        words = [f"dp{dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.vpp > 1:
            words.append(f"vpp{self.vpp}")
        if self.pp > 1:
            words.append(self.schedule or "1f1b")
        if self.sequence_parallel:
            words.append("sp")
        words.append(f"zero{self.zero}")
        if self.zero3_gather != "micro_batch":
            words.append(f"gather={self.zero3_gather}")
        if self.offload != "none":
            words.append(f"offload{self.ratio:g}")
        if self.recompute != "none":
            words.append(f"ac={self.recompute}")
        words.append(f"mbs{self.micro_batch}")
        return " ".join(words)

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with this layout's keys."""
        par = dataclasses.replace(
            cfg.parallel,
            dp=None,
            tp=self.tp,
            pp=self.pp,
            vpp=self.vpp,
            schedule=self.schedule,
            zero=self.zero,
            zero3_gather=self.zero3_gather,
            sequence_parallel=self.sequence_parallel,
            offload=dataclasses.replace(cfg.parallel.offload, optimizer=self.offload, ratio=self.ratio),
        )
        train = dataclasses.replace(
            cfg.train, micro_batch_size=self.micro_batch, activation_checkpointing=self.recompute
        )
        return dataclasses.replace(cfg, parallel=par, train=train)

    def canonical(self) -> Candidate:
        """The same launch written one way: the schedule train.py resolves (none at pp = 1), ratio 1 without
        offload, the default gather mode below ZeRO 3."""
        par = ParallelConfig(pp=self.pp, vpp=self.vpp, schedule=self.schedule)
        schedule = None if self.pp == 1 else resolve_schedule(par)
        ratio = self.ratio if self.offload != "none" else 1.0
        gather = self.zero3_gather if self.zero == 3 else "micro_batch"
        return dataclasses.replace(self, schedule=schedule, ratio=ratio, zero3_gather=gather)


def grid(cfg: Config, world: int) -> Iterator[Candidate]:
    """The full product of every layout key's domain for this model, world and global batch."""
    m, tr = cfg.model, cfg.train
    for tp in divisors(world):
        for pp in divisors(world):
            for vpp in divisors(m.n_layers):
                for schedule in (None, *SCHEDULES):
                    for zero in range(4):
                        for offload, ratio in (("none", 1.0), *(("cpu", r) for r in OFFLOAD_RATIOS)):
                            for recompute in POLICIES:
                                for mbs in divisors(tr.global_batch_size):
                                    for sp in (False, True):
                                        for gather in GATHER_MODES:
                                            yield Candidate(
                                                tp, pp, vpp, schedule, zero, offload, ratio, recompute, mbs, sp, gather
                                            )


def candidates(cfg: Config, world: int) -> Iterator[Candidate]:
    """The grid without repeats of one launch and without what cannot name a launch of this world: tp x pp not
    dividing it, or a micro-batch not dividing the batch each dp rank takes."""
    m, tr = cfg.model, cfg.train
    for tp in divisors(world):
        for pp in divisors(world // tp):
            dp = world // (tp * pp)
            for vpp in divisors(m.n_layers // pp) if pp > 1 and m.n_layers % pp == 0 else [1]:
                schedules = [None] if pp == 1 else ["interleaved"] if vpp > 1 else ["gpipe", "1f1b", "zb-h1"]
                for schedule in schedules:
                    for zero in range(4):
                        offloads = [("none", 1.0)] + ([("cpu", r) for r in OFFLOAD_RATIOS] if zero >= 1 else [])
                        for offload, ratio in offloads:
                            for recompute in POLICIES:
                                per_rank = tr.global_batch_size // dp if tr.global_batch_size % dp == 0 else 0
                                for mbs in divisors(per_rank) if per_rank else []:
                                    for sp in (False, True) if tp > 1 else (False,):
                                        for gather in GATHER_MODES if zero == 3 else ("micro_batch",):
                                            yield Candidate(
                                                tp, pp, vpp, schedule, zero, offload, ratio, recompute, mbs, sp, gather
                                            )


@dataclass
class Enumeration:
    accepted: list[tuple[Candidate, Config, int]]  # (candidate, its config, its dp)
    refused: list[tuple[Candidate, str]]  # the validator's line


def enumerate_layouts(cfg: Config, world: int) -> Enumeration:
    """Every candidate with the validator's verdict."""
    out = Enumeration([], [])
    for c in candidates(cfg, world):
        variant = c.apply(cfg)
        try:
            dp = validate(variant, world)
        except ConfigError as e:
            out.refused.append((c, str(e)))
            continue
        out.accepted.append((c, variant, dp))
    return out
