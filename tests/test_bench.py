"""tools/bench.py: each subcommand on a tiny setting, through the tool's own argument parsing. Checks that its table
has its columns and rows and that its figures are finite; never how fast anything is (benchmarks print numbers,
tests do not time them). Also the layouts' short forms and the validator's verdict before anything is launched."""

from __future__ import annotations

import math
import runpy
from pathlib import Path

import pytest

from tests.helpers import REPO
from trident_dev.bench import harness
from trident_dev.bench.compare import Column, Comparison, Rank, Setting, Steps, compare, per_round
from trident_dev.bench.harness import Stat, Table, alternate, number, ratio, spread
from trident_dev.bench.runs import checked_trial, expand
from trident_dev.curves import REL

TOOL = runpy.run_path(str(REPO / "tools" / "bench.py"))


def bench(*argv: str) -> list[Table]:
    module, args = TOOL["parse"](list(argv))
    return module.run(args)


def figure(cell: str) -> float:
    """A table cell as a number: "1,234", "1.05x", "±3%", "12.5%", "1.52 MiB"."""
    text = cell.split()[0].replace(",", "").lstrip("±").rstrip("x%")
    return float(text)


def assert_finite(table: Table, *columns: str) -> None:
    for name in columns:
        for cell in table.column(name):
            assert math.isfinite(figure(cell)), (name, cell)


# --- the harness and the layouts' short forms (pure) ----------------------------------------------------------


def test_alternate_rotates_the_order_and_times_every_round() -> None:
    calls: list[tuple[str, int]] = []
    variants = {name: (lambda step, name=name: calls.append((name, step))) for name in "abc"}
    timings = alternate(variants, warmup=1, steps=2, rounds=3)
    assert [len(t.wall) for t in timings.values()] == [3, 3, 3]
    assert calls[:3] == [("a", 0), ("b", 0), ("c", 0)]  # warm-up
    assert [name for name, _ in calls[3::2]] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [step for name, step in calls if name == "a"] == list(range(7))  # each variant's own step count
    stat = Stat.of([2.0, 1.0, 4.0])
    assert (stat.median, stat.low, stat.high, stat.spread) == (2.0, 1.0, 4.0, 1.5)
    assert stat.map(lambda s: 8 / s) == Stat(4.0, 2.0, 8.0)


