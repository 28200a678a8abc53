"""The one bench harness: every subcommand of ``tools/bench.py`` times, measures and prints through these.

- ``alternate`` times variants in rounds, the order rotated each round, so load that comes and goes on the machine
  hits every variant alike; the warm-up steps (start-up, compilation, allocator growth) are not timed.
- ``Stat`` is a median over rounds with its spread (lowest and highest round).
- ``mfu``, ``storage_bytes`` (model states, each storage once) and ``SavedBytes`` (activations autograd keeps for
  backward) are the figures beside tokens/s; a real run's peak memory is its own metrics' (``runs.py``).
- ``Table`` is the one markdown table every subcommand prints.
- ``config`` composes train.py's typed config from conf/; ``one_rank_groups`` gives rank 0 alone the groups of a
  one-process layout, so a reference run can sit inside a multi-rank pool (``trident_dev.ranks.run_distributed``).
"""

from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh

from trident.config import Config
from trident.data.dataset import TokenWindows
from trident.memory.measure import format_bytes
from trident.optim import lr_at
from trident.parallel.batch import Batch
from trident.parallel.groups import ProcessGroups
from trident.parallel.precision import autocast
from trident.parallel.topology import Topology
from trident.peak import device_peak_tflops

__all__ = ["format_bytes"]  # re-exported: byte figures print alike everywhere


# --- timing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Stat:
    """A median over rounds, with the lowest and the highest round."""

    median: float
    low: float
    high: float

    @classmethod
    def of(cls, values: Iterable[float]) -> Stat:
        values = list(values)
        return cls(statistics.median(values), min(values), max(values))

    def map(self, fn: Callable[[float], float]) -> Stat:
        """The same figures through a monotonic ``fn`` (seconds per step -> tokens/s reverses low and high)."""
        a, b = fn(self.low), fn(self.high)
        return Stat(fn(self.median), min(a, b), max(a, b))

    @property
    def spread(self) -> float:
        """(highest - lowest round) / median: how much the machine moved under the measurement."""
        return (self.high - self.low) / self.median if self.median else math.nan


