"""The one comparison the timed subcommands of ``tools/bench.py`` declare themselves to (docs/benchmarks.md).

A ``Comparison`` is its settings (each a run on a pool of ranks, ``trident_dev.ranks.run_distributed``, or in this
process), per setting the variants a factory builds on every rank, and the table's columns, each computed from the
variants' timings. ``compare`` runs it: on every rank each variant is built in turn and warmed up at once (untimed;
on a GPU its peak memory above what was allocated before is read meanwhile), then all are timed in rounds, the order
rotated every round (``harness.alternate``); each rank's timings, losses, bytes and figures come back here, where a
row's cells are computed from them (medians and spreads over rounds).

A variant (``Variant``): ``step(i)`` takes its i-th step (its loss, or None), ``state_bytes()`` the bytes it holds
(None: not measured), ``close()`` releases it; ``figures()`` is what else the columns read of it. ``Steps`` is one
made of functions.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from trident_dev.bench.harness import Stat, Table, alternate, barrier, pool_backend, rank_device, tokens_per_s
from trident_dev.ranks import run_distributed


class Variant(Protocol):
    def step(self, i: int) -> float | None: ...

    def state_bytes(self) -> int | None: ...

    def close(self) -> None: ...

    def figures(self) -> dict: ...


class Steps:
    """A variant of a step function (``state``, ``close``, ``figures``: the other three, each optional); or a base
    class whose subclasses override what they measure."""

    def __init__(
        self,
        step: Callable[[int], float | None] | None = None,
        *,
        state: Callable[[], int | None] | None = None,
        close: Callable[[], None] | None = None,
        figures: Callable[[], dict] | None = None,
    ) -> None:
        self._step, self._state, self._close, self._figures = step, state, close, figures

    def step(self, i: int) -> float | None:
        return self._step(i)

    def state_bytes(self) -> int | None:
        return self._state() if self._state else None

    def close(self) -> None:
        if self._close:
            self._close()

    def figures(self) -> dict:
        return self._figures() if self._figures else {}


@dataclass
class Rank:
    """What a factory builds on: this rank, the world, its device; ``info``, figures of the rank that the table
    reads (the device's name, a peak), comes back with the timings."""

    rank: int
    world: int
    device: torch.device
    info: dict = field(default_factory=dict)


Factory = Callable[[Rank, Any], Mapping[str, Callable[[], Variant]]]


@dataclass
class Setting:
    """One run of a comparison: ``build(rank, job)`` on each of ``world`` ranks (None: in this process, no pool)
    names the variants, each by a builder called in order. ``cells``: this setting's own cells (the columns of
    those names); ``rows``: the variants that are rows (None: all, in order); ``refused``: not run, its row is its
    cells and this line; ``note``: a line under the table. ``device``: ``pool`` is the rank's own GPU where it can
    have one (``harness.rank_device``; ``cuda`` the same), ``cpu`` the CPU; ``backend`` None: nccl on GPUs, else
    gloo."""

    build: Factory | None = None
    job: Any = None
    cells: dict = field(default_factory=dict)
    world: int | None = 1
    device: str = "pool"
    backend: str | None = None
    rows: Sequence[str] | None = None
    refused: str | None = None
    note: str | None = None


@dataclass
class OnRank:
    """One variant on one rank: seconds per step of each round (wall clock, this process's CPU time), the losses of
    every step (warm-up first), its state bytes, its warm-up's device peak (None off a GPU), its figures."""

    wall: list[float]
    cpu: list[float]
    losses: list[float]
    state: int | None
    peak: int | None
    figures: dict


@dataclass
class Outcome:
    """One variant, every rank (rank 0 first)."""

    name: str
    ranks: list[OnRank]

    @property
    def wall(self) -> list[float]:
        """Seconds per step of each round, the slowest rank's."""
        return [max(w) for w in zip(*(r.wall for r in self.ranks), strict=True)]

    @property
    def time(self) -> Stat:
        return Stat.of(self.wall)

    def rate(self, tokens: int) -> Stat:
        """``tokens`` a step over the rounds' times: tokens/s."""
        return tokens_per_s(tokens, self.wall)

    @property
    def cpu_s(self) -> float | None:
        """CPU seconds a step costs all ranks together (compute and communication threads; median over rounds, summed
        over the ranks): unlike the wall clock it hardly moves when other processes load the machine."""
        return sum(statistics.median(r.cpu) for r in self.ranks) if self.ranks[0].cpu else None

    @property
    def state(self) -> int | None:
        """The largest rank's state bytes."""
        return max((r.state for r in self.ranks if r.state is not None), default=None)

    @property
    def losses(self) -> list[float]:
        return self.ranks[0].losses

    @property
    def figures(self) -> dict:
        return self.ranks[0].figures


@dataclass
class Run:
    """A setting as it ran: its variants' outcomes, in order, and each rank's ``info``."""

    setting: Setting
    outcomes: dict[str, Outcome]
    info: list[dict]

    def rounds_line(self, tokens: int, label: Callable[[str], str] = str) -> str:
        """A note of every variant's rounds as tokens/s (``tokens`` a step)."""
        outs = self.outcomes.values()
        line = "; ".join(f"{label(o.name)} {', '.join(format(tokens / s, ',.0f') for s in o.wall)}" for o in outs)
        return f"rounds (tokens/s): {line}. spread: (fastest - slowest round) / median."


@dataclass
class Row:
    """A row's view: its variant in its run, and every run of the comparison (for a baseline elsewhere)."""

    name: str
    run: Run
    runs: list[Run]

    @property
    def out(self) -> Outcome:
        return self.run.outcomes[self.name]

    @property
    def job(self) -> Any:
        return self.run.setting.job

    @property
    def cells(self) -> dict:
        return self.run.setting.cells

    @property
    def info(self) -> dict:
        return self.run.info[0]

    def of(self, name: str) -> Outcome | None:
        """The variant ``name`` of this run, else of the first run that has one, else None."""
        for run in (self.run, *self.runs):
            if name in run.outcomes:
                return run.outcomes[name]
        return None


@dataclass(frozen=True)
class Column:
    """A column: its header, and its cell of a row (None: the setting's cell of that name, else the variant's
    name)."""

    header: str
    cell: Callable[[Row], object] | None = None


@dataclass
class Comparison:
    """What a subcommand declares: the title, the columns, the settings and the rounds (``warmup`` untimed steps of
    each variant, then ``rounds`` blocks of ``steps`` timed steps); ``title``, ``notes`` and ``ok`` (False: the tool
    exits 1) may read the runs."""

    title: str | Callable[[list[Run]], str]
    columns: Sequence[Column]
    settings: Iterable[Setting]
    warmup: int = 1
    steps: int = 1
    rounds: int = 1
    notes: Sequence[str] | Callable[[list[Run]], list[str]] = ()
    ok: Callable[[list[Run]], bool] | None = None
    timeout_s: float = 24 * 3600


def compare(c: Comparison) -> Table:
    """Run every setting of ``c`` and table it: a row per variant (or per setting), a cell per column."""
    return tabulate(c, run_settings(c))


def run_settings(c: Comparison) -> list[Run]:
    """Run every setting of ``c`` (a refused one is not run)."""
    return [_execute(s, c) for s in c.settings]


def tabulate(c: Comparison, runs: list[Run]) -> Table:
    """The table of ``c``'s runs."""
    table = Table(c.title(runs) if callable(c.title) else c.title, [col.header for col in c.columns])
    for run in runs:
        s = run.setting
        if s.refused is not None:
            lead = []
            for col in c.columns:
                if col.header not in s.cells:
                    break
                lead.append(s.cells[col.header])
            table.add(*lead, s.refused)
        else:
            for name in run.outcomes if s.rows is None else s.rows:
                row = Row(name, run, runs)
                table.add(*(s.cells.get(col.header, name) if col.cell is None else col.cell(row) for col in c.columns))
        if s.note:
            table.notes.append(s.note)
    table.notes += c.notes(runs) if callable(c.notes) else list(c.notes)
    table.ok = c.ok(runs) if c.ok else True
    return table


def losses(spec: str = ".6f", first: str = "first loss") -> list[Column]:
    """The first (a warm-up step's) and the last loss of each row's variant."""
    return [
        Column(first, lambda r: format(r.out.losses[0], spec)),
        Column("last loss", lambda r: format(r.out.losses[-1], spec)),
    ]


def batch_title(
    cfg: Any, where: Callable[[dict], str], rounds: int, steps: int, warmup: int
) -> Callable[[list[Run]], str]:
    """A training comparison's title: the model, ``where`` (the ranks, the device: from rank 0's info), precision,
    batch, ZeRO and the rounds."""
    tr = cfg.train

    def title(runs: list[Run]) -> str:
        return (
            f"model {cfg.model.name}, {where(runs[0].info[0])}, {tr.precision}, global batch {tr.global_batch_size} x "
            f"{cfg.model.seq_len} tokens, micro-batch {tr.micro_batch_size}, zero {cfg.parallel.zero}; {rounds} rounds "
            f"x {steps} steps after {warmup} warm-up"
        )

    return title


def per_round(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of ``a``'s round over ``b``'s of the same round: load that drifts cancels out."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


# --- on each rank -----------------------------------------------------------------------------------------------


@dataclass
class _Task:
    build: Factory
    job: Any
    device: str
    warmup: int
    steps: int
    rounds: int


def _execute(s: Setting, c: Comparison) -> Run:
    if s.refused is not None:
        return Run(s, {}, [])
    task = _Task(s.build, s.job, s.device, c.warmup, c.steps, c.rounds)
    if s.world is None:
        per_rank = [_measure(0, 1, task)]
    else:
        backend = s.backend or ("gloo" if s.device == "cpu" else pool_backend(s.world))
        per_rank = run_distributed(_measure, s.world, task, backend=backend, timeout_s=c.timeout_s)
    outcomes = {name: Outcome(name, [r["variants"][name] for r in per_rank]) for name in per_rank[0]["variants"]}
    return Run(s, outcomes, [r["info"] for r in per_rank])


def _warm_up(variant: Variant, steps: int, device: torch.device, losses: list[float]) -> int | None:
    """``steps`` untimed steps; on a GPU the peak bytes allocated meanwhile above those allocated before."""
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(steps):
        _keep(losses, variant.step(i))
    if not on_gpu:
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def _keep(losses: list[float], loss: float | None) -> None:
    if loss is not None:
        losses.append(loss)


def _measure(rank: int, world: int, task: _Task) -> dict:
    device = torch.device("cpu") if task.device == "cpu" else rank_device(rank, world)
    ctx = Rank(rank, world, device)
    variants: dict[str, Variant] = {}
    losses: dict[str, list[float]] = {}
    peaks: dict[str, int | None] = {}
    for name, build in task.build(ctx, task.job).items():
        variants[name] = build()  # the ones built before it are warm and still
        losses[name] = []
        peaks[name] = _warm_up(variants[name], task.warmup, device, losses[name])

    def timed(name: str) -> Callable[[int], None]:
        variant, warmup = variants[name], task.warmup
        return lambda i: _keep(losses[name], variant.step(warmup + i))  # each one's steps run on from its warm-up

    timings = alternate(
        {name: timed(name) for name in variants},
        warmup=0,
        steps=task.steps,
        rounds=task.rounds,
        sync=lambda: barrier(device),
    )
    out = {
        name: OnRank(t.wall, t.cpu, losses[name], variants[name].state_bytes(), peaks[name], variants[name].figures())
        for name, t in timings.items()
    }
    for variant in variants.values():
        variant.close()
    return {"info": ctx.info, "variants": out}
