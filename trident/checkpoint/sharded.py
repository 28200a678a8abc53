"""``Sharded``: what a rank saves of one logical tensor, the boxes of it that the rank holds.

Apart from the DCP module (``dcp.py``) that writes and reads them: everything that builds a rank's state (the
model's, the optimizer's, the RNG's) needs this class, while ``torch.distributed.checkpoint`` (with DTensor and
sympy behind it, ~0.65 s of imports) is needed only by a save or a load. DCP calls the hooks below, so they import
its types then, when DCP is already loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from trident.parallel.placement import Placement

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem


@dataclass
class Sharded:
    """The boxes of one logical tensor held by this rank: ``(offsets, tensor)`` pairs.

    Each tensor is a view of live state (a parameter, an optimizer moment), so a load writes in place.
    A rank may hold no box of a tensor (a tp rank whose rows are all padding) or several.
    """

    shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], torch.Tensor]] = field(default_factory=list)

    @classmethod
    def of(cls, local: torch.Tensor, placement: Placement) -> Sharded:
        """The real (unpadded) part of this rank's block of a tensor laid out by ``placement``."""
        real = placement.real_part(local)
        return cls(placement.shape, [(placement.offsets, real)] if real.numel() else [])

    @classmethod
    def whole(cls, tensor: torch.Tensor) -> Sharded:
        """A tensor this rank holds entirely (replicated state, this rank's RNG state)."""
        return cls(tuple(tensor.shape), [((0,) * tensor.dim(), tensor)])

    # DCP's hooks (the _Checkpointable protocol).

    def size(self) -> torch.Size:
        return torch.Size(self.shape)

    def __create_write_items__(self, fqn: str, obj: object) -> list[WriteItem]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), t.size()),
                    properties=TensorProperties(dtype=t.dtype),
                    size=self.size(),
                ),
            )
            for offsets, t in self.boxes
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(torch.Size(offsets), t.size()) for offsets, t in self.boxes]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        # On load the index is the position in our chunk list, which tells apart two boxes at the same offsets
        # (a parameter and its tied copy on one rank); on save no two boxes share offsets.
        if index.index is not None and index.index < len(self.boxes):
            offsets, t = self.boxes[index.index]
            if torch.Size(offsets) == index.offset:
                return t
        for offsets, t in self.boxes:
            if torch.Size(offsets) == index.offset:
                return t
        raise KeyError(f"{index.fqn} has no box at {tuple(index.offset or ())}")
