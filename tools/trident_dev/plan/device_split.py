"""A profiled GPU step split into what the planner's step-time model separates (trident_dev/plan/breakdown.py's
``CATEGORIES``), by the device's own timeline.

On a GPU the host's op times are only the kernels' launches (the H200's first split put a whole 0.147 s step in
``framework``), so the step's wall time is cut where the device's kernels start and end:

- each stretch goes to the first kind running then (``DEVICE_ORDER``: compute before communication, so a collective
  on its own stream behind compute is not exposed);
- a kernel's kind is its launching op's class (``breakdown.op_class``; the profiler links the kernel to the op it
  was launched for, and its launch, a CUDA runtime call, shares the kernel's correlation id), ``optimizer`` when it
  was launched after the passes, and communication when it is NCCL's or a ``c10d::`` op's: the cp ring's
  (launched inside ``CP_MARK``) in the passes, other point-to-point kernels the pipeline's; a kernel no op is
  linked to is classed by its name (``KERNEL_NAMES``);
- the device's idle stretches are the host's: the optimizer's where the main thread runs an op of its own after the
  passes (an offloaded AdamW), else ``framework`` (Python, dispatch, launches, waiting for the host), less the
  loader's wait for the step's batches (``data``).
"""

from __future__ import annotations

from collections.abc import Sequence

from trident_dev.plan.breakdown import (
    CATEGORIES,
    Event,
    _is_kernel_op,
    _main_segments,
    _marks,
    _p2p_kind,
    _take_data,
    op_class,
)

# A kernel no host op is linked to, by its name: NCCL's, matrix products' (cuBLAS, CUTLASS), attention's.
KERNEL_NAMES = (
    (("nccl",), "comm"),
    (("gemm", "nvjet", "cutlass", "xmma", "cublas"), "matmul"),
    (("flash", "fmha", "attention", "sdpa"), "attention"),
)
DEVICE_ORDER = ("matmul", "attention", "elementwise", "optimizer", "comm in passes", "dp + sync", "pipeline wait")


def split_device_step(events: Sequence[Event], data_s: float = 0.0) -> dict[str, float]:
    """Seconds of each of ``CATEGORIES`` in the profiled GPU step of ``events`` (module docstring): host events with
    ``device`` cpu, kernels with cuda, each kernel's ``corr`` its launch's and its ``link`` the op's it is for."""
    step, in_passes = _marks(events)
    lo, hi = step.start, step.end
    host = [e for e in events if e.device == "cpu" and e.corr]
    # The ops kernels are linked to (a runtime call made outside any op carries CUDA's own ids: left out), and the
    # launches (runtime calls, linked to their op) by the correlation id they share with their kernel.
    ops = {e.corr: e for e in host if not e.link and not e.name.startswith("cu")}
    launches = {e.corr: e for e in host if e.link}
    p2p_kind = _p2p_kind(events)

    def kind_of(kernel: Event) -> str:
        op = ops.get(kernel.link)
        launch = launches.get(kernel.corr)
        by_name = next((k for words, k in KERNEL_NAMES if any(w in kernel.name.lower() for w in words)), None)
        launched = launch.start if launch is not None else op.start if op is not None else kernel.start
        if by_name == "comm" or (op is not None and op.name.startswith("c10d::")):
            p2p = (op is not None and ("send" in op.name or "recv" in op.name)) or "SendRecv" in kernel.name
            return p2p_kind(launched) if p2p else "comm in passes" if in_passes(launched) else "dp + sync"
        if not in_passes(launched):
            return "optimizer"
        if op is not None and _is_kernel_op(op):
            return op_class(op.name)
        return by_name or "elementwise"  # a copy, fill or reduction launched under a wrapper

    # A sweep over the kernels' starts and ends: each stretch of the step to the first kind running then.
    edges = []
    for k in events:
        if k.device != "cpu" and min(k.end, hi) > max(k.start, lo):
            kind = kind_of(k)
            edges += [(max(k.start, lo), 1, kind), (min(k.end, hi), -1, kind)]
    edges.sort(key=lambda edge: (edge[0], edge[1]))
    out = dict.fromkeys(CATEGORIES, 0.0)
    running = dict.fromkeys(DEVICE_ORDER, 0)
    idle: list[tuple[float, float]] = []
    t = lo
    for at, change, kind in [*edges, (hi, 0, None)]:
        if at > t:
            now = next((k for k in DEVICE_ORDER if running[k] > 0), None)
            if now is not None:
                out[now] += at - t
            elif idle and idle[-1][1] == t:
                idle[-1] = (idle[-1][0], at)
            else:
                idle.append((t, at))
            t = at
        if kind is not None:
            running[kind] += change
    # The device idle: the host's time, the optimizer's where the main thread runs an op of its own after the passes.
    after = [(a, b) for a, b, op in _main_segments(events, step) if op is not None and _is_kernel_op(op)]
    after = [(a, b) for a, b in after if not in_passes(a)]
    n = 0
    for a, b in idle:
        while n < len(after) and after[n][1] <= a:
            n += 1
        optimizer, m = 0.0, n
        while m < len(after) and after[m][0] < b:
            optimizer += max(0.0, min(b, after[m][1]) - max(a, after[m][0]))
            m += 1
        out["optimizer"] += optimizer
        out["framework"] += (b - a) - optimizer
    return _take_data(out, data_s)
