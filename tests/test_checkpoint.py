"""Checkpoints (trident/checkpoint/: manager, files, dcp, state, consolidated): atomic
publishing and discovery, exact resume, resharding across tp and dp layouts, deduplicated writes, hostile
files refused, and the consolidated file the tools read.

Tensor comparisons are bit for bit. Optimizer state comes from AdamW steps on synthetic gradients (each rank
cuts its block of one logical gradient), which are elementwise: a tp rank's state is exactly its block of the
one-process state, in any process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import runpy
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trident.checkpoint.consolidated as consolidated_mod
import trident.checkpoint.dcp as format_mod
import trident.checkpoint.files as files_mod
import trident.checkpoint.manager as manager_mod
from tests.conftest import REPO
from trident.checkpoint.consolidated import (
    ModelWeights,
    load_weights,
    read_consolidated,
    read_model_tensors,
    write_consolidated,
)
from trident.checkpoint.dcp import METADATA_FILE, read_metadata
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
from trident.config import ModelConfig
from trident.errors import CheckpointError
from trident.models.gpt import GPT, init_weights, lm_loss_sum, padded_vocab_size
from trident.parallel.groups import ProcessGroups, build_process_groups
from trident.parallel.placement import Placement, placement_of, set_placement
from trident.parallel.topology import Topology
from trident.ranks import run_distributed

LAYOUT = {"dp": 1, "tp": 1, "pp": 1}


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


def adamw(model: torch.nn.Module, lr: float = 1e-2) -> torch.optim.AdamW:
    """AdamW as trident builds it: decay on matrices only, two parameter groups."""
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, foreach=True)


def build(seed: int, cfg: ModelConfig | None = None) -> tuple[GPT, torch.optim.AdamW]:
    cfg = cfg or tiny_cfg()
    model = GPT(cfg)
    init_weights(model, cfg, seed)
    return model, adamw(model)


def split_for_tp(model: GPT, tp_rank: int, tp_size: int) -> GPT:
    """Give each split parameter the block tp rank ``tp_rank`` holds (the embedding padded for tp, as a
    vocab-parallel layer pads it), then re-initialise: each block is then its slice of the one-process tensor."""
    cfg = model.cfg
    for param in model.parameters():
        one = placement_of(param)
        if one.split_dim is None:
            continue
        padded = padded_vocab_size(cfg.vocab_size, cfg.vocab_multiple, tp_size) if one.padded is not None else None
        mine = Placement(one.shape, one.split_dim, tp_rank, tp_size, padded)
        param.data = torch.zeros(mine.local_shape)
        set_placement(param, mine)
    return model


def fake_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, i: int) -> None:
    """An AdamW step on a synthetic gradient: each parameter's block of one logical gradient per (step, name)."""
    for name, p in model.named_parameters():
        gen = torch.Generator().manual_seed(i * 1_000_003 + zlib.crc32(name.encode()))
        p.grad = placement_of(p).shard(torch.randn(placement_of(p).shape, generator=gen))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step(model: GPT, optimizer: torch.optim.Optimizer, i: int) -> None:
    gen = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=gen)
    y = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=gen)
    (lm_loss_sum(model(x), y) / y.numel()).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def reference(steps: int = 2) -> tuple[GPT, torch.optim.AdamW]:
    """The one-process run every tp/dp layout must match: seed 1, ``steps`` synthetic steps."""
    model, optimizer = build(1, TP_CFG)
    for i in range(steps):
        fake_step(model, optimizer, i)
    return model, optimizer


