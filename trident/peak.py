"""The peak TFLOP/s that MFU is measured against: a known GPU's datasheet figure, or a CPU's measured one.

A CPU has no datasheet figure worth trusting (its clock under AVX-512, SMT, the cores the other ranks take, the
kernels torch has for the dtype: fp16 matmuls on most CPUs are scalar), so its peak is measured: one core's best rate
of square matmuls in the run's dtype, timed by the CPU time it ran (so other work on the machine does not lower it),
times the threads one rank uses, for a fraction of a second. Each probe is cached per machine in
``~/.cache/trident/peak.json``, keyed by CPU model, thread count, dtype and torch version, so a machine pays for it
once. Ranks that together ask for more threads than the node has cores share them: ``device_peak_tflops`` scales
each one's peak to its share.

On a GPU the figure is the datasheet's dense peak for the dtype (TF32 for fp32, half the bf16 peak), which is
what the field reports MFU against. ``logging.peak_tflops`` overrides either.
"""

from __future__ import annotations

import contextlib
import os
import platform
import re
import time
from pathlib import Path

import torch

from trident.device import local_world_size
from trident.json_cache import add_entry, read_entries

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s; fp32 runs use the TF32 peak, half of these.
# Keys match whole words of torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"),
# the more specific first, so "L40" is never read as "L4".
GPU_PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "GH200": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "H800 PCIe": 756.0,
    "H800": 989.0,
    "H20": 148.0,
    "B200": 2250.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L40": 181.0,
    "L4": 121.0,
    "A40": 150.0,
    "RTX A6000": 155.0,
    "A10G": 125.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
    "RTX 3090": 71.0,
    "V100": 125.0,  # fp16: V100 has no bf16
    "T4": 65.0,  # fp16
    "MI300X": 1307.0,
    "MI250X": 383.0,
}

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

DEFAULT_CACHE = Path("~/.cache/trident/peak.json")
PROBE_SECONDS = 0.25


def gpu_peak_bf16_tflops(name: str) -> float | None:
    """The table's peak for a device name, or None for a GPU it does not know."""
    for key, peak in GPU_PEAK_BF16_TFLOPS.items():
        if re.search(rf"(?<![\w]){re.escape(key)}(?![\w])", name):
            return peak
    return None


def cpu_model() -> str:
    """The CPU's model name as the OS reports it ("AMD EPYC 7B13"), or the machine type if it says none."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown cpu"


def probe_matmul_tflops(dtype: torch.dtype, threads: int, seconds: float = PROBE_SECONDS) -> float:
    """Peak TFLOP/s of ``threads`` CPU threads for ``dtype``: ``threads`` times one core's, as a datasheet counts.

    One core's is the best single ``512 x 512`` matmul on one thread over about ``seconds``, timed by the CPU time of
    the thread that runs it, not the wall clock: another process taking the core stops both the work and that
    clock, so a busy machine (a test suite's other worker, another job) does not lower the peak, which would put
    MFU above 1 in every later run that reads it from the cache. (A wall-timed matmul on several threads waits for
    whichever thread another process holds up.) On the 2-core VM this is developed on, two threads' best wall-timed
    matmul is 1.99x one thread's.
    """
    n = 512
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        a = torch.randn(n, n, generator=gen).to(dtype)
        b = torch.randn(n, n, generator=gen).to(dtype)
        out = torch.empty(n, n, dtype=dtype)
        torch.mm(a, b, out=out)  # warm-up: kernel selection, packing buffers
        best, reps, deadline = 0.0, 0, time.perf_counter() + seconds
        while reps < 3 or time.perf_counter() < deadline:
            start = time.thread_time()
            torch.mm(a, b, out=out)
            best = max(best, 2 * n**3 / max(time.thread_time() - start, 1e-9))
            reps += 1
    finally:
        torch.set_num_threads(before)
    return threads * best / 1e12


def _cache_key(precision: str, threads: int) -> str:
    # "cpu time": probes from before the one-thread peak was timed by CPU time are probed again.
    return f"{cpu_model()} | {threads} threads | {precision} | torch {torch.__version__} | cpu time"


def cpu_peak_tflops(precision: str, threads: int, cache: Path | None = DEFAULT_CACHE) -> float:
    """The measured peak of ``threads`` threads of this machine's CPU for ``precision``, probed once and then
    read from ``cache`` (None: always probe). A cache that cannot be written costs a probe per run, nothing more.
    """
    key = _cache_key(precision, threads)
    path = cache.expanduser() if cache is not None else None
    if path is not None:
        value = read_entries(path).get(key)
        if isinstance(value, (int, float)) and value > 0:
            return float(value)
    peak = probe_matmul_tflops(PRECISION_DTYPES[precision], threads)
    if path is not None:
        add_entry(path, key, peak)
    return peak


def device_peak_tflops(
    device: torch.device,
    precision: str,
    override: float | None,
    threads: int | None = None,
    cache: Path | None = DEFAULT_CACHE,
) -> float | None:
    """Peak dense TFLOP/s of the device one rank drives; None for a GPU the table does not know.

    ``override`` (``logging.peak_tflops``) wins. On a CPU: the measured peak of ``threads`` threads (default: the
    threads torch uses now, so call this after the rank's threads are set), scaled down when the node's ranks
    together use more threads than it has cores. An unknown GPU only costs the MFU
    figure (logged as null), never the run.
    """
    if override is not None:
        return override
    if device.type == "cuda":
        peak = gpu_peak_bf16_tflops(torch.cuda.get_device_name(device))
        if peak is None:
            return None
        return peak if precision != "fp32" else peak / 2
    threads = threads or torch.get_num_threads()
    peak = cpu_peak_tflops(precision, threads, cache)
    # Ranks of one node asking together for more threads than it has cores share them: the probe saw the cores
    # to itself, training does not (8 ranks of 1 thread on 2 cores get a quarter of a core each).
    return peak * min(1.0, (os.cpu_count() or 1) / (threads * local_world_size()))
