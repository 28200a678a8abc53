"""train.compile=true: every block compiled with torch.compile gives the eager one-process curve under tensor and
sequence parallelism with activation checkpointing, and keeps the parameter names: a compiled run's checkpoint
resumes eagerly with the uninterrupted losses. GPT-2's block with dropout (its masks drawn in an eager island inside
the compiled block, and drawn again when the checkpoint that wraps the compiled block recomputes it), and Llama's
(RMSNorm, SwiGLU, RoPE, grouped kv heads) under op-level selective recomputation (its checkpoint wrapping the
compiled block, whose kept outputs the recomputation replays)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.layouts import assert_same_curve, tiny, train_in_process
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
