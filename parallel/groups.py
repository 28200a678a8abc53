"""Create every process group of a ``Topology`` once, and hand the result around explicitly.

``torch.distributed.new_group`` must be called by every rank for every group, in the same order,
even for groups the rank is not in; this module is the one place that does it.
"""

from __future__ import annotations

import datetime
import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trident.parallel.attempt import agent_store, round_store, uses_agent_store
from trident.parallel.topology import Coord, Topology


@dataclass(frozen=True)
class ProcessGroups:
    topology: Topology
    rank: int
    world_group: dist.ProcessGroup  # every rank: the global norm and agreed verdicts reduce over it
    dp_group: dist.ProcessGroup
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup
    embedding_group: dist.ProcessGroup | None  # None on middle pipeline stages
    pp_ranks: tuple[int, ...]  # global ranks of this rank's pipeline, first stage first
    # Context parallelism: the ranks that split one sequence, and dp x cp, over which gradients reduce and ZeRO
    # shards (at cp=1 the dp group itself). None: built by hand without them (cp=1).
    cp_group: dist.ProcessGroup | None = None
    dp_cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None  # the experts' all-to-all (None at ep = 1)
    expert_dp_group: dist.ProcessGroup | None = None  # where expert gradients reduce (the dp group at ep = 1)

    @property
    def coord(self) -> Coord:
        return self.topology.coord(self.rank)

    @property
    def dp_rank(self) -> int:
        return self.coord.dp

    @property
    def dp_size(self) -> int:
        return self.topology.dp

    @property
    def cp_rank(self) -> int:
        return self.coord.cp

    @property
    def cp_size(self) -> int:
        return self.topology.cp

    @property
    def grad_group(self) -> dist.ProcessGroup:
        """The ranks holding the same piece of the model, which sum its gradients and shard ZeRO: dp x cp."""
        return self.dp_group if self.dp_cp_group is None else self.dp_cp_group

    @property
    def grad_rank(self) -> int:
        return self.coord.dp * self.topology.cp + self.coord.cp

    @property
    def grad_size(self) -> int:
        return self.topology.dp * self.topology.cp

    @property
    def ep_size(self) -> int:
        return self.topology.ep

    @property
    def ep_rank(self) -> int:
        return self.grad_rank % self.topology.ep

    @property
    def tp_rank(self) -> int:
        return self.coord.tp

    @property
    def tp_size(self) -> int:
        return self.topology.tp

    @property
    def pp_rank(self) -> int:
        return self.coord.pp

    @property
    def pp_size(self) -> int:
        return self.topology.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == self.topology.logging_rank


def _build(
    groups: list[list[int]], rank: int, timeout: datetime.timedelta, required: bool = True
) -> dist.ProcessGroup | None:
    mine = None
    for ranks in groups:
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    assert mine is not None or not required, f"rank {rank} is in none of {groups}"
    return mine


def build_process_groups(topology: Topology, timeout_s: float = 600.0) -> ProcessGroups:
    """Build the dp, tp, pp, model-parallel and embedding groups, with cp > 1 the cp and dp x cp groups, and with
    ep > 1 the ep and expert-dp groups. The default group must exist."""
    topology.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    timeout = datetime.timedelta(seconds=timeout_s)
    pp_ranks = next(g for g in topology.pp_groups() if rank in g)
    context = {}
    if topology.cp > 1:
        context = {
            "cp_group": _build(topology.cp_groups(), rank, timeout),
            "dp_cp_group": _build(topology.dp_cp_groups(), rank, timeout),
        }
    dp_group = _build(topology.dp_groups(), rank, timeout)
    ep_group = _build(topology.ep_groups(), rank, timeout) if topology.ep > 1 else None
    expert_dp_group = _build(topology.expert_dp_groups(), rank, timeout) if topology.ep > 1 else dp_group
    return ProcessGroups(
        topology=topology,
        rank=rank,
        world_group=dist.group.WORLD,
        dp_group=dp_group,
        tp_group=_build(topology.tp_groups(), rank, timeout),
        pp_group=_build(topology.pp_groups(), rank, timeout),
        model_parallel_group=_build(topology.model_parallel_groups(), rank, timeout),
        embedding_group=_build(topology.embedding_groups(), rank, timeout, required=False),
        pp_ranks=tuple(pp_ranks),
        **context,
        ep_group=ep_group,
        expert_dp_group=expert_dp_group,
    )


def init_distributed(backend: str, device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """Join the default process group on ``device``; return (rank, world_size).

    Under torchrun the env:// rendezvous is used. A plain ``python train.py`` gets a one-process group
    over an in-memory store, so the rest of the code has a single path for every world size.
    """
    if device.type == "cuda":
        # Before the group exists: NCCL binds its communicators to the current device.
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    timeout = datetime.timedelta(seconds=timeout_s)
    if uses_agent_store():
        # torchrun keeps one store for all its restart rounds: this round's ranks meet under keys of their own.
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store, _ = round_store(agent_store(timeout_s), rank, world_size, timeout_s)
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend=backend, timeout=timeout)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def launch_world_size() -> int:
    """World size as the launcher announced it, readable before any process group exists."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def launch_rank() -> int:
    """This process's global rank as the launcher announced it, readable before any process group exists."""
    return int(os.environ.get("RANK", "0"))


def shutdown_distributed(barrier: bool = True) -> None:
    """Destroy the groups before the interpreter exits.

    gloo's worker threads free a finished collective's tensors a moment after wait() returns; if the
    interpreter is already finalizing, that needs the GIL and aborts the process ("terminate called
    without an active exception"). Destroying the groups first ends those threads while Python is alive.
    ``barrier=False`` is for error paths, where the other ranks may not reach a barrier.
    """
    if dist.is_initialized():
        # Reference cycles (e.g. through gradient hooks) can hold groups alive past destroy, so break them first.
        gc.collect()
        if barrier:
            dist.barrier()
        dist.destroy_process_group()
