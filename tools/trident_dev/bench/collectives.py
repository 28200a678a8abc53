"""Counting the collectives a step sends, for ``tools/bench.py tp`` (trident_dev/bench/tp.py): trident's, by wrapping
the torch.distributed functions it calls (and the flat aliases parallel/comm.py binds at import); DTensor's, which never
pass through those functions, by a dispatch mode that sees its functional collectives. Each count is one row per
(op, in backward, group size, elements), tabled beside an expected count and the bytes a ring would send.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

import trident.parallel.comm as comm
from trident_dev.bench.harness import Table, number

COMM_HEADER = ["op", "phase", "group", "elements", "calls", "analytic", "bytes passed", "ring wire", "what"]

Key = tuple[str, bool, int, int]


class CommLog:
    def __init__(self) -> None:
        self.calls: Counter[Key] = Counter()
        self.element_size = 4

    def add(self, op: str, group_size: int, tensors: list[torch.Tensor]) -> None:
        # Backward runs inside an autograd node; the forward, the loss and the optimizer step do not.
        in_backward = torch._C._current_autograd_node() is not None
        self.calls[(op, in_backward, group_size, sum(t.numel() for t in tensors))] += 1
        self.element_size = tensors[0].element_size()


# torch.distributed function -> (kind, the argument whose bytes count): an all-reduce's tensor, an all-gather's
# output, a reduce-scatter's input. Each is then b*s*h for an activation, whatever the tp size.
_DIST_FUNCTIONS = {
    "all_reduce": ("all_reduce", "tensor"),
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "all_gather": ("all_gather", "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "reduce_scatter": ("reduce_scatter", "input_list"),
    "broadcast": ("broadcast", "tensor"),
}


@contextlib.contextmanager
def counting_collectives() -> Iterator[CommLog]:
    """Count every torch.distributed collective called inside the block (trident's path to the backend)."""
    log, depth = CommLog(), [0]

    def counted(fn: Callable, kind: str, arg: str) -> Callable:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if depth[0] == 0:  # a collective implemented by another one counts once
                bound = signature.bind(*args, **kwargs).arguments
                tensors = bound[arg]
                group = bound.get("group")
                size = dist.get_world_size(group) if group is not None else dist.get_world_size()
                log.add(kind, size, tensors if isinstance(tensors, list) else [tensors])
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    targets = [(dist, name, *spec) for name, spec in _DIST_FUNCTIONS.items() if hasattr(dist, name)]
    # parallel/comm.py binds the flat all-gather and reduce-scatter once at import: wrap its names too.
    targets += [(comm, "_all_gather_flat", "all_gather", "output_tensor")]
    targets += [(comm, "_reduce_scatter_flat", "reduce_scatter", "input")]
    originals = [(module, name, getattr(module, name)) for module, name, *_ in targets]
    for module, name, kind, arg in targets:
        setattr(module, name, counted(getattr(module, name), kind, arg))
    try:
        yield log
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


class DTensorComms(TorchDispatchMode):
    """Count the functional collectives DTensor issues (it never calls the torch.distributed functions)."""

    def __init__(self, group_size: int) -> None:
        super().__init__()
        self.log, self.group_size = CommLog(), group_size

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        # Modes run before tensor subclasses: step aside so DTensor desugars into collectives on plain tensors,
        # which come back through here (torch's CommDebugMode does the same).
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **kwargs)
        if getattr(func, "namespace", None) in ("_c10d_functional", "c10d"):
            name = func._overloadpacket.__name__.replace("allreduce", "all_reduce").replace("allgather", "all_gather")
            kind = next((k for k in ("all_reduce", "all_gather", "reduce_scatter", "broadcast") if k in name), None)
            if kind is not None:
                counted = out if kind == "all_gather" else args[0]
                tensors = counted if isinstance(counted, list | tuple) else [counted]
                self.log.add(kind, self.group_size, [t for t in tensors if isinstance(t, torch.Tensor)])
        return out


def ring_wire_bytes(op: str, group_size: int, nbytes: int) -> float:
    """Bytes one rank sends for ``nbytes`` passed, with ring algorithms (what NCCL runs; gloo may send more)."""
    if group_size == 1:
        return 0.0
    share = (group_size - 1) / group_size
    return 2 * share * nbytes if op == "all_reduce" else share * nbytes


def comm_table(title: str, calls: dict[Key, int], element_size: int, analytic: dict) -> Table:
    """One row per kind of collective; ``analytic`` maps a row to (expected calls or None, what it is)."""
    expected_keys = {key for key, (n, _) in analytic.items() if n is not None}
    keys = sorted(set(calls) | expected_keys, key=lambda k: (-k[3], k[0], k[1], k[2]))
    t = Table(title, COMM_HEADER)
    total = expected = wire = 0
    for key in keys:
        op, backward, group, numel = key
        n = calls.get(key, 0)
        want, what = analytic.get(key, (None, ""))
        nbytes = n * numel * element_size
        total += nbytes
        expected += (want or 0) * numel * element_size
        wire += ring_wire_bytes(op, group, nbytes)
        flag = "" if want is None or want == n else " (differs)"
        phase = "bwd" if backward else "fwd"
        t.add(op, phase, group, f"{numel:,}", n, want, f"{nbytes:,}", number(ring_wire_bytes(op, group, nbytes)),
              what + flag)  # fmt: skip
    t.notes.append(f"total bytes passed {total:,} (ring wire {wire:,.0f})")
    if expected_keys:
        t.notes[-1] += f"; analytic {expected:,}: {'equal' if total == expected else 'DIFFERENT'}"
    return t
