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


def plan_table(plan: Plan, cfg: Config, top: int, given: list[str] | None = None) -> str:
    """The ``top`` best layouts, one row each: predicted tokens/s, MFU, step time, peak memory per rank, pipeline
    bubble, exposed communication (tensor-parallel collectives, pipeline messages, dp/ZeRO not hidden), overrides;
    with ``given`` (the overrides the plan was made for), a last line: the whole command that launches the best."""
    lines = header(plan, cfg)
    if not plan.ranked:
        lines.append("no layout fits: try more ranks, train.activation_checkpointing, parallel.zero or offload")
        return "\n".join(lines)
    cols = (
        f"{'#':>3} {'tokens/s':>10} {'MFU':>6} {'step':>8} {'peak/rank':>10} {'bubble':>6} {'exposed comm':>13}  layout"
    )
    lines += ["", cols]
    for i, p in enumerate(plan.ranked[:top], 1):
        t = p.time
        assert t is not None
        mfu = f"{100 * p.mfu:5.1f}%" if p.mfu is not None else "   n/a"
        exposed = f"{t.exposed_comm:6.3f}s {100 * t.exposed_comm / t.step:4.1f}%"
        peak = (
            format_bytes(p.peak["device"] + p.peak["host"])
            if plan.profile.device == "cpu"
            else format_bytes(p.peak["device"])
        )
        bubble = f"{100 * t.bubble:5.1f}%"
        lines.append(
            f"{i:>3} {p.tokens_per_s:>10,.0f} {mfu:>6} {t.step:>7.3f}s {peak:>10} {bubble} {exposed:>13}  {p.label}"
        )
        lines.append(f"{'':>3} {' '.join(launch_overrides(p, cfg)) or '(the config as given)'}")
    if given is not None:
        lines += ["", "launch the best (#1):", f"  {launch_command(plan.ranked[0], plan, cfg, given)}"]
    return "\n".join(lines)