class _Clock:
    """A clock that moves only when a variant steps: each step adds its scripted seconds."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def process_time(self) -> float:
        return self.now / 2  # half the wall clock: CPU time is its own figure


# Seconds per step: a huge warm-up step (untimed), then one figure per round (rounds run in rotated order).
_SCRIPT = {"a": [100.0, 1.0, 3.0, 2.0], "b": [100.0, 4.0, 4.0, 8.0], "c": [100.0, 0.5, 0.5, 0.5]}


def _scripted(rank: Rank, job: tuple[_Clock, list, float]) -> dict:
    clock, calls, scale = job
    rank.info["where"] = f"rank {rank.rank} of {rank.world}"

    def variant(name: str) -> Steps:
        def step(i: int) -> float:
            calls.append((name, i))
            clock.now += scale * _SCRIPT[name][min(i, 3)]
            return 10.0 * scale + i

        return Steps(step, state=lambda: {"a": 7, "b": 9}.get(name), figures=lambda: {"last": calls[-1]})

    return {name: (lambda name=name: variant(name)) for name in "abc"}


def test_compare_rotates_the_rounds_and_tables_medians_and_spreads(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison every subcommand declares to, on a clock only the variants move: the order rotated each
    round after untimed warm-ups, each variant's steps counted on from its warm-up, medians and spreads of the
    rounds, a baseline of the same run, a row per setting, a refused setting's row."""
    clock, calls = _Clock(), []
    monkeypatch.setattr(harness, "time", clock)
    columns = [
        Column("scale"),
        Column("variant"),
        Column("s/step", lambda r: number(r.out.time.median, ".2f")),
        Column("spread", lambda r: spread(r.out.wall)),
        Column("tokens/s", lambda r: number(r.out.rate(12).median, ".1f")),
        Column("vs a", lambda r: ratio(r.of("a").time.median, r.out.time.median)),
        Column("per round vs a", lambda r: f"{per_round(r.out.wall, r.of('a').wall):.2f}"),
        Column("CPU", lambda r: number(r.out.cpu_s, ".2f")),
        Column("state", lambda r: r.out.state),
        Column("losses", lambda r: r.out.losses),
        Column("where", lambda r: r.info["where"]),
    ]
    settings = [
        Setting(_scripted, (clock, calls, 1.0), {"scale": 1}, world=None),
        Setting(_scripted, (clock, calls, 2.0), {"scale": 2}, world=None, rows=["b"], note="b alone"),
        Setting(refused="refused: no", cells={"scale": 3}),
    ]
    notes = lambda runs: [str(len(runs))]  # noqa: E731
    table = compare(Comparison("t", columns, settings, warmup=1, steps=1, rounds=3, notes=notes))
    assert calls[:3] == [("a", 0), ("b", 0), ("c", 0)]  # built and warmed up in order
    assert calls[3:12] == [("a", 1), ("b", 1), ("c", 1), ("b", 2), ("c", 2), ("a", 2), ("c", 3), ("a", 3), ("b", 3)]
    assert table.header[:3] == ["scale", "variant", "s/step"]
    assert table.rows == [
        ["1", "a", "2.00", "±100%", "6.0", "1.00x", "1.00", "1.00", "7", "[10.0, 11.0, 12.0, 13.0]", "rank 0 of 1"],
        ["1", "b", "4.00", "±100%", "3.0", "0.50x", "4.00", "2.00", "9", "[10.0, 11.0, 12.0, 13.0]", "rank 0 of 1"],
        ["1", "c", "0.50", "±0%", "24.0", "4.00x", "0.25", "0.25", "-", "[10.0, 11.0, 12.0, 13.0]", "rank 0 of 1"],
        ["2", "b", "8.00", "±100%", "1.5", "0.50x", "4.00", "4.00", "9", "[20.0, 21.0, 22.0, 23.0]", "rank 0 of 1"],
        ["3", "refused: no", "-", "-", "-", "-", "-", "-", "-", "-", "-"],
    ]
    assert table.notes == ["b alone", "3"] and table.ok


def test_short_forms_expand_to_train_overrides() -> None:
    layout = "dp=2 tp=2 pp=2 vpp=2 schedule=interleaved zero=1 sp ac=selective precision=bf16 mbs=2 compile"
    layout += " model.dropout=0.1"
    assert expand(layout) == [
        "parallel.dp=2",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.schedule=interleaved",
        "parallel.zero=1",
        "parallel.sequence_parallel=true",
        "train.activation_checkpointing=selective",
        "train.precision=bf16",
        "train.micro_batch_size=2",
        "train.compile=true",
        "model.dropout=0.1",
    ]
    assert expand("1") == []
    with pytest.raises(ValueError, match="cannot read 'tp2'"):
        expand("dp=2 tp2")


def test_a_layout_is_planned_with_its_world_size_and_refused_with_the_validators_line() -> None:
    ok = checked_trial(REPO, "dp=2 tp=2 sp", ["model=gpt-tiny"])
    assert ok.refused is None and ok.world == 4 and ok.config.parallel.sequence_parallel
    bad = checked_trial(REPO, "dp=2 tp=3", ["model=gpt-tiny"])
    assert bad.world == 6 and bad.refused.startswith("model.n_heads=4 is not divisible by parallel.tp=3; use ")
    unknown = checked_trial(REPO, "parallel.widths=3", ["model=gpt-tiny"])
    assert unknown.refused.startswith("unknown config key parallel.widths; ")


# --- each subcommand, tiny (multi-process) --------------------------------------------------------------------


def tiny_run(dataset: Path) -> list[str]:
    return [
        "model=gpt-tiny",
        f"data.dataset_dir={dataset}",
        "train.global_batch_size=4",
        "train.micro_batch_size=2",
        "logging.peak_tflops=1",
    ]


