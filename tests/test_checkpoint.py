"""trident/checkpoint.py: atomic writes, discovery, safe loading, by-name optimizer state, and the
``Checkpointer`` on real gloo process groups (two spawned ranks).

Every test here can fail: each compares what comes back with what went in, bit for bit, or checks the
exact files left on disk.
"""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import trident.checkpoint as ckpt_mod
from tests.dist import run_distributed
from trident.checkpoint import (
    FORMAT,
    Checkpointer,
    checkpoint_name,
    find_resume_path,
    list_checkpoints,
    load_optimizer_state_by_name,
    optimizer_state_by_name,
    prune_checkpoints,
    read_checkpoint,
    schedule_changes,
    write_checkpoint,
)
from trident.config import ModelConfig, OptimConfig
from trident.errors import CheckpointError
from trident.models.gpt import GPT, init_weights, lm_loss_sum
from trident.optim import build_optimizer
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology

LAYOUT = {"dp": 1, "tp": 1, "pp": 1}


def tiny_cfg(n_layers: int = 2) -> ModelConfig:
    return ModelConfig(name="t", n_layers=n_layers, d_model=32, n_heads=4, seq_len=16, vocab_size=100)


def build(seed: int, n_layers: int = 2) -> tuple[GPT, torch.optim.AdamW, dict]:
    cfg = tiny_cfg(n_layers)
    model = GPT(cfg)
    init_weights(model, cfg, seed)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    names = {p: n for n, p in model.named_parameters()}
    return model, optimizer, names


def train_step(model: GPT, optimizer: torch.optim.Optimizer, i: int) -> None:
    gen = torch.Generator().manual_seed(1000 + i)
    x = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=gen)
    y = torch.randint(0, model.cfg.vocab_size, (2, model.cfg.seq_len), generator=gen)
    loss = lm_loss_sum(model(x), y) / y.numel()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def clone_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


def sample_state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen), "i": torch.arange(5)}


def save(root: Path, step: int, seed: int = 0, **overrides) -> Path:
    """A small, complete checkpoint whose contents are a function of ``seed``."""
    args = {
        "model_state": sample_state(seed),
        "optimizer_state": {"state": {"w": {"exp_avg": torch.full((4, 3), float(seed))}}, "param_groups": []},
        "trainer_state": {"step": step, "seed": seed},
        "config": {"model": {"n_layers": 2}, "seed": seed},
        "tokenizer": None,
        "layout": LAYOUT,
    }
    args.update(overrides)
    return write_checkpoint(root, step, **args)


def leftovers(root: Path) -> list[str]:
    """Hidden entries (temporary or swapped-aside directories) under ``root``."""
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


# --- 1. round trip --------------------------------------------------------------------------------------


