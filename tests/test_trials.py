"""The layouts the comparison tools (tools/layout_matrix.py, tools/bench.py) take: their short forms, and the
validator's verdict before anything is launched."""

from __future__ import annotations

import pytest

from tests.conftest import REPO
from trident.trials import expand, plan


def test_short_forms_expand_to_train_overrides():
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


def test_a_layout_is_planned_with_its_world_size_and_refused_with_the_validators_line():
    ok = plan(REPO, "dp=2 tp=2 sp", ["model=gpt-tiny"])
    assert ok.refused is None and ok.world == 4 and ok.config.parallel.sequence_parallel
    bad = plan(REPO, "dp=2 tp=3", ["model=gpt-tiny"])
    assert bad.world == 6 and bad.refused.startswith("model.n_heads=4 is not divisible by parallel.tp=3; use ")
    unknown = plan(REPO, "parallel.widths=3", ["model=gpt-tiny"])
    assert unknown.refused.startswith("Could not override 'parallel.widths'")