@pytest.mark.multiprocess
def test_layouts_tables_each_run_a_refusal_and_the_plain_torch_loop(tiny_dataset: Path) -> None:
    (table,) = bench(
        "layouts", "--model", "gpt-tiny", "--layouts", "1", "dp=2", "tp=3", "--steps", "3", "--warmup", "1",
        "--baseline", "--base", *tiny_run(tiny_dataset)[1:],
    )  # fmt: skip
    assert table.header[:4] == ["layout", "ranks", "tokens/s", "spread"]
    assert table.column("layout") == ["1", "dp=2", "tp=3", "plain torch loop (throughput)"]
    assert table.column("ranks") == ["1", "2", "3", "1"]
    ran = Table(table.title, table.header, [table.rows[i] for i in (0, 1)])
    assert_finite(ran, "tokens/s", "x first", "MFU", "peak mem (MB)")
    assert all(cell != "-" for cell in ran.column("model states / rank"))
    assert table.rows[2][2].startswith("refused: model.n_heads=4 is not divisible by parallel.tp=3")
    assert math.isfinite(figure(table.rows[3][2])) and math.isfinite(figure(table.rows[3][4]))


@pytest.mark.multiprocess
def test_matrix_compares_each_layout_with_one_process(tiny_dataset: Path) -> None:
    (table,) = bench(
        "matrix", "--layouts", "dp=2", "pp=3", "--steps", "2",
        "--base", *tiny_run(tiny_dataset), "train.eval_every=0", "wandb.mode=disabled",
    )  # fmt: skip
    assert table.header == ["layout", "ranks", "max rel. loss diff", "max rel. grad-norm diff", "status"]
    assert table.column("layout") == ["dp=2", "pp=3"]
    assert table.rows[0][4] == "ok" and table.ok
    assert figure(table.rows[0][2]) <= REL and figure(table.rows[0][3]) <= REL
    assert table.rows[1][4].startswith("refused: model.n_layers=2 is not divisible by pp 3")


@pytest.mark.multiprocess
def test_throughput_times_what_train_py_runs_16_bit_parameters_against_ddp() -> None:
    (table,) = bench(
        "throughput", "--model", "gpt-tiny", "--dp", "2", "--precision", "bf16", "--zero", "1",
        "--micro-batch", "2", "--global-batch", "4", "--steps", "1", "--rounds", "2", "--peak-tflops", "1",
    )  # fmt: skip
    assert table.column("variant") == ["trident", "torch DDP"]
    # The drift it fixes: trident's bf16 step is bf16 parameters (fp32 masters in the optimizer), as in a run.
    assert table.column("precision") == ["bfloat16 parameters", "float32 weights, bf16 autocast"]
    assert_finite(table, "tokens/s", "spread", "x baseline", "MFU", "first loss", "last loss")
    first = [figure(c) for c in table.column("first loss")]
    assert first[0] == pytest.approx(first[1], rel=1e-2)  # the same weights and batch


@pytest.mark.multiprocess
def test_zero_tables_every_stage_and_torchs_against_the_formula() -> None:
    (table,) = bench(
        "zero", "--worlds", "2", "--layers", "2", "--d-model", "64", "--seq-len", "32", "--vocab", "512",
        "--micro-batch", "1", "--micro-batches", "2", "--steps", "1", "--rounds", "1",
    )  # fmt: skip
    assert table.column("variant") == ["zero0", "zero1", "zero2", "zero3", "ddp+zro", "fsdp2"]
    assert_finite(table, "tokens/s", "vs zero0", "CPU-s/step", "first loss", "last loss", "state MiB")
    assert_finite(table, "formula MiB", "measured / formula")
    for cell in table.column("measured / formula"):
        assert figure(cell) == pytest.approx(1.0, abs=0.05)
    assert_finite(Table("", table.header, table.rows[:4]), "estimate MiB")
    assert len({c for c in table.column("first loss")}) == 1  # every variant starts from the same weights


