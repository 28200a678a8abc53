"""A local Hugging Face model directory, read without running code from it and without reading more of it than
asked: ``config.json``, the weights (safetensors, one file or sharded with ``model.safetensors.index.json``; a
``pytorch_model.bin`` only through ``torch.load(weights_only=True)``) and the tokenizer file, if any.

``HFDir.slices()`` hands out each tensor as something to slice (a safetensors slice), so a rank of a run reads
only the rows and columns of its own shard (``trident.checkpoint.hf.read_box``). Nothing is ever downloaded.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from trident.checkpoint.hf import Slicer, model_from_hf
from trident.config import ModelConfig
from trident.data.tokenizer import find_tokenizer_file
from trident.errors import CheckpointError

CONFIG = "config.json"
SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX = "pytorch_model.bin", "pytorch_model.bin.index.json"
# Hub files saved from the bare model (GPT2Model, LlamaModel) name tensors without the head's prefix.
_PREFIXES = ("transformer.", "model.")


def is_hf_dir(path: Path) -> bool:
    """A directory with a config.json and no trident meta.json: what a Hugging Face model is saved as."""
    return path.is_dir() and (path / CONFIG).is_file() and not (path / "meta.json").exists()


def _message(e: Exception) -> str:
    return " ".join(str(e).split()) or type(e).__name__


class HFDir:
    """One Hugging Face model directory: its config, model shape, weights and tokenizer."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.config = json.loads((path / CONFIG).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path} holds no {CONFIG}; a Hugging Face model directory needs one") from None
        except (OSError, ValueError) as e:
            raise CheckpointError(f"cannot read {path / CONFIG}: {_message(e)}") from None
        if not isinstance(self.config, dict):
            raise CheckpointError(f"cannot read {path / CONFIG}: not a JSON object")
        self.model = model_from_hf(self.config, str(path / CONFIG))  # the model.* values it fixes

    def model_config(self, **rest: object) -> ModelConfig:
        return ModelConfig(**{"name": self.path.name, **rest, **self.model})

    def tokenizer_file(self) -> Path | None:
        return find_tokenizer_file(self.path)

    def _files(self) -> dict[str, Path] | Path:
        """The tensor name -> file map of a sharded model, or its one file."""
        for index in (SAFETENSORS_INDEX, BIN_INDEX):
            if (self.path / index).is_file():
                try:
                    weight_map = json.loads((self.path / index).read_text())["weight_map"]
                    return {str(name): self.path / str(file) for name, file in weight_map.items()}
                except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                    raise CheckpointError(f"cannot read {self.path / index}: {_message(e)}") from None
        for single in (SAFETENSORS, BIN):
            if (self.path / single).is_file():
                return self.path / single
        raise CheckpointError(
            f"{self.path} holds no {SAFETENSORS}, {SAFETENSORS_INDEX} or {BIN}; the model's weights are missing"
        )

    @contextlib.contextmanager
    def slices(self) -> Iterator[Slicer]:
        """A function from a Hugging Face tensor name to a sliceable view of it, each file opened once, when first
        needed; every failure a CheckpointError naming the file."""
        files = self._files()
        opened: dict[Path, object] = {}
        with contextlib.ExitStack() as stack:

            def open_file(file: Path) -> object:
                if file not in opened:
                    opened[file] = _open(file, stack)
                return opened[file]

            def slicer(name: str) -> object:
                for candidate in (name, *(name[len(p) :] for p in _PREFIXES if name.startswith(p))):
                    if isinstance(files, dict):
                        if candidate in files:
                            return _get(open_file(files[candidate]), candidate, files[candidate])
                    else:
                        handle = open_file(files)
                        if candidate in handle.keys():
                            return _get(handle, candidate, files)
                kind = self.config["model_type"]
                raise CheckpointError(f"{self.path} holds no tensor {name}; it is not a whole {kind} model")

            yield slicer


def _open(file: Path, stack: contextlib.ExitStack) -> object:
    if not file.is_file():
        raise CheckpointError(f"{file} is missing; the model's weights are incomplete")
    if file.suffix == ".bin":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                loaded = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        except pickle.UnpicklingError:
            raise CheckpointError(
                f"cannot read {file}: it holds objects other than tensors (damaged or hostile); refused"
            ) from None
        except Exception as e:
            raise CheckpointError(f"cannot read {file}: damaged ({_message(e)})") from None
        if not isinstance(loaded, dict) or not all(isinstance(t, torch.Tensor) for t in loaded.values()):
            raise CheckpointError(f"cannot read {file}: not a dict of tensors")
        return loaded
    try:
        return stack.enter_context(safe_open(file, framework="pt"))
    except Exception as e:  # safetensors raises its own errors on a damaged header
        raise CheckpointError(f"cannot read {file}: damaged ({_message(e)})") from None


def _get(handle: object, name: str, file: Path) -> object:
    if isinstance(handle, dict):
        return handle[name]
    try:
        return _Slice(handle.get_slice(name), file)
    except Exception as e:
        raise CheckpointError(f"cannot read {file}: {_message(e)}") from None


class _Slice:
    """A safetensors slice whose shape is ``.shape`` and whose read errors name the file."""

    def __init__(self, inner: object, file: Path) -> None:
        self.inner, self.file = inner, file
        self.shape = tuple(inner.get_shape())

    def __getitem__(self, index: object) -> torch.Tensor:
        try:
            return self.inner[index]
        except Exception as e:  # a file cut short after its header
            raise CheckpointError(f"cannot read {self.file}: damaged ({_message(e)})") from None
