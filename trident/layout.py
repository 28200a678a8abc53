"""The one description of a launch's layout: what ``validate`` (trident/config/validate.py) resolves a config into.

Every key that decides how a step is split over ranks and micro-batches, and what each rank holds, resolved once:
dp from the world size, the schedule from vpp (and vpp 2 from zb-v, which always runs two chunks a rank), no
ZeRO-3 settings below ZeRO 3, no offload ratio without offload, the micro-batch count from the global batch. The
runtime (train.py, trident/build.py, the loop), the memory estimator, the planner (its candidates are layouts) and
the fuzzer all read this one frozen object; a new parallel dimension is added here first, then in the validator,
the topology, the estimator, the planner's space and the fuzzer's space.

``PLANNED_KEYS`` are the config keys the planner chooses (and ``parallel.auto`` keeps when given);
``overrides`` writes a layout back as those keys, ``apply`` into a config.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trident.models.checkpointing import SELECTIVE_MODULES, recompute_label
from trident.models.compile import compiles
from trident.parallel.pipeline.schedules import SPLIT_BACKWARD, resolve_schedule

if TYPE_CHECKING:  # trident/config/validate.py imports this module to build layouts
    from trident.config.schema import Config

# The config keys the planner chooses, in the order its overrides are written, and the Layout field of each.
_PLANNED = {
    "parallel.dp": "dp",
    "parallel.cp": "cp",
    "parallel.cp_comm": "cp_comm",
    "parallel.tp": "tp",
    "parallel.pp": "pp",
    "parallel.vpp": "vpp",
    "parallel.schedule": "schedule",
    "parallel.zero": "zero",
    "parallel.offload.optimizer": "offload",
    "parallel.offload.ratio": "offload_ratio",
    "parallel.sequence_parallel": "sequence_parallel",
    "train.micro_batch_size": "micro_batch_size",
    "train.activation_checkpointing": "activation_checkpointing",
    "train.recompute_every": "recompute_every",
    "parallel.zero3_gather": "zero3_gather",
    "parallel.ep": "ep",
}
PLANNED_KEYS = tuple(_PLANNED)


def chunks_per_rank(schedule: str | None, pp: int, vpp: int) -> int:
    """The model chunks a pipeline rank holds: ``vpp``, but two under zb-v when vpp is left at 1 (its V is always
    two chunks; another vpp with zb-v is the validator's to refuse)."""
    return 2 if schedule == "zb-v" and pp > 1 and vpp == 1 else vpp


@dataclass(frozen=True)
class Layout:
    """A resolved launch: how it is split, how a step is batched, and what a rank holds."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1  # context parallelism: ranks splitting each sequence (parallel/context/)
    cp_comm: str = "ring"  # how they exchange keys and values: ring | allgather | ulysses
    schedule: str | None = None  # the pipeline schedule; None exactly when pp == 1 (gradient accumulation)
    zero: int = 0
    zero3_gather: str = "micro_batch"  # ZeRO-3 only: re-gather per micro-batch, or keep for the step
    zero3_prefetch: int = 1  # ZeRO-3 only: blocks gathered ahead of the running one
    offload: str = "none"  # none | cpu: the optimizer shard's first ``offload_ratio`` on the host
    offload_ratio: float = 1.0  # 1.0 without offload
    sequence_parallel: bool = False
    ep: int = 1  # expert parallelism: each sparse layer's experts over ep of the dp x cp ranks (dividing dp x cp)
    activation_checkpointing: str = "none"  # none | selective | attention | full
    recompute_modules: tuple[str, ...] = SELECTIVE_MODULES  # what selective recomputes (selective only)
    recompute_every: int = 1  # every N-th block recomputed (1 without recomputation)
    micro_batch_size: int = 1
    micro_batches: int = 1  # per rank per step (gradient accumulation): global / (micro_batch_size * dp)
    bucket_mb: float = 25.0
    precision: str = "fp32"
    device: str = "cuda"  # cuda | cpu: where the ranks compute (on a CPU run "device" memory is host memory)
    document_mask: bool = False  # data.document_mask: attention inside each packed document
    async_checkpoint: bool = False  # checkpoint.async: a host copy of what the rank saves
    optimizer: str = "adamw"  # optim.name: adamw (two moments per element) | muon (one momentum per matrix element)
    fp8: str = "off"  # train.fp8: the recipe of the linear layers' FP8 GEMMs (parallel/fp8.py), or off
    compile: str = "false"  # train.compile: auto (on cuda) | true | false: blocks compiled (models/compile.py)

    def __post_init__(self) -> None:
        # A layout written by hand resolves as validate's do: the default schedule of a pipeline, none without one.
        schedule = resolve_schedule(self.schedule, self.vpp) if self.pp > 1 else None
        object.__setattr__(self, "schedule", schedule)
        object.__setattr__(self, "vpp", chunks_per_rank(schedule, self.pp, self.vpp))

    @property
    def world(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def grad_ranks(self) -> int:
        """The ranks holding the same parameters, over which gradients reduce and ZeRO shards: dp x cp."""
        return self.dp * self.cp

    @property
    def chunks(self) -> int:
        """Model chunks (virtual pipeline stages) in all: pp x vpp."""
        return self.pp * self.vpp

    @property
    def global_batch_size(self) -> int:
        return self.micro_batch_size * self.micro_batches * self.dp

    @property
    def offloaded_fraction(self) -> float:
        """The fraction of the optimizer shard stepped on the host (0 without offload)."""
        return self.offload_ratio if self.offload == "cpu" else 0.0

    @property
    def recompute(self) -> str:
        """The recomputation in one word (``selective``, ``full/2``, ...): how the estimator keys it."""
        return recompute_label(self.activation_checkpointing, self.recompute_modules, self.recompute_every)

    @property
    def compiled(self) -> bool:
        return compiles(self.compile, torch.device(self.device))

    def defers_weight_grads(self, stage: int) -> bool:
        """Whether virtual stage ``stage``'s W is its deferred weight GEMMs (parallel/wgrad.py): zb past 0, eager."""
        return self.schedule in SPLIT_BACKWARD and stage > 0 and not self.compiled

    @property
    def seq_divisor(self) -> int:
        """What the sequence is split by inside a tensor-parallel region: tp under sequence parallelism, else 1."""
        return self.tp if self.sequence_parallel else 1

    def keys(self) -> dict[str, object]:
        """The planned config keys of this layout, as values."""
        return {key: getattr(self, name) for key, name in _PLANNED.items()}

    def overrides(self) -> list[str]:
        """The train.py overrides that launch this layout (on ``world`` ranks)."""
        return [f"{key}={override_value(value)}" for key, value in self.keys().items()]

    def short(self) -> str:
        """``dp4 tp2 pp2 1f1b zero1 mbs2``, naming only what differs from the defaults."""
        words = [
            f"dp{self.dp}",
            *([f"cp{self.cp}", self.cp_comm] if self.cp > 1 else []),
            f"tp{self.tp}",
            f"pp{self.pp}",
        ]
        if self.vpp > 1:
            words.append(f"vpp{self.vpp}")
        if self.schedule is not None:
            words.append(self.schedule)
        if self.sequence_parallel:
            words.append("sp")
        if self.ep > 1:
            words.append(f"ep{self.ep}")
        words.append(f"zero{self.zero}")
        if self.zero3_gather != "micro_batch":
            words.append(f"gather={self.zero3_gather}")
        if self.offload != "none":
            words.append(f"offload{self.offload_ratio:g}")
        if self.activation_checkpointing != "none":
            words.append(f"ac={self.recompute}")
        words.append(f"mbs{self.micro_batch_size}")
        return " ".join(words)

    def apply(self, cfg: Config) -> Config:
        """``cfg`` with this layout's planned keys (dp given explicitly)."""
        return with_keys(cfg, self.keys())


def override_value(value: object) -> str:
    """A value as a Hydra override writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def config_keys(cfg: Config) -> dict[str, str]:
    """The planned keys as ``cfg`` sets them (unresolved: dp and the schedule may be null), written as overrides."""
    return {key: override_value(read_key(cfg, key)) for key in PLANNED_KEYS}


def read_key(cfg: object, key: str) -> object:
    """The value of a dotted config key (``parallel.offload.ratio``)."""
    for name in key.split("."):
        cfg = getattr(cfg, name)
    return cfg


def with_keys(cfg: Config, values: dict[str, object]) -> Config:
    """``cfg`` with dotted keys set (a new config: the sections are frozen in spirit, replaced not mutated). Each
    section is replaced once for all its keys: the planner calls this twice per candidate, over thousands."""
    tree: dict = {}
    for key, value in values.items():
        *path, last = key.split(".")
        node = tree
        for name in path:
            node = node.setdefault(name, {})
        node[last] = _Leaf(value)
    return _replaced(cfg, tree)


class _Leaf:
    """A value to set, told apart from a section's dict of further keys."""

    __slots__ = ("value",)

    def __init__(self, value: object) -> None:
        self.value = value


def _replaced(node: object, tree: dict) -> object:
    changes = {
        name: sub.value if isinstance(sub, _Leaf) else _replaced(getattr(node, name), sub) for name, sub in tree.items()
    }
    return dataclasses.replace(node, **changes)
