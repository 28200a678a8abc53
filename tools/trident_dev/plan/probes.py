"""The micro-benchmarks a calibration (trident_dev/plan/calibrate.py) runs: each times one kind of work on this machine
and returns seconds, a ``Rate`` or a rate per second; none of them reads or writes a ``Profile``, which is the
calibration's to fill.

- timing: one run (wall time on a CPU, CUDA events on a GPU), the median of as many runs as fit in a budget, and a
  ``Rate`` (latency plus bytes at a bandwidth) fitted to timings at a few sizes;
- compute: a matmul of one shape, layout and precision on operands that are not in the cache; causal attention
  forward and backward; a device's dense peak;
- memory-bound work: an add, a tanh GELU, a host copy, an AdamW step;
- a one-layer model's forward and backward, and the work ranks do when all compute at once;
- collectives: what one rank of a launch (trident_dev/ranks.py's ``run_distributed``) times for each group size.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from trident.config import ModelConfig
from trident.peak import PRECISION_DTYPES, cpu_peak_tflops, gpu_peak_bf16_tflops
from trident.plan.ops import Shape
from trident.plan.profile import AMID_LONG_SEGMENT_S, AMID_SEGMENT_S, Rate, collective_key

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
# On a GPU up to past its L2 (H100 50 MB, H200 60 MB, B200 126 MB): 8 MiB there times the cache, not the HBM a
# layer's activations stream through.
GPU_ELEMENTWISE_BYTES = (16 * KIB, 64 * MIB, 512 * MIB)
GPU_WARM_S = 0.5  # a GPU's clocks rise from idle under load: matmuls this long before the first timing
HOST_COPY_BYTES = (1 * MIB, 64 * MIB)
ADAM_TENSORS, ADAM_NUMEL = 4, 2**20  # 4M fp32 parameters in a handful of tensors
# Collective message sizes (fp32) and timed repetitions of each, after one warm-up.
COLLECTIVE_SIZES = ((32 * KIB, 10), (1 * MIB, 6), (8 * MIB, 4))
BUSY_KEY = "matmuls while every rank computes"
SHARING_KEY = "blocks while k ranks compute"  # one entry per k: this rank's rate (0 when idle)
BUSY_S = 1.0
SHARING_S = 0.3  # per k of a sweep
SHARING_ROUNDS = 3  # sweeps of k = 1 .. ranks, one after another (each k's median: other load drifts meanwhile)
# Collectives amid compute (``amid_compute``): the message, the rounds of a sitting, the sittings, and the compute
# between two collectives.
AMID_BYTES, AMID_ROUNDS, AMID_SITTINGS = 16 * KIB, 12, 3
AMID_KEY = "amid "  # + collective_key: [(bytes, seconds a round with the collective takes beyond one without)]
# And again with longer stretches of compute between them (a layer's pass at micro-batch 1 of a small model on one
# thread): there a rank reaching its collective more often finds a peer the scheduler stopped in mid-stretch, and
# waits for it to be run again (at world 8 on 2 cores a pair's exchange added about 2 ms after 1 ms of matmuls,
# about 4 ms after 4 ms).
AMID_LONG_ROUNDS = 6  # rounds a sitting after AMID_LONG_SEGMENT_S (profile.py) of compute each
AMID_LONG_KEY = "amid-long "  # not a prefix of AMID_KEY's keys, nor they of its
CPU_KEY = "cpu "  # + collective_key: [(bytes, CPU seconds of this rank's process, every thread, per collective)]
AMID_CPU_KEY = "amid-cpu "  # + collective_key: [(bytes, CPU seconds one collective amid compute added to a round)]


@contextlib.contextmanager
def cpu_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---- timing


def seconds_once(fn: Callable[[], object], device: torch.device, cpu_time: bool = False) -> float:
    """Seconds of one ``fn()``: wall time on a CPU (``cpu_time``: the calling thread's CPU time), CUDA events
    around it on a GPU."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    clock = time.thread_time if cpu_time else time.perf_counter
    start_s = clock()
    fn()
    return clock() - start_s


def own_time(device: torch.device) -> bool:
    """Whether compute is timed by the thread's CPU time: on a CPU with one thread (a kernel's whole work is on
    it), so that what other processes take of the cores while it runs is not in its time: a kernel's rate is the
    machine's, and sharing the cores is the sharing curve's (``sharing_rates``)."""
    return device.type == "cpu" and torch.get_num_threads() == 1


def median_seconds(fn: Callable[[], object], device: torch.device, budget: float = SHAPE_BUDGET_S) -> float:
    """Median seconds of ``fn()`` after a warm-up (kernel selection, packing buffers, allocations): as many runs
    as fit in ``budget`` seconds, at least ``MIN_REPS``, at most ``MAX_REPS``. A call whose warm-up alone took the
    budget is timed once more and that run is its time: it is long enough not to be noise."""
    mine = own_time(device)
    if seconds_once(fn, device, mine) >= budget:
        return seconds_once(fn, device, mine)
    times: list[float] = []
    deadline = time.perf_counter() + budget
    while len(times) < MIN_REPS or (len(times) < MAX_REPS and time.perf_counter() < deadline):
        times.append(seconds_once(fn, device, mine))
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
    sizes = elementwise_sizes(device)
    plain = fit_rate([(3 * n, time_add(n // 4, device)) for n in sizes])
    heavy = fit_rate([(2 * n, time_gelu(n // 4, device)) for n in sizes])
    return plain, heavy


def elementwise_sizes(device: torch.device) -> tuple[int, ...]:
    """The tensor sizes an element-wise op is timed at on ``device``."""
    return GPU_ELEMENTWISE_BYTES if device.type == "cuda" else ELEMENTWISE_BYTES


def warm_gpu(device: torch.device, seconds: float = GPU_WARM_S) -> None:
    """Keep ``device`` busy with bf16 matmuls for ``seconds``, so that the timings after start at its working clocks,
    not at an idle GPU's (on an H200 here: 345 MHz idle, 1980 MHz under load)."""
    a = torch.rand(4096, 4096, device=device, dtype=torch.bfloat16)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(8):
            a @ a
        torch.cuda.synchronize(device)


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
    builds it: torch's fused kernel, on a GPU and a CPU alike."""
    params = [torch.rand(ADAM_NUMEL, device=device, requires_grad=True) for _ in range(ADAM_TENSORS)]
    for p in params:
        p.grad = torch.rand_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    return ADAM_TENSORS * ADAM_NUMEL / median_seconds(optimizer.step, device, ADAM_BUDGET_S)


# ---- a model's block, and every rank computing at once


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


def time_block(block: dict, threads: int) -> tuple[float, ModelConfig, Shape]:
    """Median seconds of ``block``'s forward and backward alone on ``threads`` threads, with the one-layer model's
    config and the micro-batch's shape (to price the same ops with)."""
    with cpu_threads(threads):
        step, m, shape = _block(block)
        return median_seconds(step, torch.device("cpu"), BUSY_S), m, shape


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


def sharing_rates(
    rank: int,
    world_size: int,
    threads: int,
    block: dict | None,
    device: torch.device,
    seconds: float = SHARING_S,
    rounds: int = SHARING_ROUNDS,
) -> list[tuple[int, float]]:
    """On one rank of a launch, ``rounds`` times: for k = 1 .. ``world_size``, the ranks below k compute
    (``block``, else matmuls) for ``seconds`` while the others wait in a collective, as a pipeline's idle ranks wait
    for a message; ``(k, this rank's rate)``, 0 when it waited, in that order. Summed over the ranks, what k ranks
    computing at once get together."""
    out = []
    for k in [k for _ in range(rounds) for k in range(1, world_size + 1)]:
        wait_for_ranks(device)
        rate = 0.0
        if rank < k:
            rate = block_rate(block, threads, seconds) if block is not None else matmul_rate(threads, seconds)
        out.append((k, rate))
    wait_for_ranks(device)
    return out


# ---- collectives


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
    if device_type == "cpu":
        times[SHARING_KEY] = sharing_rates(rank, world_size, threads, block, device)
    made = {}
    runs: dict[str, Callable[[int], Callable[[], None]]] = {}
    for g in groups:
        group = made[g] = split_into_groups(rank, world_size, g)
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"):
            runs[collective_key(op, g)] = lambda n, op=op, group=group, g=g: collective(op, n, group, g, device)
    if 2 in groups:
        runs[collective_key("p2p", 2)] = lambda nbytes: exchange(nbytes, rank ^ 1, device)
    for key, make in runs.items():
        timed = [(nbytes, time_collective(make(nbytes), reps, device)) for nbytes, reps in COLLECTIVE_SIZES]
        times[key] = [(nbytes, seconds) for nbytes, (seconds, _) in timed]
        if device_type == "cpu":
            times[CPU_KEY + key] = [(nbytes, cpu) for nbytes, (_, cpu) in timed]
    if device_type == "cpu" and world_size > 1:
        times.update(amid_compute(rank, made, device))
        times.update(amid_compute(rank, made, device, AMID_LONG_SEGMENT_S, AMID_LONG_ROUNDS, AMID_LONG_KEY))
    return times


def amid_compute(
    rank: int,
    groups: dict[int, dist.ProcessGroup],
    device: torch.device,
    segment_s: float = AMID_SEGMENT_S,
    rounds_each: int = AMID_ROUNDS,
    prefix: str = AMID_KEY,
) -> dict[str, list[tuple[int, float]]]:
    """On one rank: each collective of each group size as the passes of tensor and context parallelism meet it,
    between two stretches of compute while every rank of the launch does the same: ``prefix`` + its key, the
    seconds a round of ``segment_s`` of matmuls and a collective of ``AMID_BYTES`` takes beyond a round of the
    matmuls alone (the median of ``AMID_SITTINGS`` sittings of ``rounds_each`` rounds of each, one after the other,
    every rank timing from one barrier to the next). On cores that more ranks share than they have, a rank reaching
    a collective waits for a peer the scheduler has not run, and gloo's wake-ups cost the cores the others compute
    on: what one collective costs the step there, which back-to-back collectives (``time_collective``) do not see.
    ``groups``: this rank's group of each size (``split_into_groups``)."""
    a, b = torch.randn(128, 128), torch.randn(128, 128)
    torch.mm(a, b)
    start = time.thread_time()
    for _ in range(20):
        torch.mm(a, b)
    # The same matmuls on every rank: the most any rank needs for ``segment_s`` of its own.
    count = torch.tensor([max(1, round(segment_s / max(1e-7, (time.thread_time() - start) / 20)))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    n = int(count.item())

    def rounds(run: Callable[[], None] | None) -> tuple[float, float]:
        """Seconds of a round, and CPU seconds of this rank's process (every thread) in it."""

        def one() -> None:
            for _ in range(n):
                torch.mm(a, b)
            if run is not None:
                run()

        one()  # warm-up
        wait_for_ranks(device)
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(rounds_each):
            one()
        wait_for_ranks(device)
        return (time.perf_counter() - start) / rounds_each, (time.process_time() - cpu) / rounds_each

    out: dict[str, list[tuple[int, float]]] = {}
    for g, group in groups.items():
        for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", *(("p2p",) if g == 2 else ())):
            pair = op == "p2p"
            run = exchange(AMID_BYTES, rank ^ 1, device) if pair else collective(op, AMID_BYTES, group, g, device)
            extra = [tuple(x - y for x, y in zip(rounds(run), rounds(None), strict=True)) for _ in range(AMID_SITTINGS)]
            out[prefix + collective_key(op, g)] = [(AMID_BYTES, statistics.median(t for t, _ in extra))]
            if prefix == AMID_KEY:  # what it costs the shared cores there (a peer not yet run: woken, switched to)
                out[AMID_CPU_KEY + collective_key(op, g)] = [(AMID_BYTES, statistics.median(c for _, c in extra))]
    return out


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
    reduce-scatter's input, all-to-all's tensor on each rank (context parallelism's ulysses exchange), rounded down
    to a multiple of the group's size."""
    numel = nbytes // 4 // size * size
    whole = torch.zeros(numel, device=device)
    shard = torch.zeros(numel // size, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(whole, group=group)
    if op == "all_gather":
        return lambda: _all_gather_flat(whole, shard, group=group)
    if op == "reduce_scatter":
        return lambda: _reduce_scatter_flat(shard, whole, group=group)
    if op == "all_to_all":
        received = torch.empty_like(whole)
        return lambda: dist.all_to_all_single(received, whole, group=group)
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


def time_collective(run: Callable[[], None], reps: int, device: torch.device) -> tuple[float, float]:
    """Median seconds of ``reps`` back-to-back runs after a warm-up, every rank starting together (a fixed count,
    not a time budget: every rank of a group has to make the same calls); and the CPU seconds this rank's process
    spent per run meanwhile, on every thread (gloo's own threads move the bytes): what a collective takes from
    cores the ranks share, whether its rank waits or not (``Profile.collective_cpu``)."""
    wait_for_ranks(device)
    run()
    cpu = time.process_time()
    times = [seconds_once(run, device) for _ in range(reps)]
    return statistics.median(times), (time.process_time() - cpu) / reps


def wait_for_ranks(device: torch.device) -> None:
    """Every rank of the launch here (a tiny all-reduce: NCCL's barrier wants to be told the device)."""
    flag = torch.zeros(1, device=device)
    dist.all_reduce(flag)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
