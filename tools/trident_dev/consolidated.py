"""A whole model in one process: read from a checkpoint, a consolidated file or a Hugging Face directory
(``load_weights``), and written as one plain file or as a one-process trident checkpoint; what
``tools/convert_checkpoint.py`` writes and ``tools/generate.py`` reads.

The file is safetensors (a JSON header and raw tensor bytes: nothing in it can run code). It holds every
model parameter as its full logical tensor under its canonical name (the embedding without padding rows,
tied copies once), the model's state outside the gradient under ``buffers/<name>``, as a checkpoint holds it (a
sparse layer's loss-free balancing bias, ``buffers/layers.<i>.mlp.router.expert_bias``, [experts] fp32: part of
the function the model computes, models/moe.py), and in the header's string metadata:

    format           "trident-consolidated-1"
    step             the step of the checkpoint it came from
    config           the run config, JSON
    tokenizer.model  the run's tokenizer under its own file name, base64: a sentencepiece tokenizer.model
    or tokenizer.json  or a Hugging Face tokenizer.json (absent if the run had none)
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from trident.checkpoint import integrity
from trident.checkpoint.dcp import Sharded, read_metadata, read_sharded, write_sharded
from trident.checkpoint.files import find_resume_path, new_temporary, publish, read_head
from trident.checkpoint.hf import check_parts, read_box, sources
from trident.checkpoint.hf_dir import HFDir, is_hf_dir
from trident.checkpoint.state import BUFFERS, MODEL
from trident.config import Config, ModelConfig
from trident.data.tokenizer import FILE_NAMES, SENTENCEPIECE, Tokenizer, find_tokenizer_file, tokenizer_from_bytes
from trident.errors import CheckpointError, DataError

FORMAT = "trident-consolidated-1"


def read_model_tensors(path: Path, prefix: str = MODEL) -> dict[str, torch.Tensor]:
    """Every model parameter of a checkpoint as its full logical tensor, in this process (no process group);
    ``prefix`` ``BUFFERS``: its buffers (the loss-free balancing biases) instead."""
    metadata = read_metadata(path)
    state = {
        key: Sharded.whole(torch.zeros(entry.size, dtype=entry.properties.dtype))
        for key, entry in metadata.state_dict_metadata.items()
        if key.startswith(prefix)
    }
    if state:
        read_sharded(state, path, metadata)
    return {key[len(prefix) :]: s.boxes[0][1] for key, s in state.items()}


@dataclass
class ModelWeights:
    """A model as tools use it, from a checkpoint directory, a consolidated file or a Hugging Face directory."""

    tensors: dict[str, torch.Tensor]  # canonical name -> logical tensor
    config: dict  # the run config
    step: int
    tokenizer: bytes | None  # the tokenizer file's bytes
    source: Path  # the checkpoint directory, the consolidated file or the Hugging Face directory
    tokenizer_file: str | None = None  # its name, one of FILE_NAMES (None with bytes: a sentencepiece model)
    # State outside the gradient by name (models/moe.py ``balancing_state``: each sparse layer's loss-free balancing
    # bias); none from a Hugging Face directory or a dense model. An exit with no place for one must refuse it.
    buffers: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.tokenizer is not None and self.tokenizer_file is None:
            self.tokenizer_file = SENTENCEPIECE

    def load_tokenizer(self) -> Tokenizer:
        """The tokenizer the model came with, either kind (``trident.data.tokenizer.Tokenizer``)."""
        if self.tokenizer is None:
            raise CheckpointError(f"{self.source} holds no {' or '.join(FILE_NAMES)} (it was saved without one)")
        where = self.source / self.tokenizer_file if self.source.is_dir() else self.source
        try:
            return tokenizer_from_bytes(self.tokenizer_file, self.tokenizer, str(where))
        except DataError as e:
            raise CheckpointError(str(e)) from None


def from_checkpoint(path: Path) -> ModelWeights:
    """The model part of one checkpoint directory (any layout), read in this process, its files verified first
    (integrity.py: a damaged one is refused in one line)."""
    meta, config = read_head(path)
    if not integrity.verify(path):
        print(integrity.UNRECORDED.format(path=path), file=sys.stderr, flush=True)
    tokenizer, name = _read_tokenizer(find_tokenizer_file(path))
    tensors, buffers = read_model_tensors(path), read_model_tensors(path, BUFFERS)
    return ModelWeights(tensors, config, meta["step"], tokenizer, path, name, buffers)


def _read_tokenizer(path: Path | None) -> tuple[bytes | None, str | None]:
    if path is None:
        return None, None
    try:
        return path.read_bytes(), path.name
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None


def from_hf(path: Path) -> ModelWeights:
    """A Hugging Face directory of a family trident maps (trident/checkpoint/hf.py) as our logical tensors and a run
    config of its model, step 0."""
    hf = HFDir(path)
    cfg = hf.model_config()
    table = sources(cfg)
    tensors = {}
    with hf.slices() as slicer:
        for name in table:
            shape = (sum(table[name].sizes), *_columns(name, cfg))
            check_parts(table[name], slicer, shape, str(path))
            tensors[name] = read_box(table[name], slicer, (0,) * len(shape), shape).clone()
    tokenizer, file_name = _read_tokenizer(hf.tokenizer_file())
    config = dataclasses.asdict(Config(model=cfg))
    return ModelWeights(tensors, config, 0, tokenizer, path, file_name)


def _columns(name: str, cfg: ModelConfig) -> tuple[int, ...]:
    """The logical shape of ``name`` past dim 0: [] for a vector, else its input width."""
    if ".experts." in name:  # every expert tensor is [experts * d_expert, d_model] (models/moe.py)
        return (cfg.d_model,)
    if not name.endswith(".weight") or ".ln_" in name or name.startswith("ln_") or "_norm." in name:
        return ()
    if name.endswith("attn.proj.weight"):  # from the heads, which need not be d_model wide (model.head_dim)
        return (cfg.n_heads * cfg.head_size,)
    return (cfg.ffn_dim,) if name.endswith("mlp.proj.weight") else (cfg.d_model,)


def write_consolidated(weights: ModelWeights, out: Path) -> None:
    """Write the one file, atomically: a failed write leaves no partial file under ``out``'s name."""
    metadata = {"format": FORMAT, "step": str(weights.step), "config": json.dumps(weights.config)}
    if weights.tokenizer is not None:
        metadata[weights.tokenizer_file] = base64.b64encode(weights.tokenizer).decode("ascii")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        try:
            tensors = {**weights.tensors, **{BUFFERS + name: t for name, t in weights.buffers.items()}}
            save_file({name: t.contiguous() for name, t in tensors.items()}, tmp, metadata=metadata)
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
            tensors = {name: f.get_tensor(name) for name in f.keys() if not name.startswith(BUFFERS)}
            buffers = {name[len(BUFFERS) :]: f.get_tensor(name) for name in f.keys() if name.startswith(BUFFERS)}
        config = json.loads(metadata["config"])
        name = next((n for n in FILE_NAMES if n in metadata), None)
        tokenizer = base64.b64decode(metadata[name], validate=True) if name is not None else None
        return ModelWeights(tensors, config, int(metadata["step"]), tokenizer, path, name, buffers)
    except Exception as e:  # damaged or foreign: safetensors, json, base64 and int each raise their own errors
        raise CheckpointError(f"cannot read {path}: {' '.join(str(e).split())}") from None