def test_write_read_round_trip(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"\x00\x01sentencepiece-bytes\xff")
    model_state = sample_state(3)
    optimizer_state = {"state": {"w": {"step": torch.tensor(7.0), "exp_avg": torch.ones(4, 3)}}, "param_groups": []}
    trainer_state = {"step": 40, "consumed_samples": 1280, "rng": [{"cpu": torch.get_rng_state()}]}
    config = {"model": {"n_layers": 2, "d_ff": None}, "optim": {"lr": 0.001}, "data": {"text": ["a", "b"]}}
    layout = {"dp": 2, "tp": 1, "pp": 1}

    root = tmp_path / "ckpts"  # does not exist yet: write_checkpoint creates it
    path = write_checkpoint(root, 40, model_state, optimizer_state, trainer_state, config, tokenizer, layout)

    assert path == root / "step_00000040" == root / checkpoint_name(40)
    assert sorted(p.name for p in path.iterdir()) == sorted(
        ["model.pt", "optimizer.pt", "trainer.pt", "config.json", "tokenizer.model", "meta.json"]
    )
    assert (path / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 40 and meta["format"] == FORMAT and meta["layout"] == layout

    state = read_checkpoint(path)
    assert state["meta"] == meta
    assert_tensors_equal(state["model"], model_state)
    assert torch.equal(state["optimizer"]["state"]["w"]["exp_avg"], torch.ones(4, 3))
    assert state["optimizer"]["state"]["w"]["step"].item() == 7.0
    assert state["trainer"]["step"] == 40 and state["trainer"]["consumed_samples"] == 1280
    assert torch.equal(state["trainer"]["rng"][0]["cpu"], trainer_state["rng"][0]["cpu"])
    assert state["config"] == config
    assert leftovers(root) == []


def test_no_tokenizer_means_no_tokenizer_file(tmp_path: Path) -> None:
    path = save(tmp_path, 1)
    assert not (path / "tokenizer.model").exists()
    assert read_checkpoint(path)["trainer"] == {"step": 1, "seed": 0}


# --- 2. discovery ----------------------------------------------------------------------------------------


def test_list_checkpoints_skips_partial_and_sorts_numerically(tmp_path: Path) -> None:
    for step in (100, 9, 20):
        save(tmp_path, step)
    # A crashed save's temporary directory, even one that got as far as meta.json.
    tmp = tmp_path / ".step_00000500.tmp-123-abcdef01"
    tmp.mkdir()
    (tmp / "meta.json").write_text("{}")
    # A step directory without meta.json (e.g. copied by hand, incomplete).
    (tmp_path / "step_00000300").mkdir()
    (tmp_path / "step_00000300" / "model.pt").write_bytes(b"")
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

    first, second = save(root, 5), save(root, 12)
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
        (target / "model.pt").write_bytes(b"x")
    elif bad == "file":
        target.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume=") as info:
        find_resume_path(str(target), tmp_path)
    assert str(target) in str(info.value)
    with pytest.raises(CheckpointError, match=r"^my\.key="):
        find_resume_path(str(target), tmp_path, what="my.key")


# --- 3./4. atomicity -------------------------------------------------------------------------------------


class InjectedCrash(RuntimeError):
    pass


@pytest.mark.parametrize("second_step", [2, 1], ids=["new_step", "same_step"])
def test_crash_mid_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch, second_step: int) -> None:
    first = save(tmp_path, 1, seed=1)
    before = read_checkpoint(first)

    real_save = ckpt_mod._save
    written: list[str] = []

    def crashing_save(obj, path: Path) -> None:
        written.append(path.name)
        if path.name == "optimizer.pt":
            raise InjectedCrash("disk full")
        real_save(obj, path)

    monkeypatch.setattr(ckpt_mod, "_save", crashing_save)
    with pytest.raises(InjectedCrash, match="disk full"):
        save(tmp_path, second_step, seed=2)
    assert written == ["model.pt", "optimizer.pt"]  # the crash really hit mid-save
    monkeypatch.undo()

    assert list_checkpoints(tmp_path) == [first]
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no tmp dir, no step_00000002
    after = read_checkpoint(first)
    assert_tensors_equal(after["model"], sample_state(1))
    assert_tensors_equal(after["model"], before["model"])
    assert after["trainer"] == {"step": 1, "seed": 1} and after["config"]["seed"] == 1
    assert torch.equal(after["optimizer"]["state"]["w"]["exp_avg"], torch.full((4, 3), 1.0))
    assert find_resume_path("auto", tmp_path) == first


def test_failure_before_rename_publishes_nothing(tmp_path: Path, monkeypatch) -> None:
    """A failure at the very end (fsync of the finished temporary directory) must not publish it."""

    def failing_fsync(path: Path) -> None:
        raise OSError("fsync failed")

    monkeypatch.setattr(ckpt_mod, "_fsync_dir", failing_fsync)
    with pytest.raises(OSError, match="fsync failed"):
        save(tmp_path, 3)
    assert list(tmp_path.iterdir()) == []
    assert find_resume_path("auto", tmp_path) is None


def test_resave_same_step_replaces_it(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"old tokenizer")
    root = tmp_path / "ckpts"
    first = save(root, 8, seed=1, tokenizer=tokenizer)
    second = save(root, 8, seed=2)  # no tokenizer this time: nothing of the old one may survive

    assert first == second
    assert sorted(p.name for p in root.iterdir()) == ["step_00000008"]  # no .old-* or .tmp-* left
    state = read_checkpoint(second)
    assert_tensors_equal(state["model"], sample_state(2))
    assert state["trainer"]["seed"] == 2 and state["config"]["seed"] == 2
    assert not (second / "tokenizer.model").exists()


