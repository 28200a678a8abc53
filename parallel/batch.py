"""A micro-batch: its tokens and targets, and where they come from. Dropout derives its masks from the latter
(parallel/random.py), so a micro-batch carries them to whichever runner and pipeline stage computes it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from trident.parallel.context.span import TokenSpan


class Batch(NamedTuple):
    tokens: torch.Tensor  # token ids [B, T]
    targets: torch.Tensor  # [B, T]
    sample_ids: torch.Tensor  # [B] global sample indices (step * global batch + position in it), on the CPU
    step: int  # the optimizer step (for validation: the batch's index in the evaluation)
    # Document ids [B, T] of a packed window (data.document_mask): attention stays inside each one, and positions
    # restart at each (models/documents.py). None: the window is one sequence.
    documents: torch.Tensor | None = None
    # Context parallelism (parallel/context/batch.py): this cp rank's part of the windows, each token's position
    # [B, T / cp] computed on the whole window before the split, and the attended (query, key) pairs of every cp
    # rank (cp_balance). None without context parallelism.
    positions: torch.Tensor | None = None
    cp_pairs: tuple[int, ...] | None = None
    # Under context parallelism, each held token's place in its window [B or 1, T / cp] (the attention mask's).
    index: torch.Tensor | None = None
    # Under context parallelism, every cp rank's tokens of the windows, rank 0's first (parallel/context/span.py
    # ``TokenSpan``), in host memory (numpy): what the attention exchanges read their masks' forms from, with no
    # gather and no device sync. It stays on the host in ``to``.
    keys: TokenSpan | None = None

    def to(self, device: torch.device) -> Batch:
        """Tokens, targets, documents, positions and indices on ``device``; the sample ids stay where they are read
        from."""

        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)

        return self._replace(
            tokens=moved(self.tokens),
            targets=moved(self.targets),
            documents=moved(self.documents),
            positions=moved(self.positions),
            index=moved(self.index),
        )


def document_ids(tokens: torch.Tensor, eos_id: int) -> torch.Tensor:
    """Which document of a packed window each token belongs to, ``[B, T]`` int32 counting from 0. Documents are
    stored back to back, each followed by eos; the eos opens the next document (it plays the part of a
    beginning-of-sequence token), so every token is predicted from its own document only, and a window's loss is
    the sum of its documents' losses computed one by one, each from its leading eos."""
    return torch.cumsum(tokens == eos_id, dim=1, dtype=torch.int32) - (tokens[:, :1] == eos_id).int()