def logical(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and state tensor as its logical tensor (padding dropped), keyed ``name`` / ``name/state``."""
    out = {}
    for name, p in model.named_parameters():
        placement = placement_of(p)
        assert placement.tp_size == 1, "only a one-process model holds whole logical tensors"
        out[name] = placement.real_part(p.detach()).clone()
        for key, value in optimizer.state[p].items():
            out[f"{name}/{key}"] = value.clone() if value.dim() == 0 else placement.real_part(value).clone()
    return out


def assert_holds_blocks_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer, expected: dict) -> None:
    """Each parameter and state tensor is exactly its placement's block of the expected logical tensor."""
    for name, p in model.named_parameters():
        placement = placement_of(p)
        assert torch.equal(p.detach(), placement.shard(expected[name])), name
        assert set(optimizer.state[p]) == {"step", "exp_avg", "exp_avg_sq"}, name
        for key, value in optimizer.state[p].items():
            want = expected[f"{name}/{key}"]
            assert torch.equal(value, want if value.dim() == 0 else placement.shard(want)), f"{name}/{key}"


class FakeTrainer:
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step, "global_batch_size": 8}

    def load_state_dict(self, state: dict) -> None:
        if state["global_batch_size"] != 8:
            raise CheckpointError("global batch differs")
        self.step = state["step"]


def run_config(cfg: ModelConfig | None = None) -> dict:
    return {"model": dataclasses.asdict(cfg or tiny_cfg()), "train": {"global_batch_size": 8}}


def checkpointer(
    root: Path,
    groups: ProcessGroups,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    resume: str = "auto",
    cfg: ModelConfig | None = None,
    keep_last: int = 0,
    tokenizer: Path | None = None,
) -> Checkpointer:
    return Checkpointer(root, 0, keep_last, resume, groups, [model], optimizer, run_config(cfg), tokenizer)


