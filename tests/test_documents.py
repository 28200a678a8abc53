"""Packed documents (data.document_mask): attention stays inside each document and positions restart at each, so a
packed window's loss and gradients are exactly the sum of its documents' computed one by one."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from trident.config import ModelConfig
from trident.models.documents import Documents
from trident.models.gpt import GPT, init_weights
from trident.parallel.batch import document_ids

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

EOS = 1
GPT2 = ModelConfig(name="g", n_layers=2, d_model=32, n_heads=4, seq_len=32, vocab_size=50)
LLAMA = dataclasses.replace(
    GPT2, norm="rmsnorm", mlp="swiglu", position="rope", n_kv_heads=2, d_ff=48, bias=False, tie_embeddings=False
)


def packed_windows(t: int = 32) -> torch.Tensor:
    """Two windows cut from a stream of documents of uneven lengths, each document followed by eos; the first
    window starts mid-document, the second with an eos."""
    g = torch.Generator().manual_seed(0)
    stream = []
    for n in (7, 3, 12, 1, 9, 5, 11, 2, 8):
        stream += torch.randint(2, GPT2.vocab_size, (n,), generator=g).tolist() + [EOS]
    stream = torch.tensor(stream)
    return torch.stack([stream[4 : 4 + t + 1], stream[10 : 10 + t + 1]])  # inputs and targets: t + 1 tokens


def test_document_ids_positions_and_mask():
    tokens = torch.tensor([[5, 6, EOS, 7, 8, EOS, 9], [EOS, 2, 3, EOS, EOS, 4, 5]])
    ids = document_ids(tokens, EOS)
    assert ids.tolist() == [[0, 0, 1, 1, 1, 2, 2], [0, 0, 0, 1, 2, 2, 2]]
    docs = Documents.of(ids, "dense")
    assert docs.positions.tolist() == [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 0, 0, 1, 2]]
    for b in range(2):
        for i in range(7):
            for j in range(7):
                assert bool(docs.mask[b, 0, i, j]) == (j <= i and ids[b, i] == ids[b, j])


@pytest.mark.parametrize("gqa", [True, False])
def test_flex_attention_and_the_dense_mask_agree(gqa):
    ids = document_ids(packed_windows()[:, :-1], EOS)
    q = torch.randn(2, 4, 32, 8)
    k, v = torch.randn(2, 2, 2 if gqa else 4, 32, 8)
    dense, flex = Documents.of(ids, "dense"), Documents.of(ids, "flex")
    assert torch.allclose(dense.attention(q, k, v), flex.attention(q, k, v), atol=1e-5)


@pytest.mark.parametrize("cfg", [GPT2, LLAMA], ids=["gpt2-learned", "llama-rope-gqa"])
def test_a_packed_windows_loss_and_gradients_are_its_documents_computed_one_by_one(cfg):
    window = packed_windows()
    x, y = window[:, :-1], window[:, 1:]
    ids = document_ids(x, EOS)
    packed, alone = GPT(cfg), GPT(cfg)
    init_weights(packed, dataclasses.replace(cfg, init_std=0.2), 0)  # weights large enough that attention is not
    init_weights(alone, dataclasses.replace(cfg, init_std=0.2), 0)  # near uniform: the mask then shows in the loss
    loss = packed.loss_sum(packed(x, documents=ids), y)
    loss.backward()
    total = torch.zeros(())
    for b in range(x.shape[0]):
        for d in ids[b].unique():
            span = ids[b] == d
            total = total + alone.loss_sum(alone(x[b : b + 1, span]), y[b : b + 1, span])
    total.backward()
    assert torch.allclose(loss, total, rtol=1e-6), (loss.item(), total.item())
    for (name, p), q in zip(packed.named_parameters(), alone.parameters(), strict=True):
        scale = q.grad.abs().max()
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6 * scale), (name, (p.grad - q.grad).abs().max())
    unmasked = packed.loss_sum(packed(x), y)
    assert not torch.allclose(unmasked, loss, rtol=1e-3)  # the mask changes the loss: the comparison means something


def test_dropout_with_documents_keeps_the_mask():
    """Training with dropout spells the probabilities out: they are zero across documents."""
    from trident.models.gpt import causal_attention_probs

    ids = document_ids(packed_windows()[:, :-1], EOS)
    docs = Documents.of(ids, "dense")
    q, k = torch.randn(2, 2, 4, 32, 8)
    probs = causal_attention_probs(q, k, docs.mask)
    assert torch.all(probs[~docs.mask.expand_as(probs)] == 0)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 4, 32))


# --- training: data.document_mask under every parallelism gives one process's masked curve


FULL = "train.activation_checkpointing=full"
# Op-level selective recomputation of every second block: the first stage's block recomputed, the second's not.
SELECTIVE_EVERY_2 = ["train.activation_checkpointing=selective", "train.recompute_every=2"]


def _run(dataset, model: str, *extra: str) -> list[str]:
    from tests.helpers.layouts import tiny

    steps = ("train.steps=3", "train.micro_batch_size=4", "optim.lr=1e-2")
    return tiny(dataset, f"model={model}", "data.document_mask=true", *steps, *extra)


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "model,world,extra",
    [
        ("llama-tiny", 4, ["parallel.tp=2", "parallel.pp=2"]),
        ("gpt-tiny", 4, ["parallel.tp=2", "parallel.pp=2", "parallel.sequence_parallel=true", *SELECTIVE_EVERY_2]),
        ("llama-tiny", 2, ["parallel.pp=2", "parallel.vpp=2", "model.n_layers=4", FULL]),
    ],
    ids=["llama-tp2-pp2", "gpt-tp2-pp2-sp-selective-every2", "llama-interleaved-full-recompute"],
)
def test_document_masking_under_tp_and_pp_gives_the_one_process_curve(tiny_dataset, tmp_path, model, world, extra):
    from tests.helpers.layouts import assert_same_curve, train_in_process

    shape = [e for e in extra if e.startswith("model.")]
    (one,) = train_in_process(tmp_path / "one", _run(tiny_dataset, model, *shape))
    (unmasked,) = train_in_process(tmp_path / "plain", _run(tiny_dataset, model, *shape, "data.document_mask=false"))
    assert one[-1]["loss"] != pytest.approx(unmasked[-1]["loss"], rel=2e-5)  # the mask is in force (well past 1e-7)
    for history in train_in_process(tmp_path / "many", _run(tiny_dataset, model, *extra), world=world):
        assert_same_curve(one, history)
