"""Checkpoints (trident/checkpoint/: manager, files, dcp, state, zero_state, consolidated): atomic publishing and
discovery, exact resume, resharding across tp and dp layouts, deduplicated writes, hostile files refused, and the
consolidated file the tools read.

Every run is built as train.py builds it (trident/build.py: model chunks, reducer, the ZeRO optimizer of every
stage, 0 included), on real gloo groups. Tensor comparisons are bit for bit. Optimizer state comes from steps on
synthetic gradients (each rank hands the reducer its block of one logical gradient, through a backward), and
AdamW is elementwise: a tp rank's masters and moments are exactly its blocks of the one-process ones, in any
process. Logical tensors are read back through the checkpoint's own key space (``MasterState``, ``MomentState``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trident.checkpoint.dcp as format_mod
import trident.checkpoint.files as files_mod
import trident_dev.consolidated as consolidated_mod
from tests.helpers.processes import tool_process
from tests.helpers.tools import run_tool
from trident.build import RunParts, build_checkpointer, build_parts, layout_of
from trident.checkpoint.dcp import METADATA_FILE, Sharded, read_metadata
from trident.checkpoint.files import (
    FORMAT,
    checkpoint_name,
    find_resume_path,
    list_checkpoints,
    new_temporary,
    prune_checkpoints,
    publish,
)
from trident.checkpoint.manager import Checkpointer, schedule_changes
from trident.checkpoint.zero_state import MasterState, MomentState
from trident.config import CheckpointConfig, Config, ModelConfig, OptimConfig, ParallelConfig, TrainConfig
from trident.errors import CheckpointError, DiskFullError
from trident.models.gpt import GPT
from trident.parallel.batch import Batch
from trident.parallel.groups import ProcessGroups, build_process_groups
from trident.parallel.layout import FlatLayout, Piece
from trident.parallel.placement import placement_of
from trident.parallel.topology import Topology
from trident.parallel.zero.optimizer import ZeroOptimizer
from trident_dev.consolidated import (
    ModelWeights,
    load_weights,
    read_consolidated,
    read_model_tensors,
    write_consolidated,
)
from trident_dev.ranks import run_distributed

LAYOUT = {"dp": 1, "tp": 1, "pp": 1}
LR = 1e-2


def tiny_cfg(n_layers: int = 2, vocab_size: int = 100, vocab_multiple: int = 64) -> ModelConfig:
    return ModelConfig(
        name="t",
        n_layers=n_layers,
        d_model=32,
        n_heads=4,
        seq_len=16,
        vocab_size=vocab_size,
        vocab_multiple=vocab_multiple,
    )


# vocab 10 pads to 16 rows in one process; over tp 2 it pads to 32: rank 0 holds the 10 real rows and 6 padding
# rows, rank 1 holds only padding. Uneven blocks, padding, and a rank with nothing to save.
TP_CFG = tiny_cfg(n_layers=1, vocab_size=10, vocab_multiple=16)


@dataclass
class Run:
    """One rank's model and optimizer, as train.py builds them."""

    cfg: Config
    groups: ProcessGroups
    parts: RunParts

    @property
    def model(self) -> GPT:
        (model,) = self.parts.chunks
        return model

    @property
    def zero(self) -> ZeroOptimizer:
        return self.parts.optimizer.zero


def build(groups: ProcessGroups, seed: int, model: ModelConfig | None = None, zero: int = 0, **optim: float) -> Run:
    """A run of ``model`` initialised from ``seed`` in the layout of ``groups``, through trident/build.py.

    No gradient clipping: the clip factor comes from a global norm that another layout sums in another order, so
    it could differ in its last bit, and a step on a synthetic gradient is then elementwise in every layout."""
    topo = groups.topology
    cfg = Config(
        model=model or tiny_cfg(),
        parallel=ParallelConfig(dp=topo.dp, tp=topo.tp, pp=topo.pp, zero=zero),
        train=TrainConfig(seed=seed, global_batch_size=8),
        optim=OptimConfig(**{"lr": LR, "grad_clip": 0.0, **optim}),
    )
    return Run(cfg, groups, build_parts(cfg, layout_of(cfg, groups), groups, torch.device("cpu")))


def fake_step(run: Run, i: int) -> None:
    """A step on a synthetic gradient: each parameter's block of one logical gradient per (step, name).

    The gradient reaches the reducer as a model's does, through a backward (with the parameters as its roots), each
    dp rank handing in an equal share (1/dp, exact for a power of two, and so is the sum of the shares)."""
    dp = run.groups.dp_size
    assert dp & (dp - 1) == 0, "only a power-of-two dp splits a gradient exactly"
    params = dict(run.model.named_parameters())
    grads = []
    for name, p in params.items():
        gen = torch.Generator().manual_seed(i * 1_000_003 + zlib.crc32(name.encode()))
        grads.append(placement_of(p).shard(torch.randn(placement_of(p).shape, generator=gen)) / dp)
    optimizer = run.parts.optimizer
    optimizer.reducer.set_sync(True)
    torch.autograd.backward(list(params.values()), grads)
    optimizer.reducer.finish()
    _, skipped = optimizer.step.step(LR)
    assert not skipped


