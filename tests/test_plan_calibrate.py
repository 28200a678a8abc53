"""trident_dev/plan/calibrate.py and its probes (trident_dev/plan/probes.py): a calibration measures exactly what the
planner's needs list, with plausible times (a larger matmul takes longer, the element-wise rate predicts a size it
never measured), caches it so that a second calibration measures nothing and a wider one only what is new, and fits
collective rates from concurrent ranks. The calibrations that test the cache accept a busy machine (the suite's
other worker keeps it so); tests/test_plan_contention.py tests what a busy machine does to a calibration."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import pytest
import torch

from trident.config import ModelConfig
from trident.plan.ops import Shape, chunk_ops
from trident.plan.profile import (
    COLLECTIVES,
    Needs,
    Profile,
    Rate,
    attention_key,
    collective_key,
    load_cached,
    matmul_key,
)
from trident_dev.plan import calibrate as calibration
from trident_dev.plan import probes
from trident_dev.plan.calibrate import calibrate, still_needed
from trident_dev.plan.probes import fit_rate, time_add, time_gelu

SMALL, LARGE = ("fp32", 32, 32, 32, "nt"), ("fp32", 384, 384, 384, "tn")
ATTENTION = ("fp32", 1, 4, 2, 64, 16)  # grouped-query: 4 query heads over 2 kv heads


def tiny_needs(groups: tuple[int, ...] = ()) -> Needs:
    return Needs(matmuls={SMALL, LARGE}, attention={ATTENTION}, groups=set(groups), precisions={"fp32"})


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calibrate for ranks of one thread, whatever the machine: threads that other work on a shared machine
    preempts wait for each other, and would make every timing here noise."""
    monkeypatch.setattr(calibration, "cpu_threads_per_rank", lambda ranks_per_node: 1)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory: pytest.TempPathFactory) -> tuple[Profile, Path, list[str]]:
    """One calibration for a single rank per node (so no collectives): the profile, its cache, its log."""
    cache = tmp_path_factory.mktemp("calibration") / "profile.json"
    lines: list[str] = []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(calibration, "cpu_threads_per_rank", lambda ranks_per_node: 1)
        profile = calibrate(tiny_needs((2,)), 1, cache=cache, log=lines.append, accept_busy=True)
    return profile, cache, lines