@pytest.mark.multiprocess
def test_pp_tables_every_schedule_against_torch_and_one_process() -> None:
    table, exposed = bench(
        "pp", "--pp", "2", "--layers", "4", "--d-model", "64", "--seq-len", "32", "--vocab", "512",
        "--micro", "4", "--mbs", "1", "--steps", "1", "--warmup", "1", "--receive-lead", "0",
    )  # fmt: skip
    assert exposed.column("schedule") == ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
    assert_finite(exposed, "exposed (ms)", "step (ms)")
    assert table.column("schedule") == ["gpipe", "1f1b", "interleaved", "zb-h1", "zb-v"]
    assert_finite(table, "tokens/s", "pp=1 tokens/s", "vs pp=1", "bubble", "formula")
    for cell, cpu in zip(table.column("torch tokens/s"), table.column("CPU vs torch"), strict=True):
        assert cell.startswith("n/a") or math.isfinite(figure(cell))
        assert (cpu == "-") == cell.startswith("n/a") and (cpu == "-" or figure(cpu) > 0)
    assert [c != "-" for c in table.column("act. peak (stage 0)")] == [True, True, False, False, False]
    assert not table.column("torch tokens/s")[-1].startswith("n/a")  # torch's ScheduleZBVZeroBubble ran beside zb-v


@pytest.mark.multiprocess
def test_tp_tables_trident_against_dtensor_and_one_process_and_counts_collectives() -> None:
    tables = bench(
        "tp", "--tp", "2", "--model", "gpt-tiny", "--micro-batch", "2", "--seq-len", "32", "--steps", "1",
        "--rounds", "1", "--ref-threads", "1",
    )  # fmt: skip
    speed, *comms = tables
    names = ["tp=1, 1 thread", "trident tp=2", "trident tp=2 +SP", "DTensor tp=2", "DTensor tp=2 +SP"]
    assert speed.column("variant") == names
    assert_finite(speed, "tokens/s", "vs tp=1", "step-0 loss", "last loss")
    losses = [figure(c) for c in speed.column("step-0 loss")]
    assert max(losses) == pytest.approx(min(losses), rel=1e-4)  # one model, one batch, five ways
    assert len(comms) == 4 and all(t.header[:5] == ["op", "phase", "group", "elements", "calls"] for t in comms)
    for t in comms[:2]:  # trident's collectives are counted against the analytic count
        assert t.notes[0].endswith(": equal"), t.notes
        assert t.column("calls") == t.column("analytic")
    assert all(t.rows for t in comms)


@pytest.mark.multiprocess
def test_throughput_llama_against_the_plain_loop_and_transformers_llama() -> None:
    """--hf: trident, the plain torch loop and transformers' LlamaForCausalLM of llama-tiny's shape, one table per
    precision, each row's tokens/s and ratios positive; the three start from the same weights on the same batch, so
    their first fp32 losses agree (transformers' Llama is the same function as ours)."""
    tables = bench(
        "throughput", "--model", "llama-tiny", "--hf", "--seq", "32", "--micro-batch", "2", "--global-batch", "4",
        "--steps", "1", "--rounds", "1", "--warmup", "1", "--precision", "fp32", "bf16", "--peak-tflops", "1",
    )  # fmt: skip
    assert [t.title.split(", ")[3] for t in tables] == ["fp32", "bf16"]
    for table in tables:
        assert "x 32 tokens" in table.title
        assert table.column("variant") == ["trident", "plain torch loop", "transformers LlamaForCausalLM"]
        assert_finite(table, "tokens/s", "spread", "x baseline", "trident / this", "MFU", "first loss", "last loss")
        for name in ("tokens/s", "x baseline", "trident / this", "MFU"):
            assert all(figure(cell) > 0 for cell in table.column(name)), name
        assert table.column("trident / this")[0] == "1.00x"
    first = [figure(c) for c in tables[0].column("first loss")]
    assert first == pytest.approx([first[0]] * 3, rel=1e-5)
    assert table.column("precision")[2] == "float32 weights, bf16 autocast"


