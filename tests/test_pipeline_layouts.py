"""Pipeline layouts give the one-process loss curve of the same seed, and a checkpoint moves between pp sizes.

gpt-tiny with 4 layers (8 for the interleaved layouts that need them) and 12 sequences a step, so the
micro-batch counts (6 at mbs 2, 3 at pp=2 x dp=2) are not multiples of every pp: the interleaved schedule's
M % P != 0 and M < P cases run too. Each run validates at its last step, so forward_only is checked as well.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers.layouts import assert_same_curve, tiny, train_in_process
from trident_dev.consolidated import read_model_tensors
from trident_dev.curves import REL

pytestmark = pytest.mark.multiprocess


def _base(dataset, layers: int, *extra: str) -> list[str]:
    return tiny(
        dataset,
        "train.steps=4",
        "train.global_batch_size=12",
        "train.micro_batch_size=2",
        f"model.n_layers={layers}",
        *extra,
    )


@pytest.fixture
def reference(tiny_dataset, references) -> dict[int, list[dict]]:
    """The one-process runs, by layer count."""
    return {layers: references.history(_base(tiny_dataset, layers)) for layers in (4, 8)}


ZB_V = ["parallel.vpp=2", "parallel.schedule=zb-v"]
LAYOUTS = [
    # (world, layers, overrides)
    pytest.param(2, 4, ["parallel.pp=2", "parallel.schedule=gpipe"], id="pp2-gpipe"),
    # pp=2 under 1f1b (the default schedule) is the saving run of the checkpoint test below.
    pytest.param(
        2,
        4,
        ["parallel.pp=2", "parallel.schedule=zb-h1", "train.activation_checkpointing=full"],
        id="pp2-zb-h1-recompute",
    ),
    pytest.param(2, 4, ["parallel.pp=2", "parallel.vpp=2"], id="pp2-vpp2"),
    pytest.param(4, 4, ["parallel.pp=4", "parallel.schedule=gpipe"], id="pp4-gpipe"),
    pytest.param(4, 4, ["parallel.pp=4", "parallel.schedule=1f1b"], id="pp4-1f1b"),
    pytest.param(4, 4, ["parallel.pp=4", "parallel.schedule=zb-h1"], id="pp4-zb-h1"),
    pytest.param(
        2, 8, ["parallel.pp=2", "parallel.vpp=4", "train.micro_batch_size=4"], id="pp2-vpp4-M3"
    ),  # M=3: not a multiple of pp
    pytest.param(4, 8, ["parallel.pp=4", "parallel.vpp=2", "train.micro_batch_size=6"], id="pp4-vpp2-M2"),  # M=2 < pp
    pytest.param(4, 4, ["parallel.pp=2", "parallel.dp=2"], id="pp2-dp2"),  # M=3 per dp rank
    # dp under the schedules whose chunks reduce at different points (each chunk after its last backward or W)
    pytest.param(4, 4, ["parallel.pp=2", "parallel.dp=2", "parallel.schedule=zb-h1"], id="pp2-dp2-zb-h1"),
    pytest.param(
        4, 4, ["parallel.pp=2", "parallel.dp=2", "parallel.vpp=2", "parallel.zero=2"], id="pp2-dp2-vpp2-zero2"
    ),
    pytest.param(
        4,
        4,
        ["parallel.pp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "model.vocab_size=515"],
        id="pp2-tp2-sp",
    ),
    # zb-v: the tied embedding and its copy on one rank (stages 0 and 2P - 1), the V's turn a local message.
    # pp=2 under zb-v is the saving run of the checkpoint test below; here M=6 < 2P - 1 = 7 at pp=4.
    pytest.param(4, 8, ["parallel.pp=4", *ZB_V], id="pp4-zb-v-M6"),
    pytest.param(
        4,
        4,
        ["parallel.pp=2", *ZB_V, "parallel.tp=2", "parallel.sequence_parallel=true", "model.vocab_size=515"],
        id="pp2-zb-v-tp2-sp",
    ),
    pytest.param(4, 4, ["parallel.pp=2", *ZB_V, "parallel.dp=2", "parallel.zero=1"], id="pp2-zb-v-dp2-zero1"),
    pytest.param(4, 4, ["parallel.pp=2", *ZB_V, "parallel.dp=2", "parallel.zero=2"], id="pp2-zb-v-dp2-zero2"),
]


@pytest.mark.parametrize("world,layers,extra", LAYOUTS)
def test_pipeline_gives_the_one_process_curve(tiny_dataset, tmp_path, references, reference, world, layers, extra):
    if "model.vocab_size=515" in extra:  # tp: a vocab no tp divides, so the padded head is exercised too
        ref = references.history(_base(tiny_dataset, layers, "model.vocab_size=515"))
    else:
        ref = reference[layers]
    histories = train_in_process(tmp_path / "run", _base(tiny_dataset, layers, *extra), world=world)
    assert len(histories) == world
    for history in histories:  # every rank, every stage, knows the loss, the global norm and the val loss
        assert_same_curve(ref, history)


def test_a_pp2_checkpoint_resumes_at_pp1_and_pp4_with_the_uninterrupted_losses(tiny_dataset, tmp_path, reference):
    saved = tmp_path / "pp2"
    histories = train_in_process(saved, _base(tiny_dataset, 4, "parallel.pp=2", "checkpoint.every=2"), world=2)
    assert len(histories) == 2
    for history in histories:  # every stage knows the loss, the global norm and the val loss
        assert_same_curve(reference[4], history)
    checkpoint = saved / "checkpoints" / "step_00000002"
    for name, pp, extra in (("pp1", 1, []), ("pp4", 4, []), ("pp2-zb-v", 2, ZB_V)):  # 1f1b's stages into a V too
        resumed = train_in_process(
            tmp_path / name,
            _base(tiny_dataset, 4, f"parallel.pp={pp}", *extra, f"checkpoint.resume={checkpoint}"),
            world=pp,
        )
        for rows in resumed:
            assert_same_curve(histories[-1][2:], rows)


def test_a_zb_v_checkpoint_resumes_under_1f1b_with_the_uninterrupted_losses(
    tiny_dataset, tmp_path, references, reference
):
    """pp=2 under zb-v (rank 0 holds stages 0 and 3, the tied embedding and its copy) gives the one-process curve
    and final weights; its checkpoint resumes under 1f1b (stages 0-1 on rank 0) with the uninterrupted losses."""
    saved = tmp_path / "zb-v"
    histories = train_in_process(saved, _base(tiny_dataset, 4, "parallel.pp=2", *ZB_V, "checkpoint.every=2"), world=2)
    for history in histories:
        assert_same_curve(reference[4], history)
    final = "checkpoints/step_00000004"
    want = read_model_tensors(references.run_dir(_base(tiny_dataset, 4)) / final)
    got = read_model_tensors(saved / final)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=REL, atol=1e-6, msg=name)
    resumed = train_in_process(
        tmp_path / "1f1b",
        _base(tiny_dataset, 4, "parallel.pp=2", f"checkpoint.resume={saved / 'checkpoints' / 'step_00000002'}"),
        world=2,
    )
    for rows in resumed:
        assert_same_curve(histories[0][2:], rows)
