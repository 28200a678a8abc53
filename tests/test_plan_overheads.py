"""What a step costs the shared cores beyond its ops' kernels: the CPU of the collectives and pipeline messages
(trident/plan/cost.py ``comm_cpu``, simulate.py ``messages``), and the framework's work no op is, per split backward
action, cp pass and recomputed layer (``Profile.overheads``), measured on the model's tiny twin
(trident_dev/plan/tiny.py, trident_dev/plan/residual.py ``tiny_runs``, ``measure_overheads``)."""

from __future__ import annotations

import dataclasses

import pytest

from tests.helpers import REPO
from tests.test_plan import cpu_profile
from trident.config import compose_config, validate
from trident.layout import Layout
from trident.plan import simulate
from trident.plan.cost import Pricer, RankPlacement, _pipeline, comm_cpu, step_time
from trident.plan.ops import Op, Shape, chunk_ops, layer_parts, recompute_ops, ring_quarters
from trident.plan.planner import placement_for, predict
from trident.plan.profile import Rate, collective_key
from trident_dev.plan import residual, tiny

TINY = ["model=gpt-tiny", "train.global_batch_size=8"]
EIGHT_ON_TWO = RankPlacement(8, 8, threads=1, cores=2, sharing=(1.0, 2.0, 2.0, 2.0, 1.9, 1.8, 1.7, 1.6))


def _step(layout: Layout, profile, world: int | None = None):
    m = compose_config(REPO / "conf", TINY).model
    return step_time(m, layout, profile, placement_for(profile, world or layout.world))


def test_a_collectives_cpu_is_compute_on_the_shared_cores_and_only_the_rest_is_waited_for() -> None:
    """Eight ranks on two cores: a collective's measured CPU (taken with every rank at it) is four times its seconds
    of wall (each rank gets a quarter of a core), which as a lone rank's compute is that times the rank's share when
    all eight compute; the wait priced amid compute is left less that wall. Without a CPU figure (a GPU's
    collectives run on the device), nothing moves."""
    cpu = Rate(1e-5, 1e10)
    key = collective_key("all_gather", 2)
    profile = cpu_profile()
    measured = dataclasses.replace(profile, collective_cpu={key: cpu})
    op = Op("collective", "F", ("all_gather", "cp"), 1e6, 3)
    compute, wait = Pricer(profile, "fp32", EIGHT_ON_TWO, cp=2).op(op, 1)
    with_cpu = Pricer(measured, "fp32", EIGHT_ON_TWO, cp=2).op(op, 1)
    wall = cpu.time(1e6) * 8 / 2
    assert compute == 0.0 and wait == pytest.approx(3 * profile.collectives[key].time(1e6))
    assert with_cpu[0] == pytest.approx(3 * wall * EIGHT_ON_TWO.share(8))
    assert with_cpu[1] == pytest.approx(wait - 3 * wall)
    costly = dataclasses.replace(profile, collective_cpu={key: Rate(1e-3, 1e9)})  # more than the wait: none left
    assert Pricer(costly, "fp32", EIGHT_ON_TWO, cp=2).op(op, 1)[1] == 0.0
    assert comm_cpu(measured, EIGHT_ON_TWO, "all_gather", 2, 1e6) == pytest.approx((wall * 0.2, wall))
    assert comm_cpu(measured, EIGHT_ON_TWO, "all_reduce", 2, 1e6) == (0.0, 0.0)  # not measured


def test_a_pipelines_messages_are_its_cross_rank_dependencies() -> None:
    """Under 1f1b every action of two stages sends or receives exactly one message; under zb-v the V's turn (chunk
    1 to chunk 2, on one rank) is no message, and the weight passes (W) send none."""
    for (rank, action), n in simulate.messages("1f1b", 2, 1, 4).items():
        assert n == 1, (rank, action)
    assert len(simulate.messages("1f1b", 2, 1, 4)) == 2 * 2 * 4
    v = simulate.messages("zb-v", 2, 2, 4)
    assert all(a.kind != "W" for _, a in v)
    schedule, deps = simulate.structure("zb-v", 2, 2, 4)
    crossing = sum(d[0] != r for r, actions in enumerate(deps) for needs in actions for d in needs)
    assert sum(v.values()) == 2 * crossing
    turn = [a for r, a in v if r == 1 and a.kind == "F"]
    assert all(v[(1, a)] == 1 for a in turn)  # chunk 1 receives and chunk 2 sends: one each