def load_weights(source: Path, what: str = "checkpoint") -> ModelWeights:
    """A consolidated file, a checkpoint directory, a directory of checkpoints (the newest), or a Hugging Face
    directory of a family trident maps (GPT-2, Llama, Qwen3, Mixtral, Qwen3-MoE, OLMoE)."""
    if source.is_file():
        return read_consolidated(source)
    if is_hf_dir(source):
        return from_hf(source)
    return from_checkpoint(find_resume_path(str(source), source, what=what))


def write_checkpoint(weights: ModelWeights, root: Path) -> Path:
    """Write ``weights`` as a trident checkpoint ``root/step_XXXXXXXX`` (the weights' step) in this process: the
    model tensors and buffers, the run config and the tokenizer, no optimizer state. ``checkpoint.init_from``,
    ``tools/generate.py`` and this tool read it; returns its path."""
    step = weights.step
    tmp = new_temporary(root, step)
    try:
        state = {MODEL + name: Sharded.whole(t.detach().contiguous()) for name, t in weights.tensors.items()}
        state.update({BUFFERS + name: Sharded.whole(t.detach().contiguous()) for name, t in weights.buffers.items()})
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            write_sharded(state, tmp)
        if weights.tokenizer is not None:
            (tmp / weights.tokenizer_file).write_bytes(weights.tokenizer)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return publish(tmp, step, {"config.json": weights.config}, None, {"dp": 1, "tp": 1, "pp": 1})
