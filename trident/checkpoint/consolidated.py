"""A whole model in one plain file: what ``tools/convert_checkpoint.py`` writes and ``tools/generate.py`` reads.

The file is safetensors (a JSON header and raw tensor bytes: nothing in it can run code). It holds every
model parameter as its full logical tensor under its canonical name (the embedding without padding rows,
tied copies once), and in the header's string metadata:

    format           "trident-consolidated-1"
    step             the step of the checkpoint it came from
    config           the run config, JSON
    tokenizer.model  the run's sentencepiece model, base64 (absent if the run had none)
"""

from __future__ import annotations

import base64
import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import sentencepiece as spm
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trident.checkpoint.dcp import Sharded, read_metadata, read_sharded
from trident.checkpoint.files import find_resume_path, read_head
from trident.checkpoint.state import MODEL
from trident.errors import CheckpointError

FORMAT = "trident-consolidated-1"


def read_model_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every model parameter of a checkpoint as its full logical tensor, in this process (no process group)."""
    metadata = read_metadata(path)
    state = {
        key: Sharded.whole(torch.zeros(entry.size, dtype=entry.properties.dtype))
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(MODEL)
    }
    read_sharded(state, path, metadata)
    return {key[len(MODEL) :]: s.boxes[0][1] for key, s in state.items()}


@dataclass
class ModelWeights:
    """A model as tools use it, from either a checkpoint directory or a consolidated file."""

    tensors: dict[str, torch.Tensor]  # canonical name -> logical tensor
    config: dict  # the run config
    step: int
    tokenizer: bytes | None  # sentencepiece model
    source: Path  # the checkpoint directory or the consolidated file

    def sentencepiece(self) -> spm.SentencePieceProcessor:
        where = self.source / "tokenizer.model" if self.source.is_dir() else self.source
        if self.tokenizer is None:
            raise CheckpointError(f"{self.source} holds no tokenizer.model (the run was saved without one)")
        try:
            return spm.SentencePieceProcessor(model_proto=self.tokenizer)
        except Exception as e:  # sentencepiece raises RuntimeError or its own errors on a bad model
            raise CheckpointError(f"cannot read tokenizer {where}: {' '.join(str(e).split())}") from None


def from_checkpoint(path: Path) -> ModelWeights:
    """The model part of one checkpoint directory (any layout), read in this process."""
    meta, config = read_head(path)
    tokenizer_path = path / "tokenizer.model"
    try:
        tokenizer = tokenizer_path.read_bytes()
    except FileNotFoundError:
        tokenizer = None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {tokenizer_path}: {e}") from None
    return ModelWeights(read_model_tensors(path), config, meta["step"], tokenizer, path)


def write_consolidated(weights: ModelWeights, out: Path) -> None:
    """Write the one file, atomically: a failed write leaves no partial file under ``out``'s name."""
    metadata = {"format": FORMAT, "step": str(weights.step), "config": json.dumps(weights.config)}
    if weights.tokenizer is not None:
        metadata["tokenizer.model"] = base64.b64encode(weights.tokenizer).decode("ascii")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        try:
            save_file({name: t.contiguous() for name, t in weights.tensors.items()}, tmp, metadata=metadata)
        except SafetensorError as e:  # its I/O errors are not OSErrors
            raise OSError(" ".join(str(e).split())) from None
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def read_consolidated(path: Path) -> ModelWeights:
    try:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata() or {}
            if metadata.get("format") != FORMAT:
                raise ValueError(f"not a trident consolidated model (format {metadata.get('format')!r})")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        config = json.loads(metadata["config"])
        tokenizer = metadata.get("tokenizer.model")
        return ModelWeights(
            tensors,
            config,
            int(metadata["step"]),
            base64.b64decode(tokenizer, validate=True) if tokenizer is not None else None,
            path,
        )
    except Exception as e:  # damaged or foreign: safetensors, json, base64 and int each raise their own errors
        raise CheckpointError(f"cannot read {path}: {' '.join(str(e).split())}") from None


def load_weights(source: Path, what: str = "checkpoint") -> ModelWeights:
    """A consolidated file, a checkpoint directory, or a directory of checkpoints (the newest)."""
    if source.is_file():
        return read_consolidated(source)
    return from_checkpoint(find_resume_path(str(source), source, what=what))