def train_step(run: Run, i: int) -> None:
    """A real step: forward and backward of one batch through the run's runner, then the optimizer's step."""
    m = run.cfg.model
    gen = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=gen)
    y = torch.randint(0, m.vocab_size, (2, m.seq_len), generator=gen)
    run.parts.runner.forward_backward([Batch(x, y, torch.arange(2), i)], run.model.loss_sum, 1 / y.numel())
    _, skipped = run.parts.optimizer.step.step(LR)
    assert not skipped


def reference(groups: ProcessGroups, steps: int = 2) -> Run:
    """The one-process run every tp/dp layout must match: seed 1, ``steps`` synthetic steps."""
    run = build(groups, 1, TP_CFG)
    for i in range(steps):
        fake_step(run, i)
    # Every real element got its gradients: the comparisons below compare stepped state, not zeros.
    squares = {key: value for key, value in logical(run).items() if key.endswith("/exp_avg_sq")}
    assert len(squares) == len(list(run.model.parameters())) and all(bool((v > 0).all()) for v in squares.values())
    return run


def saved_state(run: Run) -> dict[str, Sharded]:
    """The boxes this rank saves (keys without ``model/`` and ``optim/``): the optimizer's fp32 masters under the
    parameters' names, its AdamW state under ``<name>/exp_avg``, ``<name>/exp_avg_sq``, ``<name>/step``."""
    params = dict(run.model.named_parameters())
    return {**MasterState(run.zero, params).sharded_state(), **MomentState(run.zero, params).sharded_state()}


def box(offsets: tuple[int, ...], sizes: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))


def logical(run: Run) -> dict[str, torch.Tensor]:
    """Every weight and AdamW state tensor of a one-process run as its logical tensor (padding dropped), keyed
    ``name`` / ``name/state``: its saved boxes put together, which must cover each tensor exactly once."""
    assert run.groups.topology == Topology(dp=1, pp=1, tp=1), "only a one-process run holds whole logical tensors"
    out = {}
    for key, sharded in saved_state(run).items():
        full = torch.full(sharded.shape, float("nan"))
        for offsets, values in sharded.boxes:
            full[box(offsets, values.shape)] = values
        assert sum(v.numel() for _, v in sharded.boxes) == full.numel() and not full.isnan().any(), key
        out[key] = full
    return out


def piece_of(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    """A piece's elements of a logical tensor: its range of the flattened tp block (padding zero)."""
    return placement_of(piece.param).shard(full).reshape(-1)[piece.start : piece.stop]


def assert_holds_blocks_of(run: Run, expected: dict[str, torch.Tensor]) -> None:
    """This rank's parameters, and each piece of the ZeRO optimizer's masters and AdamW state, are exactly their
    blocks of the expected logical tensors (tp padding zero); so is every box it saves."""
    names = {p: name for name, p in run.model.named_parameters()}
    for p, name in names.items():
        assert torch.equal(p.detach(), placement_of(p).shard(expected[name])), name
    for seg, piece in run.zero.pieces():
        name = names[piece.param]
        master = run.zero.master(piece)
        assert torch.equal(master, piece_of(expected[name], piece)), name
        state = run.zero.optimizer_of(seg, piece).state[master]
        assert set(state) == {"step", "exp_avg", "exp_avg_sq"}, name
        for kind, value in state.items():
            want = expected[f"{name}/{kind}"]
            assert torch.equal(value, want if value.dim() == 0 else piece_of(want, piece)), f"{name}/{kind}"
    saved = saved_state(run)
    # A rank steps a piece of every parameter unless ZeRO shards the optimizer over dp.
    assert saved.keys() <= expected.keys() and (run.zero.dp_sharded or saved.keys() == expected.keys())
    for key, sharded in saved.items():
        assert sharded.shape == tuple(expected[key].shape), key
        for offsets, values in sharded.boxes:
            assert torch.equal(values, expected[key][box(offsets, values.shape)]), key


def assert_same_state(a: Run, b: Run) -> None:
    """Two runs of one layout hold the same parameters, masters and AdamW state, bit for bit."""
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters(), strict=True):
        assert torch.equal(p, q), name
    sa, sb = saved_state(a), saved_state(b)
    assert sa.keys() == sb.keys()
    for key in sa:
        assert [o for o, _ in sa[key].boxes] == [o for o, _ in sb[key].boxes], key
        for (_, u), (_, v) in zip(sa[key].boxes, sb[key].boxes, strict=True):
            assert torch.equal(u, v), key


class FakeTrainer:
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step, "global_batch_size": 8}

    def load_state_dict(self, state: dict) -> None:
        if state["global_batch_size"] != 8:
            raise CheckpointError("global batch differs")
        self.step = state["step"]


