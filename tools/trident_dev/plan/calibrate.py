"""Measure this machine for the planner's step-time model: what ``Profile`` (trident/plan/profile.py) holds.

A datasheet's rules of thumb (matmuls at 70% of the peak, ring collectives at 80% of the link) are far off on a
CPU, where small matmuls run at a fraction of the peak, fp16 may have no fast kernel at all, and "links" are
gloo's TCP loopback between processes that share a few cores. So the layout planner's ``--calibrate`` times the
work its candidate layouts would do, under the conditions a training launch of ``ranks_per_node`` ranks gives a
rank, and only that work (``Needs``):

- each matmul shape and dtype the layouts run (``torch.mm`` of ``[m, k] @ [k, n]``), and causal attention
  (``F.scaled_dot_product_attention`` as models/gpt.py calls it) forward and backward, on the threads one rank
  gets (the node's cores divided by its ranks, as train.py sets them): the median of as many runs as fit in a
  twentieth of a second (a tenth for attention), after a warm-up, each timed on a one-thread rank by the thread's
  own CPU time (``probes.own_time``: what other processes take of the cores meanwhile is not the kernel's);
- element-wise work (an add and a GELU at a few sizes) fitted to a latency plus bytes at a bandwidth; a host copy;
  AdamW (as parallel/zero/optimizer.py builds it) in parameters per second;
- collectives: ``ranks_per_node`` gloo ranks (NCCL on GPUs) split into disjoint groups of each size, every group
  running at once as the groups of a 3D layout do, so each rank's time includes the others' load on the cores
  and the loopback. All-reduce, all-gather and reduce-scatter (the flat forms trident/parallel uses) at three
  message sizes, and pipeline point-to-point (a send and a receive each way) between pairs of ranks, each fitted
  to a ``Rate``. A collective is done when its slowest rank is, so each size's time is the slowest rank's median.

Matmuls, attention and the element-wise rates are measured with one rank alone on the machine: a launch whose
ranks ask for more threads than the node has cores shares them, which the planner accounts for with what the
same launch measures (``sharing``): for k = 1, 2, ... ``ranks_per_node`` of its ranks computing a block of the
model at once while the others wait, what they get together against one alone. That curve is this machine's
(its cores, their caches and memory bandwidth, the cost of switching between oversubscribed ranks, the other load
it had), not a rule: nothing in the model assumes a rank per core runs at full speed. The links ``intra`` and
``inter`` are the largest group's all-reduce restated for the ring formulas that price what was not measured.

With CUDA the same is timed on the GPU (CUDA events), with TF32 matmuls as training uses them, the peak from the
datasheet table of trident/peak.py, host copies from pinned memory, and the host's AdamW (optimizer offload) on
the CPU threads a rank gets.

This module decides what to measure and fills the profile; each measurement is a micro-benchmark of
trident_dev/plan/probes.py.

Results are cached per machine, thread count and torch version (trident/plan/profile.py ``load_cached``, which
``parallel.auto`` reads, and ``save_cached`` here): a second calibration with the same needs measures nothing, and
one with more needs measures only what is new (``still_needed``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path

import torch

from trident.json_cache import add_entry
from trident.peak import cpu_model
from trident.plan.conditions import Conditions
from trident.plan.ops import chunk_ops
from trident.plan.profile import (
    COLLECTIVES,
    DEFAULT_CACHE,
    Needs,
    Profile,
    Rate,
    attention_key,
    cache_key,
    collective_key,
    cpu_threads_per_rank,
    host_memory_bytes,
    load_cached,
    matmul_key,
)
from trident_dev.plan import outliers, tiny
from trident_dev.plan.contention import OtherLoad, contended
from trident_dev.plan.probes import (
    AMID_CPU_KEY,
    AMID_KEY,
    AMID_LONG_KEY,
    BUSY_KEY,
    CPU_KEY,
    SHARING_KEY,
    cpu_threads,
    fit_rate,
    matmul_rate,
    measure_adam,
    measure_elementwise,
    measure_host_copy,
    peak_tflops,
    rank_collective_times,
    time_attention,
    time_block,
    time_matmul,
    warm_gpu,
)
from trident_dev.plan.residual import measure_overheads, measure_residual
from trident_dev.ranks import run_distributed

COLLECTIVE_TIMEOUT_S = 600.0


def save_cached(profile: Profile, cache: Path = DEFAULT_CACHE) -> None:
    """Add ``profile`` to the cache (atomically: a reader sees the old file or the new one)."""
    key = cache_key(profile.device, profile.ranks_per_node, profile.threads)
    add_entry(cache.expanduser(), key, profile.to_dict())


def still_needed(needs: Needs, profile: Profile) -> Needs:
    """The part of ``needs`` that ``profile`` has not measured."""
    return Needs(
        matmuls={x for x in needs.matmuls if matmul_key(*x) not in profile.matmuls},
        attention={
            x
            for x in needs.attention
            if any(attention_key(*x, kind) not in profile.attention for kind in ("fwd", "bwd"))
        },
        # Point-to-point is between two ranks: measured with the group of 2.
        groups={
            g
            for g in needs.groups
            if any(collective_key(op, g) not in profile.collectives for op in COLLECTIVES if op != "p2p" or g == 2)
        },
        precisions={p for p in needs.precisions if p not in profile.peak_tflops},
        block=needs.block if needs.block is not None and needs.block != profile.block else None,
        run=needs.run if needs.run is not None and needs.run != profile.residual_run else None,
    )


def calibrate(
    needs: Needs,
    ranks_per_node: int,
    *,
    cache: Path | None = DEFAULT_CACHE,
    log: Callable[[str], None] = print,
    accept_busy: bool = False,
    repo: Path | None = None,
) -> Profile:
    """This machine's ``Profile`` for a launch of ``ranks_per_node`` ranks per node, with everything ``needs``
    asks for measured: read from ``cache`` where it was measured before, measured now where not, and saved back
    (``cache`` None: measure everything, save nothing). ``needs.run``, on a CPU with the ``repo`` whose train.py
    runs it: the held-out run that scales the model (trident_dev/plan/residual.py). What is measured now while other
    processes keep the machine busy (trident_dev/plan/contention.py) is said, marked in the profile's conditions, and
    not saved, unless ``accept_busy``."""
    started = time.perf_counter()
    device = calibration_device()
    host_threads = cpu_threads_per_rank(ranks_per_node)  # what train.py gives each rank of the node
    threads = 1 if device.type == "cuda" else host_threads
    profile = load_cached(device.type, ranks_per_node, threads, cache) if cache is not None else None
    fresh = profile is None
    if profile is None:
        profile = new_profile(device, threads)
    profile.ranks_per_node = ranks_per_node
    todo = still_needed(needs, profile)
    precisions = sorted(todo.precisions | ({"fp32"} - profile.peak_tflops.keys()))
    groups = sorted(g for g in todo.groups if g >= 2 and ranks_per_node % g == 0)
    if set(todo.groups) - set(groups):
        unfit = sorted(set(todo.groups) - set(groups))
        log(f"calibrating: group sizes {unfit} do not divide {ranks_per_node} ranks per node: not measured")
    held_out = todo.run if device.type == "cpu" and repo is not None else None
    if not (fresh or precisions or todo.matmuls or todo.attention or groups or held_out):
        log(f"calibration: everything needed was measured before ({profile.name}, {threads} threads per rank)")
        return profile

    log(f"calibrating {profile.name.removesuffix(' (calibrated)')}, {threads} threads per rank ...")
    with OtherLoad() as others:
        with training_settings(device, host_threads):
            if device.type == "cuda":
                warm_gpu(device)
            if fresh:
                log("calibrating: element-wise ops, host copies, AdamW ...")
                measure_basics(profile, device, host_threads)
            peak_cache = cache.with_name("peak.json") if cache is not None else None  # trident/peak.py's cache
            for precision in precisions:
                profile.peak_tflops[precision] = peak_tflops(precision, device, threads, peak_cache)
            measure_compute(profile, todo, device, log)
            if todo.block is not None and device.type == "cpu":
                measure_framework(profile, todo.block, threads, log)
        if groups or (todo.block is not None and ranks_per_node > 1):
            measure_links(profile, groups, ranks_per_node, host_threads, device, log, profile.block)
        if held_out is not None:
            profile = measure_overheads(profile, held_out.get("tiny", {}), repo, log)
            profile.residual = measure_residual(profile, held_out, repo, log)
            profile.residual_run = held_out
    now = others.conditions()
    profile.conditions = now if fresh or profile.conditions is None else merged(profile.conditions, now)
    saved = ""
    if contended(now) and not accept_busy:
        log(
            f"calibration: other processes kept {now.others_cores:.2f} of {now.cores} cores busy while it measured, "
            "so its step times are theirs as much as this machine's: not cached; plan again on an idle machine, or "
            "pass --accept-busy to plan with it anyway"
        )
    elif cache is not None:
        save_cached(profile, cache)
        saved = f", saved to {cache}"
    log(f"calibrated in {time.perf_counter() - started:.1f} s{saved}")
    return profile


def merged(before: Conditions, now: Conditions) -> Conditions:
    """A profile measured in two sittings: as old as its oldest figures, as loaded as its busiest sitting."""
    loads = [c for c in (before.others_cores, now.others_cores) if c is not None]
    return Conditions(min(before.taken_at, now.taken_at), max(loads) if loads else None, now.cores)


def measure_compute(profile: Profile, todo: Needs, device: torch.device, log: Callable[[str], None]) -> None:
    """The matmuls and attention ``todo`` lists, into ``profile``."""
    if todo.matmuls:
        log(f"calibrating: {len(todo.matmuls)} matmul shapes ...")
        times = {shape: time_matmul(*shape, device) for shape in sorted(todo.matmuls)}
        for shape, (first, kept) in outliers.retime(times, lambda s: time_matmul(*s, device)).items():
            log(
                f"calibrating: matmul {matmul_key(*shape)} timed {1e6 * first:.0f} us, slower than a shape that "
                f"contains it: retimed, {1e6 * kept:.0f} us"
            )
        profile.matmuls.update({matmul_key(*shape): t for shape, t in times.items()})
        profile.matmul_efficiency = matmul_efficiency(profile, profile.matmul_efficiency)
    if todo.attention:
        log(f"calibrating: {len(todo.attention)} attention shapes ...")
        for shape in sorted(todo.attention):
            forward, backward = time_attention(*shape, device)
            profile.attention[attention_key(*shape, "fwd")] = forward
            profile.attention[attention_key(*shape, "bwd")] = backward


def measure_links(
    profile: Profile,
    groups: list[int],
    ranks_per_node: int,
    threads: int,
    device: torch.device,
    log: Callable[[str], None],
    block: dict | None = None,
) -> None:
    """The collectives of ``groups`` into ``profile``, and its ``intra`` and ``inter`` links (one machine has no
    other) from the all-reduce of the largest group measured. Those links are what the ring formulas price the
    collectives not measured with (trident/plan/cost.py): an all-reduce over g ranks is 2 (g - 1) hops of the link's
    latency and moves 2 (g - 1) / g of the bytes at its bandwidth, so the measured rate is turned into a latency
    per hop and a ring's bus bandwidth, with which the formula gives back the measured all-reduce."""
    if device.type == "cuda" and torch.cuda.device_count() < ranks_per_node:
        log(f"calibrating: {torch.cuda.device_count()} GPUs for {ranks_per_node} ranks: collectives not measured")
        return
    log(f"calibrating: collectives over {ranks_per_node} ranks in groups of {', '.join(map(str, groups))} ...")
    rates, busy, sharing, (amid, amid_long, cpu) = measure_collectives(groups, ranks_per_node, threads, device, block)
    profile.collectives.update(rates)
    profile.collective_cpu.update(cpu)
    profile.amid.update(amid)
    profile.amid_long.update(amid_long)
    if device.type == "cpu":
        # What the node's ranks get together when all compute at once, in lone ranks' worth: the cores they share,
        # less what oversubscribing them costs (context switches, caches, memory bandwidth, other load).
        # A lone rank's block: its seconds of CPU (what the kernels are priced in, probes.own_time), else its rate.
        lone_s = time_block(block, threads)[0] if block is not None else 1 / matmul_rate(threads)
        profile.shared_capacity = busy * lone_s
        # And for every count k of them computing at once, the others waiting: what they get together against the
        # CPU time of one (about 1 at k = 1 on an idle machine, less where other processes take the cores): the
        # curve the planner's cores are shared by (cost.py RankPlacement.share).
        profile.sharing = [total * lone_s for total in sharing] if sharing else []
        log(
            f"calibrating: {ranks_per_node} ranks computing at once get {profile.shared_capacity:.2f} lone ranks' worth"
            + (f"; k = 1.. of them: {', '.join(f'{x:.2f}' for x in profile.sharing)}" if profile.sharing else "")
        )
    measured = [g for g in range(2, ranks_per_node + 1) if collective_key("all_reduce", g) in profile.collectives]
    if measured:
        g = max(measured)
        rate, hops = profile.collectives[collective_key("all_reduce", g)], 2 * (g - 1)
        profile.intra = profile.inter = Rate(rate.latency / hops, rate.bandwidth * hops / g)