@dataclass
class Timing:
    """Seconds per step of one variant, one entry per round: wall clock, and this process's CPU time."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)


def alternate(
    variants: Mapping[str, Callable[[int], object]],
    *,
    warmup: int,
    steps: int,
    rounds: int,
    sync: Callable[[], None] = lambda: None,
) -> dict[str, Timing]:
    """Time ``variants`` (each called with its own running step index) in ``rounds`` blocks of ``steps`` steps, the
    order rotated every round, after ``warmup`` untimed steps of each. ``sync`` runs before and after each block (a
    barrier across ranks, a device synchronize): every rank of a pool calls this in the same order."""
    names = list(variants)
    step = dict.fromkeys(names, 0)
    for name in names:
        for _ in range(warmup):
            variants[name](step[name])
            step[name] += 1
    timings = {name: Timing() for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync()
            start, start_cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                variants[name](step[name])
                step[name] += 1
            sync()
            timings[name].wall.append((time.perf_counter() - start) / steps)
            timings[name].cpu.append((time.process_time() - start_cpu) / steps)
    return timings


def tokens_per_s(tokens_per_step: int, seconds_per_step: Iterable[float]) -> Stat:
    return Stat.of(seconds_per_step).map(lambda s: tokens_per_step / s)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over ``peak_flops`` (all devices the tokens ran on), or None."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops else None


def barrier(device: torch.device, group: dist.ProcessGroup | None = None) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier(group)


# --- memory ---------------------------------------------------------------------------------------------------


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views once; a DTensor by its local shard)."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        t = t.to_local() if hasattr(t, "to_local") else t
        s = t.untyped_storage()
        if s.nbytes() == 0:  # freed (stage 3 between gathers)
            continue
        key = (str(t.device), s.data_ptr())
        seen[key] = max(seen.get(key, 0), s.nbytes())
    return sum(seen.values())


class SavedBytes:
    """Peak bytes of the tensors autograd keeps for backward, each storage once, parameters left out. Use as
    ``with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack): ...``."""

    def __init__(self) -> None:
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, references]
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor) -> object:
        if isinstance(t, torch.nn.Parameter) or (t.is_leaf and t.requires_grad and t.grad_fn is None and t.dim() > 2):
            return t
        key = t.untyped_storage().data_ptr()
        entry = self.live.setdefault(key, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        holder = _Holder(t)
        weakref.finalize(holder, self._release, key)
        return holder

    def _release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]

    @staticmethod
    def unpack(saved: object) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Holder) else saved


class _Holder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def adamw_args(model: torch.nn.Module, cfg: Config, **kwargs: object) -> dict:
    """torch.optim.AdamW's arguments for a torch baseline, as trident's optimizer steps: ``cfg.optim``'s
    hyperparameters, decay on matrices only, foreach."""
    o, params = cfg.optim, list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return {"params": groups, "lr": o.lr, "betas": (o.beta1, o.beta2), "eps": o.eps, "foreach": True, **kwargs}


def plain_step(
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    micro_batches: Sequence[Batch],
    cfg: Config,
    step: int,
    no_sync: bool = False,
) -> torch.Tensor:
    """The step a user writes with torch alone (nanoGPT's): ``cfg.train.precision`` by autocast, the fp32 loss /
    micro-batches, backward (``no_sync``: under DDP's no_sync but for the last micro-batch), clip, AdamW at the
    schedule's learning rate, zero_grad. Returns this rank's summed loss, on the device."""
    o, device = cfg.optim, micro_batches[0].tokens.device
    total = torch.zeros((), device=device)
    for i, (x, y, *_) in enumerate(micro_batches):
        sync = not no_sync or i == len(micro_batches) - 1
        with contextlib.nullcontext() if sync else net.no_sync():
            with autocast(cfg.train.precision, device):
                logits = net(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / len(micro_batches)
            loss.backward()
        total += loss.detach()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    torch.nn.utils.clip_grad_norm_(params, o.grad_clip)
    for group in optimizer.param_groups:
        group["lr"] = lr_at(step, o, cfg.train.steps)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


# --- the table ------------------------------------------------------------------------------------------------


@dataclass
class Table:
    """One markdown table: a title line, a header, rows of cells, notes under it. ``ok`` False makes the tool exit 1
    (a check the table reports failed, as the matrix's tolerance)."""

    title: str
    header: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    ok: bool = True

    def add(self, *cells: object) -> None:
        row = ["-" if c is None else str(c) for c in cells]
        row += ["-"] * (len(self.header) - len(row))
        self.rows.append(row)

    def column(self, name: str) -> list[str]:
        i = self.header.index(name)
        return [row[i] for row in self.rows]

    def markdown(self) -> str:
        lines = [self.title, "", "| " + " | ".join(self.header) + " |", "|" + "---|" * len(self.header)]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        if self.notes:
            lines += ["", *self.notes]
        return "\n".join(lines)


def number(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None or not math.isfinite(x) else format(x, spec)


def ratio(a: float | None, b: float | None) -> str:
    """``a / b`` as "1.23x", or "-" when either is missing."""
    return f"{a / b:.2f}x" if a and b and math.isfinite(a / b) else "-"


def spread(values: Iterable[float]) -> str:
    """The spread of rounds (or steps) as a cell, (highest - lowest) / median: "±5%"."""
    return f"±{100 * Stat.of(values).spread:.0f}%"


# --- building -------------------------------------------------------------------------------------------------


def one_rank_groups(group: dist.ProcessGroup) -> ProcessGroups:
    """The groups of a one-process layout on global rank 0, every one of them ``group`` (rank 0 alone; create it
    on every rank with ``dist.new_group([0])``)."""
    return ProcessGroups(Topology(1, 1, 1), 0, group, group, group, group, group, None, (0,))


def device_mesh(group: dist.ProcessGroup, device_type: str, name: str) -> DeviceMesh:
    """A one-dimensional DeviceMesh over ``group``, for torch's DTensor baselines (FSDP2, tensor parallelism).

    DTensor caches its sharding decisions by mesh equality, which compares ranks, device type and dimension names but
    not process groups: in a rank pool that runs one task after another, a mesh equal to an earlier task's would
    find that task's destroyed groups in the cache. The group's name (the same on every rank, never reused) in the
    dimension's name makes each task's mesh its own."""
    return DeviceMesh.from_group(group, device_type, mesh_dim_names=(f"{name}-{group.group_name}",))


def pool_backend(world: int) -> str:
    """The backend of a rank pool of ``world`` ranks: nccl when each rank can have a GPU of its own, else gloo."""
    return "nccl" if torch.cuda.is_available() and world <= torch.cuda.device_count() else "gloo"


def rank_device(rank: int, world: int) -> torch.device:
    """A pool rank's device (``pool_backend``'s choice): its own GPU, or the CPU."""
    if pool_backend(world) == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def random_batches(
    vocab_size: int, micro: int, mbs: int, seq_len: int, step: int, seed: int, first_sample: int = 0
) -> list[Batch]:
    """``micro`` micro-batches of ``mbs`` random sequences (targets: the tokens shifted by one), seeded by ``seed``;
    their samples numbered from ``first_sample`` (what dropout's masks derive from)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (micro, mbs, seq_len + 1), generator=gen)
    first = first_sample + torch.arange(micro)[:, None] * mbs + torch.arange(mbs)
    return [Batch(t[:, :-1], t[:, 1:], samples, step) for t, samples in zip(ids, first, strict=True)]


def random_windows(vocab_size: int, seq_len: int, count: int, seed: int = 0) -> TokenWindows:
    """``count`` windows of random tokens: throughput does not depend on what the tokens say."""
    tokens = np.random.default_rng(seed).integers(0, vocab_size, count * seq_len + 1).astype(np.int64)
    return TokenWindows(tokens, seq_len, 0, count)


def peak_flops(device: torch.device, precision: str, override_tflops: float | None, ranks: int) -> float | None:
    """The peak FLOP/s of ``ranks`` ranks of this machine together (each on this rank's threads), for MFU: the
    override (TFLOP/s of one rank) or trident/peak.py's figure, CPU cores shared when the ranks ask for more."""
    one = device_peak_tflops(device, precision, override_tflops)
    if one is None:
        return None
    if override_tflops is None and device.type == "cpu":
        one *= min(1.0, (os.cpu_count() or 1) / (torch.get_num_threads() * ranks))
    return one * 1e12 * ranks