def checkpointer(
    root: Path, run: Run, resume: str = "auto", keep_last: int = 0, tokenizer: Path | None = None
) -> Checkpointer:
    """The run's checkpointer, as train.py builds it (the run's config is its config.json)."""
    cfg = dataclasses.replace(run.cfg, checkpoint=CheckpointConfig(every=0, keep_last=keep_last, resume=resume))
    return build_checkpointer(cfg, run.groups, run.parts, root, tokenizer)


def fake_checkpoint(root: Path, step: int, **meta_layout) -> Path:
    """A complete checkpoint as discovery sees it: published, with meta.json; no tensor data."""
    return publish(new_temporary(root, step), step, {"config.json": {"step": step}}, None, meta_layout or LAYOUT)


def leftovers(root: Path) -> list[str]:
    """Hidden entries (temporary or swapped-aside directories) under ``root``."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# --- publishing and discovery -----------------------------------------------------------------------------


def test_publish_writes_small_files_and_meta_last(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"\x00\x01sentencepiece-bytes\xff")
    root = tmp_path / "ckpts"  # does not exist yet
    tmp = new_temporary(root, 40)
    assert tmp.name.startswith(".step_00000040.tmp-") and list_checkpoints(root) == []
    path = publish(tmp, 40, {"trainer.json": {"step": 40}, "config.json": {"a": [1, 2]}}, tokenizer, {"dp": 2})

    assert path == root / "step_00000040" == root / checkpoint_name(40)
    assert sorted(p.name for p in path.iterdir()) == ["config.json", "meta.json", "tokenizer.model", "trainer.json"]
    assert (path / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 40 and meta["format"] == FORMAT and meta["layout"] == {"dp": 2}
    assert json.loads((path / "config.json").read_text()) == {"a": [1, 2]}
    assert leftovers(root) == []


def test_publish_refuses_non_json_state_and_publishes_nothing(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="trainer.json must hold plain JSON values"):
        publish(new_temporary(tmp_path, 1), 1, {"trainer.json": {"t": torch.zeros(1)}}, None, LAYOUT)
    assert list(tmp_path.iterdir()) == []


def test_list_checkpoints_skips_partial_and_sorts_numerically(tmp_path: Path) -> None:
    for step in (100, 9, 20):
        fake_checkpoint(tmp_path, step)
    # A crashed save's temporary directory, even one that got as far as meta.json.
    tmp = tmp_path / ".step_00000500.tmp-123-abcdef01"
    tmp.mkdir()
    (tmp / "meta.json").write_text("{}")
    # A step directory without meta.json (e.g. copied by hand, incomplete).
    (tmp_path / "step_00000300").mkdir()
    (tmp_path / "step_00000300" / METADATA_FILE).write_bytes(b"")
    # Names that are close but not a checkpoint.
    for name in ("step_400", "step_000004000", "notes.txt"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "meta.json").write_text("{}")

    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000009", "step_00000020", "step_00000100"]
    assert find_resume_path("auto", tmp_path) == tmp_path / "step_00000100"


def test_find_resume_path_modes(tmp_path: Path) -> None:
    root = tmp_path / "ckpts"
    assert list_checkpoints(root) == []
    assert find_resume_path("auto", root) is None  # root does not exist
    root.mkdir()
    assert find_resume_path("auto", root) is None  # root is empty
    (root / ".step_00000001.tmp-1-deadbeef").mkdir()
    assert find_resume_path("auto", root) is None  # only a leftover

    first, second = fake_checkpoint(root, 5), fake_checkpoint(root, 12)
    assert find_resume_path("none", root) is None
    assert find_resume_path("auto", root) == second
    # An explicit checkpoint, even an older one, and a directory holding checkpoints (its newest).
    assert find_resume_path(str(first), tmp_path / "elsewhere") == first
    assert find_resume_path(str(root), tmp_path / "elsewhere") == second


@pytest.mark.parametrize("bad", ["missing", "empty_dir", "partial", "file"])
def test_find_resume_path_bad_path_names_the_key(tmp_path: Path, bad: str) -> None:
    target = tmp_path / bad
    if bad == "empty_dir":
        target.mkdir()
    elif bad == "partial":
        target = tmp_path / "step_00000007"
        target.mkdir()
        (target / "__0_0.distcp").write_bytes(b"x")
    elif bad == "file":
        target.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume=") as info:
        find_resume_path(str(target), tmp_path)
    assert str(target) in str(info.value)
    with pytest.raises(CheckpointError, match=r"^my\.key="):
        find_resume_path(str(target), tmp_path, what="my.key")


def test_failure_before_rename_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    """A failure at the very end (fsync of the finished temporary directory) must not publish it."""

    def failing_fsync(path: Path) -> None:
        raise OSError("fsync failed")

    monkeypatch.setattr(files_mod, "_fsync_dir", failing_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        fake_checkpoint(tmp_path, 3)
    assert list(tmp_path.iterdir()) == []
    assert find_resume_path("auto", tmp_path) is None


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"old tokenizer")
    root = tmp_path / "ckpts"
    first = publish(new_temporary(root, 8), 8, {"config.json": {"seed": 1}}, tokenizer, LAYOUT)
    second = publish(new_temporary(root, 8), 8, {"config.json": {"seed": 2}}, None, LAYOUT)

    assert first == second
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008"]  # no .old-* or .tmp-* left
    assert json.loads((second / "config.json").read_text()) == {"seed": 2}
    assert not (second / "tokenizer.model").exists()  # nothing of the old one survives


@pytest.mark.parametrize(("keep", "expected"), [(0, [1, 2, 3, 10]), (2, [3, 10]), (1, [10]), (10, [1, 2, 3, 10])])
def test_prune_keeps_newest(tmp_path: Path, keep: int, expected: list[int]) -> None:
    for step in (10, 1, 3, 2):
        fake_checkpoint(tmp_path, step)
    partial = tmp_path / ".step_00000011.tmp-9-00000000"
    partial.mkdir()
    prune_checkpoints(tmp_path, keep, current_step=10)
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_name(s) for s in expected]
    assert partial.is_dir()  # only complete checkpoints count and are removed


def test_prune_never_removes_newer_than_current(tmp_path: Path) -> None:
    """After resuming from an older checkpoint, later ones (from the interrupted run) are left alone."""
    for step in (1, 2, 3, 8, 9):
        fake_checkpoint(tmp_path, step)
    prune_checkpoints(tmp_path, 1, current_step=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000008", "step_00000009"]


def test_schedule_changes_names_each_changed_setting() -> None:
    saved = {"train": {"steps": 100, "seed": 1}, "optim": {"lr": 1e-3, "min_lr": 1e-4}, "model": {"d_model": 8}}
    assert schedule_changes(saved, saved) == []
    current = {"train": {"steps": 200, "seed": 1}, "optim": {"lr": 1e-3, "min_lr": 0.0}, "model": {"d_model": 8}}
    assert schedule_changes(saved, current) == ["train.steps 100 -> 200", "optim.min_lr 0.0001 -> 0.0"]


# --- one process: exact resume, by-name optimizer state, refusals ------------------------------------------


def storages(run: Run) -> set[int]:
    """The storages holding a run's model state (parameters, gradients, masters, AdamW state)."""
    tensors = [t for ts in run.parts.optimizer.step.model_state_tensors().values() for t in ts]
    return {t.untyped_storage().data_ptr() for t in tensors if t.untyped_storage().nbytes() > 0}