# --- 5. pruning ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("keep", "expected"), [(0, [1, 2, 3, 10]), (2, [3, 10]), (1, [10]), (10, [1, 2, 3, 10])])
def test_prune_keeps_newest(tmp_path: Path, keep: int, expected: list[int]) -> None:
    for step in (10, 1, 3, 2):
        save(tmp_path, step)
    partial = tmp_path / ".step_00000011.tmp-9-00000000"
    partial.mkdir()
    prune_checkpoints(tmp_path, keep, current_step=10)
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_name(s) for s in expected]
    # Only complete checkpoints count and are removed.
    assert partial.is_dir()
    assert {p.name for p in tmp_path.iterdir()} == {checkpoint_name(s) for s in expected} | {partial.name}


def test_prune_never_touches_newer_steps(tmp_path: Path) -> None:
    """A run writing step 3 into a directory that also holds a later step 10 must not delete its own step 3."""
    for step in (1, 2, 3, 10):
        save(tmp_path, step)
    prune_checkpoints(tmp_path, 1, current_step=3)
    assert [p.name for p in list_checkpoints(tmp_path)] == [checkpoint_name(3), checkpoint_name(10)]
    assert not [p for p in tmp_path.iterdir() if ".trash-" in p.name]


# --- 6./7. safe and strict loading -----------------------------------------------------------------------