@pytest.fixture
def one_process():
    """A one-process gloo group (as a plain ``python train.py`` has), torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield build_process_groups(Topology(dp=1, pp=1, tp=1), timeout_s=60)
    finally:
        if dist.is_initialized():  # a test may have ended it early
            dist.destroy_process_group()


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


def test_resume_is_exact_and_keeps_this_runs_hyper_parameters(one_process, tmp_path: Path, capsys) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"tokenizer bytes")
    root = tmp_path / "ckpts"
    model, optimizer = build(1)
    for i in range(2):
        train_step(model, optimizer, i)
    torch.manual_seed(123)
    rng_at_save = torch.get_rng_state()
    saver = checkpointer(root, one_process, model, optimizer, tokenizer=tokenizer)
    assert saver.maybe_resume(FakeTrainer()) is None  # nothing saved yet
    saver.save(FakeTrainer(step=2))

    path = root / "step_00000002"
    assert list_checkpoints(root) == [path] and leftovers(root) == []
    assert sorted(p.name for p in path.iterdir()) == sorted(
        [METADATA_FILE, "__0_0.distcp", "trainer.json", "config.json", "tokenizer.model", "meta.json"]
    )
    assert json.loads((path / "meta.json").read_text())["layout"] == LAYOUT
    assert json.loads((path / "trainer.json").read_text()) == {"step": 2, "global_batch_size": 8}
    assert json.loads((path / "config.json").read_text()) == run_config()
    # Logical tensors: the embedding without its padding rows (100 of 128).
    saved = read_model_tensors(path)
    assert saved["wte.weight"].shape == (100, 32)
    assert torch.equal(saved["wte.weight"], model.wte.weight.detach()[:100])

    torch.rand(10)  # move on, so restoring the RNG is observable
    fresh, fresh_opt = build(7)  # other weights, and an optimizer that has never stepped
    fresh_opt.param_groups[0]["lr"] = 123.0  # this run's hyper-parameters must win over the saved ones
    trainer = FakeTrainer()
    capsys.readouterr()
    assert checkpointer(root, one_process, fresh, fresh_opt).maybe_resume(trainer) == 2
    assert capsys.readouterr().out == f"resumed from {path} at step 2\n"
    assert trainer.step == 2
    assert torch.equal(torch.get_rng_state(), rng_at_save)  # same layout: this rank's stream comes back
    assert fresh_opt.param_groups[0]["lr"] == 123.0
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.1, 0.0]
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], fresh_opt.state[q][key]), (name, key)
        assert optimizer.state[p]["exp_avg"].data_ptr() != fresh_opt.state[q]["exp_avg"].data_ptr()
    assert torch.count_nonzero(fresh.wte.weight[100:]) == 0  # padding rows stay zero

    fresh_opt.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]
    train_step(model, optimizer, 2)
    train_step(fresh, fresh_opt, 2)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_optimizer_state_follows_names_not_order(one_process, tmp_path: Path) -> None:
    model, optimizer = build(1)
    train_step(model, optimizer, 0)
    checkpointer(tmp_path, one_process, model, optimizer).save(FakeTrainer(1))

    fresh, _ = build(1)
    params = list(fresh.parameters())
    reversed_opt = torch.optim.AdamW(
        [
            {"params": [p for p in reversed(params) if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in reversed(params) if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1.0,
        foreach=True,
    )
    checkpointer(tmp_path, one_process, fresh, reversed_opt).maybe_resume(FakeTrainer())
    names = {p: n for n, p in fresh.named_parameters()}
    by_name = {names[p]: s for p, s in reversed_opt.state.items()}
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(by_name[name][key], optimizer.state[p][key]), (name, key)


def test_resume_refusals_name_what_is_wrong(one_process, tmp_path: Path) -> None:
    model, optimizer = build(1)
    checkpointer(tmp_path, one_process, model, optimizer).save(FakeTrainer(1))
    path = tmp_path / "step_00000001"

    def resume(cfg: ModelConfig | None = None, resume: str = "auto") -> None:
        fresh, fresh_opt = build(2, cfg)
        checkpointer(tmp_path, one_process, fresh, fresh_opt, resume, cfg).maybe_resume(FakeTrainer())

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
    model, optimizer = build(1)
    train_step(model, optimizer, 0)
    tokenizer = tiny_dataset / "tokenizer.model"
    checkpointer(tmp_path / "ckpts", one_process, model, optimizer, tokenizer=tokenizer).save(FakeTrainer(1))
    good = tmp_path / "ckpts" / "step_00000001"
    files = sorted(p.name for p in good.iterdir())
    assert files == sorted(
        [METADATA_FILE, "__0_0.distcp", "config.json", "meta.json", "tokenizer.model", "trainer.json"]
    )

    def resume(path: Path) -> None:
        fresh, fresh_opt = build(2)
        checkpointer(tmp_path / "unused", one_process, fresh, fresh_opt, resume=str(path)).maybe_resume(FakeTrainer())

    def load_for_tools(path: Path) -> None:
        load_weights(path).sentencepiece()

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
    model, optimizer = build(1)
    train_step(model, optimizer, 0)
    checkpointer(tmp_path, one_process, model, optimizer).save(FakeTrainer(1))
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


def _tp2_ranks(rank: int, world_size: int, one_root: str, tp_root: str) -> None:
    groups = build_process_groups(Topology(dp=1, pp=1, tp=2), timeout_s=60)
    expected = logical(*reference(2))

    # Save from the tp layout: each rank holds its blocks of the same run.
    model, optimizer = build(1, TP_CFG)
    split_for_tp(model, rank, world_size)
    init_weights(model, TP_CFG, 1)
    for i in range(2):
        fake_step(model, optimizer, i)
    assert_holds_blocks_of(model, optimizer, expected)  # the layout itself is right
    if rank == 1:
        assert placement_of(model.wte.weight).real == 0  # this rank holds only padding rows
    checkpointer(Path(tp_root), groups, model, optimizer, cfg=TP_CFG).save(FakeTrainer(2))

    # Load a one-process checkpoint into the tp layout, with a fresh optimizer.
    fresh, fresh_opt = build(5, TP_CFG)
    split_for_tp(fresh, rank, world_size)
    init_weights(fresh, TP_CFG, 5)
    assert checkpointer(Path(one_root), groups, fresh, fresh_opt, cfg=TP_CFG).maybe_resume(FakeTrainer()) == 2
    assert_holds_blocks_of(fresh, fresh_opt, expected)
    # And both continue alike.
    fake_step(model, optimizer, 2)
    fake_step(fresh, fresh_opt, 2)
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(p, q)


def test_tp_reshard_both_ways(one_process, tmp_path: Path) -> None:
    one_root, tp_root = tmp_path / "one", tmp_path / "tp2"
    model, optimizer = reference(2)
    checkpointer(one_root, one_process, model, optimizer, cfg=TP_CFG).save(FakeTrainer(2))

    run_distributed(_tp2_ranks, 2, str(one_root), str(tp_root), timeout_s=90)

    path = tp_root / "step_00000002"
    assert json.loads((path / "meta.json").read_text())["layout"] == {"dp": 1, "tp": 2, "pp": 1}
    chunks = read_metadata(path).state_dict_metadata
    # The saved embedding is the logical one: rank 0's 10 real rows, nothing from rank 1.
    assert chunks["model/wte.weight"].size == (10, 32) and len(chunks["model/wte.weight"].chunks) == 1
    assert len(chunks["model/layers.0.mlp.fc.weight"].chunks) == 2  # one block from each tp rank
    assert len(chunks["model/layers.0.ln_1.weight"].chunks) == 1  # replicated over tp: written once

    fresh, fresh_opt = build(5, TP_CFG)
    rng = torch.get_rng_state()
    assert checkpointer(tp_root, one_process, fresh, fresh_opt, cfg=TP_CFG).maybe_resume(FakeTrainer()) == 2
    assert_holds_blocks_of(fresh, fresh_opt, logical(model, optimizer))
    assert torch.equal(torch.get_rng_state(), rng)  # another layout: the fresh RNG stream is kept


# --- dp: written once, RNG per coordinate, agreed errors, crash mid-save --------------------------------------


def _dp2_ranks(rank: int, world_size: int, root_s: str, tokenizer_s: str) -> None:
    root, tokenizer = Path(root_s), Path(tokenizer_s)
    groups = build_process_groups(Topology(dp=2, pp=1, tp=1), timeout_s=60)
    model, optimizer = reference(2)  # identical replicas
    torch.manual_seed(100 + rank)  # ... with a different RNG stream on each rank
    rng_at_save = torch.get_rng_state()
    saver = checkpointer(root, groups, model, optimizer, cfg=TP_CFG, tokenizer=tokenizer)
    assert saver.maybe_resume(FakeTrainer()) is None
    saver.save(FakeTrainer(step=2))
    path = root / "step_00000002"
    assert list_checkpoints(root) == [path] and leftovers(root) == []  # every rank sees the finished one

    # Written once: one box per tensor, and the data files hold nothing but the indexed boxes.
    metadata = read_metadata(path)
    for key, entry in metadata.state_dict_metadata.items():
        assert len(entry.chunks) == 1, key
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
    fresh, fresh_opt = build(5, TP_CFG)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert checkpointer(root, groups, fresh, fresh_opt, cfg=TP_CFG).maybe_resume(FakeTrainer()) == 2
    assert out.getvalue() == (f"resumed from {path} at step 2\n" if rank == 0 else "")
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    assert_holds_blocks_of(fresh, fresh_opt, logical(model, optimizer))

    # Errors are agreed: a bad path decided on rank 0, a checkpoint only rank 1 cannot read.
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume="):
        checkpointer(root, groups, fresh, fresh_opt, str(root / "nope"), cfg=TP_CFG).maybe_resume(FakeTrainer())
    real_read = manager_mod.read_metadata

    def unreadable_on_rank_1(directory: Path):
        if dist.get_rank() == 1:
            raise CheckpointError(f"{directory} not here")
        return real_read(directory)

    manager_mod.read_metadata = unreadable_on_rank_1
    try:
        with pytest.raises(CheckpointError, match=r"^rank 1: .*step_00000002 not here$"):
            checkpointer(root, groups, fresh, fresh_opt, cfg=TP_CFG).maybe_resume(FakeTrainer())
    finally:
        manager_mod.read_metadata = real_read

    # A crash while rank 1 writes its data: every rank raises it, nothing is published, no temporary is left.
    real_write = format_mod._Writer.write_data

    def disk_full_on_rank_1(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError("No space left on device")
        return real_write(self, plan, planner)

    format_mod._Writer.write_data = disk_full_on_rank_1
    try:
        with pytest.raises(CheckpointError, match=r"^rank 1: cannot write checkpoint data .*No space left on device$"):
            saver.save(FakeTrainer(step=3))
    finally:
        format_mod._Writer.write_data = real_write
    dist.barrier()  # rank 0 removes the temporary directory before raising
    assert list_checkpoints(root) == [path] and leftovers(root) == []

    # keep_last prunes after a later save; every rank returns.
    checkpointer(root / "pruned", groups, model, optimizer, cfg=TP_CFG, keep_last=1).save(FakeTrainer(step=3))
    checkpointer(root / "pruned", groups, model, optimizer, cfg=TP_CFG, keep_last=1).save(FakeTrainer(step=4))
    assert [p.name for p in list_checkpoints(root / "pruned")] == ["step_00000004"]
    dist.barrier()  # the group still works after the errors above: nobody is stuck in a collective


def test_dp2_writes_each_box_once_and_resumes_at_dp1(one_process, tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"tokenizer bytes")
    root = tmp_path / "ckpts"
    run_distributed(_dp2_ranks, 2, str(root), str(tokenizer), timeout_s=90)

    path = root / "step_00000002"
    assert (path / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    # At dp=1 the same run continues exactly as if never stopped.
    model, optimizer = reference(2)
    fresh, fresh_opt = build(5, TP_CFG)
    assert checkpointer(root, one_process, fresh, fresh_opt, cfg=TP_CFG).maybe_resume(FakeTrainer()) == 2
    fake_step(model, optimizer, 2)
    fake_step(fresh, fresh_opt, 2)
    assert_holds_blocks_of(fresh, fresh_opt, logical(model, optimizer))


# --- the consolidated file and the tools ---------------------------------------------------------------------


def run_tool(name: str, *args: str, monkeypatch, capsys) -> tuple[int, str, str]:
    """``python tools/<name>.py args`` in this process (torch is imported already): exit code, stdout, stderr."""
    path = REPO / "tools" / f"{name}.py"
    monkeypatch.setattr(sys, "argv", [str(path), *args])
    capsys.readouterr()
    try:
        runpy.run_path(str(path), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_consolidate_then_generate_gives_the_checkpoints_text(
    one_process, tiny_dataset: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    # vocab 600 pads to 640 rows (the file must hold the 600 real ones), past the tokenizer's 512 pieces.
    cfg = tiny_cfg(vocab_size=600)
    model, optimizer = build(3, cfg)
    for i in range(3):
        train_step(model, optimizer, i)
    root = tmp_path / "ckpts"
    tokenizer = tiny_dataset / "tokenizer.model"
    checkpointer(root, one_process, model, optimizer, cfg=cfg, tokenizer=tokenizer).save(FakeTrainer(3))
    out = tmp_path / "out" / "model.safetensors"
    dist.destroy_process_group()  # the tools run without one

    # As a user runs it: its own process, no torchrun.
    cmd = [sys.executable, str(REPO / "tools" / "convert_checkpoint.py"), str(root), "--out", str(out)]
    converted = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert converted.returncode == 0, converted.stderr
    assert converted.stderr == f"wrote {out}: {len(weights_of(model))} tensors from {root / 'step_00000003'} (step 3)\n"
    weights = read_consolidated(out)
    assert weights.step == 3 and weights.config == run_config(cfg) and weights.tokenizer == tokenizer.read_bytes()
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