def test_a_pipelines_messages_cpu_is_its_actions_compute() -> None:
    """With the CPU of an exchange measured, each action's compute grows by half an exchange's per message it sends
    or receives (as lone compute, on shared cores), and the transfer it waits for shrinks by the exchange's wall."""
    layout = Layout(dp=1, pp=2, micro_batch_size=2, micro_batches=4, schedule="1f1b", device="cpu")
    profile = cpu_profile()
    cpu = Rate(2e-4, 1e9)
    measured = dataclasses.replace(profile, collective_cpu={collective_key("p2p", 2): cpu})
    base, more = _step(layout, profile), _step(layout, measured)
    m = compose_config(REPO / "conf", TINY).model
    message = 2 * m.seq_len * m.d_model * 4
    # Two ranks on two cores: the wall of an exchange's CPU is itself, and so is its lone compute.
    assert more.compute - base.compute == pytest.approx(8 * cpu.time(message) / 2)
    assert more.p2p == pytest.approx(base.p2p - 2 * 4 * cpu.time(message))


def test_the_frameworks_work_per_cp_pass_recomputed_layer_and_split_action_is_priced_from_the_profile() -> None:
    """``Profile.overheads``: each layer's cp attention forward and backward costs ``cp:<cp_comm>``'s seconds,
    each recomputed layer ``recompute``'s, each I and W action of zb's split backward ``split``'s; unmeasured,
    nothing."""
    m = compose_config(REPO / "conf", TINY).model
    profile = cpu_profile()
    x = 1e-3
    shape = Shape(1, m.seq_len // 2, 1, False, "fp32", 2, "ring")
    ops = chunk_ops(m, shape, m.n_layers, True, True, "full", recomputed=1)
    placement = RankPlacement(2, 2, cores=2)
    # cp 2: the ring's 5 quarters a pass (parallel/context/ring.py); one layer of the chunk recomputed.
    quarters = ring_quarters(2)
    assert quarters == 5
    cases = (
        ("cp:ring", "F", quarters * m.n_layers),
        ("cp:ring", "I", quarters * (m.n_layers + 1)),
        ("recompute", "I", 1),
    )
    for name, phase, count in cases:
        priced = Pricer(dataclasses.replace(profile, overheads={name: x}), "fp32", placement).ops(ops, 1, phase)[0]
        assert priced - Pricer(profile, "fp32", placement).ops(ops, 1, phase)[0] == pytest.approx(count * x), name
    assert Pricer(dataclasses.replace(profile, overheads={"cp:ulysses": x}), "fp32", placement).ops(ops, 1, "F") == (
        Pricer(profile, "fp32", placement).ops(ops, 1, "F")
    )
    assert recompute_ops(m, shape, "none") == []
    # zb-h1 on two ranks of their own cores: the loss rank's 4 I and 4 W actions each cost ``split`` more.
    layout = Layout(dp=1, pp=2, micro_batch_size=2, micro_batches=4, schedule="zb-h1", device="cpu")
    base = _step(layout, profile)
    split = _step(layout, dataclasses.replace(profile, overheads={"split": x}))
    assert split.compute - base.compute == pytest.approx(8 * x)
    plain = dataclasses.replace(layout, schedule="1f1b")
    assert _step(plain, dataclasses.replace(profile, overheads={"split": x})).compute == _step(plain, profile).compute


def test_selective_checkpointings_dispatch_mode_is_priced_per_op_of_the_forward_and_the_recomputation() -> None:
    """``Profile.overheads["selective"]``: seconds per kernel of a selectively checkpointed layer's forward (F) and
    of what its backward recomputes (I), which its dispatch mode runs a Python policy on; a full or attention
    recomputation runs no such mode, and a layer not recomputed neither; cp's bookkeeping there takes a measured
    fraction more."""
    m = compose_config(REPO / "conf", TINY).model
    profile = cpu_profile()
    x = 1e-4
    shape = Shape(2, m.seq_len, 1, False, "fp32")
    placement = RankPlacement(1, 1)
    parts = layer_parts(m, shape)
    kernels = ("matmul", "attention", "elementwise")
    forward = sum(o.count for part in parts.values() for o in part if o.phase == "F" and o.kind in kernels)
    again = sum(o.count for o in recompute_ops(m, shape, "selective") if o.kind in kernels)
    assert 0 < again < forward
    with_it = dataclasses.replace(profile, overheads={"selective": x})
    for policy, counts in (("selective", {"F": forward, "I": again}), ("full", {"F": 0, "I": 0})):
        ops = chunk_ops(m, shape, m.n_layers, True, True, policy, recomputed=1)
        for phase in ("F", "I", "W"):
            more = Pricer(with_it, "fp32", placement).ops(ops, 1, phase)[0]
            less = Pricer(profile, "fp32", placement).ops(ops, 1, phase)[0]
            assert more - less == pytest.approx(counts.get(phase, 0) * x), (policy, phase)
    # Under cp, its bookkeeping takes ``selective:cp`` times more in the forward and the recomputation: the ring's
    # quarters of a pass, at ``cp:ring``'s seconds each.
    ring = Shape(2, m.seq_len // 2, 1, False, "fp32", 2, "ring")
    fraction = dataclasses.replace(profile, overheads={"cp:ring": x, "selective:cp": 0.5})
    alone = dataclasses.replace(profile, overheads={"cp:ring": x})
    ops = chunk_ops(m, ring, m.n_layers, True, True, "selective", recomputed=1)
    for phase in ("F", "I", "W"):
        more = Pricer(fraction, "fp32", placement).ops(ops, 1, phase)[0]
        less = Pricer(alone, "fp32", placement).ops(ops, 1, phase)[0]
        assert more - less == pytest.approx(0.5 * x * ring_quarters(2) * (phase != "W")), phase


def test_the_tiny_twin_has_the_models_ops_on_a_few_elements() -> None:
    cfg = compose_config(REPO / "conf", TINY)
    model = dataclasses.asdict(cfg.model)
    twin = compose_config(REPO / "conf", [*TINY, *tiny.overrides(model)]).model
    assert twin.d_model == tiny.HEAD_DIM * cfg.model.n_heads and twin.seq_len == tiny.SEQ
    assert (twin.n_layers, twin.n_heads, twin.vocab_size, twin.mlp) == (
        cfg.model.n_layers,
        cfg.model.n_heads,
        cfg.model.vocab_size,
        cfg.model.mlp,
    )
    llama = {**model, "mlp": "swiglu", "d_ff": 1376}
    assert tiny.twin(llama)["d_ff"] == 2 * tiny.HEAD_DIM * cfg.model.n_heads
    assert "model.d_ff=" + str(tiny.twin(llama)["d_ff"]) in tiny.overrides(llama)


@pytest.mark.parametrize("world", [3, 4])
def test_each_tiny_run_adds_one_kind_of_work_to_the_tiny_twin(world: int) -> None:
    """The tiny twin's runs are layouts train.py accepts on ``world`` ranks: full and selective recomputation over
    all of them; on an even world also cp over two ranks by each cp_comm (the ring also under selective
    recomputation), and two zb-h1 stages; one sequence per micro-batch,
    eight per replica; none of them at the plan's own model."""
    cfg = compose_config(REPO / "conf", TINY)
    runs = residual.tiny_runs(cfg, world, TINY)
    expected = {"recompute", "selective"} | (
        {"cp:ring", "cp:allgather", "cp:ulysses", "split", "selective:cp"} if world % 2 == 0 else set()
    )
    assert set(runs) == expected
    for name, run in runs.items():
        assert run["world"] == world and run["overrides"][: len(TINY)] == TINY
        held = compose_config(REPO / "conf", run["overrides"])
        layout = validate(held, world)
        assert held.model.d_model == tiny.HEAD_DIM * cfg.model.n_heads != cfg.model.d_model
        assert layout.micro_batch_size == 1 and layout.micro_batches == 8
        kind = (layout.activation_checkpointing, layout.cp, layout.cp_comm if layout.cp > 1 else None, layout.pp)
        assert (
            kind
            == {
                "recompute": ("full", 1, None, 1),
                "selective": ("selective", 1, None, 1),
                "selective:cp": ("selective", 2, "ring", 1),
                "cp:ring": ("none", 2, "ring", 1),
                "cp:allgather": ("none", 2, "allgather", 1),
                "cp:ulysses": ("none", 2, "ulysses", 1),
                "split": ("none", 1, None, 2),
            }[name]
        )
        assert layout.schedule == ("zb-h1" if name == "split" else None)


def test_each_overhead_is_the_one_with_which_the_model_gives_its_runs_measured_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``measure_overheads`` bisects each overhead until the model's step of its tiny run is the measured one (here
    a third above the model's own, selective recomputation's twice it); one whose run the model already prices at
    or above what it measured is 0."""
    cfg = compose_config(REPO / "conf", TINY)
    runs = residual.tiny_runs(cfg, 2, TINY)
    profile = cpu_profile()
    modelled = {
        name: predict(compose_config(REPO / "conf", run["overrides"]), 2, profile).time.step
        for name, run in runs.items()
    }
    # Selective recomputation runs the recomputed layers' own overhead too, fitted first: twice the model's step.
    scale = {"cp:ulysses": 1 / 2, "selective": 2.0, "selective:cp": 3.0}
    measured = {name: step * scale.get(name, 4 / 3) for name, step in modelled.items()}

    def measured_step(cfg_, run, profile_, repo):
        return measured[next(n for n, r in runs.items() if r is run)], "a tiny run"

    monkeypatch.setattr(residual, "_measured_step", measured_step)
    lines: list[str] = []
    fitted = residual.measure_overheads(profile, runs, REPO, lines.append)
    assert fitted.overheads["cp:ulysses"] == 0.0
    for name, run in runs.items():
        if name == "cp:ulysses":
            continue
        assert fitted.overheads[name] > 0
        step = predict(compose_config(REPO / "conf", run["overrides"]), 2, fitted).time.step
        assert step == pytest.approx(measured[name], rel=1e-6), name
    assert len(lines) == len(runs) and fitted.residual == profile.residual


def test_the_fit_bisects_a_growing_step() -> None:
    assert residual._fit(lambda x: 0.1 + 5 * x, 0.15) == pytest.approx(0.01, rel=1e-6)
    assert residual._fit(lambda x: 0.1 + 5 * x, 0.05) == 0.0


def test_any_recomputation_reruns_cps_exchange_and_a_kept_core_hides_none_of_it() -> None:
    """The ring's exchange is no kernel a selective policy keeps: every recomputation of a cp layer's forward runs
    it again, full and attention policies behind the recomputed core's kernels, selective without the core (its
    kernels kept) with nothing to hide behind; the cp pass's framework work reruns with it."""
    m = compose_config(REPO / "conf", TINY).model
    shape = Shape(1, m.seq_len // 2, 1, False, "fp32", 2, "ring")

    def ring(policy: str) -> list[tuple]:
        return [o.shape for o in recompute_ops(m, shape, policy) if o.kind == "collective" and o.shape[0] == "ring"]

    def cp_work(policy: str) -> int:
        return sum(
            o.count for o in recompute_ops(m, shape, policy) if o.kind == "framework" and o.shape == ("cp:ring",)
        )

    for policy in ("full", "attention", "selective", "selective[attn_core]", "selective[mlp]"):
        assert len(ring(policy)) == 1 and cp_work(policy) == ring_quarters(2), policy
    assert ring("full")[0][-1] == ring("attention")[0][-1] == ring("selective[attn_core]")[0][-1] == "fwd"
    assert ring("selective")[0][-1] == ring("selective[mlp]")[0][-1] == "alone"
    # Priced: a recomputed step hides behind its block's attention, one alone behind nothing.
    placement = RankPlacement(2, 2, cores=2)
    pricer = Pricer(cpu_profile(), "fp32", placement, cp=2)
    hidden, alone = (
        pricer.ops(recompute_ops(m, shape, policy), 1, "I")[1] for policy in ("selective[attn_core]", "selective")
    )
    assert alone > hidden


def test_a_recomputed_zb_chunks_weight_pass_recomputes_nothing() -> None:
    """The executor's W pass is the linear layers' weight GEMMs from what I kept (parallel/wgrad.py): a checkpointed
    chunk's W costs what an unrecomputed one's does, on every stage, and its I pays the recomputation."""
    m = compose_config(REPO / "conf", TINY).model
    profile = cpu_profile()
    placement = RankPlacement(2, 2, cores=2)
    layout = Layout(
        dp=1, pp=2, micro_batch_size=2, micro_batches=4, schedule="zb-h1", device="cpu", activation_checkpointing="full"
    )
    plain = dataclasses.replace(layout, activation_checkpointing="none")

    def cost(lay: Layout, stage: int, action: str) -> float:
        costs = _pipeline(m, lay, profile, placement, Pricer(profile, "fp32", placement))[0]
        return costs[(stage, action)][0]

    shape = Shape(2, m.seq_len, 1, False, "fp32")
    pricer = Pricer(profile, "fp32", placement)
    layers = m.n_layers // 2
    for stage in (0, 1):  # past stage 0 the deferred GEMMs rerun each block's last one (tests/test_zb_weight_pass.py)
        again = pricer.ops(recompute_ops(m, shape, "full", deferred=stage > 0), 1, "I")[0]
        assert cost(layout, stage, "W") == pytest.approx(cost(plain, stage, "W"))
        assert cost(layout, stage, "I") - cost(plain, stage, "I") == pytest.approx(layers * again)