class Payload:
    """Unpickling this runs a shell command: exactly what a checkpoint must never be able to do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch '{self.marker}'",))


def test_loading_never_executes_code(tmp_path: Path) -> None:
    path = save(tmp_path / "ckpts", 1)
    marker = tmp_path / "pwned"
    torch.save({"w": torch.zeros(2), "evil": Payload(marker)}, path / "model.pt")

    with pytest.raises(CheckpointError, match="model.pt"):
        read_checkpoint(path)
    assert not marker.exists()

    # The payload is real: an unsafe load would have run it.
    control = tmp_path / "control"
    buf = io.BytesIO()
    torch.save({"evil": Payload(control)}, buf)
    buf.seek(0)
    torch.load(buf, weights_only=False)
    assert control.exists()


def test_truncated_file_names_it(tmp_path: Path) -> None:
    path = save(tmp_path, 1)
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cannot read checkpoint file .*model\.pt"):
        read_checkpoint(path)


def test_missing_file_is_reported(tmp_path: Path) -> None:
    path = save(tmp_path, 1)
    (path / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match=r"optimizer\.pt is missing"):
        read_checkpoint(path)


@pytest.mark.parametrize("fmt", [FORMAT + 1, 0, None])
def test_format_mismatch(tmp_path: Path, fmt) -> None:
    path = save(tmp_path, 1)
    meta = json.loads((path / "meta.json").read_text())
    if fmt is None:
        del meta["format"]
    else:
        meta["format"] = fmt
    (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="format"):
        read_checkpoint(path)


# --- 8. optimizer state by name --------------------------------------------------------------------------


def test_optimizer_state_by_name_resumes_bit_identically(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, optimizer, names = build(seed=1)
    for i in range(2):
        train_step(model, optimizer, i)

    by_name = optimizer_state_by_name(optimizer, names)
    assert set(by_name["state"]) == {n for n, _ in model.named_parameters()}
    assert [len(g["params"]) for g in by_name["param_groups"]] == [len(g["params"]) for g in optimizer.param_groups]
    assert all(isinstance(n, str) for g in by_name["param_groups"] for n in g["params"])
    path = write_checkpoint(tmp_path, 2, model.state_dict(), by_name, {"step": 2}, {}, None, LAYOUT)
    state = read_checkpoint(path)

    fresh, fresh_opt, fresh_names = build(seed=2)  # different initial weights: the load must overwrite them
    assert not torch.equal(fresh.wte.weight, model.wte.weight)
    fresh_opt.param_groups[0]["lr"] = 123.0  # this run's hyper-parameters must win over the saved ones
    fresh.load_state_dict(state["model"])
    load_optimizer_state_by_name(fresh_opt, state["optimizer"], fresh_names)
    assert fresh_opt.param_groups[0]["lr"] == 123.0
    assert [g["weight_decay"] for g in fresh_opt.param_groups] == [0.1, 0.0]
    fresh_opt.param_groups[0]["lr"] = optimizer.param_groups[0]["lr"]

    train_step(model, optimizer, 2)
    train_step(fresh, fresh_opt, 2)
    assert_tensors_equal(clone_state(fresh), clone_state(model))
    for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], fresh_opt.state[q][key]), (name, key)
        # Separate storage: the fresh optimizer must not share tensors with the original.
        assert optimizer.state[p]["exp_avg"].data_ptr() != fresh_opt.state[q]["exp_avg"].data_ptr()


def test_optimizer_state_order_independent(tmp_path: Path) -> None:
    """State follows the parameter name, not its index: a reversed parameter order still loads right."""
    model, optimizer, names = build(seed=1)
    train_step(model, optimizer, 0)
    path = write_checkpoint(
        tmp_path, 1, model.state_dict(), optimizer_state_by_name(optimizer, names), {}, {}, None, LAYOUT
    )
    saved = read_checkpoint(path)["optimizer"]

    fresh, _, fresh_names = build(seed=1)
    fresh.load_state_dict(model.state_dict())
    params = [p for p in fresh.parameters()]
    reversed_opt = torch.optim.AdamW(
        [
            {"params": [p for p in reversed(params) if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for p in reversed(params) if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=1.0,
        foreach=True,
    )
    load_optimizer_state_by_name(reversed_opt, saved, fresh_names)
    by_name = {fresh_names[p]: s for p, s in reversed_opt.state.items()}
    for p, s in optimizer.state.items():
        assert torch.equal(by_name[names[p]]["exp_avg"], s["exp_avg"]), names[p]
        assert torch.equal(by_name[names[p]]["exp_avg_sq"], s["exp_avg_sq"]), names[p]


def test_optimizer_state_mismatching_model(tmp_path: Path) -> None:
    model, optimizer, names = build(seed=1, n_layers=2)
    train_step(model, optimizer, 0)
    saved = optimizer_state_by_name(optimizer, names)

    other, other_opt, other_names = build(seed=1, n_layers=3)
    with pytest.raises(CheckpointError, match="do not match"):
        load_optimizer_state_by_name(other_opt, saved, other_names)

    one_group = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError, match="groups"):
        load_optimizer_state_by_name(one_group, saved, names)


# --- 9. Checkpointer on two gloo ranks --------------------------------------------------------------------


class FakeTrainer:
    def __init__(self, step: int = 0) -> None:
        self.step = step

    def state_dict(self) -> dict:
        return {"step": self.step, "global_batch_size": 8}

    def load_state_dict(self, state: dict) -> None:
        assert state["global_batch_size"] == 8
        self.step = state["step"]


def _run_config(n_layers: int = 2) -> dict:
    return {"model": dataclasses.asdict(tiny_cfg(n_layers)), "train": {"global_batch_size": 8}}


def _checkpointer_ranks(rank: int, world_size: int, root_s: str, tokenizer_s: str) -> None:
    root, tokenizer = Path(root_s), Path(tokenizer_s)
    groups = build_process_groups(Topology(dp=2, pp=1, tp=1), timeout_s=60)

    def make(resume: str, seed: int, n_layers: int = 2, keep_last: int = 0):
        model, optimizer, _ = build(seed, n_layers)
        checkpointer = Checkpointer(
            root, 0, keep_last, resume, groups, model, optimizer, _run_config(n_layers), tokenizer
        )
        return model, optimizer, checkpointer

    # Identical replicas (same init, same data), but each rank's RNG stream differs.
    model, optimizer, checkpointer = make("auto", seed=1)
    for i in range(2):
        train_step(model, optimizer, i)
    torch.manual_seed(100 + rank)
    torch.rand(3)
    rng_at_save = torch.get_rng_state()
    weights = clone_state(model)
    exp_avg = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}

    assert checkpointer.maybe_resume(FakeTrainer()) is None  # nothing saved yet
    checkpointer.save(FakeTrainer(step=2))
    # save ends in a barrier: rank 1 sees rank 0's finished checkpoint.
    assert [p.name for p in list_checkpoints(root)] == ["step_00000002"]
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002"]
    state = read_checkpoint(root / "step_00000002")
    assert state["meta"]["layout"] == {"dp": 2, "tp": 1, "pp": 1}
    assert state["trainer"]["step"] == 2
    assert (root / "step_00000002" / "tokenizer.model").read_bytes() == tokenizer.read_bytes()
    rngs = state["trainer"]["rng"]
    assert len(rngs) == world_size
    assert torch.equal(rngs[rank]["cpu"], rng_at_save)
    assert not torch.equal(rngs[0]["cpu"], rngs[1]["cpu"])
    # Canonical: the embedding is saved without its padding rows, so any tp layout can load it.
    assert state["model"]["wte.weight"].shape[0] == 100
    assert_tensors_equal(state["model"], {**weights, "wte.weight": weights["wte.weight"][:100]})

    torch.rand(10)  # move on, so restoring the RNG is observable
    fresh, fresh_opt, resumer = make("auto", seed=7)
    assert not torch.equal(fresh.wte.weight, weights["wte.weight"])
    trainer = FakeTrainer()
    assert resumer.maybe_resume(trainer) == 2
    assert trainer.step == 2
    # Nothing of the checkpoint stays memory-mapped: a pruned checkpoint's space must be freed.
    del state, rngs  # this test's own read above
    gc.collect()
    assert [line for line in Path("/proc/self/maps").read_text().splitlines() if str(root) in line] == []
    assert_tensors_equal(clone_state(fresh), weights)
    for n, p in fresh.named_parameters():
        assert torch.equal(fresh_opt.state[p]["exp_avg"], exp_avg[n]), n
    assert torch.equal(torch.get_rng_state(), rng_at_save)
    # Resumed replicas continue exactly like the original.
    train_step(model, optimizer, 2)
    train_step(fresh, fresh_opt, 2)
    assert_tensors_equal(clone_state(fresh), clone_state(model))

    # An explicit path, and resume=none.
    _, _, explicit = make(str(root / "step_00000002"), seed=7)
    assert explicit.maybe_resume(FakeTrainer()) == 2
    # resume=none into a directory that already holds checkpoints would mix two runs: refused.
    _, _, none = make("none", seed=7)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        none.maybe_resume(FakeTrainer())

    # A bad path: rank 0 decides, every rank raises the same error instead of waiting.
    _, _, bad = make(str(root / "does_not_exist"), seed=7)
    with pytest.raises(CheckpointError, match=r"checkpoint\.resume="):
        bad.maybe_resume(FakeTrainer())
    # A different model shape is refused with the key that differs.
    _, _, wrong_shape = make("auto", seed=7, n_layers=3)
    with pytest.raises(CheckpointError, match="n_layers"):
        wrong_shape.maybe_resume(FakeTrainer())

    # A checkpoint only one rank cannot read (a node without the shared filesystem): every rank stops
    # with that rank's reason instead of the others waiting in the next collective.
    _, _, partial = make("auto", seed=7)

    def missing(path: Path) -> dict:
        raise CheckpointError(f"{path} not here")

    real_read = ckpt_mod.read_checkpoint
    if rank == 1:
        ckpt_mod.read_checkpoint = missing
    with pytest.raises(CheckpointError, match=r"^rank 1: .*step_00000002 not here$"):
        partial.maybe_resume(FakeTrainer())
    ckpt_mod.read_checkpoint = real_read

    # keep_last prunes after a later save; every rank still returns.
    _, _, pruner = make("auto", seed=1, keep_last=1)
    pruner.save(FakeTrainer(step=4))
    assert [p.name for p in list_checkpoints(root)] == ["step_00000004"]
    dist.barrier()  # the group still works after the errors above: nobody is stuck in a collective


def test_checkpointer_two_ranks(tmp_path: Path) -> None:
    tokenizer = tmp_path / "tok.model"
    tokenizer.write_bytes(b"tokenizer bytes")
    run_distributed(_checkpointer_ranks, 2, str(tmp_path / "ckpts"), str(tokenizer), timeout_s=90)


def test_schedule_changes_names_each_changed_setting() -> None:
    saved = {"train": {"steps": 100, "seed": 1}, "optim": {"lr": 1e-3, "min_lr": 1e-4}, "model": {"d_model": 8}}
    assert schedule_changes(saved, saved) == []
    current = {"train": {"steps": 200, "seed": 1}, "optim": {"lr": 1e-3, "min_lr": 0.0}, "model": {"d_model": 8}}
    assert schedule_changes(saved, current) == ["train.steps 100 -> 200", "optim.min_lr 0.0001 -> 0.0"]
