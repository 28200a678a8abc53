"""Checkpoints that survive crashes and layout changes.

A checkpoint is a directory ``<root>/step_00000040/`` holding

    model.pt        full (unsharded) tensors under their canonical names
    optimizer.pt    AdamW state per parameter *name* (not index), plus hyper-parameters
    trainer.pt      step, consumed samples, loss scaler, every rank's RNG state
    tokenizer.model the tokenizer the run used, so the checkpoint is self-contained
    config.json     the full run config
    meta.json       written last: its presence marks the checkpoint complete

It is written under a temporary name and renamed into place, so a crash mid-save leaves the previous
checkpoint intact and never a half-written one that looks complete. Loading uses
``torch.load(weights_only=True)``: a checkpoint can never execute code.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from trident.errors import CheckpointError
from trident.parallel.agree import on_every_rank, on_one_rank
from trident.parallel.groups import ProcessGroups

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _read_meta(path: Path) -> dict | None:
    try:
        return json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: Path) -> bool:
    """A finished checkpoint: a step_XXXXXXXX directory whose meta.json (written last) parses."""
    return path.is_dir() and _NAME.match(path.name) is not None and _read_meta(path) is not None


def checkpoint_step(path: Path) -> int:
    return int(_NAME.match(path.name).group(1))


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first. Temporary and partial ones are ignored."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=checkpoint_step)


def find_resume_path(resume: str, root: Path, what: str = "checkpoint.resume") -> Path | None:
    """Interpret checkpoint.resume: ``none``, ``auto`` (newest complete checkpoint in root, if any) or a path."""
    if resume == "none":
        return None
    if resume == "auto":
        found = list_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume).expanduser()
    if is_complete(path):
        return path
    if path.is_dir() and list_checkpoints(path):
        return list_checkpoints(path)[-1]
    raise CheckpointError(
        f"{what}={resume!r} is not a complete checkpoint (a step_XXXXXXXX directory with meta.json) "
        "nor a directory holding one; use auto, none or a valid path"
    )


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> dict:
    """Re-key torch's index-based optimizer state by parameter name, so it loads into any layout."""
    state = {}
    for param, s in optimizer.state.items():
        state[names[param]] = {k: (v.detach().cpu() if torch.is_tensor(v) else v) for k, v in s.items()}
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [names[p] for p in group["params"]]})
    return {"state": state, "param_groups": groups}


