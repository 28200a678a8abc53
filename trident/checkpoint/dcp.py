"""Sharded tensor files through ``torch.distributed.checkpoint`` (DCP), and the one safe way to read them.

What a rank saves is a flat dict of keys to ``Sharded`` values (sharded.py): the boxes of a *logical* tensor that
the rank holds, each a local tensor placed at its offsets in the logical one (a tp rank's real rows of the embedding,
a whole LayerNorm gain, a 0-d step counter). DCP writes, per rank, one ``__<rank>_0.distcp`` file of
``torch.save``'d boxes and, from the coordinator, a ``.metadata`` index: for every key its logical size and
dtype, and where each saved box lies. A box that several ranks hold (dp replicas, tp-replicated parameters)
has the same key and offsets everywhere, so DCP's planner writes it once.

Loading asks for boxes too, in this run's layout: DCP intersects each wanted box with the saved ones and reads
only the overlaps, so a checkpoint resharded from any tp (and any padding) fills exactly what each rank holds.

``Sharded`` takes part through DCP's ``_Checkpointable`` hooks (``__create_write_items__``,
``__create_chunk_list__``, ``__get_tensor_shard__``), which DTensor implements the same way. It is not a
tensor, so the two planners here look boxes up through those hooks instead of DCP's tensor-only lookup.

Reading never runs code from the files:

- ``.metadata`` is a pickle. It is read by ``read_metadata`` through an unpickler that admits only DCP's
  metadata dataclasses, ``torch.Size``, dtypes and the layout lookup, then checked field by field.
- a ``.distcp`` box is read with ``torch.load(weights_only=True)`` and must be a tensor. Non-tensor
  ("bytes") items, which DCP would load with a plain ``torch.load``, are never written and always refused.
"""

from __future__ import annotations

import io
import math
import pickle
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    _MEM_FORMAT_ENCODING,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from trident.checkpoint import room
from trident.checkpoint.sharded import Sharded
from trident.errors import CheckpointError, DiskFullError

if TYPE_CHECKING:
    from trident.checkpoint.background import WriterProcess

METADATA_FILE = ".metadata"
_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")  # DCP's names for the per-rank data files


class _SavePlanner(DefaultSavePlanner):
    """DCP's planner (deduplication of identical boxes, validation that boxes tile each tensor) over our flat
    dict of ``Sharded`` values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's planner (each wanted box read from the saved boxes it overlaps) over our ``Sharded`` values."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict: dict, metadata: Metadata | None = None, is_coordinator: bool = False) -> None:
        # The default set-up only materialises meta tensors, and replaces values it does not know with None.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn].__get_tensor_shard__(index)


class _Writer(FileSystemWriter):
    """DCP's file writer; with ``process`` (a background save's ``WriterProcess``) the files are written by that
    process: DCP's planning and collectives stay here, only the serialisation and the writes move."""

    def __init__(self, path: Path, process: WriterProcess | None = None) -> None:
        super().__init__(path)
        self.process = process
        self._written: Future[list[WriteResult]] | None = None
        self.planned_bytes = 0  # the tensor bytes of this rank's final plan: what its files need, about

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        self.planned_bytes = sum(_item_bytes(item) for item in plan.items)
        if self.process is None:
            self._written = super().write_data(plan, planner)
        else:
            self._written = self.process.write(Path(self.path), plan, planner)
        return self._written

    def written(self) -> list[str]:
        """The files this rank wrote (names in the directory), once the save is done."""
        if self._written is None:
            return []
        return sorted({result.storage_data.relative_path for result in self._written.value()})

    def storage_meta(self) -> StorageMeta:
        # The default records the directory written to: a temporary name, stale once renamed into place.
        return StorageMeta()


def _raise_agreed(e: CheckpointException, what: str) -> None:
    """DCP gathers every rank's failure and raises the same exception on all of them: one line from it."""
    failures = e.failures
    rank = min(failures)
    error = failures[rank][0]
    message = str(error) if isinstance(error, CheckpointError) else f"cannot {what}: {type(error).__name__}: {error}"
    message = " ".join(message.split())
    if dist.is_initialized() and len(failures) < dist.get_world_size():
        message = f"rank {rank}: {message}"
    agreed = CheckpointError(message)
    agreed.agreed = True
    raise agreed from None