def test_resume_is_exact_and_keeps_this_runs_hyper_parameters(one_process, tmp_path: Path, capsys) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"tokenizer bytes")
    root = tmp_path / "ckpts"
    run = build(one_process, 1)
    for i in range(2):
        train_step(run, i)
    torch.manual_seed(123)
    rng_at_save = torch.get_rng_state()
    saver = checkpointer(root, run, tokenizer=tokenizer)
    assert saver.maybe_resume(FakeTrainer()) is None  # nothing saved yet
    saver.save(FakeTrainer(step=2))

    path = root / "step_00000002"
    assert list_checkpoints(root) == [path] and leftovers(root) == []
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [METADATA_FILE, "__0_0.distcp", "trainer.json", "config.json", "tokenizer.model", "meta.json"]
    )
    assert json.loads((path / "meta.json").read_text())["layout"] == LAYOUT
    assert json.loads((path / "trainer.json").read_text()) == {"step": 2, "global_batch_size": 8}
    assert json.loads((path / "config.json").read_text()) == dataclasses.asdict(run.cfg)
    # Logical tensors: the embedding without its padding rows (100 of 128).
    saved = read_model_tensors(path)
    assert saved["wte.weight"].shape == (100, 32)
    assert torch.equal(saved["wte.weight"], run.model.wte.weight.detach()[:100])
    # The saved optimizer state is AdamW's, by parameter name, for every parameter.
    keys = set(read_metadata(path).state_dict_metadata)
    names = [name for name, _ in run.model.named_parameters()]
    assert {k for k in keys if k.startswith("model/")} == {f"model/{n}" for n in names}
    assert {k for k in keys if k.startswith("optim/")} == {
        f"optim/{n}/{kind}" for n in names for kind in ("exp_avg", "exp_avg_sq", "step")
    }

    torch.rand(10)  # move on, so restoring the RNG is observable
    fresh = build(one_process, 7)  # other weights, and an optimizer that has never stepped
    trainer = FakeTrainer()
    capsys.readouterr()
    assert checkpointer(root, fresh).maybe_resume(trainer) == 2
    assert capsys.readouterr().out == f"resumed from {path} at step 2\n"
    assert trainer.step == 2
    assert torch.equal(torch.get_rng_state(), rng_at_save)  # same layout: this rank's stream comes back
    assert_holds_blocks_of(fresh, logical(run))
    assert not storages(run) & storages(fresh)  # loaded into the fresh run's own tensors
    assert torch.count_nonzero(fresh.model.wte.weight[100:]) == 0  # padding rows stay zero

    # This run's hyper-parameters win over the saved run's; resuming says which schedule settings changed.
    other = build(one_process, 7, lr=123.0, weight_decay=0.05, beta1=0.8, beta2=0.99, eps=1e-6)
    capsys.readouterr()
    assert checkpointer(root, other).maybe_resume(FakeTrainer()) == 2
    assert "optim.lr 0.01 -> 123.0, optim.weight_decay 0.1 -> 0.05" in capsys.readouterr().out
    assert_holds_blocks_of(other, logical(run))
    (adamw,) = other.zero.optimizers
    hyper = [(g["lr"], g["weight_decay"], g["betas"], g["eps"]) for g in adamw.param_groups]
    assert hyper == [(123.0, 0.05, (0.8, 0.99), 1e-6), (123.0, 0.0, (0.8, 0.99), 1e-6)]

    train_step(run, 2)
    train_step(fresh, 2)
    assert_same_state(run, fresh)


