"""What a machine can do, as the planner's step-time model reads it: compute rates, link rates, memory.

A ``Profile`` is either a datasheet (``DATASHEETS``: H100, H200, A100 nodes of 8 GPUs, NVLink inside a node,
InfiniBand between) or a calibration of this machine (trident_dev/plan/calibrate.py), which measures the same
fields and replaces the datasheet's rules of thumb with times:

- matmuls by shape and dtype (``matmuls``, seconds by ``matmul_key``); a shape not measured costs its FLOPs at
  ``matmul_efficiency`` of the peak;
- attention (``attention``, seconds by ``attention_key``, forward and backward); else FLOPs at
  ``attention_efficiency`` of the peak;
- element-wise work by bytes: each op ``elementwise.latency`` (launch or dispatch) plus bytes at its bandwidth, the
  ops bound by their arithmetic (GELU, SiLU, the loss's exponentials) at ``transcendental``'s;
- collectives by bytes and group size: a measured ``Rate`` per ``collective_key`` (measured with every rank of the
  launch in a group of that size at once, as in training), else the ring formulas over the ``intra`` (inside a
  node) or ``inter`` (between nodes) link;
- host-device copies, AdamW on the device and on the host (offload), in parameters per second.

On a CPU the "device" is a rank's share of the node: ``threads`` threads (train.py gives each rank the node's
cores divided by its ranks, at least one), ``units_per_node`` cores that the ranks of a node share, and the node's
host memory, which its ranks share too. A calibration is cached per machine, thread count and torch version in
``~/.cache/trident/profile.json`` (like the CPU peak of trident/peak.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from trident.json_cache import read_entries
from trident.plan.conditions import Conditions

DEFAULT_CACHE = Path("~/.cache/trident/profile.json")
VERSION = 14  # what a cached calibration measured: an entry of another version is measured again (14: selective)
# The lone compute a rank does before each collective in the calibration's two figures amid compute (``Profile.amid``
# and ``amid_long``, probes.amid_compute): about a layer's pass at a CPU's, and a layer's at micro-batch 1 of a small
# model on one thread, where a rank more often finds a peer the scheduler stopped in mid-stretch.
AMID_SEGMENT_S, AMID_LONG_SEGMENT_S = 1e-3, 4e-3
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")  # all_to_all: ulysses


@dataclass(frozen=True)
class Rate:
    """A cost of ``latency + bytes / bandwidth`` seconds."""

    latency: float  # seconds
    bandwidth: float  # bytes per second

    def time(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


MATMUL_LAYOUTS = ("nn", "nt", "tn")  # which operand is a transposed view: none, the second, the first


def matmul_key(precision: str, m: int, n: int, k: int, layout: str = "nn") -> str:
    """An ``[m, k] @ [k, n]`` matmul in ``precision`` (fp32 | bf16 | fp16) with operands laid out as ``layout``: a
    linear layer's forward is ``x @ W^T`` (nt), its input gradient ``dy @ W`` (nn), its weight gradient
    ``dy^T @ x`` (tn), and BLAS speeds differ between them."""
    return f"{precision}:{m}x{n}x{k}:{layout}"


def attention_key(precision: str, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, kind: str) -> str:
    """Causal attention of ``heads`` query heads over ``kv_heads`` key/value heads; ``kind``: fwd | bwd."""
    return f"{precision}:{batch}x{heads}x{kv_heads}x{seq}x{head_dim}:{kind}"


def collective_key(op: str, group: int) -> str:
    """``op`` (one of ``COLLECTIVES``) over a group of ``group`` ranks (2 for p2p)."""
    return f"{op}:{group}"


@dataclass
class Profile:
    name: str  # "h100", or "cpu: <model> (calibrated)"
    device: str  # cuda | cpu
    source: str  # where the figures come from: a datasheet, or a calibration's date and machine
    memory_bytes: float  # a GPU's memory; on a CPU the node's host memory, shared by the node's ranks
    units_per_node: int  # GPUs per node, or a CPU's cores (which the node's ranks share)
    threads: int = 1  # CPU threads per rank the rates were measured on (1 on a GPU)
    ranks_per_node: int = 0  # a calibration's: the ranks per node its collectives ran (0: a datasheet)
    version: int = VERSION
    # On a CPU: the speed the node's ranks get together when all compute at once, in lone ranks' worth (measured;
    # 0: units_per_node / threads, the cores shared without loss).
    shared_capacity: float = 0.0
    # On a CPU: what k of the node's ranks computing a block at once get together, in lone ranks' worth, for k = 1,
    # 2, ... ranks_per_node (measured: the cores, their sharing of caches and memory bandwidth, the cost of
    # oversubscribing them, the machine's other load). Empty: not measured (``shared_capacity`` and the cores).
    sharing: list[float] = field(default_factory=list)
    # A real block's forward and backward over what its ops are priced at, measured alone (the framework's overhead
    # beyond its kernels: autograd, allocation, dispatch); compute is priced times this. 1: not measured.
    framework: float = 1.0
    # And the framework's time per op dispatched (an op's ``count``: a kernel, a matmul, an attention), whatever its
    # size: autograd's node, the module call, views and allocations around it. Fitted with ``framework`` to the block
    # at two micro-batch sizes (trident_dev/plan/calibrate.py ``fit_framework``). 0: not measured.
    dispatch: float = 0.0
    block: dict | None = None  # the block framework and shared_capacity were measured with
    usable_fraction: float = 0.9  # of memory_bytes, for the estimator's peak (context, fragmentation not in it)
    peak_tflops: dict[str, float] = field(default_factory=dict)  # precision -> dense peak of one rank's device
    matmul_efficiency: float = 0.7
    attention_efficiency: float = 0.45
    elementwise: Rate = Rate(5e-6, 1e12)
    transcendental: Rate | None = None  # element-wise ops bound by arithmetic (GELU, SiLU, exp); None: elementwise
    matmuls: dict[str, float] = field(default_factory=dict)
    attention: dict[str, float] = field(default_factory=dict)
    collectives: dict[str, Rate] = field(default_factory=dict)
    # On a CPU, by ``collective_key``: what one collective adds to the step where the passes meet it, between
    # stretches of compute while every rank of the launch does the same (probes.amid_compute). On cores shared by
    # more ranks than they have this is far above ``collectives`` (back to back): a rank waits for a peer the
    # scheduler has not run. Empty: not measured (``collectives``).
    amid: dict[str, Rate] = field(default_factory=dict)
    # The same with longer stretches of compute between them (AMID_LONG_SEGMENT_S against AMID_SEGMENT_S):
    # cost.amid_time reads between the two by the compute a layout has between its collectives.
    amid_long: dict[str, Rate] = field(default_factory=dict)
    # On a CPU, by ``collective_key``: the CPU seconds one collective costs a rank's process, every thread (gloo's
    # copies, its wake-ups and the sockets' system time): its bytes at the back-to-back rate (probes.time_collective)
    # and what else it added amid compute while every rank of the node did the same (probes.amid_compute): cores
    # the ranks share spend them whether the rank waits or not. Empty: not measured (a GPU's run on the device).
    collective_cpu: dict[str, Rate] = field(default_factory=dict)
    intra: Rate = Rate(1e-5, 1e11)  # ring bus bandwidth per rank inside a node
    inter: Rate = Rate(3e-5, 1e10)  # between nodes
    host_copy: Rate = Rate(1e-5, 2.5e10)  # host <-> device, each direction
    adam: float = 1e10  # parameters per second of AdamW on a rank's device
    host_adam: float = 1e8  # parameters per second of AdamW on the host, per rank (optimizer offload)
    # Seconds of a rank's compute that work no op is costs (the framework's, beyond the ops' kernels and messages),
    # by what it is per: ``split`` each action of zb's split backward (I, W: torch's split of the autograd graph),
    # ``cp:<parallel.cp_comm>`` each forward or backward of a layer's cp attention (masks, waits on a peer; the
    # ring's per quarter of a block it computes, its merges), ``recompute`` each layer recomputed (the checkpoint's
    # hooks), ``selective`` each op of a selectively checkpointed layer's forward and recomputation (its dispatch
    # mode), ``selective:cp`` (a fraction, not seconds) how much more cp's bookkeeping takes under that mode. Each
    # is what makes the model give the step a held-out run of the model's tiny twin measured
    # (trident_dev/plan/residual.py). Empty: not measured.
    overheads: dict[str, float] = field(default_factory=dict)
    # A held-out run's measured step over the model's (trident_dev/plan/residual.py): every step is scaled by
    # it. 1: none.
    residual: float = 1.0
    residual_run: dict | None = None  # the run it was measured on (residual.held_out)
    # A calibration's: when it was taken and the other work on the machine meanwhile (trident/plan/conditions.py).
    conditions: Conditions | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Profile:
        d = dict(d)
        for key in ("elementwise", "transcendental", "intra", "inter", "host_copy"):
            if d.get(key) is not None:
                d[key] = Rate(**d[key])
        d["collectives"] = {k: Rate(**v) for k, v in d.get("collectives", {}).items()}
        d["amid"] = {k: Rate(**v) for k, v in d.get("amid", {}).items()}
        d["amid_long"] = {k: Rate(**v) for k, v in d.get("amid_long", {}).items()}
        d["collective_cpu"] = {k: Rate(**v) for k, v in d.get("collective_cpu", {}).items()}
        if d.get("conditions") is not None:
            d["conditions"] = Conditions(**d["conditions"])
        return cls(**d)

    def peak(self, precision: str) -> float:
        """Dense FLOP/s of one rank's device in ``precision``; a precision the profile has no figure of (a CPU
        calibrated for an fp32 plan, then asked to plan an fp16 run) at its fp32 figure: every layout of a plan has
        the one precision, so the ranking stands (its matmuls not timed are priced from this alone)."""
        figure = self.peak_tflops.get(precision, self.peak_tflops.get("fp32"))
        if figure is None:
            raise KeyError(f"profile {self.name} has no peak for {precision} or fp32")
        return figure * 1e12


def _gpu(
    name: str,
    bf16_tflops: float,
    memory_gb: float,
    hbm_tb_s: float,
    nvlink_gb_s: float,
    ib_gb_s: float,
    pcie_gb_s: float,
    fp8_tflops: float | None = None,
) -> Profile:
    """A node of 8 GPUs from the datasheet. Bus bandwidths are ~80% of a link's one-way rate (what NCCL's tests
    report for large all-reduces), matmuls reach 70% of the dense peak, flash attention 45%; AdamW is
    memory-bound (about 16 bytes read and 16 written per parameter) on the device; host AdamW is DeepSpeed's
    CPU-Adam at about 1e9 parameters/s for a whole node, shared by its 8 ranks."""
    return Profile(
        name=name,
        device="cuda",
        source=f"datasheet ({name.upper()} SXM, 8 per node)",
        memory_bytes=memory_gb * 1e9,
        units_per_node=8,
        # FP8 (Hopper's dense e4m3 / e5m2 peak, twice bf16's; an A100 has none and runs FP8 GEMMs no faster)
        peak_tflops={
            "bf16": bf16_tflops,
            "fp16": bf16_tflops,
            "fp32": bf16_tflops / 2,
            "fp8": fp8_tflops or bf16_tflops,
        },
        elementwise=Rate(4e-6, 0.8 * hbm_tb_s * 1e12),
        intra=Rate(1.5e-5, 0.8 * nvlink_gb_s * 1e9),
        inter=Rate(3e-5, 0.8 * ib_gb_s * 1e9),
        host_copy=Rate(1e-5, 0.8 * pcie_gb_s * 1e9),
        adam=0.8 * hbm_tb_s * 1e12 / 32,
        host_adam=1e9 / 8,
    )


# NVLink one-way per GPU: 450 GB/s (H100/H200, NVLink 4), 300 GB/s (A100, NVLink 3); InfiniBand: one NDR 400 Gb/s
# (50 GB/s) NIC per H100/H200, one HDR 200 Gb/s (25 GB/s) per A100; PCIe Gen5 x16 64 GB/s, Gen4 32 GB/s.
DATASHEETS = {
    "h100": _gpu("h100", 989.0, 80, 3.35, 450, 50, 64, fp8_tflops=1979.0),
    "h200": _gpu("h200", 989.0, 141, 4.8, 450, 50, 64, fp8_tflops=1979.0),
    "a100": _gpu("a100", 312.0, 80, 2.0, 300, 25, 32),
}


def cache_key(device: str, ranks_per_node: int, threads: int) -> str:
    """A calibration's identity: the machine (the GPU's name, or the CPU's model and cores), the ranks per node it
    was measured under (collectives and shared cores depend on them), the threads per rank, torch's version."""
    import torch  # noqa: PLC0415

    from trident.peak import cpu_model  # noqa: PLC0415 (peak imports torch, which only this function needs)

    if device == "cuda":
        machine = torch.cuda.get_device_name()
    else:
        machine = f"{cpu_model()} | {os.cpu_count()} cores"
    return f"{machine} | {ranks_per_node} ranks per node | {threads} threads | torch {torch.__version__}"


