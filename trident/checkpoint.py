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

import torch
import torch.distributed as dist
from torch import nn

from parallel.groups import ProcessGroups
from trident.errors import CheckpointError

FORMAT = 1
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def is_complete(path: Path) -> bool:
    return path.is_dir() and _NAME.match(path.name) is not None and (path / "meta.json").is_file()


def list_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first. Temporary and partial ones are ignored."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if is_complete(p)]
    return sorted(found, key=lambda p: int(_NAME.match(p.name).group(1)))


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
        # Kernel choices (fused / foreach) belong to this machine, not to the one that saved.
        local = {k: group[k] for k in ("fused", "foreach", "capturable") if k in group}
        groups.append({**saved_group, **local, "params": ids})
        index += len(mine)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / "tokenizer.model")
        meta = {"format": FORMAT, "step": step, "layout": layout, "time": time.time()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2))
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


def prune_checkpoints(root: Path, keep_last: int) -> None:
    if keep_last <= 0:
        return
    for path in list_checkpoints(root)[:-keep_last]:
        shutil.rmtree(path)


def _load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as e:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from e
    except Exception as e:  # a corrupted or foreign file: say which one, never run code from it
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from e


def read_checkpoint(path: Path) -> dict:
    """Load every part of a checkpoint onto the CPU."""
    meta = json.loads((path / "meta.json").read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}; this trident reads {FORMAT}")
    return {
        "meta": meta,
        "model": _load(path / "model.pt"),
        "optimizer": _load(path / "optimizer.pt"),
        "trainer": _load(path / "trainer.pt"),
        "config": json.loads((path / "config.json").read_text()),
    }


# Model settings that fix parameter shapes: a checkpoint only loads into the same ones.
_SHAPE_KEYS = ("n_layers", "d_model", "n_heads", "seq_len", "vocab_size", "d_ff", "bias")


class Checkpointer:
    """When to save, what goes in, and how a run resumes. Every rank calls ``save`` and ``maybe_resume``."""

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

    def due(self, step: int, total: int) -> bool:
        return step == total or (self.every > 0 and step % self.every == 0)

    def _writer(self) -> bool:
        # With data parallelism alone every replica is identical: rank 0 writes the whole state.
        return self.groups.rank == 0

    def save(self, trainer) -> None:
        rng = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state()
        all_rng: list[dict | None] = [None] * dist.get_world_size()
        dist.all_gather_object(all_rng, rng)
        if self._writer():
            topo = self.groups.topology
            write_checkpoint(
                self.root,
                trainer.step,
                self.model.state_dict(),
                optimizer_state_by_name(self.optimizer, self.names),
                {**trainer.state_dict(), "rng": all_rng},
                self.config,
                self.tokenizer,
                layout={"dp": topo.dp, "tp": topo.tp, "pp": topo.pp},
            )
            prune_checkpoints(self.root, self.keep_last)
        dist.barrier()

    def _agreed_resume_path(self) -> Path | None:
        """Rank 0 decides; an error travels to every rank instead of leaving them waiting."""
        decision: list[object] = [None]
        if dist.get_rank() == 0:
            try:
                path = find_resume_path(self.resume, self.root)
                decision = [("ok", str(path) if path else None)]
            except CheckpointError as e:
                decision = [("error", str(e))]
        dist.broadcast_object_list(decision, src=0)
        kind, value = decision[0]
        if kind == "error":
            raise CheckpointError(value)
        return Path(value) if value else None

    def maybe_resume(self, trainer) -> int | None:
        """Restore model, optimizer and trainer state from checkpoint.resume; return the step, or None."""
        path = self._agreed_resume_path()
        if path is None:
            return None
        state = read_checkpoint(path)
        saved_model = state["config"]["model"]
        for key in _SHAPE_KEYS:
            mine = self.config["model"][key]
            if saved_model.get(key) != mine:
                raise CheckpointError(
                    f"checkpoint {path} has model.{key}={saved_model.get(key)} but this run has {mine}; "
                    "resume with the same model shape or set checkpoint.resume=none"
                )
        self.model.load_state_dict(state["model"])
        load_optimizer_state_by_name(self.optimizer, state["optimizer"], self.names)
        trainer.load_state_dict(state["trainer"])
        rng = state["trainer"].get("rng") or []
        if len(rng) == dist.get_world_size():
            mine = rng[dist.get_rank()]
            torch.set_rng_state(mine["cpu"])
            if "cuda" in mine and torch.cuda.is_available():
                torch.cuda.set_rng_state(mine["cuda"])
        if self.groups.is_logging_rank:
            print(f"resumed from {path} at step {trainer.step}", flush=True)
        return trainer.step