def write_sharded(
    state: dict[str, Sharded],
    directory: Path,
    group: dist.ProcessGroup | None = None,
    process: WriterProcess | None = None,
) -> list[str]:
    """Every rank calls this with its own boxes; a failure on any rank raises on every rank. ``group``: the
    group DCP's collectives run on (every rank's; default the world); ``process``: the files are written there.
    Returns the names of the files this rank wrote (``.metadata`` is the coordinator's, not among them)."""
    writer = _Writer(directory, process)
    try:
        dcp.save(state, storage_writer=writer, planner=_SavePlanner(), process_group=group)
    except CheckpointException as e:
        if room.is_full(e):  # DCP raised it on every rank alike, so every rank is here and can sum the need
            needed = torch.tensor([writer.planned_bytes], dtype=torch.int64)
            if dist.is_initialized():
                dist.all_reduce(needed, group=group)
            line = room.full_line(directory.parent, int(needed), room.used_bytes(directory))
            failed, world = sorted(e.failures), dist.get_world_size(group) if dist.is_initialized() else 1
            full = DiskFullError(f"rank {failed[0]}: {line}" if len(failed) < world else line)
            full.agreed = True
            raise full from None
        _raise_agreed(e, f"write checkpoint data in {directory}")
    return writer.written()


def _item_bytes(item: object) -> int:
    data = getattr(item, "tensor_data", None)
    if data is None:
        return 0
    return math.prod(data.chunk.sizes) * torch.tensor([], dtype=data.properties.dtype).element_size()


def read_sharded(state: dict[str, Sharded], directory: Path, metadata: Metadata) -> None:
    """Fill ``state``'s boxes from the checkpoint in ``directory`` (whose ``metadata`` was read safely).

    Collective when a process group exists; without one (the tools) DCP reads in this process alone.
    """
    try:
        with warnings.catch_warnings():
            # Without a process group DCP warns that it assumes one process: what the tools want.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=_Reader(directory, metadata), planner=_LoadPlanner())
    except CheckpointException as e:
        _raise_agreed(e, f"read checkpoint {directory}")


# --- reading .metadata ----------------------------------------------------------------------------------

_METADATA_CLASSES: dict[tuple[str, str], object] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # "torch.strided" -> the layout
    **{
        ("torch.distributed.checkpoint.metadata", c.__name__): c
        for c in (Metadata, TensorStorageMetadata, ChunkStorageMetadata, TensorProperties, MetadataIndex, StorageMeta)
    },
    # TensorProperties pickles its memory format as this enum.
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"): _MEM_FORMAT_ENCODING,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses and nothing else: any other global (os.system, builtins.eval, a
    class with a hostile ``__reduce__``) is refused before it is looked up, so it can never be called."""

    def find_class(self, module: str, name: str) -> object:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _METADATA_CLASSES:
            return _METADATA_CLASSES[(module, name)]
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def persistent_load(self, pid: object) -> object:
        raise pickle.UnpicklingError("refused persistent id")


def read_metadata(directory: Path) -> Metadata:
    """DCP's index of a checkpoint, unpickled with only the metadata classes admitted, then checked."""
    path = directory / METADATA_FILE
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        _check_metadata(metadata)
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from None
    except Exception as e:  # hostile, damaged or foreign: say which file, never run code from it
        raise CheckpointError(f"cannot read checkpoint file {path}: {' '.join(str(e).split())}") from None
    return metadata


def _is_size(value: object, dims: int | None = None) -> bool:
    return (
        type(value) is torch.Size
        and (dims is None or len(value) == dims)
        and all(isinstance(n, int) and n >= 0 for n in value)
    )


