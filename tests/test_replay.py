"""``train.replay_every`` (trident/replay.py): a healthy run's replays agree bit for bit and change nothing (the same
losses as the run without them, MoE routing statistics included); one bit flipped in one rank's gradient by a
test-only hook during a replay is named with its rank and step, and the run stops with exit code 5, or with
``train.replay_action=warn`` says so and goes on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO
from tests.helpers.layouts import assert_same_curve, four_layers, make_config, train_in_process
from train import run
from trident.config import compose_config
from trident.errors import ConfigError
from trident.replay import Replay, ReplayMismatch, grad_digest
from trident_dev.ranks import run_distributed


def test_the_digest_sees_one_flipped_bit_and_the_keys_are_checked() -> None:
    t = torch.randn(1000)
    before = grad_digest([t, t.bfloat16()])
    t.view(torch.int32)[123] ^= 1 << 17
    after = grad_digest([t, t.bfloat16()])
    assert before[0] != after[0] and len(after) == 2
    with pytest.raises(ConfigError, match=r"^train.replay_action=maybe must be stop or warn$"):
        from trident.config import validate

        validate(compose_config(REPO / "conf", ["train.replay_action=maybe"]), 1)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("extra", "world"),
    [
        (["parallel.tp=2", "parallel.pp=2"], 4),
        (["model=moe-tiny", "model.moe.bias_update_rate=0.01", "parallel.dp=2"], 2),
        (["parallel.dp=2", "parallel.zero=3", "train.micro_batch_size=4"], 2),  # staging freed between passes
    ],
    ids=["tp2-pp2", "moe-dp2", "zero3-dp2"],
)
def test_replays_of_a_healthy_run_agree_and_change_nothing(
    tiny_dataset: Path, tmp_path: Path, extra: list[str], world: int
) -> None:
    base = [*four_layers(tiny_dataset, 4, "train.eval_every=0"), *extra]
    plain = train_in_process(tmp_path / "plain", base, world=world)
    replayed = train_in_process(tmp_path / "replayed", [*base, "train.replay_every=1"], world=world)
    for a, b in zip(plain, replayed, strict=True):
        assert_same_curve(a, b, rel=0.0)
        assert [r.get("moe/load/0") for r in a] == [r.get("moe/load/0") for r in b]


def _flipping_rank(rank: int, world: int, cfg, run_dir: Path, flip_rank: int) -> str | None:
    """A run in which global rank ``flip_rank`` flips one bit of its first gradient buffer during step 2's replay."""
    real = Replay.check

    def check(self: Replay, step: int, loss_sum: torch.Tensor, again) -> torch.Tensor:
        def flipped() -> torch.Tensor:
            out = again()
            if step == 1 and dist.get_rank() == flip_rank:
                buffer = next(g for g in self.grads() if g.numel())
                buffer.reshape(-1).view(torch.uint8)[7] ^= 0x04
            return out

        return real(self, step, loss_sum, flipped)

    Replay.check = check
    try:
        run(cfg, run_dir)
    except ReplayMismatch as e:
        return str(e)
    finally:
        Replay.check = real
    return None


@pytest.mark.multiprocess
def test_a_bit_flipped_in_one_ranks_gradient_is_named_with_its_rank_and_step(
    tiny_dataset: Path, tmp_path: Path
) -> None:
    base = [*four_layers(tiny_dataset, 4, "train.eval_every=0"), "parallel.tp=2", "parallel.pp=2"]
    cfg = make_config(*base, "train.replay_every=1")
    lines = run_distributed(_flipping_rank, 4, cfg, tmp_path / "stop", 3, timeout_s=300)
    assert len(set(lines)) == 1 and lines[0] is not None, lines  # every rank stops with the same line
    assert lines[0].startswith("train.replay_every: step 2 computed twice from the same weights and batch differed on ")
    assert "rank 3: gradient buffer 0 of " in lines[0] and "rank 0" not in lines[0] and "rank 2" not in lines[0]
    assert lines[0].endswith("(a device miscomputed; the step was not applied)")
    assert ReplayMismatch("x").exit_code == 5

    warned = run_distributed(
        _flipping_rank, 4, make_config(*base, "train.replay_every=1", "train.replay_action=warn"), tmp_path / "warn", 3
    )
    assert warned == [None] * 4  # said, and trained on to the end
    assert (tmp_path / "warn" / "checkpoints" / "step_00000004").is_dir()


def test_the_planner_adds_one_more_forward_and_backward_every_n_steps() -> None:
    from trident.plan.planner import predict
    from trident.plan.profile import DATASHEETS

    base = ["model=gpt-tiny", "train.global_batch_size=16", "train.micro_batch_size=2"]
    plain = predict(compose_config(REPO / "conf", base), 2, DATASHEETS["h100"]).time
    every2 = predict(compose_config(REPO / "conf", [*base, "train.replay_every=2"]), 2, DATASHEETS["h100"]).time
    assert every2.step == pytest.approx(plain.step + (plain.step - plain.optimizer) / 2, rel=1e-9)
    assert plain.optimizer > 0 and every2.step > plain.step