def load_optimizer_state_by_name(optimizer: torch.optim.Optimizer, saved: dict, names: dict[nn.Parameter, str]) -> None:
    """Map a by-name state back to this optimizer's indices and let torch place it (device, dtype)."""
    if len(saved["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError("optimizer parameter groups in the checkpoint do not match this model")
    index, state, groups = 0, {}, []
    for group, saved_group in zip(optimizer.param_groups, saved["param_groups"], strict=True):
        mine = [names[p] for p in group["params"]]
        if sorted(mine) != sorted(saved_group["params"]):
            raise CheckpointError("optimizer parameters in the checkpoint do not match this model")
        ids = list(range(index, index + len(mine)))
        for i, name in zip(ids, mine, strict=True):
            if name in saved["state"]:
                state[i] = saved["state"][name]
        # Only the state is restored: hyper-parameters (betas, eps, weight decay, kernels) come from this
        # run's config, so what the user asked for is what runs.
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        index += len(mine)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_text(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _save(obj: object, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_checkpoint(
    root: Path,
    step: int,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict,
    trainer_state: dict,
    config: dict,
    tokenizer: Path | None,
    layout: dict,
) -> Path:
    """Write one checkpoint atomically (from the one rank that holds the full state)."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_name(step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _save({k: v.detach().cpu() for k, v in model_state.items()}, tmp / "model.pt")
        _save(optimizer_state, tmp / "optimizer.pt")
        _save(trainer_state, tmp / "trainer.pt")
        _write_text(tmp / "config.json", json.dumps(config, indent=2))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.model")
        meta = {"format": FORMAT, "step": step, "layout": layout, "time": time.time()}
        _write_text(tmp / "meta.json", json.dumps(meta, indent=2))
        _fsync_dir(tmp)
        if final.exists():
            # Re-saving a step (e.g. after a resume): swap the old one aside only once the new one is whole.
            old = root / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old)
        else:
            os.rename(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune_checkpoints(root: Path, keep_last: int, current_step: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``current_step``; never touch newer ones."""
    if keep_last <= 0:
        return
    mine = [p for p in list_checkpoints(root) if checkpoint_step(p) <= current_step]
    for path in mine[:-keep_last]:
        # Renamed first, so a crash mid-delete never leaves a damaged checkpoint that still looks complete.
        trash = root / f".{path.name}.trash-{uuid.uuid4().hex[:8]}"
        os.rename(path, trash)
        shutil.rmtree(trash)


def load_file(path: Path) -> dict:
    try:
        # mmap: ranks read what they need instead of each holding a full copy in memory.
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from e
    except Exception as e:  # a corrupted or foreign file: say which one, never run code from it
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e


def _read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}") from e


def read_checkpoint(path: Path) -> dict:
    """Load every part of a checkpoint onto the CPU."""
    meta = _read_meta(path)
    if meta is None:
        raise CheckpointError(f"checkpoint {path} has no readable meta.json; it is incomplete")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}; this trident reads {FORMAT}")
    return {
        "meta": meta,
        "model": load_file(path / "model.pt"),
        "optimizer": load_file(path / "optimizer.pt"),
        "trainer": load_file(path / "trainer.pt"),
        "config": _read_config(path),
    }


def canonical(name: str, t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The layout-free form of a parameter (or of its optimizer state): the embedding without tp padding."""
    return t[:vocab_size] if name == "wte.weight" else t


def to_layout(name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A canonical tensor in this run's layout: the embedding gets zero padding rows up to ``like``'s."""
    if name != "wte.weight" or t.shape == like.shape:
        return t
    padded = torch.zeros(like.shape, dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded


def load_model_state(model: nn.Module, saved: dict[str, torch.Tensor]) -> None:
    """Load a checkpoint's canonical tensors into ``model`` (copied in, so nothing stays mapped)."""
    local = model.state_dict()
    model.load_state_dict({n: to_layout(n, t, local[n]) for n, t in saved.items()})


# Model settings that fix parameter shapes: a checkpoint only loads into the same ones.
_SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "d_ff", "bias")


class Trainable(Protocol):
    """What the checkpointer needs of the training loop."""

    step: int

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Checkpointer:
    """When to save, what goes in, and how a run resumes. Every rank calls ``save`` and ``maybe_resume``.

    Saved tensors are canonical: full shapes and the unpadded vocab (the embedding is padded to a multiple
    of tp at run time), so a checkpoint loads into any layout.
    """

    def __init__(
        self,
        root: Path,
        every: int,
        keep_last: int,
        resume: str,
        groups: ProcessGroups,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: dict,
        tokenizer: Path | None,
    ) -> None:
        self.root, self.every, self.keep_last, self.resume = root, every, keep_last, resume
        self.groups, self.model, self.optimizer = groups, model, optimizer
        self.config, self.tokenizer = config, tokenizer
        self.names = {p: n for n, p in model.named_parameters()}
        self.vocab_size = config["model"]["vocab_size"]

    def due(self, step: int, total: int) -> bool:
        return step == total or (self.every > 0 and step % self.every == 0)

    # With data parallelism alone every replica is identical: rank 0 writes the whole state.
    _WRITER = 0

    def _optimizer_state(self) -> dict:
        saved = optimizer_state_by_name(self.optimizer, self.names)
        for name, s in saved["state"].items():
            for k, v in s.items():
                if torch.is_tensor(v) and v.dim() > 0:
                    s[k] = canonical(name, v, self.vocab_size)
        return saved

    def prepare(self) -> None:
        """Before step 0: a checkpoint directory that cannot be written fails now, not after hours."""

        def probe() -> None:
            self.root.mkdir(parents=True, exist_ok=True)
            probe_file = self.root / f".write-test-{os.getpid()}"
            probe_file.write_text("ok")
            probe_file.unlink()

        on_one_rank(probe, self._WRITER, f"write to checkpoint.dir {self.root}")

    def save(self, trainer: Trainable) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        all_rng: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(all_rng, rng)
        topo = self.groups.topology

        def write() -> None:
            write_checkpoint(
                self.root,
                trainer.step,
                {n: canonical(n, t, self.vocab_size) for n, t in self.model.state_dict().items()},
                self._optimizer_state(),
                {**trainer.state_dict(), "rng": all_rng},
                self.config,
                self.tokenizer,
                layout={"dp": topo.dp, "tp": topo.tp, "pp": topo.pp},
            )
            prune_checkpoints(self.root, self.keep_last, trainer.step)

        on_one_rank(write, self._WRITER, f"write checkpoint {checkpoint_name(trainer.step)} in {self.root}")

    def _find(self) -> str | None:
        if self.resume == "none" and list_checkpoints(self.root):
            raise CheckpointError(
                f"checkpoint.dir {self.root} already holds checkpoints (newest "
                f"{list_checkpoints(self.root)[-1].name}) and checkpoint.resume=none would mix a new run into "
                "them; use checkpoint.resume=auto to continue, or another checkpoint.dir"
            )
        path = find_resume_path(self.resume, self.root)
        return str(path) if path else None

    def maybe_resume(self, trainer: Trainable) -> int | None:
        """Restore model, optimizer and trainer state from checkpoint.resume; return the step, or None."""
        # Rank 0 decides and every rank agrees, so an error can never leave the others waiting.
        found = [on_one_rank(self._find, 0, "look for checkpoints")]
        dist.broadcast_object_list(found, src=0)
        if found[0] is None:
            return None
        path = Path(found[0])
        # Every rank reads the files itself (on several nodes checkpoint.dir must be a shared filesystem);
        # one that cannot makes them all stop with its reason instead of leaving the rest waiting.
        saved_config, rng = on_every_rank(lambda: self._load(path, trainer), f"read checkpoint {path}")
        if len(rng) == dist.get_world_size():
            mine = rng[dist.get_rank()]
            torch.set_rng_state(mine["cpu"])
            if "cuda" in mine and torch.cuda.is_available():
                torch.cuda.set_rng_state(mine["cuda"])
        if self.groups.is_logging_rank:
            print(f"resumed from {path} at step {trainer.step}", flush=True)
            changed = schedule_changes(saved_config, self.config)
            if changed:
                print(
                    f"note: resuming with {', '.join(changed)}: the steps from here differ from the interrupted run's",
                    flush=True,
                )
        return trainer.step

    def _load(self, path: Path, trainer: Trainable) -> tuple[dict, list[dict]]:
        """Load every part into this rank's model, optimizer and trainer; return the saved config and the
        saved RNG states (one per rank of the run that saved)."""
        state = read_checkpoint(path)
        saved_model = state["config"]["model"]
        for key in _SHAPE_KEYS:
            mine = self.config["model"][key]
            if saved_model.get(key) != mine:
                raise CheckpointError(
                    f"checkpoint {path} has model.{key}={saved_model.get(key)} but this run has {mine}; "
                    "resume with the same model shape or set checkpoint.resume=none"
                )
        load_model_state(self.model, state["model"])
        local = self.model.state_dict()
        saved_opt = state["optimizer"]
        for name, s in saved_opt["state"].items():
            for k, v in s.items():
                if torch.is_tensor(v):
                    # Cloned: torch keeps CPU state tensors as given, and these are views of the mmap'd file,
                    # which would pin a pruned checkpoint's disk space (and break its removal on NFS).
                    s[k] = to_layout(name, v, local[name]).clone() if v.dim() > 0 else v.clone()
        load_optimizer_state_by_name(self.optimizer, saved_opt, self.names)
        trainer.load_state_dict(state["trainer"])
        return state["config"], state["trainer"].get("rng") or []


# Settings that shape every later step without changing parameter shapes: changing them on resume is
# allowed (extending a run is common), but the user is told the curve will not match the original.
_SCHEDULE_KEYS = {"train": ("steps",), "optim": ("lr", "min_lr", "warmup_steps", "weight_decay", "grad_clip")}


def schedule_changes(saved: dict, current: dict) -> list[str]:
    """``key old -> new`` for each schedule setting that differs between two run configs."""
    changes = []
    for section, keys in _SCHEDULE_KEYS.items():
        for key in keys:
            old, new = saved.get(section, {}).get(key), current.get(section, {}).get(key)
            if old is not None and old != new:
                changes.append(f"{section}.{key} {old} -> {new}")
    return changes
