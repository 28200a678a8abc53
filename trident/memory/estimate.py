"""The whole prediction: for every pipeline stage of a layout, the model states a rank holds (the largest dp
shard), the transient buffers above them, and the activations at the schedule's peak under each recomputation
policy (``estimate``). A mixture-of-experts model's activations depend on the routing: ``activations`` are the
worst routing's, a bound every routing keeps within (the peak uses them), ``activations_balanced`` a balanced
routing's (trident/memory/activations.py ``routed_rows``; empty for a dense model, whose figures are exact).
tools/estimate_memory.py prints it, train.py writes it into memory.json beside what the ranks measured, and the
planner (trident/plan/planner.py) ranks layouts by it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from trident.config import ModelConfig
from trident.layout import Layout
from trident.memory.activations import (
    BALANCED,
    POLICIES,
    activation_bytes,
    activation_sets,
    loss_backward_bytes,
    recompute_bytes,
    recompute_flops,
)
from trident.memory.measure import Figures
from trident.memory.params import stage_params
from trident.memory.states import model_states
from trident.models.gpt import count_params
from trident.parallel.pipeline.schedules import holder_of, stage_placement


@dataclass
class StageEstimate:
    """A rank of one pipeline stage (every tp rank of it holds the same; the largest dp shard)."""

    stage: int
    compute_place: str  # where activations and transient buffers live: "device", or "host" on a CPU run
    params: int  # parameter elements this rank holds (local, unpadded)
    model_states: Figures  # kind -> place -> bytes
    staging: int  # transient gradient buffers (stages 2-3)
    gathered: int  # transient gathered parameters (stage 3)
    activations: dict[str, int]  # bytes kept for backward at the schedule's peak, per recomputation policy
    recompute: dict[str, int]  # transient bytes while backward recomputes, per policy
    recompute_flops: dict[str, float]  # matmul and attention FLOPs a step's backward recomputes, per policy
    loss_backward: int = 0  # transient bytes of the loss's backward (the last stage only)
    checkpoint_staging: int = 0  # checkpoint.async: host memory holding a copy of what the rank saves, for the run
    activation_sets: int = 1  # the most micro-batch x chunk activation sets held at once (the schedule's walk)
    optimizer_step: int = 0  # transient bytes of the optimizer's step (Muon: a whole matrix parameter's update)
    # A mixture-of-experts model: the activations under a balanced routing (``activations`` are the worst's, a bound).
    activations_balanced: dict[str, int] = field(default_factory=dict)

    def backward_transient(self, policy: str) -> int:
        """What backward allocates above the held activations: a recomputed layer or the loss's gradients,
        whichever is larger (the loss's backward is over before the first layer's recomputation starts)."""
        return max(self.recompute[policy], self.loss_backward)

    def peak(self, policy: str) -> dict[str, int]:
        """Model states, transient buffers and activations, by place, at the schedule's peak under ``policy``."""
        out = dict(self.model_states["total"])
        transient = self.backward_transient(policy)
        passes = self.staging + self.gathered + self.activations[policy] + transient
        out[self.compute_place] += max(passes, self.optimizer_step)  # the step runs after the passes' buffers go
        out["host"] += self.checkpoint_staging
        return out


@dataclass
class Estimate:
    model: str
    layout: Layout
    total_params: int  # the model's, unpadded, tied embedding once
    # "exact"; "bound" for a mixture-of-experts model: activations of the worst routing, which no routing exceeds
    activations_are: str = "exact"
    stages: list[StageEstimate] = field(default_factory=list)

    @property
    def worst(self) -> StageEstimate:
        """The pipeline stage needing the most memory at its peak under the layout's checkpointing policy."""
        policy = self.layout.recompute
        return max(self.stages, key=lambda s: (s.peak(policy)["device"], s.peak(policy)["host"]))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def estimate(m: ModelConfig, layout: Layout, policies: Sequence[str] = POLICIES, balanced: bool = True) -> Estimate:
    """Predicted per-rank bytes of every pipeline stage: model states, transient buffers and activations, under
    each recomputation of ``policies`` and the layout's own; ``balanced``: a sparse model's activations under a
    balanced routing besides the worst's bound (each policy and routing a trace of its own on a CPU layout)."""
    out = Estimate(model=m.name, layout=layout, total_params=count_params(m))
    out.activations_are = "bound" if m.moe.enabled else "exact"
    last, _ = holder_of(layout.chunks - 1, layout.pp, stage_placement(layout.schedule))  # the loss's rank
    policies = list(dict.fromkeys((*policies, layout.recompute)))  # the layout's own too
    for stage in range(layout.pp):
        params = stage_params(m, layout, stage)
        states = model_states(params, layout)
        out.stages.append(
            StageEstimate(
                stage=stage,
                compute_place="host" if layout.device == "cpu" else "device",
                params=params.numel,
                model_states=states.figures,
                staging=states.staging,
                gathered=states.gathered,
                activations={p: activation_bytes(m, layout, stage, p) for p in policies},
                recompute={p: recompute_bytes(m, layout, p) for p in policies},
                recompute_flops={p: recompute_flops(m, layout, stage, p) for p in policies},
                loss_backward=loss_backward_bytes(m, layout) if stage == last else 0,
                checkpoint_staging=states.checkpoint if layout.async_checkpoint else 0,
                activation_sets=activation_sets(layout, stage, m),
                optimizer_step=states.optimizer_step,
                activations_balanced={p: activation_bytes(m, layout, stage, p, BALANCED) for p in policies}
                if m.moe.enabled and balanced
                else {},
            )
        )
    return out