def test_optimizer_state_follows_names_not_order(one_process, tmp_path: Path, monkeypatch) -> None:
    run = build(one_process, 1)
    train_step(run, 0)
    checkpointer(tmp_path, run).save(FakeTrainer(1))

    # The same build with the flat layout in registration order, the reverse of the one build_optimizer makes:
    # every piece of the ZeRO optimizer, and every view of its AdamW, sits at another index.
    monkeypatch.setattr(FlatLayout, "by_size", classmethod(lambda cls, params, *_: cls([list(params)], 1)))
    fresh = build(one_process, 1)
    monkeypatch.undo()
    saved_order, loaded_order = piece_order(run), piece_order(fresh)
    assert loaded_order == saved_order[::-1] and len(set(saved_order)) == len(saved_order)
    checkpointer(tmp_path, fresh).maybe_resume(FakeTrainer())
    expected, loaded = logical(run), logical(fresh)
    assert loaded.keys() == expected.keys()
    for key in expected:
        assert torch.equal(loaded[key], expected[key]), key


def piece_order(run: Run) -> list[str]:
    """The parameter name of each piece the run's ZeRO optimizer steps, in its order."""
    names = {p: name for name, p in run.model.named_parameters()}
    return [names[piece.param] for _, piece in run.zero.pieces()]


def test_resume_refusals_name_what_is_wrong(one_process, tmp_path: Path) -> None:
    run = build(one_process, 1)
    checkpointer(tmp_path, run).save(FakeTrainer(1))
    path = tmp_path / "step_00000001"

    def resume(cfg: ModelConfig | None = None, resume: str = "auto") -> None:
        checkpointer(tmp_path, build(one_process, 2, cfg), resume).maybe_resume(FakeTrainer())

    with pytest.raises(CheckpointError, match=r"has model\.n_layers=2 but this run has 3"):
        resume(tiny_cfg(n_layers=3))
    with pytest.raises(CheckpointError, match="already holds checkpoints .* checkpoint.resume=none"):
        resume(resume="none")

    meta = json.loads((path / "meta.json").read_text())
    (path / "meta.json").write_text(json.dumps({**meta, "format": FORMAT + 1}))
    with pytest.raises(CheckpointError, match=f"has format {FORMAT + 1}; this trident reads {FORMAT}"):
        resume()
    (path / "meta.json").write_text(json.dumps(meta))

    data = (path / "__0_0.distcp").read_bytes()
    (path / "__0_0.distcp").write_bytes(data[: len(data) // 2])
    damaged = r"^checkpoint .*step_00000001 is damaged: __0_0\.distcp is \d+ bytes, its record says \d+"
    with pytest.raises(CheckpointError, match=damaged + r"; no older checkpoint in .* is intact either$"):
        resume()
    with pytest.raises(CheckpointError, match=damaged + "$"):
        resume(resume=str(path))
    # Written before checksums were recorded: the reader's own checks still name the file.
    (path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "files"}))
    with pytest.raises(CheckpointError, match=r"^cannot read checkpoint file .*__0_0\.distcp: damaged"):
        resume()
    (path / "__0_0.distcp").unlink()
    with pytest.raises(CheckpointError, match=r"__0_0\.distcp is missing; the checkpoint is incomplete"):
        resume()


# --- hostile files -------------------------------------------------------------------------------------------


class Payload:
    """Unpickling this runs a shell command: exactly what a checkpoint must never be able to do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def hostile_pickles(marker: Path) -> dict[str, bytes]:
    """The payload as a bare pickle and inside torch.save's zip format (what a .distcp record looks like)."""
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(2), "evil": Payload(marker)}, buf)
    return {"pickle": pickle.dumps(Payload(marker)), "torch.save": buf.getvalue()}


def test_the_payload_is_real(tmp_path: Path) -> None:
    """An unsafe load of the hostile bytes does run the command, so the test below proves something."""
    for kind, payload in hostile_pickles(tmp_path / "control").items():
        if kind == "pickle":
            pickle.loads(payload)
        else:
            torch.load(io.BytesIO(payload), weights_only=False)
        assert (tmp_path / "control").exists(), kind
        (tmp_path / "control").unlink()


