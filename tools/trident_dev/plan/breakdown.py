"""A step split into what the planner's step-time model separates, measured by the torch profiler.

The planner (trident/plan/cost.py) composes a step from parts: the kernels of each op class (matmuls, attention,
element-wise work), the framework's share on top of them (autograd, dispatch, allocation), collectives inside the
passes (tp, cp, ep), the pipeline's wait (its bubble and p2p messages), the gradient reduction and the step's
all-reduces left after the passes (dp, ZeRO, the sync with the slowest rank) and the optimizer. The run's step
time alone cannot say which part a miss is in, so ``tools/plan.py --measure`` profiles one extra step of each run
(``logging.profile_step``, after the steps it times) and splits its wall time into the same ``CATEGORIES``:

- the main thread's ops, each by its own time (less the ops it called): ``aten::mm`` and the other matmuls,
  scaled-dot-product attention, every other ``aten::`` op that runs a kernel element-wise; ops after the passes
  (the optimizer step, the clip's norm, zeroing) are ``optimizer``; anything else the profiler records there
  (autograd's nodes, views, allocations, wrappers such as ``aten::linear`` around the kernels they call) is
  ``framework``;
- the main thread's time outside kernels (gaps with no op recorded, and the own time of wrappers such as
  autograd's nodes, inside which a collective's backward waits for it): time it waited on a collective or a
  point-to-point message when one such (gloo records each, on its worker threads or the main one) ends within
  it (``TOLERANCE_S`` after it at most), from its start or the message's, whichever is later, to the message's
  end: p2p ``pipeline wait``, a collective ``comm in passes`` or, after the passes, ``dp + sync``; the rest is
  Python and dispatch between kernels (``framework``), less what the loader's wait for the step's batches took
  (``data``).

Times are wall time, so on a CPU whose cores more ranks share than it has, each op's time holds the time its
thread waited for a core as well (and each gap's: a thread woken by a message still waits for a core). The
kernel reports that wait (``/proc/self/task/<tid>/schedstat``'s run-queue time, of the main thread over the
step): ``with_core_wait`` moves it out of the parts the thread was runnable in (op classes, framework, optimizer),
in proportion to each, into ``core wait``, the model's stretch of the busy time by the measured sharing
(cost.py). A run writes each rank's profiled step, its events and its wait for a core, to
``<run dir>/step_profile/rank<r>.json`` (trident/step_profile.py), which trident_dev/plan/splits.py splits (here
or, for a GPU's, by trident_dev/plan/device_split.py) and averages.

On a GPU the main thread's op times are only the kernels' launches, so a CUDA step is split by the device's own
timeline instead (trident_dev/plan/device_split.py), with no core wait (a GPU's kernels wait for no CPU core).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from trident.parallel.context.ring import CP_MARK  # around the cp ring's point-to-point messages
from trident.step_profile import PASSES_MARK, STEP_MARK, Event, run_queue_s  # noqa: F401 (the tests' too)

CATEGORIES = (
    "matmul",
    "attention",
    "elementwise",
    "framework",
    "core wait",
    "comm in passes",
    "pipeline wait",
    "dp + sync",
    "optimizer",
    "data",
)
TOLERANCE_S = 1e-3  # a message ending this long after a gap still ended it (the thread's wake-up)
MATMULS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::_addmm_activation"}
# Ops that move no data (views, wrappers that call the kernels, allocations): their own time is the framework's.
NO_KERNEL = {
    f"aten::{name}"
    for name in (
        "linear matmul t transpose view _unsafe_view reshape as_strided expand permute detach alias slice select "
        "split split_with_sizes chunk unbind narrow unsqueeze squeeze contiguous empty empty_like empty_strided "
        "resolve_conj resolve_neg to _to_copy lift_fresh result_type numpy_T expand_as view_as flatten unflatten"
    ).split()
}
P2P = ("gloo:send", "gloo:recv", "gloo:isend", "gloo:irecv")


def op_class(name: str) -> str:
    """A main-thread op's category inside the passes (its own time's)."""
    if name in MATMULS:
        return "matmul"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    if name.startswith("aten::") and name not in NO_KERNEL:
        return "elementwise"
    return "framework"


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _marks(events: Sequence[Event]) -> tuple[Event, Callable[[float], bool]]:
    """The profiled step's ``STEP_MARK`` event, and whether a time is inside its main thread's ``PASSES_MARK`` event
    (never, where the step has no passes)."""
    step = next(e for e in events if e.name == STEP_MARK)
    passes = next((e for e in events if e.name == PASSES_MARK and e.thread == step.thread), None)

    def in_passes(t: float) -> bool:
        return passes is not None and passes.start <= t < passes.end

    return step, in_passes


def _take_data(out: dict[str, float], data_s: float) -> dict[str, float]:
    """``out`` with the loader's wait for the step's batches (``data_s``) moved from ``framework`` to ``data``."""
    data = min(max(0.0, data_s), out["framework"])
    out["framework"] -= data
    out["data"] += data
    return out


def _main_segments(events: Sequence[Event], step: Event) -> list[tuple[float, float, Event | None]]:
    """The step's main thread cut into segments, each owned by the innermost host op running then (None: a gap)."""
    lo, hi = step.start, step.end
    ops = sorted(
        (
            e
            for e in events
            if e.thread == step.thread
            and e.device == "cpu"
            and not e.link  # a CUDA runtime call (the launch) is its op's, not an op of its own
            and not e.name.startswith(("gloo:", "trident.", "ProfilerStep"))
            and e.end > lo
            and e.start < hi
        ),
        key=lambda e: (e.start, -e.end),
    )
    # The step cut into segments, each owned by the innermost op running then (None: no op, a gap).
    segments: list[tuple[float, float, Event | None]] = []
    stack: list[tuple[Event, float]] = []  # (op, its end, clamped to its parent's)
    t = lo

    def emit(until: float) -> None:
        nonlocal t
        if until > t:
            segments.append((t, until, stack[-1][0] if stack else None))
            t = until

    for e in ops:
        begin = max(e.start, lo)
        while stack and stack[-1][1] <= begin:
            emit(stack[-1][1])
            stack.pop()
        emit(begin)
        stack.append((e, min(e.end, hi, stack[-1][1] if stack else hi)))
    while stack:
        emit(stack[-1][1])
        stack.pop()
    emit(hi)
    return segments