def test_throughput_refuses_hf_where_transformers_llama_is_not_the_same_model() -> None:
    with pytest.raises(SystemExit, match="--hf needs Llama blocks; model gpt-tiny is a GPT2LMHeadModel"):
        bench("throughput", "--model", "gpt-tiny", "--hf")
    with pytest.raises(SystemExit, match="--hf: model.norm=layernorm with .* has no Hugging Face class"):
        bench("throughput", "--model", "llama-tiny", "--hf", "--set", "model.norm=layernorm")
    with pytest.raises(SystemExit, match="--hf compares one process: use --dp 1"):
        bench("throughput", "--model", "llama-tiny", "--hf", "--dp", "2", "--global-batch", "8")


@pytest.mark.multiprocess
def test_gpu_bench_times_trident_the_plain_loop_and_torch_compile_here_on_a_cpu() -> None:
    """The GPU check kit's bench, run where CI runs: gpt-tiny on the CPU, through the same code a GPU takes. Its
    torch.compile is dynamo and AOT autograd without inductor's code generation (40 s of C++ compilation on a CPU;
    inductor itself is tests/test_gpu.py's and test_compile.py's)."""
    (table,) = bench(
        "gpu", "--device", "cpu", "--models", "gpt-tiny", "--precision", "fp32", "--micro-batch", "2",
        "--global-batch", "4", "--steps", "1", "--rounds", "2", "--warmup", "1", "--peak-tflops", "1",
        "--compile-backend", "aot_eager",
    )  # fmt: skip
    assert table.column("variant") == ["trident", "plain torch loop", "torch.compile (aot_eager)"]
    assert table.column("precision") == ["float32 parameters", "float32 weights", "float32 weights"]
    assert_finite(table, "tokens/s", "spread", "x plain", "MFU", "first loss", "last loss")
    assert table.column("x plain")[1] == "1.00x" and table.ok
    assert table.column("peak mem") == ["n/a (cpu)"] * 3  # no allocator peak on a CPU
    estimate = table.column("estimate")
    assert figure(estimate[0]) > 0 and estimate[1:] == ["-", "-"]  # the estimator predicts trident's run only
    first = [figure(c) for c in table.column("first loss")]
    assert first[0] == pytest.approx(first[1], rel=1e-5)  # trident and the plain loop: the same weights and batch
    last = [figure(c) for c in table.column("last loss")]
    assert last[2] < first[1]  # torch.compile trained the plain loop's model on from its warm-up


def test_recompute_tables_each_policy_measured_against_the_estimate_and_timed_against_none() -> None:
    policies = ["none", "selective", "attention", "full/2", "full"]
    (table,) = bench(
        "recompute", "--model", "gpt-tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "1", "--rounds", "1",
        "--device", "cpu", "--policies", *policies,
    )  # fmt: skip
    assert table.column("policy") == policies
    assert table.column("activations") == table.column("estimate")  # to the byte on a CPU
    assert table.column("vs none")[0] == "1.00x"
    assert_finite(table, "s/step", "vs none", "CPU-s/step", "CPU vs none", "recompute TFLOP")
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    held = {p: figure(c) * units[c.split()[1]] for p, c in zip(policies, table.column("activations"), strict=True)}
    assert held["full"] < held["full/2"] < held["none"] and held["selective"] < held["none"]


def test_moe_bench_times_the_grouped_experts_against_the_loop() -> None:
    (table,) = bench("moe", "--shapes", "32x16x4x2", "--tokens", "64", "--precision", "fp32", "--rounds", "1",
                     "--steps", "1", "--warmup", "1")  # fmt: skip
    assert table.column("shape (d x f x E x k)") == ["32x16x4x2"]
    assert_finite(table, "grouped ms", "loop ms", "loop / grouped")