def calibration_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def new_profile(device: torch.device, threads: int) -> Profile:
    """A profile of this machine with nothing measured yet."""
    stamp = f"calibrated {datetime.now():%Y-%m-%d %H:%M} on {socket.gethostname()}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return Profile(
            name=f"cuda: {props.name} (calibrated)",
            device="cuda",
            source=stamp,
            memory_bytes=float(props.total_memory),
            units_per_node=torch.cuda.device_count(),
            threads=1,
        )
    return Profile(
        name=f"cpu: {cpu_model()} (calibrated)",
        device="cpu",
        source=f"{stamp}, {threads} threads per rank",
        memory_bytes=host_memory_bytes(),
        units_per_node=os.cpu_count() or 1,
        threads=threads,
        usable_fraction=0.9,
    )


@contextlib.contextmanager
def training_settings(device: torch.device, threads: int) -> Iterator[None]:
    """A rank's settings while measuring: its CPU threads, and TF32 matmuls on a GPU (trident/device.py)."""
    before = torch.get_num_threads(), torch.backends.cuda.matmul.allow_tf32
    torch.set_num_threads(threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        torch.backends.cuda.matmul.allow_tf32 = before[1]


def matmul_efficiency(profile: Profile, default: float) -> float:
    """The median fraction of the peak the measured matmuls reach: the planner's figure for a shape not measured."""
    fractions = []
    for key, seconds in profile.matmuls.items():
        precision, shape, _ = key.split(":")
        if precision in profile.peak_tflops:
            m, n, k = map(int, shape.split("x"))
            fractions.append(2 * m * n * k / seconds / profile.peak(precision))
    return min(1.0, statistics.median(fractions)) if fractions else default


def measure_basics(profile: Profile, device: torch.device, host_threads: int) -> None:
    """The fields every calibration measures once: element-wise rate, host copies, AdamW on device and host."""
    profile.elementwise, profile.transcendental = measure_elementwise(device)
    profile.host_copy = measure_host_copy(device)
    profile.adam = measure_adam(device)
    if device.type == "cuda":
        with cpu_threads(host_threads):
            profile.host_adam = measure_adam(torch.device("cpu"))
    else:
        profile.host_adam = profile.adam


def measure_collectives(
    groups: list[int], ranks_per_node: int, threads: int, device: torch.device, block: dict | None = None
) -> tuple[dict[str, Rate], float, list[float]]:
    """A ``Rate`` per ``collective_key`` for each group size (each dividing ``ranks_per_node``), and ``p2p`` at 2,
    from ``ranks_per_node`` ranks of ``threads`` threads that all run their groups' collectives at once; the
    blocks (or matmuls) per second those ranks do together when they all compute at once; and on a CPU, for k = 1,
    2, ... of them computing at once, what they do together (``probes.sharing_rates``); and on a CPU each
    collective's ``Rate`` amid compute (``amid_rates``)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    per_rank = run_distributed(
        rank_collective_times, ranks_per_node, groups, threads, device.type, block, backend=backend,
        timeout_s=COLLECTIVE_TIMEOUT_S,
    )  # fmt: skip
    busy = sum(times.pop(BUSY_KEY)[0][1] for times in per_rank)
    swept = [times.pop(SHARING_KEY, []) for times in per_rank]
    extras, long_extras = amid_extras(per_rank), amid_extras(per_rank, AMID_LONG_KEY)
    # A collective's CPU: its bytes at the back-to-back CPU rate, and what else it cost amid compute.
    cpu = amid_rates(amid_extras(per_rank, AMID_CPU_KEY), cpu_rates(per_rank))
    totals: dict[int, list[float]] = {}  # k -> what the ranks did together, each round
    for i, (k, _) in enumerate(swept[0] if swept else []):
        totals.setdefault(k, []).append(sum(rates[i][1] for rates in swept))
    sharing = [statistics.median(totals[k]) for k in sorted(totals)]
    rates = {}
    for key, sizes in per_rank[0].items():
        # A collective is done when its slowest rank is: each size's time is the slowest rank's median.
        points = [(nbytes, max(times[key][i][1] for times in per_rank)) for i, (nbytes, _) in enumerate(sizes)]
        rates[key] = fit_rate(points)
    return rates, busy, sharing, (amid_rates(extras, rates), amid_rates(long_extras, rates), cpu)


def cpu_rates(per_rank: list[dict[str, list[tuple[int, float]]]]) -> dict[str, Rate]:
    """Popped from each rank's times (``probes.CPU_KEY``): per ``collective_key``, the ``Rate`` of the CPU seconds one
    collective costs a rank's process (every thread), each size's the median over the ranks."""
    out = {}
    for key in [key for key in per_rank[0] if key.startswith(CPU_KEY)]:
        sizes = [times.pop(key) for times in per_rank]
        points = [(nbytes, statistics.median(rank[i][1] for rank in sizes)) for i, (nbytes, _) in enumerate(sizes[0])]
        out[key.removeprefix(CPU_KEY)] = fit_rate([(b, max(t, 1e-9)) for b, t in points])
    return out


def amid_extras(
    per_rank: list[dict[str, list[tuple[int, float]]]], prefix: str = AMID_KEY
) -> dict[str, tuple[int, float]]:
    """Popped from each rank's times (``probes.amid_compute``, its keys under ``prefix``): per ``collective_key``,
    (bytes, the median over the ranks of the seconds one collective added to a round of compute; every rank timed
    the same barriers)."""
    keys = [key for key in per_rank[0] if key.startswith(prefix)]
    out = {}
    for key in keys:
        sizes = [times.pop(key)[0] for times in per_rank]  # (bytes, seconds added): one size, the same on every rank
        out[key.removeprefix(prefix)] = (sizes[0][0], statistics.median(extra for _, extra in sizes))
    return out


def amid_rates(extras: dict[str, tuple[int, float]], rates: dict[str, Rate]) -> dict[str, Rate]:
    """Each collective's ``Rate`` amid compute: its bytes at the back-to-back bandwidth (``rates``: moving them costs
    what it costs), and a latency of whatever else the round measured it to add (at least 0)."""
    out = {}
    for key, (nbytes, extra) in extras.items():
        bandwidth = rates[key].bandwidth
        out[key] = Rate(max(0.0, extra - nbytes / bandwidth), bandwidth)
    return out


def measure_framework(profile: Profile, block: dict, threads: int, log: Callable[[str], None]) -> None:
    """``profile.dispatch`` and ``profile.framework``: a real one-layer model's forward and backward, alone on
    ``threads`` threads. Its tiny twin (``tiny_block``: the same ops on a few elements each, whose kernels cost next to
    nothing) gives the framework's time per op (``per_op``); the block itself at its micro-batch, less that per op,
    over the sum of its ops as the profile prices their kernels, the scale on the kernels (``kernel_scale``)."""
    from trident.plan.cost import Pricer, RankPlacement  # noqa: PLC0415 (cost imports this module's profile)

    def point(block: dict, measure: bool) -> tuple[float, float, int]:
        """(measured seconds, priced kernels, ops) of ``block``'s forward and backward."""
        measured, m, shape = time_block(block, threads)
        ops = [o for o in chunk_ops(m, shape, 1, True, True, "none") if o.kind != "collective"]
        pricer = Pricer(profile, shape.precision, RankPlacement(1, 1, threads, threads))
        for o in ops if measure else ():  # its matmuls and attention, measured if not yet
            key = matmul_key(shape.precision, *o.shape[:4]) if o.kind == "matmul" and o.shape[4] is None else None
            if key is not None and key not in profile.matmuls:  # an FP8 GEMM is priced at the peak, not timed
                profile.matmuls[key] = time_matmul(shape.precision, *o.shape[:4], cpu())
            if o.kind == "attention":
                key = attention_key(shape.precision, *o.shape[:5], "fwd")
                if key not in profile.attention:
                    forward, backward = time_attention(shape.precision, *o.shape[:5], cpu())
                    profile.attention[key] = forward
                    profile.attention[attention_key(shape.precision, *o.shape[:5], "bwd")] = backward
        return measured, sum(pricer.kernels(o) for o in ops), sum(o.count for o in ops)

    profile.dispatch = per_op(point(tiny_block(block), measure=False))
    profile.framework = kernel_scale(point(block, measure=True), profile.dispatch)
    profile.block = block
    log(
        f"calibrating: a {block['model']['name']} block runs at {profile.framework:.2f} x its kernels' time + "
        f"{1e6 * profile.dispatch:.0f} us per op (the framework's share)"
    )


def tiny_block(block: dict) -> dict:
    """``block``'s model's tiny twin (trident_dev/plan/tiny.py: the same ops on a few elements each), with a small
    vocabulary, at micro-batch 1."""
    return {**block, "model": {**tiny.twin(block["model"]), "vocab_size": tiny.VOCAB}, "batch": 1}


def per_op(tiny: tuple[float, float, int]) -> float:
    """Seconds the framework adds to each op (autograd's node, the module call, views and allocations around it),
    from a tiny block's ``(measured, priced kernels, ops)``: what is left of its time beyond its kernels, per op."""
    measured, kernels, ops = tiny
    return max(0.0, measured - kernels) / ops if ops else 0.0


def kernel_scale(block: tuple[float, float, int], dispatch: float) -> float:
    """The scale on the kernels' time with which ``scale x kernels + ops x dispatch`` gives the measured seconds of
    the block's ``(measured, priced kernels, ops)``; the kernels' ratio alone if ``dispatch`` leaves nothing
    (noise)."""
    measured, kernels, ops = block
    rest = measured - ops * dispatch
    return rest / kernels if rest > 0 else measured / kernels


def cpu() -> torch.device:
    return torch.device("cpu")