def count_timings(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the calls of the timing function every non-collective measurement goes through."""
    calls = [0]
    timed = probes.median_seconds

    def counting(*args: object, **kwargs: object) -> float:
        calls[0] += 1
        return timed(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(probes, "median_seconds", counting)
    return calls


def test_fit_rate_recovers_a_line_and_clamps_the_latency() -> None:
    exact = fit_rate([(b, 1e-5 + b / 2e9) for b in (1e3, 1e5, 1e7)])
    assert exact.latency == pytest.approx(1e-5, rel=1e-6) and exact.bandwidth == pytest.approx(2e9, rel=1e-6)
    # Times that extrapolate to a negative latency: none, and the bandwidth fitted alone.
    through_origin = fit_rate([(1e3, 1e-9), (1e6, 2e-3), (2e6, 3.5e-3)])
    assert through_origin.latency == 0 and through_origin.bandwidth > 0


def test_a_gpu_times_element_wise_ops_past_its_l2_cache_and_a_cpu_at_its_own_sizes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An H200's 60 MB of L2 holds an 8 MiB tensor whole: timed there, an add runs at the cache's bandwidth, and a
    layer's activations (50 MB a tensor for gpt-small at micro-batch 32) were priced several times too fast."""
    gpu = probes.elementwise_sizes(torch.device("cuda"))
    assert min(gpu) <= 64 * 1024 and max(gpu) > 126e6  # the launch latency, and past B200's 126 MB of L2
    assert probes.elementwise_sizes(torch.device("cpu")) == probes.ELEMENTWISE_BYTES
    timed = []  # and those are the sizes measure_elementwise times an add and a GELU at (no GPU needed to see it)
    for name in ("time_add", "time_gelu"):
        monkeypatch.setattr(probes, name, lambda numel, device: timed.append(4 * numel) or 1e-5 + numel * 4e-12)
    probes.measure_elementwise(torch.device("cuda"))
    assert sorted(set(timed)) == sorted(gpu)


def test_p2p_is_missing_at_group_two_only() -> None:
    profile = Profile(name="x", device="cpu", source="test", memory_bytes=1.0, units_per_node=8)
    needs = Needs(groups={2, 4})
    assert still_needed(needs, profile).groups == {2, 4}
    profile.collectives = {
        collective_key(op, 4): Rate(1e-5, 1e9) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
    }
    assert still_needed(needs, profile).groups == {2}
    profile.collectives |= {collective_key(op, 2): Rate(1e-5, 1e9) for op in COLLECTIVES}
    assert still_needed(needs, profile).groups == set()


def test_calibration_measures_exactly_the_needs(calibrated: tuple[Profile, Path, list[str]]) -> None:
    profile, cache, lines = calibrated
    threads = 1
    assert profile.device == "cpu" and profile.name.startswith("cpu: ") and profile.name.endswith("(calibrated)")
    assert profile.threads == threads and f"{threads} threads per rank" in profile.source
    assert profile.memory_bytes > 0 and profile.units_per_node >= 1
    assert set(profile.matmuls) == {matmul_key(*SMALL), matmul_key(*LARGE)}
    assert set(profile.attention) == {attention_key(*ATTENTION, "fwd"), attention_key(*ATTENTION, "bwd")}
    assert all(t > 0 for t in [*profile.matmuls.values(), *profile.attention.values()])
    assert profile.peak_tflops["fp32"] > 0 and 0 < profile.matmul_efficiency <= 1
    # 1728 times the FLOPs: however noisy the machine, not faster.
    assert profile.matmuls[matmul_key(*LARGE)] > profile.matmuls[matmul_key(*SMALL)]
    for rate in (profile.elementwise, profile.host_copy):
        assert rate.latency >= 0 and rate.bandwidth > 0
    assert profile.adam > 0 and profile.host_adam == profile.adam
    # One rank per node has no groups of 2: nothing measured, and the log says so.
    assert profile.collectives == {}
    assert any("not measured" in line for line in lines) and any("2 matmul shapes" in line for line in lines)
    assert load_cached("cpu", 1, threads, cache) == profile


def test_elementwise_rate_predicts_a_size_it_did_not_measure(calibrated: tuple[Profile, Path, list[str]]) -> None:
    """4 MiB tensors (16 KiB, 1 MiB and 8 MiB were measured): an add at the memory-bound rate and a GELU at the
    arithmetic-bound one, within a factor of 3 of the fastest and the slowest of five measurements (the machine is
    shared: the calibration and the measurements may meet different loads)."""
    profile, _, _ = calibrated
    nbytes = 4 * 1024**2
    before = torch.get_num_threads()
    torch.set_num_threads(profile.threads)
    try:
        cpu = torch.device("cpu")
        measured = [time_add(nbytes // 4, cpu) + time_gelu(nbytes // 4, cpu) for _ in range(5)]
    finally:
        torch.set_num_threads(before)
    assert profile.transcendental is not None
    predicted = profile.elementwise.time(3 * nbytes) + profile.transcendental.time(2 * nbytes)
    assert min(measured) / 3 < predicted < 3 * max(measured), (predicted, measured)


def test_cached_calibration_measures_only_what_is_new(
    calibrated: tuple[Profile, Path, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile, shared_cache, _ = calibrated
    cache = tmp_path / "profile.json"
    shutil.copy(shared_cache, cache)
    calls = count_timings(monkeypatch)
    again = calibrate(tiny_needs((2,)), 1, cache=cache, log=lambda _: None, accept_busy=True)
    assert calls[0] == 0 and again == profile

    wider = tiny_needs()
    wider.matmuls.add(("fp32", 64, 48, 32, "nn"))
    grown = calibrate(wider, 1, cache=cache, log=lambda _: None, accept_busy=True)
    assert calls[0] == 1  # that one shape, nothing else
    assert set(grown.matmuls) == set(profile.matmuls) | {matmul_key("fp32", 64, 48, 32, "nn")}
    assert all(grown.matmuls[key] == t for key, t in profile.matmuls.items())
    assert load_cached("cpu", profile.ranks_per_node, profile.threads, cache) == grown


def test_no_cache_measures_everything_and_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # where the default caches (profile, peak) would go
    calls = count_timings(monkeypatch)
    profile = calibrate(Needs(matmuls={SMALL}), 1, cache=None, log=lambda _: None)
    assert set(profile.matmuls) == {matmul_key(*SMALL)} and calls[0] > 1  # the shape, and the basics
    assert list(tmp_path.iterdir()) == []


@pytest.mark.lab
@pytest.mark.multiprocess
def test_collectives_from_concurrent_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four ranks (of one thread): two groups of 2 at once and one group of 4; 3 does not divide 4 ranks. Each op
    of COLLECTIVES gets a rate at group size 2, and the others at 4; the intra-node link is the all-reduce of
    the largest group restated for the ring formula. A second calibration starts no ranks."""
    cache = tmp_path / "profile.json"
    needs = Needs(matmuls={SMALL}, groups={2, 3, 4}, precisions={"fp32"})
    profile = calibrate(needs, 4, cache=cache, log=lambda _: None, accept_busy=True)
    expected = {collective_key(op, 2) for op in COLLECTIVES}
    expected |= {collective_key(op, 4) for op in COLLECTIVES if op != "p2p"}
    assert set(profile.collectives) == expected
    assert all(rate.latency >= 0 and rate.bandwidth > 0 for rate in profile.collectives.values())
    # The same collectives amid compute, every rank of the launch computing between them.
    assert set(profile.amid) == expected
    assert all(rate.latency >= 0 and rate.bandwidth > 0 for rate in profile.amid.values())
    # And after longer stretches of compute.
    assert set(profile.amid_long) == expected
    assert all(rate.latency >= 0 and rate.bandwidth > 0 for rate in profile.amid_long.values())
    # And what each costs a rank's process in CPU (gloo's threads too): bytes at a rate, and some per collective.
    assert set(profile.collective_cpu) == expected
    assert all(rate.latency >= 0 and rate.bandwidth > 0 for rate in profile.collective_cpu.values())
    assert all(rate.time(1e6) > 0 for rate in profile.collective_cpu.values())
    # How k = 1 .. 4 ranks computing at once share the cores, in a lone rank's CPU time's worth.
    assert len(profile.sharing) == 4 and all(x > 0 for x in profile.sharing)
    # The ring formula over the intra link (6 hops over 4 ranks) gives back the measured all-reduce of 4.
    all_reduce, hops = profile.collectives[collective_key("all_reduce", 4)], 6
    assert profile.intra == profile.inter
    for nbytes in (1e3, 1e7):
        ring = hops * profile.intra.latency + hops / 4 * nbytes / profile.intra.bandwidth
        assert ring == pytest.approx(all_reduce.time(nbytes))

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("measured collectives again")

    monkeypatch.setattr(calibration, "run_distributed", refuse)
    assert calibrate(needs, 4, cache=cache, log=lambda _: None, accept_busy=True) == profile


def test_a_collective_amid_compute_is_what_it_added_to_a_round_at_its_bytes_back_to_back_cost() -> None:
    """Per collective, the median over the ranks of what it added to a round of compute, taken out of the ranks'
    times (the others left); its rate moves bytes at the back-to-back bandwidth, and the rest of what it added is
    its latency (none where the bytes alone explain it)."""
    key = probes.AMID_KEY + collective_key("all_reduce", 2)
    nbytes = probes.AMID_BYTES
    per_rank = [{key: [(nbytes, extra)], "other": [(1, 1.0)]} for extra in (0.002, 0.004, 0.003)]
    extras = calibration.amid_extras(per_rank)
    assert extras == {collective_key("all_reduce", 2): (nbytes, 0.003)}
    assert all(set(times) == {"other"} for times in per_rank)
    back_to_back = Rate(1e-4, 1e8)
    rates = calibration.amid_rates(extras, {collective_key("all_reduce", 2): back_to_back})
    assert rates == {collective_key("all_reduce", 2): Rate(pytest.approx(0.003 - nbytes / 1e8), 1e8)}
    cheap = calibration.amid_rates({"p2p:2": (nbytes, 1e-5)}, {"p2p:2": back_to_back})
    assert cheap == {"p2p:2": Rate(0.0, 1e8)}
    # The longer stretches' figures are kept apart, under their own prefix.
    longer = probes.AMID_LONG_KEY + collective_key("all_reduce", 2)
    per_rank = [{key: [(nbytes, 0.003)], longer: [(nbytes, extra)]} for extra in (0.006, 0.005, 0.009)]
    assert calibration.amid_extras(per_rank, probes.AMID_LONG_KEY) == {collective_key("all_reduce", 2): (nbytes, 0.006)}
    assert calibration.amid_extras(per_rank) == {collective_key("all_reduce", 2): (nbytes, 0.003)}


def test_a_collectives_cpu_is_its_bytes_at_the_back_to_back_rate_and_what_else_it_cost_amid_compute() -> None:
    """Each rank's CPU seconds per collective at each size (``probes.CPU_KEY``) give the bytes' rate, the median over
    the ranks; what one collective amid compute added to a round's CPU (``probes.AMID_CPU_KEY``), less its bytes,
    the latency; both taken out of the ranks' times."""
    key = collective_key("p2p", 2)
    per_rank = [
        {
            probes.CPU_KEY + key: [(1e3, 1e-4 + 1e3 * scale), (1e6, 1e-4 + 1e6 * scale)],
            probes.AMID_CPU_KEY + key: [(probes.AMID_BYTES, 5e-4 + probes.AMID_BYTES * 1e-9)],
            "other": [(1, 1.0)],
        }
        for scale in (0.9e-9, 1e-9, 1.2e-9)
    ]
    back_to_back = calibration.cpu_rates(per_rank)
    assert back_to_back[key].latency == pytest.approx(1e-4, rel=1e-3)
    assert back_to_back[key].bandwidth == pytest.approx(1e9, rel=1e-3)
    cpu = calibration.amid_rates(calibration.amid_extras(per_rank, probes.AMID_CPU_KEY), back_to_back)
    assert cpu[key].latency == pytest.approx(5e-4, rel=1e-3) and cpu[key].bandwidth == back_to_back[key].bandwidth
    assert all(set(times) == {"other"} for times in per_rank)


def test_framework_share_is_a_real_block_against_its_priced_kernels(tmp_path: Path) -> None:
    """A one-layer model run forward and backward, over its ops as priced: a ratio, recorded with the block, and
    not asked for again. Its kernels are a good share of its time (128 wide, 128 tokens): the scale on them is what
    is left beyond the framework's time per op, which a block of gpt-tiny's 32 x 16 is nearly all of."""
    block = {"model": dataclasses.asdict(ModelConfig(n_layers=2, d_model=128, n_heads=2, seq_len=128, vocab_size=64)),
             "batch": 1, "precision": "fp32"}  # fmt: skip
    needs = Needs(precisions={"fp32"}, block=block)
    profile = calibrate(needs, 1, cache=tmp_path / "p.json", log=lambda _: None)
    assert profile.block == block and 0.2 < profile.framework < 100 and profile.dispatch >= 0
    assert still_needed(needs, profile).block is None


def test_the_framework_is_a_time_per_op_from_a_tiny_twin_and_a_scale_on_the_kernels_from_the_block() -> None:
    # A tiny block of 100 ops: 1.1 ms measured, 0.1 ms of it kernels: 10 us per op.
    dispatch = calibration.per_op((1.1e-3, 1e-4, 100))
    assert dispatch == pytest.approx(1e-5)
    # The block: 1.2 x its 10 ms of kernels' time and those 10 us per op.
    assert calibration.kernel_scale((1.2 * 0.01 + 100 * 1e-5, 0.01, 100), dispatch) == pytest.approx(1.2)
    # Noise that leaves nothing beyond the ops: the kernels' ratio alone.
    assert calibration.kernel_scale((5e-4, 4e-4, 100), dispatch) == pytest.approx(1.25)
    # A tiny block faster than its priced kernels (noise) adds nothing per op.
    assert calibration.per_op((1e-4, 2e-4, 100)) == 0.0


def test_a_blocks_tiny_twin_has_the_same_ops_on_a_few_elements() -> None:
    model = dataclasses.asdict(ModelConfig(d_model=512, n_heads=8, seq_len=1024, vocab_size=32000, d_ff=1376))
    block = {"model": {**model, "mlp": "swiglu"}, "batch": 4, "precision": "bf16"}
    tiny = calibration.tiny_block(block)
    assert tiny["batch"] == 1 and tiny["precision"] == "bf16"
    assert tiny["model"]["d_model"] == 64 and tiny["model"]["n_heads"] == 8 and tiny["model"]["d_ff"] == 128
    assert tiny["model"]["mlp"] == "swiglu" and tiny["model"]["seq_len"] == 8 and tiny["model"]["vocab_size"] == 64
    shape = Shape(1, 8, 1, False, "bf16")
    big, small = (ModelConfig(**{**b["model"], "n_layers": 1}) for b in (block, tiny))
    counts = [[(o.kind, o.phase, o.count) for o in chunk_ops(x, shape, 1, True, True, "none")] for x in (big, small)]
    assert counts[0] == counts[1]


def test_compute_is_timed_by_the_threads_own_cpu_time_so_other_load_is_not_in_it() -> None:
    """A kernel that sleeps half its wall time (as a thread does whose core another process holds) is timed by the
    half it ran; collectives, which wait by nature, keep wall time."""

    def half_asleep() -> None:
        end = time.thread_time() + 0.01
        while time.thread_time() < end:
            pass
        time.sleep(0.01)

    cpu = torch.device("cpu")
    with probes.cpu_threads(1):
        assert probes.own_time(cpu)
        assert 0.008 < probes.median_seconds(half_asleep, cpu, 0.05) < 0.015
    assert probes.seconds_once(half_asleep, cpu) >= 0.02