def _check_metadata(metadata: object) -> None:
    """Every field DCP will use has the type and range a save by this module gives it."""
    if type(metadata) is not Metadata or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError("not a checkpoint index")
    if not isinstance(metadata.storage_data, dict):
        raise ValueError("no storage index")
    for key, entry in metadata.state_dict_metadata.items():
        if not isinstance(key, str) or type(entry) is not TensorStorageMetadata:
            # Non-tensor ("bytes") entries would be loaded with a plain torch.load; this module never writes them.
            raise ValueError(f"entry {key!r} is not a tensor")
        if type(entry.properties) is not TensorProperties or not isinstance(entry.properties.dtype, torch.dtype):
            raise ValueError(f"entry {key!r} has no valid dtype")
        if not _is_size(entry.size) or not isinstance(entry.chunks, list):
            raise ValueError(f"entry {key!r} has no valid size")
        for chunk in entry.chunks:
            dims = len(entry.size)
            if type(chunk) is not ChunkStorageMetadata or not (
                _is_size(chunk.offsets, dims) and _is_size(chunk.sizes, dims)
            ):
                raise ValueError(f"entry {key!r} has an invalid box")
            if any(o + s > n for o, s, n in zip(chunk.offsets, chunk.sizes, entry.size, strict=True)):
                raise ValueError(f"entry {key!r} has a box outside its size {tuple(entry.size)}")
            if MetadataIndex(key, chunk.offsets) not in metadata.storage_data:
                raise ValueError(f"entry {key!r} has a box stored nowhere")
    for index, info in metadata.storage_data.items():
        if type(index) is not MetadataIndex or index.fqn not in metadata.state_dict_metadata:
            raise ValueError("storage index names an unknown entry")
        if type(info) is not _StorageInfo or not (
            isinstance(info.relative_path, str) and _DATA_FILE.match(info.relative_path)
        ):
            # Only data files inside this checkpoint: no path elsewhere on the filesystem.
            raise ValueError(f"storage of {index.fqn!r} is not a data file of this checkpoint")
        if not all(isinstance(n, int) and n >= 0 for n in (info.offset, info.length)) or info.transform_descriptors:
            raise ValueError(f"storage of {index.fqn!r} has an invalid extent")


# --- reading .distcp ------------------------------------------------------------------------------------


class _Reader(FileSystemReader):
    """DCP's file reader with the metadata already read (safely), and a data path that only admits tensors."""

    def __init__(self, directory: Path, metadata: Metadata) -> None:
        super().__init__(directory)
        self.directory, self.metadata = directory, metadata

    def read_metadata(self, *args: object, **kwargs: object) -> Metadata:
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            if item.type != LoadItemType.TENSOR:
                raise CheckpointError(f"checkpoint {self.directory} asks to unpickle a non-tensor item; refused")
            by_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for name, items in sorted(by_file.items()):
            path = self.directory / name
            with _open(path) as f:
                for item in items:
                    box = _load_box(f, self.storage_data[item.storage_index], path)
                    for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
                        box = box.narrow(dim, start, length)
                    target = planner.resolve_tensor(item).detach()
                    if target.shape != box.shape:
                        raise CheckpointError(f"cannot read checkpoint file {path}: a box has the wrong shape")
                    target.copy_(box)
                    planner.commit_tensor(item, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _open(path: Path) -> io.BufferedReader:
    try:
        return open(path, "rb")
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete") from None
    except OSError as e:
        raise CheckpointError(f"cannot read checkpoint file {path}: {e}") from None


def _load_box(f: io.BufferedReader, info: _StorageInfo, path: Path) -> torch.Tensor:
    """One saved box: a torch.save'd tensor at [offset, offset + length) of a data file."""
    try:
        f.seek(info.offset)
        blob = f.read(info.length)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns about the pickle protocol of files it then refuses
            box = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        # torch's own message suggests weights_only=False: exactly what must never be done with this file.
        raise CheckpointError(
            f"cannot read checkpoint file {path}: it holds objects other than tensors (damaged or hostile); refused"
        ) from None
    except Exception as e:
        reason = " ".join(str(e).split()) or type(e).__name__
        raise CheckpointError(f"cannot read checkpoint file {path}: damaged ({reason})") from None
    if not isinstance(box, torch.Tensor):
        raise CheckpointError(f"cannot read checkpoint file {path}: it holds a {type(box).__name__}, not a tensor")
    return box