def test_every_hostile_file_is_refused_and_never_run(one_process, tiny_dataset: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    run = build(one_process, 1)
    train_step(run, 0)
    tokenizer = tiny_dataset / "tokenizer.model"
    checkpointer(tmp_path / "ckpts", run, tokenizer=tokenizer).save(FakeTrainer(1))
    good = tmp_path / "ckpts" / "step_00000001"
    files = sorted(p.name for p in good.iterdir())
    assert files == sorted(
        [METADATA_FILE, "__0_0.distcp", "config.json", "meta.json", "tokenizer.model", "trainer.json"]
    )

    def resume(path: Path) -> None:
        checkpointer(tmp_path / "unused", build(one_process, 2), resume=str(path)).maybe_resume(FakeTrainer())

    def load_for_tools(path: Path) -> None:
        load_weights(path).load_tokenizer()

    for name in files:
        for kind, payload in hostile_pickles(marker).items():
            case = tmp_path / "cases" / f"{kind}-{name}" / "step_00000001"
            shutil.copytree(good, case)
            (case / name).write_bytes(payload)
            # tokenizer.model is read by the tools alone; every other file by resume.
            readers = [load_for_tools] if name == "tokenizer.model" else [resume]
            if name in ("meta.json", "config.json", METADATA_FILE, "__0_0.distcp"):
                readers.append(load_for_tools)
            for read in readers:
                with pytest.raises(CheckpointError) as info:
                    read(case)
                message = str(info.value)
                assert name in message and "\n" not in message, (kind, name, read.__name__, message)
            assert not marker.exists(), (kind, name)

    # The tools also read the consolidated file: a pickle in its place is refused the same way.
    fake = tmp_path / "model.safetensors"
    fake.write_bytes(hostile_pickles(marker)["pickle"])
    with pytest.raises(CheckpointError, match=r"^cannot read .*model\.safetensors"):
        load_weights(fake)
    assert not marker.exists()


def test_metadata_allow_list_is_what_dcp_writes(one_process, tmp_path: Path) -> None:
    run = build(one_process, 1)
    train_step(run, 0)
    checkpointer(tmp_path, run).save(FakeTrainer(1))
    path = tmp_path / "step_00000001"

    seen: set[tuple[str, str]] = set()

    class Recording(format_mod._MetadataUnpickler):
        def find_class(self, module: str, name: str) -> object:
            seen.add((module, name))
            return super().find_class(module, name)

    with open(path / METADATA_FILE, "rb") as f:
        metadata = Recording(f).load()
    classes = {(m, n) for m, n in seen if not (m == "torch" and isinstance(getattr(torch, n), torch.dtype))}
    # Nothing is admitted that a real save does not need.
    assert classes == set(format_mod._METADATA_CLASSES)

    # Admitted classes, hostile values: a data file outside the checkpoint is refused.
    index = next(iter(metadata.storage_data))
    metadata.storage_data[index].relative_path = "../../etc/passwd"
    (path / METADATA_FILE).write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match="is not a data file of this checkpoint"):
        read_metadata(path)
    for module, name in [("builtins", "eval"), ("os", "system"), ("torch", "load"), ("pathlib", "PosixPath")]:
        (path / METADATA_FILE).write_bytes(f"c{module}\n{name}\n(S'1'\ntR.".encode())
        with pytest.raises(CheckpointError, match=f"refused global {module}.{name}"):
            read_metadata(path)


# --- tp: a real reshard, both ways ----------------------------------------------------------------------


def _tp2_ranks(rank: int, world_size: int, one_root: str, tp_root: str, expected: list[dict]) -> None:
    """``expected``: the one-process run's logical tensors after 2 steps and after 3."""
    groups = build_process_groups(Topology(dp=1, pp=1, tp=2), timeout_s=60)

    # Save from the tp layout: each rank holds its blocks of the same run.
    run = build(groups, 1, TP_CFG)
    for i in range(2):
        fake_step(run, i)
    assert_holds_blocks_of(run, expected[0])  # the layout itself is right
    if rank == 1:
        assert placement_of(run.model.wte.weight).real == 0  # this rank holds only padding rows
    checkpointer(Path(tp_root), run).save(FakeTrainer(2))

    # Load a one-process checkpoint into the tp layout, with a fresh optimizer.
    fresh = build(groups, 5, TP_CFG)
    assert checkpointer(Path(one_root), fresh).maybe_resume(FakeTrainer()) == 2
    assert_holds_blocks_of(fresh, expected[0])
    # And both continue alike, as the one-process run does.
    fake_step(run, 2)
    fake_step(fresh, 2)
    assert_same_state(run, fresh)
    assert_holds_blocks_of(fresh, expected[1])


