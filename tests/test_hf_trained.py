"""A released family's model in, trained, and out again: a transformers-written Qwen3, Qwen3-MoE, Mixtral or OLMoE
(tests/helpers/hf_models.py: heads of head_dim 32 on a width of 64 where the family has them, 8 experts, 4 layers)
starts a real tp=2 run (``checkpoint.init_from``: each rank reads its heads, its share of OLMoE's projection
norms, its experts) at transformers' own loss on the first batch, trains 2 steps, and its checkpoint's export
loads in transformers with our logits and greedy tokens. One 2-rank run per family."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.helpers.hf_models import CLASSES, FAMILIES, greedy, hf_greedy, ours, prompts, saved
from tests.helpers.layouts import train_rank
from tests.helpers.tools import run_tool
from tests.test_init_from import adopted, first_batch, run_args
from trident_dev.consolidated import load_weights
from trident_dev.ranks import run_distributed


@pytest.mark.multiprocess
@pytest.mark.parametrize("family", FAMILIES)
def test_a_released_family_trains_at_tp2_and_exports_with_our_greedy_tokens(
    family, tiny_dataset, tmp_path, monkeypatch, capsys
):
    source = saved(family, tmp_path / "src")
    run = tmp_path / "run"
    cfg = adopted(run, run_args(tiny_dataset, "parallel.tp=2", "train.steps=2", f"checkpoint.init_from={source}"))
    histories = run_distributed(train_rank, 2, cfg, run, timeout_s=300)
    x, y = first_batch(cfg)
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
        expected = F.cross_entropy(hf(x).logits.flatten(0, 1).double(), y.flatten()).item()
    loss = histories[0][0]["loss"]
    assert abs(loss - expected) <= 1e-5 * expected, (loss, expected)

    checkpoint, out = run / "checkpoints" / "step_00000002", tmp_path / "hf"
    args = [str(checkpoint), "--to", "hf", "--out", str(out)]
    code, _, err = run_tool("convert_checkpoint", *args, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0, err
    exported, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()) and type(exported).__name__ == CLASSES[family], info
    model = ours(load_weights(checkpoint))
    with torch.no_grad():
        assert (model(x[:2]) - exported.eval()(x[:2]).logits).abs().max() <= 1e-5
    tokens = greedy(model, prompts(), 8)
    assert tokens == hf_greedy(exported, prompts(), 8)
    assert exported.config.to_dict().get("router_aux_loss_coef") == hf.config.to_dict().get("router_aux_loss_coef")
