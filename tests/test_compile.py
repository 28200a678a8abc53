"""train.compile=true: every block compiled with torch.compile gives the eager one-process curve under tensor and
sequence parallelism with activation checkpointing, and keeps the parameter names: a compiled run's checkpoint
resumes eagerly with the uninterrupted losses. GPT-2's block with dropout (its masks drawn in an eager island inside
the compiled block, and drawn again when the checkpoint that wraps the compiled block recomputes it), and Llama's
(RMSNorm, SwiGLU, RoPE, grouped kv heads) under op-level selective recomputation (its checkpoint wrapping the
compiled block, whose kept outputs the recomputation replays)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.layouts import assert_same_curve, make_config, tiny, train_in_process
from trident.errors import ConfigError
from trident.models.compile import check_toolchain

# Each eager island splits the compiled block (every split a C++ compilation on a CPU): dropout's three in one case.
CASES = {
    "gpt-tiny-dropout-full": (["model=gpt-tiny", "model.dropout=0.1"], "full"),
    "llama-tiny-selective": (["model=llama-tiny"], "selective"),
}

# Inductor fuses fp32 arithmetic differently from eager kernels (its own GELU, LayerNorm and epilogue code), about
# as far from eager as another reduction order: the layout tests' tolerance.


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", list(CASES))
def test_compiled_blocks_give_the_eager_curve_and_resumable_checkpoints(tiny_dataset, tmp_path, case):
    model, recompute = CASES[case]
    base = tiny(tiny_dataset, *model, "train.steps=4", "train.micro_batch_size=8", "train.eval_every=0")
    (eager,) = train_in_process(tmp_path / "eager", base)
    layout = ["parallel.tp=2", "parallel.sequence_parallel=true", f"train.activation_checkpointing={recompute}"]
    compiled = train_in_process(tmp_path / "compiled", [*base, *layout, "train.compile=true", "checkpoint.every=2"], 2)
    for history in compiled:
        assert_same_curve(eager, history)
    resume = f"checkpoint.resume={tmp_path / 'compiled' / 'checkpoints' / 'step_00000002'}"
    (resumed,) = train_in_process(tmp_path / "resumed", [*base, resume])
    assert_same_curve(eager[2:], resumed)


def test_compile_on_a_cpu_without_a_cxx_compiler_is_refused_in_one_line(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-c++")
    with pytest.raises(
        ConfigError, match=r"^train.compile=true on a CPU needs a C\+\+ compiler .*no-such-c\+\+ is not"
    ):
        check_toolchain(torch.device("cpu"))
    check_toolchain(torch.device("cuda"))  # a GPU compiles with Triton, not the host compiler


def _graphs_per_step(rank: int, world: int, cfg, run_dir) -> list[int]:
    """A run of ``cfg`` on this rank; after each training step, the graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    from train import run
    from trident.loop import Trainer

    real, graphs = Trainer.train_step, []

    def train_step(self, step, micro_batches):
        out = real(self, step, micro_batches)
        graphs.append(counters["stats"]["unique_graphs"])
        return out

    Trainer.train_step = train_step
    try:
        run(cfg, run_dir)
    finally:
        Trainer.train_step = real
    return graphs


@pytest.mark.multiprocess
def test_nothing_recompiles_after_the_first_step_across_layouts_micro_batches_and_resume(tiny_dataset, tmp_path):
    """Dynamo compiles the block in the first step (and, under gradient accumulation, nothing more for the later
    micro-batches); the steps after it compile nothing, at tp=2 + SP with micro-batches of 2, and in a run resumed
    from its compiled checkpoint under another layout (one process) with micro-batches of 4."""
    from tests.helpers.layouts import make_config
    from trident_dev.ranks import run_distributed

    base = tiny(tiny_dataset, "model=llama-tiny", "train.steps=4", "train.eval_every=0", "train.compile=true")
    saved = tmp_path / "tp2" / "checkpoints" / "step_00000002"
    runs = {
        "tp2": (
            2,
            ["train.micro_batch_size=2", "parallel.tp=2", "parallel.sequence_parallel=true", "checkpoint.every=2"],
        ),
        "resumed-one": (1, ["train.micro_batch_size=4", f"checkpoint.resume={saved}"]),
    }
    for name, (world, extra) in runs.items():
        cfg = make_config(*base, *extra)
        for graphs in run_distributed(_graphs_per_step, world, cfg, tmp_path / name, timeout_s=600):
            assert graphs[0] > 0 and all(g == graphs[0] for g in graphs), (name, graphs)  # compiled, then no more


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_a_deeper_model_compiles_no_more_graphs(model, monkeypatch) -> None:
    """One compilation serves every block: the graphs dynamo builds in a forward and backward with dropout do not
    grow with the layers (a dropout's layer index once made its frame recompile per layer, up to dynamo's cache
    limit), and a second step builds none. Dynamo's graphs, counted with its eager backend (no C++: the backend
    does not change what is traced)."""
    from torch._dynamo.utils import counters

    from trident.models.compile import compile_blocks
    from trident.models.gpt import GPT, init_weights
    from trident.parallel.random import model_parallel_rng

    real = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, options=None: real(fn, backend="eager"))

    def graphs(layers: int) -> int:
        torch._dynamo.reset()
        counters.clear()
        cfg = make_config(f"model={model}", f"model.n_layers={layers}", "model.dropout=0.1").model
        rng = model_parallel_rng(0)
        gpt = GPT(cfg, rng=rng)
        init_weights(gpt, cfg, 0)
        compile_blocks(gpt, torch.device("cpu"))
        x = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
        after = []
        for step in range(2):
            with rng.context(step, range(2)):
                gpt(x, targets=x).backward()
            after.append(counters["stats"]["unique_graphs"])
        return after

    two = graphs(2)
    assert two[0] > 0 and two[1] == two[0]  # the second step compiles nothing (RoPE's per-device copy once did)
    assert graphs(6) == two


def test_compile_auto_compiles_on_cuda_and_stays_eager_on_a_cpu() -> None:
    from trident.config import Config
    from trident.models.compile import compiles

    assert Config().train.compile == "auto"
    assert compiles("auto", torch.device("cuda")) and not compiles("auto", torch.device("cpu"))
    assert compiles("True", torch.device("cpu")) and compiles(True, torch.device("cpu"))  # Hydra's true, as a str
    assert not compiles("false", torch.device("cuda")) and not compiles(False, torch.device("cuda"))