def _p2p_kind(events: Sequence[Event]) -> Callable[[float], str]:
    """Whose a point-to-point message started at a time is: context parallelism's ring (``CP_MARK`` around where it
    was posted, on any thread: autograd runs a GPU's backward on a thread of its own) waits ``comm in passes``, any
    other is a pipeline's."""
    marks = [(e.start, e.end) for e in events if e.name == CP_MARK and e.device == "cpu"]

    def kind(t: float) -> str:
        return "comm in passes" if any(a <= t <= b for a, b in marks) else "pipeline wait"

    return kind


def _is_kernel_op(e: Event) -> bool:
    """A host op that does work of its own (not a wrapper, view, allocation or collective call)."""
    return e.name.startswith("aten::") and e.name not in NO_KERNEL


def split_step(events: Sequence[Event], data_s: float = 0.0) -> dict[str, float]:
    """Seconds of each of ``CATEGORIES`` in the profiled step of ``events`` (module docstring): the step is the
    ``STEP_MARK`` event, its main thread that event's thread, its passes the ``PASSES_MARK`` event (none: the step
    has no passes, all of it is after them); ``data_s``: the loader's wait for the step's batches."""
    step, in_passes = _marks(events)
    lo, hi = step.start, step.end
    out = dict.fromkeys(CATEGORIES, 0.0)
    messages = [e for e in events if e.name.startswith("gloo:") and e.end > lo and e.start < hi]
    segments = _main_segments(events, step)
    p2p_kind = _p2p_kind(events)

    def kind_of(e: Event) -> str | None:
        """A kernel's category, or None: time the thread may have spent waiting on a message."""
        if _is_kernel_op(e):
            return op_class(e.name) if in_passes(e.start) else "optimizer"
        return None

    # Runs of segments that are neither a kernel's nor a collective's call: gaps and wrappers (autograd's nodes, a
    # Function's backward that waits on its collective). A message ending in a run is what the thread waited on.
    runs: list[list[float]] = []
    for a, b, owner in segments:
        kind = kind_of(owner) if owner is not None else None
        if kind is not None:
            out[kind] += b - a
        elif owner is not None and owner.name.startswith("c10d::"):  # issuing one: communication's time
            p2p = "send" in owner.name or "recv" in owner.name
            out[p2p_kind(a) if p2p else "comm in passes" if in_passes(a) else "dp + sync"] += b - a
        elif runs and runs[-1][1] == a:
            runs[-1][1] = b
        else:
            runs.append([a, b])
    for a, b in runs:
        cursor, waited = a, 0.0  # each message ending in the run, in the order they end, from where the last left off
        for m in sorted((m for m in messages if a < m.end <= b + TOLERANCE_S and m.start < b), key=lambda m: m.end):
            wait = max(0.0, min(m.end, b) - max(cursor, m.start))
            kind = p2p_kind(m.start) if m.name.startswith(P2P) else "comm in passes" if in_passes(a) else "dp + sync"
            out[kind] += wait
            waited += wait
            cursor = max(cursor, min(m.end, b))
        out["framework"] += (b - a) - waited
    return _take_data(out, data_s)


RUNNABLE = ("matmul", "attention", "elementwise", "framework", "optimizer")


def with_core_wait(split: dict[str, float], waited_s: float) -> dict[str, float]:
    """``split`` with ``waited_s`` seconds of waiting for a core (the run queue's) taken out of the parts its thread
    was runnable in, in proportion to each, and put in ``core wait`` (at most all of those parts)."""
    runnable = sum(split[k] for k in RUNNABLE)
    waited = min(max(0.0, waited_s), runnable)
    out = dict(split)
    if runnable > 0:
        for k in RUNNABLE:
            out[k] = split[k] * (1 - waited / runnable)
    out["core wait"] = split.get("core wait", 0.0) + waited
    return out