@pytest.mark.multiprocess
def test_tp_reshard_both_ways(one_process, tmp_path: Path) -> None:
    one_root, tp_root = tmp_path / "one", tmp_path / "tp2"
    run = reference(one_process, 2)
    checkpointer(one_root, run).save(FakeTrainer(2))
    expected = logical(run)
    fake_step(run, 2)

    run_distributed(_tp2_ranks, 2, str(one_root), str(tp_root), [expected, logical(run)], timeout_s=90)

    path = tp_root / "step_00000002"
    assert json.loads((path / "meta.json").read_text())["layout"] == {"dp": 1, "tp": 2, "pp": 1}
    chunks = read_metadata(path).state_dict_metadata
    # The saved embedding is the logical one: rank 0's 10 real rows, nothing from rank 1; its moments too.
    for key in ("model/wte.weight", "optim/wte.weight/exp_avg", "optim/wte.weight/exp_avg_sq"):
        assert chunks[key].size == (10, 32) and len(chunks[key].chunks) == 1, key
    for key in ("model/layers.0.mlp.fc.weight", "optim/layers.0.mlp.fc.weight/exp_avg"):
        assert len(chunks[key].chunks) == 2, key  # one block from each tp rank
    assert len(chunks["model/layers.0.ln_1.weight"].chunks) == 1  # replicated over tp: written once

    fresh = build(one_process, 5, TP_CFG)
    rng = torch.get_rng_state()
    assert checkpointer(tp_root, fresh).maybe_resume(FakeTrainer()) == 2
    assert_holds_blocks_of(fresh, expected)
    assert torch.equal(torch.get_rng_state(), rng)  # another layout: the fresh RNG stream is kept


# --- dp: written once, RNG per coordinate, agreed errors, crash mid-save --------------------------------------


def assert_tiled(key: str, entry: object) -> None:
    """The saved boxes of one tensor cover each of its elements exactly once."""
    count = torch.zeros(tuple(entry.size), dtype=torch.int32)
    for chunk in entry.chunks:
        count[box(tuple(chunk.offsets), tuple(chunk.sizes))] += 1
    assert bool((count == 1).all()), key


