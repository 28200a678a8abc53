"""The keys and values of the tokens seen so far, per layer, so that generation runs each new token through the
model once instead of the whole context again.

One process, one model (tp = pp = 1). ``GPT.forward(ids, cache)`` reads ``cache.length`` as the position of
``ids``' first token, each attention layer appends its keys and values (after RoPE) and attends to everything
held, and the model then advances ``length``. Storage is allocated once per layer, for ``max_len`` tokens (what the
generation needs: tools/generate.py asks for the prompt and the new tokens), in the dtype of the keys and values,
which is the model's.
"""

from __future__ import annotations

import torch


class KVCache:
    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.length = 0
        self._k: dict[int, torch.Tensor] = {}
        self._v: dict[int, torch.Tensor] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store ``k``, ``v`` ``[b, heads, t, d]`` at positions [length, length + t); return all keys and values
        held for this layer, the new ones included."""
        end = self.length + k.shape[-2]
        if end > self.max_len:
            raise ValueError(f"the cache holds {self.max_len} positions; {end} asked (crop the context first)")
        if layer not in self._k:
            shape = (*k.shape[:-2], self.max_len, k.shape[-1])
            self._k[layer], self._v[layer] = k.new_empty(shape), v.new_empty(shape)
        self._k[layer][..., self.length : end, :] = k
        self._v[layer][..., self.length : end, :] = v
        return self._k[layer][..., :end, :], self._v[layer][..., :end, :]

    def advance(self, t: int) -> None:
        self.length += t

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the storage (None before the first layer appends)."""
        return next(iter(self._k.values())).dtype if self._k else None

    @property
    def nbytes(self) -> int:
        """The bytes of storage allocated, keys and values of every layer."""
        return sum(t.nbytes for held in (self._k, self._v) for t in held.values())
