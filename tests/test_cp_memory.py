"""The estimator under context parallelism: what a cp rank's forward keeps for backward, measured on real gloo ranks,
equals the prediction to the byte, for each exchange, with and without packed documents, for a GPT-2 and a
grouped-query Llama block, and in training with dropout: the trace (trident/memory/trace.py ``chunk_bytes``) under
every recomputation policy, and trident/memory/activations.py's formula, which the estimator uses for cp, without
recomputation (under recomputation it overcounts: trace.py says by how much)."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers import REPO
from trident.config import ModelConfig, compose_config
from trident.layout import Layout
from trident.memory.activations import POLICIES, activation_bytes
from trident.memory.measure import held_by_forward
from trident.memory.trace import chunk_bytes
from trident.models.checkpointing import apply_activation_checkpointing, parse_label
from trident.models.gpt import GPT, init_weights
from trident.parallel.batch import Batch, document_ids
from trident.parallel.context.attention import CP_COMMS
from trident.parallel.context.batch import context_part
from trident.parallel.precision import autocast
from trident.parallel.random import RNGTracker
from trident.peak import PRECISION_DTYPES
from trident_dev.ranks import run_distributed

EOS, BATCH = 0, 2


def _held(
    cfg: ModelConfig, group: dist.ProcessGroup, comm: str, documents: bool, precision: str, policy: str = "none"
) -> int:
    rank, cp = dist.get_rank(group), dist.get_world_size(group)
    rng = RNGTracker(0)
    model = GPT(cfg, cp_group=group, cp_comm=comm, rng=rng)
    init_weights(model, cfg, 0)
    model.to(PRECISION_DTYPES[precision])
    name, modules, every = parse_label(policy)
    apply_activation_checkpointing(model, name, modules=modules, every=every)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(1, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
    y = torch.randint(0, cfg.vocab_size, (BATCH, cfg.seq_len), generator=g)
    ids = None
    if documents:  # an eos every 7 tokens: documents crossing the chunks of every rank
        x[:, ::7] = EOS
        ids = document_ids(x, EOS)
    batch = context_part(Batch(x, y, torch.arange(BATCH), 0, ids), cp, rank)

    def forward() -> torch.Tensor:
        with autocast(precision, x.device), rng.context(0, batch.sample_ids):
            b = batch
            kwargs = dict(documents=b.documents, positions=b.positions, index=b.index, keys=b.keys)
            loss = model(b.tokens, **kwargs, targets=b.targets)
        # gloo's worker thread lets go of a collective's buffers a moment after the call returns (see
        # parallel/groups.py): give it that moment, or a transient buffer would count as kept.
        time.sleep(0.1)
        return loss

    rope = [m.inv_freq for m in model.modules() if getattr(m, "inv_freq", None) is not None]
    inputs = [t for t in (batch.tokens, batch.targets, batch.documents, batch.positions, batch.index) if t is not None]
    _, held = held_by_forward(forward, [*model.parameters(), *rope, *inputs])
    return held


def _cases(cp: int, models: dict[str, ModelConfig]):
    for name, cfg in models.items():
        # With dropout training spells the probabilities out over gathered keys, whatever the exchange.
        for comm in CP_COMMS if cfg.dropout == 0 else CP_COMMS[:1]:
            for documents in (False, True):
                for precision in ("fp32", "bf16"):
                    layout = Layout(
                        cp=cp, cp_comm=comm, micro_batch_size=BATCH, device="cpu", document_mask=documents,
                        precision=precision,
                    )  # fmt: skip
                    yield f"{name} {comm} documents={documents} {precision}", cfg, layout


def _swept(cp: int, layout: Layout) -> bool:
    """Whether the trace is checked, under every recomputation policy, for this case: at cp 2, in bf16 with packed
    documents (the masks and the casts), for every model and exchange (every case: about a minute more)."""
    return cp == 2 and layout.precision == "bf16" and layout.document_mask


def _check(rank: int, cp: int, models: dict[str, ModelConfig], traced: dict[tuple[str, str], int]) -> None:
    group = dist.new_group(list(range(cp)))
    for case, cfg, layout in _cases(cp, models):
        held = _held(cfg, group, layout.cp_comm, layout.document_mask, layout.precision)
        predicted = activation_bytes(cfg, layout, 0, "none", traced=False)
        assert held == predicted, f"{case}: measured {held}, the formula's {predicted}"
        for policy in POLICIES if _swept(cp, layout) else ():
            held = _held(cfg, group, layout.cp_comm, layout.document_mask, layout.precision, policy)
            assert held == traced[case, policy], f"{case} {policy}: measured {held}, traced {traced[case, policy]}"


@pytest.mark.multiprocess
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_activations_match_the_prediction_to_the_byte(cp):
    models = {}
    for preset in ("gpt-tiny", "llama-tiny"):
        cfg = compose_config(REPO / "conf", [f"model={preset}"]).model
        models[preset] = dataclasses.replace(cfg, n_layers=2)
    models["llama-tiny dropout"] = dataclasses.replace(models["llama-tiny"], dropout=0.1)
    models["gpt-tiny dropout"] = dataclasses.replace(models["gpt-tiny"], dropout=0.1)
    # Traced here, once (each rank would trace the same again).
    traced = {
        (case, p): chunk_bytes(cfg, layout, 0, p)  # the trace of the one chunk (the estimator's is the formula)
        for case, cfg, layout in _cases(cp, models)
        if _swept(cp, layout)
        for p in POLICIES
    }
    run_distributed(_check, cp, models, traced)
