"""Measure this machine for the planner's step-time model: what ``Profile`` (trident/plan/profile.py) holds.

A datasheet's rules of thumb (matmuls at 70% of the peak, ring collectives at 80% of the link) are far off on a
CPU, where small matmuls run at a fraction of the peak, fp16 may have no fast kernel at all, and "links" are
gloo's TCP loopback between processes that share a few cores. So the layout planner's ``--calibrate`` times the
work its candidate layouts would do, under the conditions a training launch of ``ranks_per_node`` ranks gives a
rank, and only that work (``Needs``):

- each matmul shape and dtype the layouts run (``torch.mm`` of ``[m, k] @ [k, n]``), and causal attention
  (``F.scaled_dot_product_attention`` as models/gpt.py calls it) forward and backward, on the threads one rank
  gets (the node's cores divided by its ranks, as train.py sets them): the median of as many runs as fit in a
  twentieth of a second (a tenth for attention), after a warm-up;
- element-wise work (an add and a GELU at a few sizes) fitted to a latency plus bytes at a bandwidth; a host copy;
  AdamW (as parallel/zero/optimizer.py builds it) in parameters per second;
- collectives: ``ranks_per_node`` gloo ranks (NCCL on GPUs) split into disjoint groups of each size, every group
  running at once as the groups of a 3D layout do, so each rank's time includes the others' load on the cores
  and the loopback. All-reduce, all-gather and reduce-scatter (the flat forms trident/parallel uses) at three
  message sizes, and pipeline point-to-point (a send and a receive each way) between pairs of ranks, each fitted
  to a ``Rate``. A collective is done when its slowest rank is, so each size's time is the slowest rank's median.

Matmuls, attention and the element-wise rates are measured with one rank alone on the machine: a launch whose
ranks ask for more threads than the node has cores shares them, which is the planner's to account for, from
``threads`` and ``units_per_node`` (as trident/peak.py scales its peak). The links ``intra`` and ``inter`` are
the largest group's all-reduce restated for the ring formulas that price what was not measured.

With CUDA the same is timed on the GPU (CUDA events), with TF32 matmuls as training uses them, the peak from the
datasheet table of trident/peak.py, host copies from pinned memory, and the host's AdamW (optimizer offload) on
the CPU threads a rank gets.

Results are cached per machine, thread count and torch version (``load_cached`` / ``save_cached``): a second
calibration with the same needs measures nothing, and one with more needs measures only what is new.
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
import torch.distributed as dist
import torch.nn.functional as F

from trident.config import ModelConfig
from trident.peak import PRECISION_DTYPES, cpu_model, cpu_peak_tflops, gpu_peak_bf16_tflops
from trident.plan.ops import Shape, chunk_ops
from trident.plan.profile import (
    DEFAULT_CACHE,
    Needs,
    Profile,
    Rate,
    attention_key,
    collective_key,
    cpu_threads_per_rank,
    host_memory_bytes,
    load_cached,
    matmul_key,
    save_cached,
)
from trident.ranks import run_distributed

# torch renamed the flat collectives (as parallel/comm.py uses them); gloo has both forms.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

KIB, MIB = 1024, 1024**2
COLD_COPIES, COLD_BYTES = 8, 64 * 2**20  # operand pairs a matmul's timing cycles through (at most 64 MiB of them)
SHAPE_BUDGET_S = 0.05  # per matmul shape: ~150 shapes in a few seconds
ATTENTION_BUDGET_S = 0.1  # per attention shape and direction
RATE_BUDGET_S = 0.05  # per size of an element-wise op or a copy
ADAM_BUDGET_S = 0.3
MIN_REPS, MAX_REPS = 3, 50
ELEMENTWISE_BYTES = (16 * KIB, 1 * MIB, 8 * MIB)  # one tensor's size
HOST_COPY_BYTES = (1 * MIB, 64 * MIB)
ADAM_TENSORS, ADAM_NUMEL = 4, 2**20  # 4M fp32 parameters in a handful of tensors
# Collective message sizes (fp32) and timed repetitions of each, after one warm-up.
COLLECTIVE_SIZES = ((32 * KIB, 10), (1 * MIB, 6), (8 * MIB, 4))
COLLECTIVE_TIMEOUT_S = 600.0
BUSY_KEY = "matmuls while every rank computes"
BUSY_S = 1.0


def calibrate(
    needs: Needs,
    ranks_per_node: int,
    *,
    cache: Path | None = DEFAULT_CACHE,
    log: Callable[[str], None] = print,
) -> Profile:
    """This machine's ``Profile`` for a launch of ``ranks_per_node`` ranks per node, with everything ``needs``
    asks for measured: read from ``cache`` where it was measured before, measured now where not, and saved back
    (``cache`` None: measure everything, save nothing)."""
    started = time.perf_counter()
    device = calibration_device()
    host_threads = cpu_threads_per_rank(ranks_per_node)  # what train.py gives each rank of the node
    threads = 1 if device.type == "cuda" else host_threads
    profile = load_cached(device.type, ranks_per_node, threads, cache) if cache is not None else None
    fresh = profile is None
    if profile is None:
        profile = new_profile(device, threads)
    profile.ranks_per_node = ranks_per_node
    todo = needs.missing(profile)
    precisions = sorted(todo.precisions | ({"fp32"} - profile.peak_tflops.keys()))
    groups = sorted(g for g in todo.groups if g >= 2 and ranks_per_node % g == 0)
    if set(todo.groups) - set(groups):
        unfit = sorted(set(todo.groups) - set(groups))
        log(f"calibrating: group sizes {unfit} do not divide {ranks_per_node} ranks per node: not measured")
    if not (fresh or precisions or todo.matmuls or todo.attention or groups):
        log(f"calibration: everything needed was measured before ({profile.name}, {threads} threads per rank)")
        return profile

    log(f"calibrating {profile.name.removesuffix(' (calibrated)')}, {threads} threads per rank ...")
    with training_settings(device, host_threads):
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
    if cache is not None:
        save_cached(profile, cache)
    saved = f", saved to {cache}" if cache is not None else ""
    log(f"calibrated in {time.perf_counter() - started:.1f} s{saved}")
    return profile


def measure_compute(profile: Profile, todo: Needs, device: torch.device, log: Callable[[str], None]) -> None:
    """The matmuls and attention ``todo`` lists, into ``profile``."""
    if todo.matmuls:
        log(f"calibrating: {len(todo.matmuls)} matmul shapes ...")
        for shape in sorted(todo.matmuls):
            profile.matmuls[matmul_key(*shape)] = time_matmul(*shape, device)
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
    rates, busy = measure_collectives(groups, ranks_per_node, threads, device, block)
    profile.collectives.update(rates)
    if device.type == "cpu":
        # What the node's ranks get together when all compute at once, in lone ranks' worth: the cores they share,
        # less what oversubscribing them costs (context switches, caches, memory bandwidth, other load).
        lone = block_rate(block, threads) if block is not None else matmul_rate(threads)
        profile.shared_capacity = busy / lone
        log(
            f"calibrating: {ranks_per_node} ranks computing at once get {profile.shared_capacity:.2f} lone ranks' worth"
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


@contextlib.contextmanager
def cpu_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- timing


def seconds_once(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds of one ``fn()``: wall time on a CPU, CUDA events around it on a GPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s


def median_seconds(fn: Callable[[], object], device: torch.device, budget: float = SHAPE_BUDGET_S) -> float:
    """Median seconds of ``fn()`` after a warm-up (kernel selection, packing buffers, allocations): as many runs
    as fit in ``budget`` seconds, at least ``MIN_REPS``, at most ``MAX_REPS``. A call whose warm-up alone took the
    budget is timed once more and that run is its time: it is long enough not to be noise."""
    if seconds_once(fn, device) >= budget:
        return seconds_once(fn, device)
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < MIN_REPS or (len(times) < MAX_REPS and time.perf_counter() < deadline):
        times.append(seconds_once(fn, device))
    return statistics.median(times)


def fit_rate(points: list[tuple[float, float]]) -> Rate:
    """The ``Rate`` whose ``latency + bytes / bandwidth`` best fits ``(bytes, seconds)`` points, in relative error
    (so that the small sizes, which fix the latency, count as much as the large ones, which fix the bandwidth);
    latency at least 0, bandwidth positive."""
    # Least squares of (latency + bytes * inverse - t) / t over the points: a 2x2 linear system.
    rows = [(1 / t, b / t) for b, t in points]
    s11 = sum(x * x for x, _ in rows)
    s12 = sum(x * y for x, y in rows)
    s22 = sum(y * y for _, y in rows)
    r1, r2 = sum(x for x, _ in rows), sum(y for _, y in rows)
    det = s11 * s22 - s12 * s12
    latency, inverse = ((r1 * s22 - r2 * s12) / det, (s11 * r2 - s12 * r1) / det) if det > 0 else (-1.0, 0.0)
    if latency < 0 or inverse <= 0:  # no latency to speak of: fit the bandwidth alone
        latency, inverse = 0.0, r2 / s22
    if inverse <= 0:  # pragma: no cover (r2 / s22 > 0 for positive bytes and times)
        raise ValueError(f"cannot fit a rate to {points}")
    return Rate(latency, 1 / inverse)


# ---- compute


def time_matmul(precision: str, m: int, n: int, k: int, layout: str, device: torch.device) -> float:
    """Median seconds of an ``[m, k] @ [k, n]`` matmul in ``precision``, its operands laid out as ``layout`` (a
    transposed view where training has one), each run on other operands than the last (``COLD_COPIES`` of them
    in turn): training's operands come from memory, not from the cache the previous run warmed."""
    dtype = PRECISION_DTYPES[precision]
    gen = torch.Generator(device=device).manual_seed(0)

    def operand(rows: int, cols: int, transposed: bool) -> torch.Tensor:
        if transposed:
            return torch.randn(cols, rows, generator=gen, device=device).to(dtype).t()
        return torch.randn(rows, cols, generator=gen, device=device).to(dtype)

    copies = max(1, min(COLD_COPIES, COLD_BYTES // max(1, (m * k + k * n) * dtype.itemsize)))
    pairs = [(operand(m, k, layout == "tn"), operand(k, n, layout == "nt")) for _ in range(copies)]
    out = torch.empty(m, n, dtype=dtype, device=device)
    turn = iter(range(1 << 62))

    def run() -> None:
        a, b = pairs[next(turn) % copies]
        torch.mm(a, b, out=out)

    return median_seconds(run, device, SHAPE_BUDGET_S)


def time_attention(
    precision: str, batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, device: torch.device
) -> tuple[float, float]:
    """Median seconds of causal attention's forward (recording the graph, as training does) and of its backward
    (``torch.autograd.grad`` through one recorded forward, kept for every run)."""
    dtype = PRECISION_DTYPES[precision]
    gen = torch.Generator(device=device).manual_seed(0)

    def tensor(h: int) -> torch.Tensor:
        return torch.randn(batch, h, seq, head_dim, generator=gen, device=device).to(dtype).requires_grad_()

    q, k, v = tensor(heads), tensor(kv_heads), tensor(kv_heads)
    gqa = kv_heads != heads

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    forward_s = median_seconds(forward, device, ATTENTION_BUDGET_S)
    out = forward()
    grad = torch.randn(out.shape, generator=gen, device=device).to(dtype)
    backward_s = median_seconds(
        lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), device, ATTENTION_BUDGET_S
    )
    return forward_s, backward_s


def matmul_efficiency(profile: Profile, default: float) -> float:
    """The median fraction of the peak the measured matmuls reach: the planner's figure for a shape not measured."""
    fractions = []
    for key, seconds in profile.matmuls.items():
        precision, shape, _ = key.split(":")
        if precision in profile.peak_tflops:
            m, n, k = map(int, shape.split("x"))
            fractions.append(2 * m * n * k / seconds / profile.peak(precision))
    return min(1.0, statistics.median(fractions)) if fractions else default


def peak_tflops(precision: str, device: torch.device, threads: int, peak_cache: Path | None) -> float:
    """Dense peak of one rank's device: trident/peak.py's measured CPU peak (cached beside the profile), a known
    GPU's datasheet figure, or the best of a few large matmuls on a GPU the table does not know."""
    if device.type != "cuda":
        return cpu_peak_tflops(precision, threads, peak_cache)
    known = gpu_peak_bf16_tflops(torch.cuda.get_device_name(device))
    if known is not None:
        return known / 2 if precision == "fp32" else known
    n = 4096
    return 2 * n**3 / time_matmul(precision, n, n, n, "nn", device) / 1e12


# ---- memory-bound work


def time_add(numel: int, device: torch.device) -> float:
    """Median seconds of ``a + b`` on ``numel`` fp32 elements (reads 2, writes 1 tensor), its output allocated
    each time as in training (past glibc's mmap threshold, 32 MiB, that is fresh pages: the OS zeroes each)."""
    a, b = (torch.rand(numel, device=device) for _ in range(2))
    return median_seconds(lambda: a + b, device, RATE_BUDGET_S)


def time_gelu(numel: int, device: torch.device) -> float:
    """Median seconds of GPT-2's tanh GELU on ``numel`` fp32 elements (reads 1, writes 1 tensor)."""
    a = torch.rand(numel, device=device)
    return median_seconds(lambda: F.gelu(a, approximate="tanh"), device, RATE_BUDGET_S)


def measure_elementwise(device: torch.device) -> tuple[Rate, Rate]:
    """Element-wise ops as a latency (dispatch, a kernel launch) plus bytes read and written at a bandwidth: the
    memory-bound kind (an add) and the kind bound on a CPU by its arithmetic (a tanh GELU: transcendentals, about a
    tenth of the add's bytes per second on one core), priced apart (trident/plan/ops.py says which op is which)."""
    plain = fit_rate([(3 * n, time_add(n // 4, device)) for n in ELEMENTWISE_BYTES])
    heavy = fit_rate([(2 * n, time_gelu(n // 4, device)) for n in ELEMENTWISE_BYTES])
    return plain, heavy


def time_copy(nbytes: int, device: torch.device) -> float:
    """Median seconds of a copy of ``nbytes``: host to device from pinned memory on a GPU, host to host on a CPU."""
    numel = nbytes // 4
    source = torch.rand(numel, pin_memory=device.type == "cuda")
    target = torch.empty(numel, device=device)
    return median_seconds(lambda: target.copy_(source, non_blocking=True), device, RATE_BUDGET_S)


def measure_host_copy(device: torch.device) -> Rate:
    return fit_rate([(nbytes, time_copy(nbytes, device)) for nbytes in HOST_COPY_BYTES])


def measure_adam(device: torch.device) -> float:
    """Parameters per second of an AdamW step on a few million fp32 parameters, as parallel/zero/optimizer.py
    builds it: fused on a GPU, foreach on a CPU."""
    params = [torch.rand(ADAM_NUMEL, device=device, requires_grad=True) for _ in range(ADAM_TENSORS)]
    for p in params:
        p.grad = torch.rand_like(p)
    on_cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=on_cuda, foreach=None if on_cuda else True)
    return ADAM_TENSORS * ADAM_NUMEL / median_seconds(optimizer.step, device, ADAM_BUDGET_S)


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


# ---- collectives


def measure_collectives(
    groups: list[int], ranks_per_node: int, threads: int, device: torch.device, block: dict | None = None
) -> tuple[dict[str, Rate], float]:
    """A ``Rate`` per ``collective_key`` for each group size (each dividing ``ranks_per_node``), and ``p2p`` at 2,
    from ``ranks_per_node`` ranks of ``threads`` threads that all run their groups' collectives at once; and the
    matmuls per second those ranks do together when they all compute at once."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    per_rank = run_distributed(
        rank_collective_times, ranks_per_node, groups, threads, device.type, block, backend=backend,
        timeout_s=COLLECTIVE_TIMEOUT_S,
    )  # fmt: skip
    busy = sum(times.pop(BUSY_KEY)[0][1] for times in per_rank)
    rates = {}
    for key, sizes in per_rank[0].items():
        # A collective is done when its slowest rank is: each size's time is the slowest rank's median.
        points = [(nbytes, max(times[key][i][1] for times in per_rank)) for i, (nbytes, _) in enumerate(sizes)]
        rates[key] = fit_rate(points)
    return rates, busy


def rank_collective_times(
    rank: int, world_size: int, groups: list[int], threads: int, device_type: str, block: dict | None = None
) -> dict[str, list[tuple[int, float]]]:
    """On one rank (of run_distributed): median seconds of each collective by group size and message bytes."""
    torch.set_num_threads(threads)
    device = torch.device(device_type)
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    times: dict[str, list[tuple[int, float]]] = {}
    wait_for_ranks(device)
    busy = 0.0
    if device_type == "cpu":
        busy = block_rate(block, threads) if block is not None else matmul_rate(threads)
    times[BUSY_KEY] = [(0, busy)]
    for g in groups:
        group = split_into_groups(rank, world_size, g)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            times[collective_key(op, g)] = [
                (nbytes, time_collective(collective(op, nbytes, group, g, device), reps, device))
                for nbytes, reps in COLLECTIVE_SIZES
            ]
    if 2 in groups:
        times[collective_key("p2p", 2)] = [
            (nbytes, time_collective(exchange(nbytes, rank ^ 1, device), reps, device))
            for nbytes, reps in COLLECTIVE_SIZES
        ]
    return times


def _block(block: dict) -> tuple[Callable[[], None], ModelConfig, Shape]:
    """A one-layer model of ``block``'s shape (embedding, one block, head and loss) and one forward and backward of
    a micro-batch through it."""
    from trident.models.gpt import GPT  # noqa: PLC0415

    m = ModelConfig(**{**block["model"], "n_layers": 1, "dropout": 0.0})
    torch.manual_seed(0)
    model = GPT(m).to(PRECISION_DTYPES[block["precision"]])
    x = torch.randint(0, m.vocab_size, (block["batch"], m.seq_len))

    def step() -> None:
        model.loss_sum(model(x), x).backward()

    return step, m, Shape(block["batch"], m.seq_len, 1, False, block["precision"])


def block_rate(block: dict, threads: int, seconds: float = BUSY_S) -> float:
    """Forwards and backwards per second of ``block`` on ``threads`` threads over ``seconds``."""
    with cpu_threads(threads):
        step, _, _ = _block(block)
        step()
        n, start = 0, time.perf_counter()
        while n < 2 or time.perf_counter() - start < seconds:
            step()
            n += 1
        return n / (time.perf_counter() - start)


def measure_framework(profile: Profile, block: dict, threads: int, log: Callable[[str], None]) -> None:
    """``profile.framework``: a real one-layer model's forward and backward, alone on ``threads`` threads, over the
    sum of its ops as the profile prices their kernels (its shapes are among those just measured)."""
    from trident.plan.cost import Pricer, RankPlacement  # noqa: PLC0415 (cost imports this module's profile)

    with cpu_threads(threads):
        step, m, shape = _block(block)
        measured = median_seconds(step, torch.device("cpu"), BUSY_S)
    pricer = Pricer(profile, shape.precision, RankPlacement(1, 1, threads, threads))
    priced = sum(pricer.kernels(o) for o in chunk_ops(m, shape, 1, True, True, "none") if o.kind != "collective")
    profile.framework, profile.block = measured / priced, block
    log(f"calibrating: a {m.name} block runs at {profile.framework:.2f} x its kernels' time (the framework's share)")


def matmul_rate(threads: int, seconds: float = BUSY_S) -> float:
    """512 x 512 fp32 matmuls per second on ``threads`` threads over ``seconds``."""
    with cpu_threads(threads):
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        torch.mm(a, b)
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            torch.mm(a, b)
            n += 1
        return n / (time.perf_counter() - start)


def split_into_groups(rank: int, world_size: int, size: int) -> dist.ProcessGroup:
    """This rank's group among ``world_size / size`` disjoint groups of consecutive ranks (every rank creates
    every group, in the same order, as torch.distributed requires)."""
    mine = None
    for start in range(0, world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    assert mine is not None
    return mine


def collective(op: str, nbytes: int, group: dist.ProcessGroup, size: int, device: torch.device) -> Callable[[], None]:
    """One ``op`` over ``group`` moving ``nbytes`` of fp32: all-reduce's tensor, all-gather's gathered output,
    reduce-scatter's input (rounded down to a multiple of the group's size)."""
    numel = nbytes // 4 // size * size
    whole = torch.zeros(numel, device=device)
    shard = torch.zeros(numel // size, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if op == "all_gather":
        return lambda: _all_gather_flat(whole, shard, group=group)
    if op == "reduce_scatter":
        return lambda: _reduce_scatter_flat(shard, whole, group=group)
    raise ValueError(f"unknown collective {op!r}")


def exchange(nbytes: int, peer: int, device: torch.device) -> Callable[[], None]:
    """A pipeline's point-to-point step: ``nbytes`` sent to ``peer`` and as many received from it, at once."""
    send = torch.zeros(nbytes // 4, device=device)
    receive = torch.empty_like(send)

    def run() -> None:
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, receive, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return run


def time_collective(run: Callable[[], None], reps: int, device: torch.device) -> float:
    """Median seconds of ``reps`` back-to-back runs after a warm-up, every rank starting together. A fixed
    count, not a time budget: every rank of a group has to make the same calls."""
    wait_for_ranks(device)
    run()
    times = [seconds_once(run, device) for _ in range(reps)]
    return statistics.median(times)


def wait_for_ranks(device: torch.device) -> None:
    """Every rank of the launch here (a tiny all-reduce: NCCL's barrier wants to be told the device)."""
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
