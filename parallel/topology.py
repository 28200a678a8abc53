"""Pure rank arithmetic for a dp x cp x pp x tp layout. No torch.distributed here.

Ranks are laid out as ``arange(world).view(pp, dp, cp, tp)``: tp varies fastest so a tensor-parallel
group sits on neighbouring ranks (one NVLink island), then cp (context parallelism exchanges keys and values
every layer), dp next, pp slowest (Megatron's order). At cp=1 the layout is ``view(pp, dp, tp)``.
With 16 ranks, tp=2, pp=4, dp=2:

    tp groups:   [0, 1] [2, 3] [4, 5] ... [14, 15]
    dp groups:   [0, 2] [1, 3] [4, 6] [5, 7] ... [13, 15]
    pp groups:   [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    embedding:   [0, 12] [1, 13] [2, 14] [3, 15]      (first + last stage of each pp group)
    model-par.:  [0, 1, 4, 5, 8, 9, 12, 13] [2, 3, 6, 7, 10, 11, 14, 15]   (tp x pp, one dp replica)

With 8 ranks, dp=2, cp=2, tp=2: cp groups [0, 2] [1, 3] [4, 6] [5, 7], dp groups [0, 4] [1, 5] [2, 6] [3, 7],
and the dp x cp groups that reduce gradients and shard ZeRO [0, 2, 4, 6] [1, 3, 5, 7] (every rank holding the
same piece of the model: cp ranks hold the whole model and see different tokens, like dp ranks).

Expert parallelism (``ep``, dividing dp x cp) cuts each dp x cp group (the ranks holding the same piece of the
model, in the order of their gradient rank dp * cp + cp_rank) into runs of ep consecutive members: an ep group holds
one copy of all the experts, E / ep on each rank (ep rank = gradient rank % ep); the ranks holding the same experts
(the same gradient rank % ep) are an expert-data-parallel group, over which expert gradients reduce. At cp = 1 that
is each dp group. With 8 ranks, dp=4, tp=2, ep=2:

    dp groups:         [0, 2, 4, 6] [1, 3, 5, 7]
    ep groups:         [0, 2] [4, 6] [1, 3] [5, 7]
    expert-dp groups:  [0, 4] [2, 6] [1, 5] [3, 7]

and with 4 ranks, dp=2, cp=2, ep=2 (ranks 0-3 are (dp, cp) = (0, 0), (0, 1), (1, 0), (1, 1)): ep groups [0, 1]
[2, 3] (a sequence's two cp ranks), expert-dp groups [0, 2] [1, 3].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from trident.parallel.errors import ConfigError


class Coord(NamedTuple):
    dp: int
    pp: int
    tp: int
    cp: int = 0


@dataclass(frozen=True)
class Topology:
    dp: int
    pp: int
    tp: int
    cp: int = 1
    ep: int = 1  # expert parallelism: divides dp x cp

    def __post_init__(self) -> None:
        for axis in ("dp", "pp", "tp", "cp", "ep"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"parallel.{axis}={getattr(self, axis)} must be >= 1")
        if self.dp * self.cp % self.ep:
            raise ConfigError(f"parallel.ep={self.ep} does not divide dp x cp {self.dp * self.cp}; use parallel.ep=1")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.pp * self.tp

    def check_world_size(self, world_size: int) -> None:
        if world_size != self.world_size:
            cp = f" x cp {self.cp}" if self.cp > 1 else ""
            raise ConfigError(
                f"world size {world_size} != dp {self.dp}{cp} x tp {self.tp} x pp {self.pp} = {self.world_size}; "
                f"set parallel.dp or launch {self.world_size} processes"
            )

    def rank_of(self, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        if not (0 <= dp < self.dp and 0 <= pp < self.pp and 0 <= tp < self.tp and 0 <= cp < self.cp):
            raise ValueError(f"coordinate (dp={dp}, pp={pp}, tp={tp}, cp={cp}) is outside {self}")
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coord(self, rank: int) -> Coord:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside a world of {self.world_size}")
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return Coord(dp=dp, pp=pp, tp=tp, cp=cp)

    def _groups_varying(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Groups of ranks that share every coordinate except those in ``axes``."""
        fixed = [a for a in ("dp", "pp", "tp", "cp") if a not in axes]
        groups: dict[tuple[int, ...], list[int]] = {}
        for rank in range(self.world_size):
            c = self.coord(rank)
            groups.setdefault(tuple(getattr(c, a) for a in fixed), []).append(rank)
        return sorted(groups.values())

    def dp_groups(self) -> list[list[int]]:
        return self._groups_varying(("dp",))

    def tp_groups(self) -> list[list[int]]:
        return self._groups_varying(("tp",))

    def pp_groups(self) -> list[list[int]]:
        return self._groups_varying(("pp",))

    def cp_groups(self) -> list[list[int]]:
        return self._groups_varying(("cp",))

    def dp_cp_groups(self) -> list[list[int]]:
        """dp x cp: every rank that holds the same piece of the model (gradients reduce, ZeRO shards over them)."""
        return self._groups_varying(("dp", "cp"))

    def ep_groups(self) -> list[list[int]]:
        """Runs of ep consecutive members of each dp x cp group: together they hold every expert once."""
        return sorted(g[i : i + self.ep] for g in self.dp_cp_groups() for i in range(0, len(g), self.ep))

    def expert_dp_groups(self) -> list[list[int]]:
        """The members of each dp x cp group holding the same experts (the same gradient rank % ep): expert gradients
        reduce here."""
        return sorted(g[i :: self.ep] for g in self.dp_cp_groups() for i in range(self.ep))

    def model_parallel_groups(self) -> list[list[int]]:
        """tp x pp: every rank that holds a piece of one model replica (and sees the same tokens)."""
        return self._groups_varying(("pp", "tp"))

    def embedding_groups(self) -> list[list[int]]:
        """First and last stage of each pipeline: they hold the tied embedding / LM head."""
        return [sorted({g[0], g[-1]}) for g in self.pp_groups()]

    def is_first_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == 0

    def is_last_stage(self, rank: int) -> bool:
        return self.coord(rank).pp == self.pp - 1

    @property
    def logging_rank(self) -> int:
        """The one rank that writes metrics: it holds the loss (last stage) of dp replica 0, tp rank 0, cp rank 0."""
        return self.rank_of(dp=0, pp=self.pp - 1, tp=0, cp=0)
