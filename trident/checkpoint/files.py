"""Checkpoint directories on disk: names, listing, the atomic publish of a finished save, pruning, and reading
the small JSON files back.

A checkpoint is a directory ``<root>/step_00000040/`` holding

    .metadata            DCP's index of the tensor data: each key's logical shape, dtype and saved boxes
    __<rank>_0.distcp    tensor data, written by every rank that holds a box no other rank writes
    trainer.json         step, consumed samples, loss scaler, seed, global batch (the trainer's state)
    config.json          the full run config
    tokenizer.model      the tokenizer the run used, under its own file name (a sentencepiece tokenizer.model
      or .json           or a Hugging Face tokenizer.json), so the checkpoint is self-contained
    meta.json            written last, its presence marks the checkpoint complete: format, step, saving layout

Every rank writes into one temporary directory ``<root>/.step_00000040.tmp-<uuid>``; once all have written,
rank 0 adds the small files, ``meta.json`` last, and renames it into place. A crash mid-save leaves the previous
checkpoint intact and never a half-written one that looks complete.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

from trident.checkpoint import integrity
from trident.config import ModelConfig, model_config_from_dict
from trident.errors import CheckpointError

FORMAT = 2
_NAME = re.compile(r"^step_(\d{8})$")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def _read_meta(path: Path) -> dict | None:
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


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
    if (path / "meta.json").is_file():
        raise CheckpointError(f"{what}={resume!r}: cannot read {path / 'meta.json'}; it is damaged or not trident's")
    raise CheckpointError(
        f"{what}={resume!r} is not a complete checkpoint (a step_XXXXXXXX directory with meta.json) "
        "nor a directory holding one; use auto, none or a valid path"
    )


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


# A save being written, a replaced step moved aside, a pruned step being deleted: hidden names never mistaken for
# a checkpoint, which the owner of the run directory clears after a killed run (trident/rundir.py).
PARTIAL_SAVE_PATTERNS = tuple(f".step_*.{kind}-*" for kind in ("tmp", "old", "trash"))


def _partial(root: Path, name: str, kind: str) -> Path:
    return root / f".{name}.{kind}-{uuid.uuid4().hex[:12]}"


def new_temporary(root: Path, step: int) -> Path:
    """An empty hidden directory for one save; never mistaken for a checkpoint."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = _partial(root, checkpoint_name(step), "tmp")
    tmp.mkdir()
    return tmp


def tokenizer_file_name(path: Path) -> str:
    """The name a tokenizer file is kept under: ``tokenizer.json`` (Hugging Face) or ``tokenizer.model``."""
    return "tokenizer.json" if path.suffix == ".json" else "tokenizer.model"


def publish(
    tmp: Path,
    step: int,
    files: dict[str, dict],
    tokenizer: Path | None,
    layout: dict,
    checksums: dict[str, dict] | None = None,
) -> Path:
    """Finish a temporary directory whose tensor data is written: the JSON ``files``, the tokenizer, ``meta.json``
    last, then rename it to ``step_XXXXXXXX``. ``checksums``: the tensor files' (integrity.py), by the ranks that
    wrote them; ``meta.json`` records them with those of every other file here, hashed now. On any failure the temporary
    directory is removed and nothing is published."""
    root = tmp.parent
    final = root / checkpoint_name(step)
    try:
        for name, value in files.items():
            _write_text(tmp / name, _to_json(name, value))
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / tokenizer_file_name(tokenizer))
        checksums = checksums or {}
        others = sorted(p.name for p in tmp.iterdir() if p.is_file() and p.name not in checksums)
        record = {**checksums, **integrity.digests(tmp, others)}
        meta = {"format": FORMAT, "step": step, "layout": layout, "time": time.time(), integrity.RECORD: record}
        _write_text(tmp / "meta.json", json.dumps(meta, indent=2))
        _fsync_dir(tmp)
        if final.exists():
            # Re-saving a step (e.g. after a resume): swap the old one aside only once the new one is whole.
            old = _partial(root, final.name, "old")
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


def _to_json(name: str, value: dict) -> str:
    try:
        return json.dumps(value, indent=2)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{name} must hold plain JSON values to be checkpointed: {e}") from None


def prune_checkpoints(root: Path, keep_last: int, current_step: int) -> None:
    """Keep the newest ``keep_last`` checkpoints up to ``current_step``; never touch newer ones."""
    if keep_last <= 0:
        return
    mine = [p for p in list_checkpoints(root) if checkpoint_step(p) <= current_step]
    for path in mine[:-keep_last]:
        # Renamed first, so a crash mid-delete never leaves a damaged checkpoint that still looks complete.
        trash = _partial(root, path.name, "trash")
        os.rename(path, trash)
        shutil.rmtree(trash)


def read_json(path: Path, name: str) -> dict:
    """One of a checkpoint's JSON files, as a dict; anything else is a CheckpointError naming the file."""
    try:
        value = json.loads((path / name).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path / name} is missing; the checkpoint is incomplete") from None
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise CheckpointError(f"cannot read checkpoint file {path / name}: {' '.join(str(e).split())}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"cannot read checkpoint file {path / name}: not a JSON object")
    return value


def read_head(path: Path) -> tuple[dict, dict]:
    """A checkpoint's meta.json and config.json, with the format and the fields everything reads checked."""
    meta = read_json(path, "meta.json")
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {meta.get('format')}; this trident reads {FORMAT}")
    if not isinstance(meta.get("step"), int):
        raise CheckpointError(f"cannot read checkpoint file {path / 'meta.json'}: it has no step")
    config = read_json(path, "config.json")
    if not isinstance(config.get("model"), dict):
        raise CheckpointError(f"cannot read checkpoint file {path / 'config.json'}: it has no model section")
    return meta, config


def saved_model_config(config: dict, where: object) -> ModelConfig:
    """The model a saved run config (a checkpoint's config.json, a consolidated file's) describes, older keys read
    as ``model_config_from_dict`` reads them; a CheckpointError naming ``where`` when it describes none."""
    try:
        return model_config_from_dict(config["model"])
    except (KeyError, TypeError) as e:
        raise CheckpointError(
            f"{where}: the saved config does not describe a trident model: {type(e).__name__} {e}"
        ) from None