@pytest.mark.multiprocess
def test_cp_tables_each_exchange_against_one_process_and_dp() -> None:
    (table,) = bench(
        "cp", "--model", "gpt-tiny", "--seq-len", "64", "--global-batch", "2", "--layouts", "cp=1", "dp=2", "cp=2",
        "--rounds", "1",
    )  # fmt: skip
    assert table.column("layout") == ["cp=1", "dp=2", "cp=2 ring", "cp=2 allgather", "cp=2 ulysses"]
    assert table.column("vs cp=1")[0] == "1.00" and table.column("vs dp=2")[1] == "1.00x"
    assert table.column("cp_balance")[2:] == ["1.000"] * 3
    assert_finite(table, "s/step", "tokens/s", "vs cp=1", "CPU-s/step")
    assert all(figure(c) < 1 for c in table.column("vs cp=1")[2:])  # each cp rank keeps less than one process


@pytest.mark.multiprocess
def test_moe_bench_trains_at_ep1_and_ep2_on_two_ranks() -> None:
    """``--ep 2``: the same steps at ep 1 and ep 2 (the same last loss), each with its tokens/s and ratio to dp, and
    the time in the experts' all-to-alls (none at ep 1)."""
    _, table = bench("moe", "--shapes", "32x16x4x2", "--tokens", "64", "--precision", "fp32", "--rounds", "1",
                     "--steps", "1", "--warmup", "1", "--ep", "2", "--global-batch", "8",
                     "--set", "model.moe.experts=2")  # fmt: skip
    assert "moe-tiny (2 experts of 64, top-2, d_model 64), 2 ranks" in table.title  # --set reaches the config
    assert table.column("variant") == ["ep 1", "ep 2"]
    assert_finite(table, "tokens/s", "x dp", "all-to-all ms/step")
    none, some = (float(v) for v in table.column("all-to-all ms/step"))
    assert none == 0 and some > 0
    first, second = (float(v) for v in table.column("last loss"))
    assert first == pytest.approx(second, rel=2e-4)


@pytest.mark.multiprocess
def test_replay_bench_times_replays_against_none_on_a_tp_layout() -> None:
    (table,) = bench(
        "replay", "--model", "gpt-tiny", "--seq", "32", "--tp", "2", "--micro-batch", "2", "--global-batch", "4",
        "--every", "2", "1", "--steps", "2", "--rounds", "1", "--warmup", "1",
    )  # fmt: skip
    assert table.column("variant") == ["replay off", "every 2", "every 1"]
    # 3 steps each (1 warm-up, 2 timed): step i replays when (i + 1) % N == 0, the check trident/replay.py runs
    assert table.column("replayed steps") == ["0", "1", "3"]
    assert table.column("step time vs replay off")[0] == "1.00x"
    assert_finite(table, "tokens/s", "step time vs replay off")


@pytest.mark.multiprocess
def test_optim_bench_sweeps_adamw_and_muon_tables_each_run_and_draws_the_curves(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    png = tmp_path / "optim.png"
    (table,) = bench(
        "optim", "--model", "gpt-tiny", "--dp", "1", "--steps", "3", "--warmup-steps", "1", "--seq", "32",
        "--global-batch", "4", "--eval-batches", "1", "--adamw-lr", "1e-3", "3e-3", "--muon-lr", "0.02",
        "--base", f"data.dataset_dir={tiny_dataset}", "--plot", str(png),
    )  # fmt: skip
    assert table.header == [
        "ranks", "optimizer", "lr", "AdamW lr (rest)", "train loss (last 4)", "val loss", "step time (s)",
        "vs AdamW", "best",
    ]  # fmt: skip
    assert table.ok
    assert table.column("optimizer") == ["AdamW", "AdamW", "Muon"]
    assert table.column("lr") == ["0.001", "0.003", "0.02"]
    assert table.column("best").count("best") == 2 and table.column("best")[2] == "best"
    best_adamw = table.column("lr")[table.column("best")[:2].index("best")]
    assert table.column("AdamW lr (rest)")[2] == best_adamw  # Muon's rest steps at AdamW's best lr
    assert_finite(table, "train loss (last 4)", "val loss", "step time (s)", "vs AdamW")
    assert any("Muon's best validation loss" in note for note in table.notes)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
