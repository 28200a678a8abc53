"""The planner's table: the best layouts with their predicted throughput, memory, bubble and exposed communication,
and the overrides that launch each."""

from __future__ import annotations

from trident.config import Config
from trident.layout import config_keys, override_value
from trident.memory.measure import format_bytes
from trident.plan.planner import Plan, Prediction


def launch_overrides(p: Prediction, base: Config) -> list[str]:
    """The overrides that turn ``base`` (the config the plan was made for) into this layout: only the keys that
    differ (dp always follows from the world size)."""
    theirs = config_keys(base)
    mine = {key: override_value(value) for key, value in p.layout.keys().items()}
    out = [f"{k}={v}" for k, v in mine.items() if v != theirs[k] and k != "parallel.dp"]
    if base.parallel.dp is not None:
        out.insert(0, "parallel.dp=null")
    return out


def launch_command(p: Prediction, plan: Plan, base: Config, given: list[str]) -> str:
    """The whole command that launches ``p``: torchrun on the plan's nodes and ranks per node, train.py with the
    overrides the plan was made for (``given``, but those of the keys the layout sets) and the layout's own."""
    mine = launch_overrides(p, base)
    keys = {o.split("=", 1)[0].lstrip("+") for o in mine}
    kept = [o for o in given if o.split("=", 1)[0].lstrip("+") not in keys]
    nodes, per_node = plan.placement.nodes, plan.placement.ranks_per_node
    rendezvous = " --rdzv-backend c10d --rdzv-endpoint HOST:29500 --rdzv-id JOB" if nodes > 1 else ""
    return f"torchrun --nnodes {nodes} --nproc-per-node {per_node}{rendezvous} train.py {' '.join([*kept, *mine])}"


def header(plan: Plan, cfg: Config) -> list[str]:
    m, tr, pl = cfg.model, cfg.train, plan.placement
    nodes = f"{pl.nodes} node{'s' if pl.nodes > 1 else ''} of {pl.ranks_per_node}"
    threads = (
        f", {pl.threads} thread{'s' if pl.threads > 1 else ''} per rank on {pl.cores} cores"
        if plan.profile.device == "cpu"
        else ""
    )
    floored = f" ({plan.floored:,} by a lower bound of their memory)" if plan.floored else ""
    untimed = (
        f"; {plan.untimed:,} not estimated, their step (or its lower bound) behind the best {plan.top}"
        if plan.untimed
        else ""
    )
    return [
        f"plan: {m.name} on {plan.world} ranks ({nodes}{threads}), {plan.profile.describe()}",
        f"batch {tr.global_batch_size} x {m.seq_len} tokens, {tr.precision}; "
        f"{plan.examined:,} layouts accepted by the validator ({len(plan.refused):,} refused), "
        f"{plan.do_not_fit:,} do not fit in {format_bytes(plan.profile.usable_fraction * plan.profile.memory_bytes)}"
        f"{' per node' if plan.profile.device == 'cpu' else ' per device'}{floored}{untimed}; "
        f"planned in {plan.seconds:.1f} s",
    ]