def _dp2_ranks(rank: int, world_size: int, root_s: str, tokenizer_s: str, zero: int, expected: dict) -> None:
    root, tokenizer = Path(root_s), Path(tokenizer_s)
    groups = build_process_groups(Topology(dp=2, pp=1, tp=1), timeout_s=60)
    run = build(groups, 1, TP_CFG, zero=zero)
    for i in range(2):
        fake_step(run, i)
    # Replicas (zero 0) or dp shards (zero 1) of the one-process run, bit for bit.
    assert_holds_blocks_of(run, expected)
    torch.manual_seed(100 + rank)  # ... with a different RNG stream on each rank
    rng_at_save = torch.get_rng_state()
    saver = checkpointer(root, run, tokenizer=tokenizer)
    assert saver.maybe_resume(FakeTrainer()) is None
    saver.save(FakeTrainer(step=2))
    path = root / "step_00000002"
    assert list_checkpoints(root) == [path] and leftovers(root) == []  # every rank sees the finished one

    # Written once: the boxes of each tensor tile it (replicas' boxes are one box), and the data files hold
    # nothing but the indexed boxes.
    metadata = read_metadata(path)
    for key, entry in metadata.state_dict_metadata.items():
        assert_tiled(key, entry)
        if zero == 0:
            assert len(entry.chunks) == 1, key
    if zero == 1:  # the dp shards cut a parameter: it is saved as a few boxes from each side of the cut
        assert any(len(e.chunks) > 1 for k, e in metadata.state_dict_metadata.items() if k.startswith("optim/"))
    assert {k for k in metadata.state_dict_metadata if k.startswith("rng/")} == {
        "rng/dp0.pp0.tp0/cpu",
        "rng/dp1.pp0.tp0/cpu",
    }
    data = sorted(path.glob("*.distcp"))
    assert [p.name for p in data] == ["__0_0.distcp", "__1_0.distcp"]  # the work is shared
    assert all(p.stat().st_size > 0 for p in data)
    assert sum(p.stat().st_size for p in data) == sum(info.length for info in metadata.storage_data.values())

    # Same layout: each rank gets its own RNG stream back.
    torch.rand(10)
    fresh = build(groups, 5, TP_CFG, zero=zero)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert checkpointer(root, fresh).maybe_resume(FakeTrainer()) == 2
    assert out.getvalue() == (f"resumed from {path} at step 2\n" if rank == 0 else "")
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert_holds_blocks_of(fresh, expected)

    # Errors are agreed: a bad path decided on rank 0, a checkpoint only rank 1 cannot read.
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume="):
        checkpointer(root, fresh, str(root / "nope")).maybe_resume(FakeTrainer())
    real_read = format_mod.read_metadata

    def unreadable_on_rank_1(directory: Path):
        if dist.get_rank() == 1:
            raise CheckpointError(f"{directory} not here")
        return real_read(directory)

    format_mod.read_metadata = unreadable_on_rank_1
    try:
        with pytest.raises(CheckpointError, match=r"^rank 1: .*step_00000002 not here$"):
            checkpointer(root, fresh).maybe_resume(FakeTrainer())
    finally:
        format_mod.read_metadata = real_read

    # A crash while rank 1 writes its data: every rank raises it, nothing is published, no temporary is left.
    real_write = format_mod._Writer.write_data

    def disk_full_on_rank_1(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("No space left on device")
        return real_write(self, plan, planner)

    format_mod._Writer.write_data = disk_full_on_rank_1
    try:
        full = r"^rank 1: the disk is full: a checkpoint in .* reports .* free of .* but refused the write as full"
        with pytest.raises(DiskFullError, match=full):
            saver.save(FakeTrainer(step=3))
    finally:
        format_mod._Writer.write_data = real_write
    dist.barrier()  # rank 0 removes the temporary directory before raising
    assert list_checkpoints(root) == [path] and leftovers(root) == []

    # keep_last prunes after a later save; every rank returns.
    checkpointer(root / "pruned", run, keep_last=1).save(FakeTrainer(step=3))
    checkpointer(root / "pruned", run, keep_last=1).save(FakeTrainer(step=4))
    assert [p.name for p in list_checkpoints(root / "pruned")] == ["step_00000004"]
    dist.barrier()  # the group still works after the errors above: nobody is stuck in a collective


@pytest.mark.multiprocess
@pytest.mark.parametrize("zero", [0, 1])
def test_dp2_writes_each_box_once_and_resumes_at_dp1(one_process, tmp_path: Path, zero: int) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"tokenizer bytes")
    root = tmp_path / "ckpts"
    run = reference(one_process, 2)
    run_distributed(_dp2_ranks, 2, str(root), str(tokenizer), zero, logical(run), timeout_s=90)

    path = root / "step_00000002"
    assert (path / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    # At dp=1 the same run continues exactly as if never stopped.
    fresh = build(one_process, 5, TP_CFG)
    assert checkpointer(root, fresh).maybe_resume(FakeTrainer()) == 2
    assert_holds_blocks_of(fresh, logical(run))
    fake_step(run, 2)
    fake_step(fresh, 2)
    assert_same_state(run, fresh)


# --- the consolidated file and the tools ---------------------------------------------------------------------


@pytest.mark.multiprocess
def test_consolidate_then_generate_gives_the_checkpoints_text(
    one_process, tiny_dataset: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    # vocab 600 pads to 640 rows (the file must hold the 600 real ones), past the tokenizer's 512 pieces.
    cfg = tiny_cfg(vocab_size=600)
    run = build(one_process, 3, cfg)
    for i in range(3):
        train_step(run, i)
    model = run.model
    root = tmp_path / "ckpts"
    tokenizer = tiny_dataset / "tokenizer.model"
    checkpointer(root, run, tokenizer=tokenizer).save(FakeTrainer(3))
    out = tmp_path / "out" / "model.safetensors"
    dist.destroy_process_group()  # the tools run without one

    # As a user runs it: its own process, no torchrun.
    converted = tool_process("convert_checkpoint", str(root), "--out", str(out))
    assert converted.returncode == 0, converted.stderr
    assert converted.stderr == f"wrote {out}: {len(weights_of(model))} tensors from {root / 'step_00000003'} (step 3)\n"
    weights = read_consolidated(out)
    assert weights.step == 3 and weights.config == dataclasses.asdict(run.cfg)
    assert weights.tokenizer == tokenizer.read_bytes()
    assert weights.tensors.keys() == weights_of(model).keys()
    assert torch.equal(weights.tensors["wte.weight"], model.wte.weight.detach()[:600])
    for name, tensor in read_model_tensors(root / "step_00000003").items():
        assert torch.equal(weights.tensors[name], tensor), name

    greedy = ("--prompt", "def ", "--tokens", "12", "--temperature", "0")
    code_dir, text_dir, _ = run_tool("generate", str(root), *greedy, monkeypatch=monkeypatch, capsys=capsys)
    code_file, text_file, _ = run_tool("generate", str(out), *greedy, monkeypatch=monkeypatch, capsys=capsys)
    assert code_dir == code_file == 0
    assert text_dir == text_file and text_dir.startswith("def ") and len(text_dir) > len("def \n")
    # Sampling draws only ids the tokenizer can decode.
    sampled = ("--tokens", "40", "--temperature", "1", "--top-k", "0")
    code, text, err = run_tool("generate", str(out), *sampled, monkeypatch=monkeypatch, capsys=capsys)
    assert code == 0 and text.startswith("def "), err

    # Errors are one line and exit 2, and leave no file behind.
    bad_out = tmp_path / "x.safetensors"
    code, _, err = run_tool(
        "convert_checkpoint", str(tmp_path), "--out", str(bad_out), monkeypatch=monkeypatch, capsys=capsys
    )
    assert code == 2 and err.startswith("error: checkpoint=") and err.count("\n") == 1
    assert not bad_out.exists()


def weights_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def test_write_consolidated_is_atomic(tmp_path: Path, monkeypatch) -> None:
    def failing_save(tensors: dict, filename: Path, metadata: dict) -> None:
        Path(filename).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(consolidated_mod, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        write_consolidated(ModelWeights({"w": torch.zeros(2)}, {}, 1, None, tmp_path), tmp_path / "m.safetensors")
    assert list(tmp_path.iterdir()) == []
