"""Memory a rank really holds: model states (parameters, gradients, optimizer states) and activations.

``measure_model_states`` counts bytes the way the allocator holds them: each storage once (the views of one flat
buffer, an optimizer state that aliases a parameter), and whole (a view of a slice still holds the whole
buffer), on the accelerator ("device") or in host memory ("host"). A storage is counted under the first kind
that names it, in the order params, grads, optimizer, so bytes shared by two kinds are never counted twice.

The object a run hands the Trainer as ``grad_step`` names its tensors (``model_state_tensors() -> {"params":
[...], "grads": [...], "optimizer": [...]}``); ``log_model_states`` measures them once, after the first step
(Adam allocates its moments lazily, in the first ``step``), gathers every rank's figures, prints one line on the
logging rank and writes ``<run dir>/memory.json``: each rank's bytes by kind and place, and the max over ranks.
The prediction of the same figures before launch is trident/memory/estimate.py.

``held_by_forward`` measures activations: the bytes of every storage created while a function runs that is still
alive when it returns, which for a forward pass is what autograd (or activation checkpointing) keeps for backward.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from trident.parallel.groups import ProcessGroups

KINDS = ("params", "grads", "optimizer")
PLACES = ("device", "host")

# kind -> place -> bytes, with "total" as a kind too
Figures = dict[str, dict[str, int]]


def place_of(device: torch.device) -> str:
    """ "host" for CPU memory, "device" for an accelerator's."""
    return "host" if device.type == "cpu" else "device"


def _with_total(figures: Figures) -> Figures:
    figures["total"] = {place: sum(figures[kind][place] for kind in KINDS) for place in PLACES}
    return figures


def measure_model_states(tensors: Mapping[str, Iterable[torch.Tensor]]) -> Figures:
    """Bytes per kind ("params", "grads", "optimizer", and their "total") and place ("device", "host")."""
    unknown = set(tensors) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown model-state kinds {sorted(unknown)}; expected {', '.join(KINDS)}")
    figures = {kind: dict.fromkeys(PLACES, 0) for kind in KINDS}
    seen: set[tuple[str, int]] = set()
    for kind in KINDS:
        for t in tensors.get(kind, ()):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            # A freed storage (stage 3 between gathers, resized to 0) holds nothing and has no address.
            if storage.nbytes() == 0 or key in seen:
                continue
            seen.add(key)
            figures[kind][place_of(t.device)] += storage.nbytes()
    return _with_total(figures)


def max_over_ranks(per_rank: list[Figures]) -> Figures:
    """Each figure's maximum over the ranks (the total's too: the largest rank, not a sum of maxima)."""
    return {kind: {place: max(r[kind][place] for r in per_rank) for place in PLACES} for kind in (*KINDS, "total")}


def format_bytes(n: float) -> str:
    """Binary units: 812 B, 1.50 KiB, 23.4 MiB, 205 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n:.2f} {unit}" if abs(n) < 10 else f"{n:.1f} {unit}" if abs(n) < 100 else f"{n:.0f} {unit}"


def model_states_line(figures: Figures, ranks: int = 1) -> str:
    """One line: each kind's bytes, their total, and where they live."""
    total = {place: figures["total"][place] for place in PLACES}
    kinds = ", ".join(f"{kind} {format_bytes(sum(figures[kind].values()))}" for kind in KINDS)
    where = " + ".join(f"{format_bytes(total[place])} on {place}" for place in PLACES if total[place])
    scope = f"max over {ranks} ranks" if ranks > 1 else "this rank"
    return f"model states per rank ({scope}): {kinds} = {where or '0 B'}"


def log_model_states(
    grad_step: Any, groups: ProcessGroups, run_dir: Path, extra: dict | None = None, mine: dict | None = None
) -> Figures:
    """Measure this rank's model states, gather every rank's; the logging rank prints one line and writes
    ``run_dir / "memory.json"``. Every rank must call it (an all-gather); returns the max over ranks.

    ``extra`` (e.g. the estimator's prediction) is written beside the measured figures, ``mine`` into this rank's
    row (e.g. ``activation_sets``: measured beside predicted).
    """
    states = measure_model_states(grad_step.model_state_tensors())
    coord = groups.coord
    row = {"rank": groups.rank, "dp": coord.dp, "tp": coord.tp, "pp": coord.pp, **states, **(mine or {})}
    if groups.cp_size > 1:
        row["cp"] = coord.cp
    rows: list[dict | None] = [None] * dist.get_world_size(groups.world_group)
    dist.all_gather_object(rows, row, group=groups.world_group)
    per_rank = [r for r in rows if r is not None]
    worst = max_over_ranks(per_rank)
    if groups.is_logging_rank:
        print(f"memory: {model_states_line(worst, len(per_rank))}; {run_dir / 'memory.json'}", flush=True)
        report = {"ranks": per_rank, "max": worst, **(extra or {})}
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "memory.json").write_text(json.dumps(report, indent=1) + "\n")
    return worst


class _Created(TorchDispatchMode):
    """Weak references to the storage of every tensor an operator returns."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[tuple[StorageWeakRef, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                self.refs.append((StorageWeakRef(storage), storage.nbytes()))
        return out


def held_by_forward(fn: Callable[[], Any], existing: Iterable[torch.Tensor] = ()) -> tuple[Any, int]:
    """Run ``fn`` and return (its result, the bytes of storages created during it and alive after it).

    Run over a forward pass that returns only the loss, the bytes are the activations kept for backward: tensors
    autograd saved, and the inputs activation checkpointing keeps for recomputation. Storages of ``existing``
    (parameters, the input batch) are left out even when an operator returns a view of them.
    """
    skip = {StorageWeakRef(t.untyped_storage()).cdata for t in existing}
    mode = _Created()
    with mode:
        result = fn()
    gc.collect()
    alive: dict[int, int] = {}
    for ref, nbytes in mode.refs:
        if not ref.expired() and ref.cdata not in skip:
            alive[ref.cdata] = nbytes
    return result, sum(alive.values())