def load_cached(device: str, ranks_per_node: int, threads: int, cache: Path = DEFAULT_CACHE) -> Profile | None:
    """This machine's calibration for ``ranks_per_node`` ranks of ``threads`` threads, if one was saved (by
    trident_dev/plan/calibrate.py ``save_cached``)."""
    entry = read_entries(cache.expanduser()).get(cache_key(device, ranks_per_node, threads))
    if not isinstance(entry, dict) or entry.get("version") != VERSION:
        return None
    try:
        profile = Profile.from_dict(entry)
    except (TypeError, KeyError):
        return None
    # Taken too long ago, or by a trident that did not record when: measured again. One accepted while the machine
    # was busy (--accept-busy) is used, and the plan's first lines say so
    # (trident_dev/plan/contention.py ``describe_profile``).
    if profile.conditions is None or profile.conditions.stale():
        return None
    return profile


def host_memory_bytes() -> float:
    """The machine's physical memory."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def cpu_threads_per_rank(ranks_per_node: int, cores: int | None = None) -> int:
    """What train.py's set_cpu_threads gives each rank of a node."""
    return max(1, (cores or os.cpu_count() or 1) // ranks_per_node)


@dataclass
class Needs:
    """What a calibration has to measure for a plan: the planner lists it from the layouts it considers."""

    matmuls: set[tuple[str, int, int, int, str]] = field(default_factory=set)  # (precision, m, n, k, layout)
    attention: set[tuple[str, int, int, int, int, int]] = field(default_factory=set)  # (precision, b, heads, kv, s, dh)
    groups: set[int] = field(default_factory=set)  # collective group sizes (2 also for p2p)
    precisions: set[str] = field(default_factory=set)
    # A block to run whole (a one-layer model of the plan's: {"model": ModelConfig fields, "batch", "precision"}):
    # its measured forward and backward against its priced ops is ``framework``, and all the node's ranks running it
    # at once give ``shared_capacity``.
    block: dict | None = None
    # A held-out run (trident_dev/plan/residual.py ``held_out``) whose measured step scales the model's.
    run: dict | None = None
